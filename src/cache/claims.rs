//! Claims: one `FCALL` per key group per poll batch (`mod.rs`), the frontiers they leave,
//! and a reader's restart of a partition after a warm-up.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::Ordering;

use futures_util::future::join_all;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::Value;

use super::error::{DedupError, Lost};
use super::shared::SharedCache;
use super::target::{slot_of, Conn, Node};
use crate::dedup::{Claim, Pin, Secs, Sighting, Verdict};
use crate::position::CacheFrontier;

/// Bytes of one packed claim (`claim.lua`, `CLAIM`).
const CLAIM_SIZE: usize = 32;

/// One group's answer to a claim call: `OK` or `LOST`, a verdict byte per claim, and the
/// partitions that are not ready (or, when lost, why).
/// The fourth element: the partitions nothing of which was applied because the previous
/// call had not reached its mark (`prev`).
pub type ClaimReply = (String, Vec<u8>, String, String);

/// One poll batch's claim calls, one per key group ([`SharedCache::claim_calls`]).
pub struct ClaimCalls {
    pub calls: Vec<redis::Cmd>,
    /// Per group, the positions in the batch's claims of those its call carries.
    by_group: Vec<Vec<usize>>,
    /// Per partition, the batch's mark: its highest offset read and the clock there.
    marks: BTreeMap<i32, (i64, Secs)>,
}

impl ClaimCalls {
    /// Per partition, the offset this batch's mark takes it to (the next batch's `prev`).
    pub fn marks(&self) -> impl Iterator<Item = (i32, i64)> + '_ {
        self.marks.iter().map(|(&p, &(o, _))| (p, o))
    }
}

