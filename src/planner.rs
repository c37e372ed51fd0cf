//! Where readers start, from what is recorded: the recorded partition clocks at batch
//! boundaries (`clickagg_clocks`) give each reader the clock just before where it
//! starts reading, and the lookback that rebuilds its dedup state.
//!
//! The broker's time index is not used for either: it holds aborted transactional
//! records and a single absurd timestamp as faithfully as any other, while the clock
//! is a function of the committed records read in order (`dedup::clock`).

use std::collections::BTreeMap;

use crate::dedup::{PartitionClock, Secs};
use crate::position::Marks;
use crate::sink::{Sink, SinkError};

/// Where a partition's reader counts from, and where its log starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    /// The batch boundary counted from.
    pub boundary: i64,
    /// The first offset the broker still holds.
    pub low: i64,
    /// The log end when planned.
    pub high: i64,
}

/// For every partition, the recorded clocks a reader counting from its boundary needs
/// ([`Marks`]): the nearest recorded clock at or below the boundary, and the latest
/// recorded boundary before which every record lies more than `window` before that
/// clock (the lookback). Where nothing is recorded, the log start with a fresh clock:
/// the clock there is the definition's when the log starts at offset 0, and what
/// retention left of it otherwise.
pub async fn marks(
    sink: &Sink,
    topic: &str,
    at: &BTreeMap<i32, Boundary>,
    window: Secs,
) -> Result<BTreeMap<i32, Marks>, SinkError> {
    let mut out = BTreeMap::new();
    for (&p, b) in at {
        let log_start = (b.low, PartitionClock::default());
        let near = sink.clock_at_or_below(topic, p, b.low, b.boundary).await?.unwrap_or(log_start);
        let lookback = match near.1.get() {
            // Nothing stamped before it: everything before matters as much as it can.
            None => log_start,
            Some(c) => {
                sink.clock_before_time(topic, p, b.low, near.0, c.saturating_sub(window)).await?.unwrap_or(log_start)
            }
        };
        let lookback = if lookback.0 > near.0 { near } else { lookback };
        out.insert(p, Marks { boundary: b.boundary, near, lookback });
    }
    Ok(out)
}
