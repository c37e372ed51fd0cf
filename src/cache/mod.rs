//! The shared dedup cache in Redis: the Redis Function `claim.lua` and its client.
//!
//! Layout, per topic and key group `g`, under `redis.key_prefix` (`claim.lua` has the
//! value formats), with `{<topic>:0}` as the tag on a single Redis and `{<topic>:<g>/<G>}`
//! for the `G = redis.slot_groups` groups on a Redis Cluster:
//! - `<prefix>{<tag>}:s:<shard>`: the `dedup.shards` hashes of entries (fingerprint →
//!   per partition that sighted the click: its chain's start, whether it counted, and the
//!   latest sighting's record time; 12 bytes each); shard `s` is in group `s mod G`;
//! - `<prefix>{<tag>}:frontier`: per partition, the highest offset claimed through the
//!   group and its record time (a claim at or below it is a re-read);
//! - `<prefix>{<tag>}:x:<partition>`: cross-partition decisions not yet durable.
//!
//! One `FCALL` per key group per poll batch claims its clicks, in order, atomically:
//! every call touches the keys of one group only, which a Redis Cluster requires of a
//! function (one slot), and every group gets a call, so the groups' frontiers move
//! together (`position::merge_frontiers` reads them). The sweeper ([`SharedCache::
//! sweep`]) deletes entries last seen more than `window + max_record_lag` ago: garbage
//! collection, never a decision (see `mod.rs`).
//!
//! # On a Redis Cluster
//!
//! The groups' hash tags spread them over the cluster's slots, so over its masters. A
//! poll batch's calls are sent as one pipeline per master (the groups it serves), all
//! masters at once. Redis replicates asynchronously: a claim a master acknowledged and
//! lost in a failover before its replica had it would be forgotten, and a later copy of
//! that click counted again. So with `redis.wait_replicas = n` (1 by default on a
//! cluster) every pipeline ends with `WAIT n`, and the verdicts are used — aggregated,
//! flushed, committed past — only once every master that decided them reports the
//! claims on `n` replicas. Fewer within `redis.wait_timeout` is a transient failure:
//! the batch is claimed again (a re-read where the claims survived, the same decisions
//! where they did not), which is safe because nothing was done with the first answer.
//! A crash between the calls of one batch leaves some groups a batch ahead; claiming
//! the batch again answers what the first claims answered (`claim.lua`).

pub mod claimer;
pub mod sweeper;

mod claims;
mod error;
mod namespace;
mod shared;
mod target;
mod upkeep;

pub use claimer::{Claimer, Verdicts};
pub use claims::{ClaimCalls, ClaimReply, ClaimSender};
pub use error::{DedupError, Lost, Recovery};

/// Partitions the cache can hold: claim.lua keeps a partition in 14 bits of an item.
pub const MAX_PARTITIONS: i32 = 16_384;
pub use shared::SharedCache;
pub use target::{slot_of, RedisTarget, Wait};