impl SharedCache {
    /// The `FCALL` that claims `members` (positions in `claims`, all in `group`), with
    /// the poll batch's marks and what this handle saw acknowledged before.
    pub(super) fn claim_call(
        &self,
        group: u32,
        members: &[usize],
        claims: &[Claim],
        marks: &[u8],
        expect: &[u8],
        prev: &[u8],
    ) -> redis::Cmd {
        let mut partitions: Vec<i32> = members.iter().map(|&i| claims[i].sighting.partition).collect();
        partitions.sort_unstable();
        partitions.dedup();
        // The shard hashes in order of first use; a claim names its hash by index into
        // KEYS (u32: a poll batch may touch more shard hashes than a u16 counts).
        let fixed = 2 + partitions.len() as u32;
        let mut index: HashMap<u32, u32> = HashMap::with_capacity(members.len());
        let mut shards: Vec<u32> = Vec::with_capacity(members.len());
        let mut blob = Vec::with_capacity(members.len() * CLAIM_SIZE);
        for &i in members {
            let c = &claims[i];
            let shard = c.fingerprint.shard(self.shards);
            let ki = *index.entry(shard).or_insert_with(|| {
                shards.push(shard);
                fixed + shards.len() as u32
            });
            let s = c.sighting;
            blob.extend_from_slice(&ki.to_be_bytes());
            blob.extend_from_slice(&c.fingerprint.field());
            blob.extend_from_slice(&(s.partition as u16).to_be_bytes());
            blob.extend_from_slice(&(s.offset as u64).to_be_bytes()[2..]);
            blob.extend_from_slice(&s.clock.get().to_be_bytes());
            blob.extend_from_slice(&s.now.get().to_be_bytes());
            blob.push(
                u8::from(c.mode.pin.is_some())
                    | u8::from(c.mode.warm) << 1
                    | u8::from(c.mode.pin == Some(Pin::Uncounted)) << 2
                    | u8::from(c.mode.confirm) << 3,
            );
        }
        // The namespace and the key prefix once per call, and one buffer for every shard
        // key: this runs for every click.
        let ns = self.namespace();
        let prefix = self.data_prefix(group, &ns);
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.functions.claim).arg(fixed as usize + shards.len());
        cmd.arg(self.ns_key(group)).arg(format!("{prefix}frontier"));
        for p in &partitions {
            cmd.arg(format!("{prefix}x:{p}"));
        }
        let mut key = String::with_capacity(prefix.len() + 8);
        for shard in shards {
            key.clear();
            key.push_str(&prefix);
            let _ = write!(key, "s:{shard:06x}");
            cmd.arg(key.as_str());
        }
        let named: Vec<String> = partitions.iter().map(i32::to_string).collect();
        cmd.arg(&ns)
            .arg(self.window.get())
            .arg(blob)
            .arg(named.join(","))
            .arg(marks)
            .arg(expect)
            .arg(self.partitions.load(Ordering::Relaxed))
            .arg(prev);
        cmd
    }

    /// Claims every click, in order, with one `FCALL` per key group; verdicts come back
    /// in input order. A click appearing twice is decided in order. Returns only once the
    /// claims are as durable as `redis.wait_replicas` asks.
    ///
    /// With no claims it still asks every group whether it holds what this member relies
    /// on (an idle member's check for a lost cache). A sighting that must wait for another
    /// partition's state to be rebuilt is answered [`Verdict::Wait`], and so is every later
    /// one of its partition in that group: the reader reads them again later (claimed
    /// again, the ones decided now answer what they answered now).
    pub async fn claim(&mut self, claims: &[Claim]) -> Result<Vec<Verdict>, DedupError> {
        self.claim_marked(claims, &[]).await
    }

    /// [`SharedCache::claim`] with the poll batch's last records read (`reached`, clicks or
    /// not, per partition read through the cache): the marks reach them too.
    pub async fn claim_marked(&mut self, claims: &[Claim], reached: &[Sighting]) -> Result<Vec<Verdict>, DedupError> {
        let calls = self.claim_calls(claims, reached, &BTreeMap::new()).await?;
        let replies = self.sender().await?.send(calls.calls.clone()).await;
        self.answer(&calls, claims, replies)
    }

    /// The calls of one poll batch (`reached` as in [`SharedCache::claim_marked`]), to
    /// send with a [`ClaimSender`] — possibly before the previous batch's are answered.
    /// `prev`: per partition, the mark the previous batch's calls of the same reader
    /// sent; where a group did not reach it (one of that batch's sightings waited, or
    /// the call failed), this call applies nothing of the partition (`claim.lua`).
    pub async fn claim_calls(
        &mut self,
        claims: &[Claim],
        reached: &[Sighting],
        prev: &BTreeMap<i32, i64>,
    ) -> Result<ClaimCalls, DedupError> {
        self.ensure_open().await?;
        // Per group: the claims' positions in `claims`, in order. Every group gets a call,
        // with the marks: the highest offset claimed per partition and its record time.
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); self.groups as usize];
        let mut marks: BTreeMap<i32, (i64, Secs)> = BTreeMap::new();
        for (i, c) in claims.iter().enumerate() {
            by_group[self.group_of(c.fingerprint.shard(self.shards)) as usize].push(i);
            let s = c.sighting;
            let mark = marks.entry(s.partition).or_insert((s.offset, s.now));
            if s.offset >= mark.0 {
                *mark = (s.offset, s.now);
            }
        }
        for s in reached {
            let mark = marks.entry(s.partition).or_insert((s.offset, s.now));
            if s.offset >= mark.0 {
                *mark = (s.offset, s.now);
            }
        }
        let mut mark_blob = Vec::with_capacity(marks.len() * 12);
        for (&p, &(o, clock)) in &marks {
            mark_blob.extend_from_slice(&(p as u16).to_be_bytes());
            mark_blob.extend_from_slice(&(o as u64).to_be_bytes()[2..]);
            mark_blob.extend_from_slice(&clock.get().to_be_bytes());
        }
        let mut prev_blob = Vec::with_capacity(prev.len() * 8);
        for (&p, &o) in prev {
            prev_blob.extend_from_slice(&(p as u16).to_be_bytes());
            prev_blob.extend_from_slice(&(o as u64).to_be_bytes()[2..]);
        }
        // What this handle relies on each group holding (`claim.lua`, ARGV[6]: one past
        // the highest offset acknowledged): of the batch's partitions, or of all it
        // claimed for when this is an idle check. A partition the batch reads through
        // the cache (`reached`) and nothing of which was acknowledged yet still needs
        // its frontier: the restart that planned its reader wrote it in every group, and
        // a group without it lost that write. Without this, a loss between the restarts
        // and the first acknowledged claim went unnoticed, and left every partition
        // waiting for the others for ever where no reader had a warm-up to claim.
        let ns = self.namespace();
        if self.acked.0 != ns {
            self.acked = (ns, BTreeMap::new());
        }
        let mut need: BTreeMap<(u32, i32), i64> = BTreeMap::new();
        for (&(g, p), &o) in &self.acked.1 {
            if (marks.is_empty() || marks.contains_key(&p)) && g < self.groups {
                need.insert((g, p), o + 1);
            }
        }
        for s in reached {
            for g in 0..self.groups {
                need.entry((g, s.partition)).or_insert(0);
            }
        }
        let mut expect = vec![Vec::new(); self.groups as usize];
        for (&(g, p), &n) in &need {
            expect[g as usize].extend_from_slice(&(p as u16).to_be_bytes());
            expect[g as usize].extend_from_slice(&(n as u64).to_be_bytes()[2..]);
        }
        let calls: Vec<redis::Cmd> = (0..self.groups)
            .map(|g| self.claim_call(g, &by_group[g as usize], claims, &mark_blob, &expect[g as usize], &prev_blob))
            .collect();
        Ok(ClaimCalls { calls, by_group, marks })
    }

    /// What the calls of `calls` answered (`replies`, from [`ClaimSender::send`]): the
    /// verdicts in the order of `claims`, or why there are none. Called in the order the
    /// calls were sent, so that what this handle saw acknowledged moves forward.
    pub fn answer(
        &mut self,
        calls: &ClaimCalls,
        claims: &[Claim],
        replies: Result<Vec<ClaimReply>, DedupError>,
    ) -> Result<Vec<Verdict>, DedupError> {
        let replies = replies.inspect_err(|e| {
            if !e.is_lost() {
                self.conn = None;
            }
        })?;
        let (by_group, marks) = (&calls.by_group, &calls.marks);
        let mut verdicts = vec![Verdict::Undecidable; claims.len()];
        let mut unready = std::collections::BTreeSet::new();
        // Per group, the partitions it applied nothing of: their frontier there did not move.
        let mut refused: std::collections::BTreeSet<(u32, i32)> = std::collections::BTreeSet::new();
        for (g, (members, reply)) in by_group.iter().zip(replies).enumerate() {
            let (status, codes, detail, not_applied) = reply;
            refused.extend(not_applied.split(',').filter_map(|p| p.parse().ok()).map(|p| (g as u32, p)));
            if status == "LOST" {
                let (why, detail) = detail.split_once(':').unwrap_or((detail.as_str(), ""));
                return Err(DedupError::Lost(Lost {
                    group: g as u32,
                    why: why.to_string(),
                    detail: detail.to_string(),
                }));
            }
            if codes.len() != members.len() {
                return Err(DedupError::Fatal(format!("{} verdicts for {} claims", codes.len(), members.len())));
            }
            for (&i, &code) in members.iter().zip(&codes) {
                verdicts[i] = Verdict::from_code(code)
                    .ok_or_else(|| DedupError::Fatal(format!("unknown verdict byte {code}")))?;
            }
            unready.extend(detail.split(',').filter(|p| !p.is_empty()).map(str::to_string));
        }
        // Acknowledged per group: a partition reached its mark in every group but one that
        // held a sighting of it that waits; there, its frontier reached just before the
        // first claim that waited (`claim.lua`) — past warm-up claims its reader relies on,
        // so a group that loses them must be noticed too.
        let mut waiting: BTreeMap<(u32, i32), i64> = BTreeMap::new();
        for (g, members) in by_group.iter().enumerate() {
            for &i in members {
                let s = claims[i].sighting;
                if verdicts[i] == Verdict::Wait {
                    let first = waiting.entry((g as u32, s.partition)).or_insert(s.offset);
                    *first = (*first).min(s.offset);
                }
            }
        }
        if !waiting.is_empty() {
            let unready: Vec<String> = unready.into_iter().collect();
            let partitions: std::collections::BTreeSet<i32> = waiting.keys().map(|&(_, p)| p).collect();
            tracing::debug!(waiting = ?partitions, unready = %unready.join(","), "sightings wait for other partitions' state");
        }
        for g in 0..self.groups {
            for (&p, &(o, _)) in marks.iter().filter(|(p, _)| !refused.contains(&(g, **p))) {
                let reached = match waiting.get(&(g, p)) {
                    None => Some(o),
                    Some(&first) => Some(o.min(first - 1)).filter(|&r| r >= 0),
                };
                if let Some(o) = reached {
                    let seen = self.acked.1.entry((g, p)).or_insert(o);
                    *seen = (*seen).max(o);
                }
            }
        }
        Ok(verdicts)
    }
}

