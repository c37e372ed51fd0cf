//! Where each partition of the topic stands: the group's committed offsets and the
//! log's ends from Kafka, the clock recorded at each committed boundary from
//! ClickHouse (`plan::PartitionPosition`).

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;

use super::plan::PartitionPosition;
use crate::config::KafkaSettings;
use crate::dedup::Secs;
use crate::sink::{Sink, SinkError};
use crate::source;

/// How long one broker look-up may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Per partition: the group's committed offset, the log's start and end.
pub type GroupOffsets = BTreeMap<i32, (Option<i64>, i64, i64)>;

/// Per partition of `topic`: `group`'s committed offset and the log's start and end.
/// Blocking. Asks for the committed offsets without joining the group.
pub fn group_offsets(k: &KafkaSettings, group: &str, topic: &str) -> Result<GroupOffsets, KafkaError> {
    let consumer = source::group_lookup_consumer(k, group)?;
    let partitions = source::partitions(&consumer, topic, TIMEOUT)?;
    let committed = source::group_committed(&consumer, topic, &partitions, TIMEOUT)?;
    let mut out = BTreeMap::new();
    for p in partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, TIMEOUT)?;
        out.insert(p, (committed.get(&p).copied().flatten(), low, high));
    }
    Ok(out)
}

/// The positions of every partition: Kafka's offsets with the clock recorded at (or
/// below) each committed offset.
pub async fn positions(
    sink: &Sink,
    kafka: &KafkaSettings,
    group: &str,
    topic: &str,
) -> Result<Vec<PartitionPosition>, PositionsError> {
    let (k, g, t) = (kafka.clone(), group.to_string(), topic.to_string());
    let offsets = tokio::task::spawn_blocking(move || group_offsets(&k, &g, &t))
        .await
        .map_err(|e| PositionsError::Kafka { fatal: false, message: e.to_string() })?
        .map_err(|e| PositionsError::Kafka {
            fatal: source::is_fatal_kafka(e.rdkafka_error_code()),
            message: e.to_string(),
        })?;
    let mut out = Vec::new();
    for (partition, (committed, log_start, log_end)) in offsets {
        let clock = match committed {
            Some(c) => {
                sink.clock_at_or_below(topic, partition, 0, c).await?.and_then(|(_, clock)| clock.get()).map(Secs::get)
            }
            None => None,
        };
        out.push(PartitionPosition { partition, committed, log_start, log_end, clock });
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum PositionsError {
    #[error("reading the group's offsets from Kafka: {message}")]
    Kafka { fatal: bool, message: String },
    #[error(transparent)]
    Sink(#[from] SinkError),
}
