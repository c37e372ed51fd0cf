//! Dedup: which valid clicks count.
//!
//! # The definition
//!
//! Every decision is a function of the log (docs/DESIGN.md §5), so any re-read — a restart,
//! a rebalance, a group reset to any offset, a backfill a month later — makes it again:
//!
//! - The **record time** `τ` of a record is its partition's clock (`clock.rs`): the
//!   highest Kafka record timestamp (whole seconds) among the records of the partition
//!   up to and including it — or, for a record stamped more than an hour ahead of the
//!   clock that the next record has not confirmed, its own timestamp (it is *judged
//!   ahead*; the clock stays). A partition has no clock (0) until two consecutive
//!   timestamped records lie within an hour of each other; it starts at the later of
//!   them, and the records before are judged ahead of no clock. A record without a
//!   timestamp, or with one the clock cannot hold (before 1970, after
//!   2106-02-07T06:28:15Z), leaves the clock where it is and is judged at it. The clock
//!   never goes back.
//! - Within a partition, a valid click **counts** unless an earlier valid click of that
//!   partition with the same click ID has a record time within the window `W`
//!   (`dedup.window`) before it: `τ(o) − W ≤ τ(o') ≤ τ(o)` — and, for an `o'` judged
//!   ahead, the partition's clock just after `o` is within `W` of its *reach* (the clock
//!   after `o'`, or the clock its confirming record moved to, once read). Every sighting
//!   extends the window, counted or not, so a click retried again and again within `W`
//!   counts once; a repeat after a quiet gap longer than `W` counts as a new click; and a
//!   click judged ahead is forgotten a window of clock later, like any other.
//! - A **copy on another partition** (producers that do not key by click ID) is a
//!   duplicate when a copy of it counted on another partition within `W` of it, as the
//!   live member sees them. Which copy counts then depends on the order partitions are
//!   read in, which the log does not fix, so the live member records that decision
//!   durably (`clickagg_pins`, written by the same flush as the counts it changes) and
//!   every re-read honours it.
//!
//! # Who holds the state
//!
//! The definition needs, per partition, the sightings of the last `W` of record time.
//! - **The shared cache** (`cache`, Redis) is a cache of that state, kept by live
//!   members. Its entries are deleted `W + dedup.max_record_lag` after their last
//!   sighting: garbage collection, never a decision. A member trusts it only while its
//!   partition lags the wall clock by less than `max_record_lag`; a re-read at or below
//!   the cache's frontier is decided from what the cache knows (the owner token tells a
//!   re-read of the counting record from a duplicate), and one it cannot decide comes
//!   back [`Verdict::Undecidable`].
//! - **A private scope** ([`PrivateScope`]) is state a reader rebuilt from the log by
//!   reading the `W` of record time before its first batch without counting. Replays and
//!   reconcile always use one (nothing of theirs touches Redis); a member falls back to
//!   one when the cache cannot decide or its partition lags too far.
//!
//! A member whose cache lacks the sightings before its start (a new deployment, a lost
//! Redis, offsets moved forward) first replays that stretch of the log into the cache
//! without counting (a warm-up); see `pipeline`.

pub mod clock;
pub mod decide;
pub mod fingerprint;

pub use clock::{Checkpoint, PartitionClock, Read, Secs, Timeline, CLOCK_JUMP};
pub use decide::{
    decide_shared, Chain, Claim, ClaimBatch, ClaimMode, Frontier, Pin, PrivateScope, ReaderClaim, ReaderMark, Sighting,
    Start, Verdict,
};
pub use fingerprint::{Fingerprint, Fingerprinter};