/// A connection to send one poll batch's claim calls on, while earlier ones may still be
/// in flight on it: Redis runs the calls of one connection in the order sent.
pub struct ClaimSender {
    conn: Conn,
    wait: Option<super::target::Wait>,
    /// Per key group, the slot its keys hash to.
    slots_of: Vec<u16>,
}

impl SharedCache {
    /// A sender on this handle's connection (connecting first if needed).
    pub async fn sender(&mut self) -> Result<ClaimSender, DedupError> {
        let slots_of = (0..self.groups).map(|g| slot_of(&self.frontier_key(g))).collect();
        let wait = self.wait;
        let conn = self.connection().await?.clone();
        Ok(ClaimSender { conn, wait, slots_of })
    }
}

impl ClaimSender {
    /// Sends the claim calls (one per group, in group order) and returns their replies in
    /// that order (an error drops nothing: [`SharedCache::answer`] drops the connection): one pipeline on a single Redis; on a cluster one pipeline per master,
    /// all masters at once. Each pipeline ends with `WAIT` when claims must be durable:
    /// on the same connection, after the calls, so it counts exactly their writes.
    pub async fn send(mut self, calls: Vec<redis::Cmd>) -> Result<Vec<ClaimReply>, DedupError> {
        let (wait, slots_of) = (self.wait, &self.slots_of);
        let groups: Vec<u32> = (0..slots_of.len() as u32).collect();
        let result = match &mut self.conn {
            Conn::Single(conn) => {
                let mut pipe = redis::pipe();
                for cmd in calls {
                    pipe.add_command(cmd);
                }
                if let Some(w) = wait {
                    pipe.cmd("WAIT").arg(w.replicas).arg(w.timeout.as_millis() as u64);
                }
                pipe.query_async::<Vec<Value>>(conn).await.map(|values| vec![values])
            }
            Conn::Cluster { conn, slots } => {
                // The groups of each master, in group order.
                let mut by_node: BTreeMap<Node, Vec<usize>> = BTreeMap::new();
                for (g, &slot) in slots_of.iter().enumerate() {
                    let node = slots.master_of(slot).cloned().unwrap_or_else(|| (String::new(), slot));
                    by_node.entry(node).or_default().push(g);
                }
                let mut calls: Vec<Option<redis::Cmd>> = calls.into_iter().map(Some).collect();
                let pipelines: Vec<(Vec<usize>, redis::Pipeline)> = by_node
                    .into_values()
                    .map(|gs| {
                        let mut pipe = redis::pipe();
                        for &g in &gs {
                            pipe.add_command(calls[g].take().expect("each group once"));
                        }
                        if let Some(w) = wait {
                            pipe.cmd("WAIT").arg(w.replicas).arg(w.timeout.as_millis() as u64);
                        }
                        (gs, pipe)
                    })
                    .collect();
                let sends = pipelines.iter().map(|(gs, pipe)| {
                    let mut conn = conn.clone();
                    // To the master of the first group's slot; the other groups' slots are
                    // on it too, by the slot map (if it is stale the node redirects).
                    let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slots_of[gs[0]], SlotAddr::Master));
                    async move { conn.route_pipeline(pipe.clone(), 0, pipe.len(), route).await }
                });
                let mut by_group: Vec<Value> = vec![Value::Nil; groups.len()];
                let mut waits = Vec::new();
                let mut failed = None;
                for ((gs, _), reply) in pipelines.iter().zip(join_all(sends).await) {
                    match reply
                        .and_then(|values| values.into_iter().map(Value::extract_error).collect::<Result<Vec<_>, _>>())
                    {
                        Ok(mut values) => {
                            if wait.is_some() {
                                waits.push(values.pop().unwrap_or(Value::Nil));
                            }
                            for (&g, v) in gs.iter().zip(values) {
                                by_group[g] = v;
                            }
                        }
                        Err(e) => failed = failed.or(Some(e)),
                    }
                }
                match failed {
                    Some(e) => Err(e),
                    None => {
                        by_group.extend(waits);
                        Ok(vec![by_group])
                    }
                }
            }
        };
        let mut values = match result {
            Ok(mut v) => v.pop().expect("one list"),
            Err(e) => return Err(DedupError::classify(e)),
        };
        // The WAIT replies follow the groups' replies; the fewest replicas counts.
        let acked = values.split_off(groups.len());
        if let Some(w) = wait {
            let fewest = acked.iter().map(|v| redis::from_redis_value_ref::<i64>(v).unwrap_or(0)).min().unwrap_or(0);
            if fewest < i64::from(w.replicas) {
                return Err(DedupError::unreachable(format!(
                    "claims acknowledged by {fewest} of the {} replicas redis.wait_replicas asks for within {:?} \
                     (redis.wait_timeout); claiming again",
                    w.replicas, w.timeout
                )));
            }
        }
        values
            .into_iter()
            .map(|v| redis::from_redis_value(v).map_err(|e| DedupError::Fatal(format!("claim reply: {e}"))))
            .collect()
    }
}

