//! What keeps the cache small without losing what anyone needs: the holds of lagging
//! readers, the cross-partition decisions not yet durable, and the sweep.

use std::collections::BTreeMap;

use super::error::DedupError;
use super::shared::SharedCache;
use crate::dedup::{Fingerprint, Pin, Secs};

impl SharedCache {
    /// Keeps the sweeper from collecting what lagging readers may still need: per
    /// partition, the record time a reader of it has reached, or `None` when it no
    /// longer lags (group 0's `holds`).
    pub async fn set_holds(&mut self, holds: &BTreeMap<i32, Option<Secs>>) -> Result<(), DedupError> {
        if holds.is_empty() {
            return Ok(());
        }
        self.ensure_open().await?;
        let key = self.holds_key();
        let cmds = holds
            .iter()
            .map(|(&p, &hold)| match hold {
                Some(t) => redis::cmd("HSET").arg(&key).arg(p).arg(t.get()).clone(),
                None => redis::cmd("HDEL").arg(&key).arg(p).clone(),
            })
            .collect();
        self.each(cmds).await.map(drop)
    }

    /// The lowest record time a lagging reader holds, if any.
    pub(super) async fn lowest_hold(&mut self) -> Result<Option<Secs>, DedupError> {
        let held: Vec<u32> = self.query(redis::cmd("HVALS").arg(self.holds_key()).clone(), 0).await?;
        Ok(held.into_iter().min().map(Secs::new))
    }

    /// The cross-partition decisions of `partition` in `[from, to]` still in the cache
    /// (made by a live member whose flush may not have recorded them yet).
    pub async fn cached_pins(&mut self, partition: i32, from: i64, to: i64) -> Result<BTreeMap<i64, Pin>, DedupError> {
        self.ensure_open().await?;
        let cmds = (0..self.groups)
            .map(|g| {
                let mut cmd = redis::cmd("ZRANGEBYSCORE");
                cmd.arg(self.x_key(g, partition)).arg(from).arg(to);
                cmd
            })
            .collect();
        let mut out = BTreeMap::new();
        for reply in self.each(cmds).await? {
            let members: Vec<i64> =
                redis::from_redis_value(reply).map_err(|e| DedupError::Fatal(format!("pins reply: {e}")))?;
            out.extend(members.into_iter().filter_map(|m| Some((m / 4, Pin::from_code((m % 4) as u8)?))));
        }
        Ok(out)
    }

    /// Drops cached cross-partition decisions below each partition's committed offset:
    /// the flush before that commit recorded them in ClickHouse.
    pub async fn trim_cached_pins(&mut self, committed: &BTreeMap<i32, i64>) -> Result<(), DedupError> {
        if committed.is_empty() {
            return Ok(());
        }
        self.ensure_open().await?;
        let mut cmds = Vec::new();
        for g in 0..self.groups {
            for (&p, &c) in committed {
                let mut cmd = redis::cmd("ZREMRANGEBYSCORE");
                cmd.arg(self.x_key(g, p)).arg("-inf").arg(format!("({c}"));
                cmds.push(cmd);
            }
        }
        self.each(cmds).await.map(drop)
    }

    /// The bytes `claim.lua` keeps for `fingerprint` (its field in its shard hash), if
    /// any: for the tests that hold them to the Rust copy (`tests/it/dedup_cache.rs`).
    #[doc(hidden)]
    pub async fn entry_bytes(&mut self, fingerprint: Fingerprint) -> Result<Option<Vec<u8>>, DedupError> {
        self.ensure_open().await?;
        let shard = fingerprint.shard(self.shards);
        let cmd = redis::cmd("HGET").arg(self.shard_key(shard)).arg(&fingerprint.field()[..]).clone();
        self.query(cmd, self.group_of(shard)).await
    }

    /// Deletes the entries of `shards` last seen before `cutoff`; returns how many. The
    /// same shards of the namespace a renewal replaced go altogether.
    pub async fn sweep(&mut self, shards: std::ops::Range<u32>, cutoff: Secs) -> Result<u64, DedupError> {
        self.ensure_open().await?;
        let previous: Option<String> = self.query(redis::cmd("GET").arg(self.previous_ns_key()).clone(), 0).await?;
        let mut by_group: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        let mut old_keys = Vec::new();
        for s in shards {
            by_group.entry(self.group_of(s)).or_default().push(self.shard_key(s));
            if let Some(prev) = &previous {
                old_keys.push(self.shard_key_in(s, prev));
            }
        }
        if by_group.is_empty() {
            return Ok(0);
        }
        let mut cmds: Vec<redis::Cmd> = by_group
            .iter()
            .map(|(&g, keys)| {
                // The group's frontier first: the sweep keeps what a partition with no
                // clock there may still confirm.
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.functions.sweep)
                    .arg(keys.len() + 1)
                    .arg(self.frontier_key(g))
                    .arg(keys)
                    .arg(cutoff.get());
                cmd
            })
            .collect();
        let sweeps = cmds.len();
        // One key per command: a cluster routes each to the node that serves it.
        cmds.extend(old_keys.iter().map(|k| redis::cmd("UNLINK").arg(k).clone()));
        let mut removed = 0;
        for reply in self.each(cmds).await?.into_iter().take(sweeps) {
            removed +=
                redis::from_redis_value::<u64>(reply).map_err(|e| DedupError::Fatal(format!("sweep reply: {e}")))?;
        }
        Ok(removed)
    }
}