impl SharedCache {
    /// Per partition, what each key group says: the highest offset claimed, its record
    /// time, and where its state is exact from (`position::merge_frontiers` merges them).
    pub async fn frontiers(
        &mut self,
        partitions: &[i32],
    ) -> Result<BTreeMap<i32, Vec<Option<CacheFrontier>>>, DedupError> {
        if partitions.is_empty() {
            return Ok(BTreeMap::new());
        }
        self.ensure_open().await?;
        let cmds = (0..self.groups)
            .map(|g| {
                let mut cmd = redis::cmd("HMGET");
                cmd.arg(self.frontier_key(g)).arg(partitions);
                cmd
            })
            .collect();
        let replies = self.each(cmds).await?;
        let u48 = |b: &[u8]| {
            let mut x = [0u8; 8];
            x[2..].copy_from_slice(b);
            i64::from_be_bytes(x)
        };
        let mut out: BTreeMap<i32, Vec<Option<CacheFrontier>>> = BTreeMap::new();
        for reply in replies {
            let values: Vec<Option<Vec<u8>>> =
                redis::from_redis_value(reply).map_err(|e| DedupError::Fatal(format!("frontier reply: {e}")))?;
            for (&p, v) in partitions.iter().zip(values) {
                let f = v.filter(|v| v.len() == 16).map(|v| CacheFrontier {
                    claimed: u48(&v[..6]) - 1,
                    clock: Secs::new(u32::from_be_bytes(v[6..10].try_into().expect("4 bytes"))),
                    exact_from: u48(&v[10..16]),
                });
                out.entry(p).or_default().push(f);
            }
        }
        Ok(out)
    }

    /// Before a reader counts `partition` from `boundary` after a warm-up from
    /// `lookback`: unless the cache already reached the boundary, its re-reads are
    /// decided only from `boundary` on (`claim.lua`, `restart`), in every key group, and
    /// the partition is not ready until the warm-up reaches the boundary. A partition
    /// the namespace never saw gets its frontier here, so that others wait for it.
    pub async fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) -> Result<(), DedupError> {
        self.ensure_open().await?;
        let ns = self.namespace();
        let cmds = (0..self.groups)
            .map(|g| {
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.functions.restart)
                    .arg(2)
                    .arg(self.ns_key(g))
                    .arg(self.frontier_key(g))
                    .arg(&ns)
                    .arg(partition)
                    .arg(lookback)
                    .arg(boundary);
                cmd
            })
            .collect();
        for (g, reply) in self.each(cmds).await?.into_iter().enumerate() {
            if let Value::Array(parts) = reply {
                let detail: String = parts.get(2).and_then(|v| redis::from_redis_value_ref(v).ok()).unwrap_or_default();
                let (why, detail) = detail.split_once(':').unwrap_or((detail.as_str(), ""));
                return Err(DedupError::Lost(Lost {
                    group: g as u32,
                    why: why.to_string(),
                    detail: detail.to_string(),
                }));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    /// A member's handle in namespace `n` (no Redis is reached: the calls are only built).
    fn cache() -> SharedCache {
        let s = Settings::default();
        let cache = SharedCache::connect(&s.redis, &s.rules(), "clicks").unwrap();
        *cache.namespace.lock().unwrap() = Some("n".into());
        cache
    }

    /// ARGV[6] of a claim call (`claim.lua`): (partition, the frontier it must have reached).
    fn expected(cmd: &redis::Cmd) -> Vec<(u16, u64)> {
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        // ... ARGV[5] marks, ARGV[6] expect, ARGV[7] partition count, ARGV[8] prev.
        let blob = &args[args.len() - 3];
        blob.chunks(8)
            .map(|c| {
                let mut o = [0u8; 8];
                o[2..].copy_from_slice(&c[2..]);
                (u16::from_be_bytes([c[0], c[1]]), u64::from_be_bytes(o))
            })
            .collect()
    }

    // Issue 35, defect 1: a partition a poll batch reads through the cache must still have
    // its frontier, also before anything of it was acknowledged (right after the restart
    // that planned its reader): a group without it lost writes, and the call answers lost
    // instead of leaving the partition "not ready" with nobody to rebuild it.
    #[tokio::test]
    async fn a_partition_read_through_the_cache_must_keep_its_frontier_before_anything_is_acknowledged() {
        let mut c = cache();
        let reached = [Sighting::at(3, 41, Secs::new(1_000))];
        let claims = [Claim {
            fingerprint: crate::dedup::Fingerprint(7),
            sighting: Sighting::at(3, 40, Secs::new(1_000)),
            mode: Default::default(),
        }];
        let calls = c.claim_calls(&claims, &reached, &BTreeMap::new()).await.unwrap();
        assert_eq!(expected(&calls.calls[0]), vec![(3, 0)], "its frontier must exist");
        // Once acknowledged, one past the highest offset acknowledged.
        c.acked.1.insert((0, 3), 41);
        let calls = c.claim_calls(&claims, &reached, &BTreeMap::new()).await.unwrap();
        assert_eq!(expected(&calls.calls[0]), vec![(3, 42)]);
        // An idle check relies on every partition acknowledged; claims that name no
        // partition read through the cache (a private reader's, the benchmark's) on none
        // acknowledged.
        c.acked.1.clear();
        let idle = c.claim_calls(&[], &[], &BTreeMap::new()).await.unwrap();
        assert_eq!(expected(&idle.calls[0]), vec![]);
        let bare = c.claim_calls(&claims, &[], &BTreeMap::new()).await.unwrap();
        assert_eq!(expected(&bare.calls[0]), vec![]);
    }
}
