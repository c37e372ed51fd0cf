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

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, Value};
use siphasher::sip128::SipHasher13;

use super::decide::{ClaimMode, Pin, Secs, Sighting, Verdict};
use super::fingerprint::Fingerprint;
use crate::position::CacheFrontier;

const CLAIM_LUA: &str = include_str!("claim.lua");

/// One click to claim: its fingerprint, where it was sighted, and how (`ClaimMode`).
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub fingerprint: Fingerprint,
    pub sighting: Sighting,
    pub mode: ClaimMode,
}

#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// Redis is unreachable, slow, loading, out of memory, read-only, failing over, or
    /// its replicas did not acknowledge the claims in time: retry with backoff.
    #[error("Redis unavailable: {0}")]
    Transient(String),
    /// Retrying cannot help (bad credentials, missing ACL permission, a Redis without
    /// functions, a setting that can lose dedup state): stop with this message.
    #[error("Redis refused the dedup cache: {0}")]
    Fatal(String),
}

impl DedupError {
    fn classify(e: RedisError) -> DedupError {
        use redis::ServerErrorKind as S;
        let text = e.to_string();
        // An untrusted server certificate stays untrusted however often we retry.
        if text.contains("certificate verify failed") {
            return DedupError::Fatal(format!(
                "{text} (set redis.tls_ca_file to the CA that signed the Redis server certificate)"
            ));
        }
        match e.kind() {
            ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => DedupError::Fatal(text),
            ErrorKind::Server(S::NoPerm) => DedupError::Fatal(format!(
                "{text} (the ACL user needs +fcall, +function, +hget, +hmget, +ping, and +wait and +cluster on a Redis Cluster)"
            )),
            // Keys of two slots in one call: the layout is wrong, not the server.
            ErrorKind::Server(S::CrossSlot) => DedupError::Fatal(format!("{text} (a bug: report it)")),
            ErrorKind::Extension if text.contains("WRONGPASS") || text.contains("NOAUTH") => DedupError::Fatal(text),
            // A bug in the function, or a server without functions (Redis < 7.0).
            _ if text.contains("user_function") || text.contains("unknown command 'FCALL'") => {
                DedupError::Fatal(format!("{text} (clickagg needs Redis >= 7.0 with functions)"))
            }
            // A cluster client pointed at a Redis that is not one.
            _ if text.contains("cluster support disabled") => DedupError::Fatal(format!(
                "{text} (redis.url names a Redis without cluster mode: unset redis.cluster)"
            )),
            _ => DedupError::Transient(text),
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self, DedupError::Fatal(_))
    }
}

/// The function library's version: a hash of its source, so two clickagg versions with
/// different code never call each other's functions.
fn library_version() -> String {
    let h = SipHasher13::new_with_keys(0, 0).hash(CLAIM_LUA.as_bytes());
    format!("{:08x}", h.h1 as u32)
}

/// Where the cache lives: one Redis (or a primary with replicas behind one address), or
/// a Redis Cluster reached through seed nodes.
pub enum RedisTarget {
    Single(redis::Client),
    Cluster(ClusterClient),
}

impl From<redis::Client> for RedisTarget {
    fn from(client: redis::Client) -> RedisTarget {
        RedisTarget::Single(client)
    }
}

/// How durable a claim must be before its verdict is used: acknowledged by `replicas`
/// replicas of the master that made it (`WAIT`), within `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    pub replicas: u32,
    pub timeout: Duration,
}

/// A node of a Redis Cluster, as `CLUSTER SLOTS` names it.
type Node = (String, u16);

/// Which master serves which slots, and every node (replicas too). Only to bundle the
/// calls of the groups one master serves into one pipeline: a stale map costs a
/// redirect or a retry, never a wrong answer (each node refuses keys it does not serve).
#[derive(Debug, Default)]
struct SlotMap {
    masters: Vec<(u16, u16, Node)>,
    nodes: Vec<Node>,
}

impl SlotMap {
    fn master_of(&self, slot: u16) -> Option<&Node> {
        self.masters.iter().find(|(from, to, _)| (*from..=*to).contains(&slot)).map(|(_, _, n)| n)
    }

    /// From a `CLUSTER SLOTS` reply: `[[from, to, [host, port, id, …], replica…], …]`.
    fn parse(reply: &Value) -> Option<SlotMap> {
        let node = |v: &Value| -> Option<Node> {
            let Value::Array(fields) = v else { return None };
            let host: String = redis::from_redis_value_ref(fields.first()?).ok()?;
            let port: u16 = redis::from_redis_value_ref(fields.get(1)?).ok()?;
            Some((host, port))
        };
        let Value::Array(ranges) = reply else { return None };
        let mut map = SlotMap::default();
        for r in ranges {
            let Value::Array(parts) = r else { return None };
            let from: u16 = redis::from_redis_value_ref(parts.first()?).ok()?;
            let to: u16 = redis::from_redis_value_ref(parts.get(1)?).ok()?;
            let master = node(parts.get(2)?)?;
            for n in parts[2..].iter().filter_map(node) {
                if !map.nodes.contains(&n) {
                    map.nodes.push(n);
                }
            }
            map.masters.push((from, to, master));
        }
        Some(map)
    }
}

/// The Redis Cluster slot of a key (CRC16/XMODEM of its hash tag, mod 16384).
pub fn slot_of(key: &str) -> u16 {
    let tag = key
        .find('{')
        .and_then(|open| key[open + 1..].find('}').map(|len| &key[open + 1..open + 1 + len]))
        .filter(|t| !t.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16_384
}

enum Conn {
    Single(MultiplexedConnection),
    Cluster { conn: ClusterConnection, slots: SlotMap },
}

/// A client of one topic's shared cache. It reconnects (and reloads the function
/// library) lazily after any error, so the caller's retry loop is the only recovery path.
pub struct SharedCache {
    target: RedisTarget,
    conn: Option<Conn>,
    timeout: Duration,
    key_prefix: String,
    topic: String,
    shards: u32,
    /// Key groups: every call touches one group only, so a Redis Cluster can spread the
    /// groups over its nodes (a group is a hash tag). One on a single Redis.
    groups: u32,
    /// Replicas that must hold a claim before its verdict is used (`None`: the master's
    /// answer is enough).
    wait: Option<Wait>,
    window: Secs,
    claim_fn: String,
    sweep_fn: String,
    restart_fn: String,
    library: String,
}

impl SharedCache {
    pub fn new(
        target: impl Into<RedisTarget>,
        key_prefix: &str,
        topic: &str,
        shards: u32,
        groups: u32,
        window: Duration,
        timeout: Duration,
    ) -> SharedCache {
        let v = library_version();
        let library = CLAIM_LUA
            .replacen("name=clickagg_dedup_v1", &format!("name=clickagg_dedup_{v}"), 1)
            .replace("'clickagg_claim_v1'", &format!("'clickagg_claim_{v}'"))
            .replace("'clickagg_sweep_v1'", &format!("'clickagg_sweep_{v}'"))
            .replace("'clickagg_restart_v1'", &format!("'clickagg_restart_{v}'"));
        SharedCache {
            target: target.into(),
            conn: None,
            timeout,
            key_prefix: key_prefix.to_string(),
            topic: topic.to_string(),
            shards,
            groups: groups.max(1),
            wait: None,
            window: window.as_secs().try_into().unwrap_or(Secs::MAX),
            claim_fn: format!("clickagg_claim_{v}"),
            sweep_fn: format!("clickagg_sweep_{v}"),
            restart_fn: format!("clickagg_restart_{v}"),
            library,
        }
    }

    /// Uses a claim's verdict only once `wait.replicas` replicas acknowledged it.
    pub fn with_wait(mut self, wait: Option<Wait>) -> SharedCache {
        self.wait = wait.filter(|w| w.replicas > 0);
        self
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    pub fn groups(&self) -> u32 {
        self.groups
    }

    fn group_of(&self, shard: u32) -> u32 {
        shard % self.groups
    }

    /// `<prefix>{<topic>:<group>}:`, or `<prefix>{<topic>:<group>/<groups>}:` with several
    /// groups: the braces make the group a Redis Cluster hash tag, and the group count is
    /// part of the name because it decides which group holds a click (another count is
    /// another cache, which starts empty and is warmed up from the log).
    fn group_prefix(&self, group: u32) -> String {
        if self.groups == 1 {
            format!("{}{{{}:{group}}}:", self.key_prefix, self.topic)
        } else {
            format!("{}{{{}:{group}/{}}}:", self.key_prefix, self.topic, self.groups)
        }
    }

    pub fn shard_key(&self, shard: u32) -> String {
        format!("{}s:{shard:06x}", self.group_prefix(self.group_of(shard)))
    }

    fn frontier_key(&self, group: u32) -> String {
        format!("{}frontier", self.group_prefix(group))
    }

    fn x_key(&self, group: u32, partition: i32) -> String {
        format!("{}x:{partition}", self.group_prefix(group))
    }

    async fn connection(&mut self) -> Result<&mut Conn, DedupError> {
        if self.conn.is_none() {
            let conn = match &self.target {
                RedisTarget::Single(client) => {
                    let config = AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout));
                    let mut conn = client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                        .map_err(DedupError::classify)?;
                    // Loading is idempotent; "already exists" means another member was first.
                    let loaded: Result<String, RedisError> =
                        redis::cmd("FUNCTION").arg("LOAD").arg(&self.library).query_async(&mut conn).await;
                    if let Err(e) = loaded {
                        if !e.to_string().contains("already exists") {
                            return Err(DedupError::classify(e));
                        }
                    }
                    Conn::Single(conn)
                }
                RedisTarget::Cluster(client) => {
                    let config =
                        ClusterConfig::new().set_connection_timeout(self.timeout).set_response_timeout(self.timeout);
                    let mut conn =
                        client.get_async_connection_with_config(config).await.map_err(DedupError::classify)?;
                    // On every master (the client sends it to all and wants every one to
                    // succeed); REPLACE because some have it already: the same code,
                    // since the library's name carries the hash of its source. Replicas
                    // get it by replication, so a promoted one has it too.
                    let _: Value = redis::cmd("FUNCTION")
                        .arg("LOAD")
                        .arg("REPLACE")
                        .arg(&self.library)
                        .query_async(&mut conn)
                        .await
                        .map_err(DedupError::classify)?;
                    let reply: Value = conn
                        .route_command(
                            redis::cmd("CLUSTER").arg("SLOTS").clone(),
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                        )
                        .await
                        .map_err(DedupError::classify)?;
                    let slots = SlotMap::parse(&reply)
                        .ok_or_else(|| DedupError::Transient("an unreadable CLUSTER SLOTS reply".into()))?;
                    Conn::Cluster { conn, slots }
                }
            };
            self.conn = Some(conn);
        }
        Ok(self.conn.as_mut().expect("just connected"))
    }

    /// Runs commands that each touch one key group: pipelined on a single Redis, all at
    /// once (each to the node that serves its keys) on a cluster. On failure the
    /// connection is dropped, so the next call starts afresh (and reloads the library, in
    /// case a node restarted without it, and reads the cluster's slots again).
    async fn each(&mut self, cmds: Vec<redis::Cmd>) -> Result<Vec<Value>, DedupError> {
        let result = match self.connection().await? {
            Conn::Single(conn) => {
                let mut pipe = redis::pipe();
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                pipe.query_async::<Vec<Value>>(conn).await
            }
            Conn::Cluster { conn, .. } => {
                let calls = cmds.into_iter().map(|cmd| {
                    let mut conn = conn.clone();
                    async move { cmd.query_async::<Value>(&mut conn).await }
                });
                join_all(calls).await.into_iter().collect()
            }
        };
        result.map_err(|e| {
            self.conn = None;
            DedupError::classify(e)
        })
    }

    /// The `FCALL` that claims `members` (positions in `claims`, all in `group`), with
    /// the poll batch's marks.
    fn claim_call(&self, group: u32, members: &[usize], claims: &[Claim], marks: &[u8]) -> redis::Cmd {
        let mut partitions: Vec<i32> = members.iter().map(|&i| claims[i].sighting.partition).collect();
        partitions.sort_unstable();
        partitions.dedup();
        let mut keys = vec![self.frontier_key(group)];
        keys.extend(partitions.iter().map(|&p| self.x_key(group, p)));
        let mut index: BTreeMap<u32, u16> = BTreeMap::new();
        let mut blob = Vec::with_capacity(members.len() * 26);
        for &i in members {
            let c = &claims[i];
            let shard = c.fingerprint.shard(self.shards);
            let ki = *index.entry(shard).or_insert_with(|| {
                keys.push(self.shard_key(shard));
                keys.len() as u16
            });
            let s = c.sighting;
            blob.extend_from_slice(&ki.to_be_bytes());
            blob.extend_from_slice(&c.fingerprint.field());
            blob.extend_from_slice(&(s.partition as u16).to_be_bytes());
            blob.extend_from_slice(&(s.offset as u64).to_be_bytes()[2..]);
            blob.extend_from_slice(&s.clock.to_be_bytes());
            blob.push(u8::from(c.mode.pin.is_some()) | u8::from(c.mode.warm) << 1);
        }
        let named: Vec<String> = partitions.iter().map(i32::to_string).collect();
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.claim_fn).arg(keys.len()).arg(&keys).arg(self.window).arg(blob).arg(named.join(",")).arg(marks);
        cmd
    }

    /// Claims every click, in order, with one `FCALL` per key group; verdicts come back
    /// in input order. A click appearing twice is decided in order. Returns only once the
    /// claims are as durable as `redis.wait_replicas` asks.
    pub async fn claim(&mut self, claims: &[Claim]) -> Result<Vec<Verdict>, DedupError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        // Per group: the claims' positions in `claims`, in order. Every group gets a call,
        // with the marks: the highest offset claimed per partition and its record time.
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); self.groups as usize];
        let mut marks: BTreeMap<i32, (i64, Secs)> = BTreeMap::new();
        for (i, c) in claims.iter().enumerate() {
            by_group[self.group_of(c.fingerprint.shard(self.shards)) as usize].push(i);
            let s = c.sighting;
            let mark = marks.entry(s.partition).or_insert((s.offset, s.clock));
            if s.offset >= mark.0 {
                *mark = (s.offset, s.clock);
            }
        }
        let mut mark_blob = Vec::with_capacity(marks.len() * 12);
        for (&p, &(o, clock)) in &marks {
            mark_blob.extend_from_slice(&(p as u16).to_be_bytes());
            mark_blob.extend_from_slice(&(o as u64).to_be_bytes()[2..]);
            mark_blob.extend_from_slice(&clock.to_be_bytes());
        }
        let calls: Vec<redis::Cmd> =
            (0..self.groups).map(|g| self.claim_call(g, &by_group[g as usize], claims, &mark_blob)).collect();
        let replies = self.run_claims(calls).await?;
        let mut verdicts = vec![Verdict::Undecidable; claims.len()];
        for (members, codes) in by_group.iter().zip(&replies) {
            if codes.len() != members.len() {
                return Err(DedupError::Fatal(format!("{} verdicts for {} claims", codes.len(), members.len())));
            }
            for (&i, &code) in members.iter().zip(codes) {
                verdicts[i] = Verdict::from_code(code)
                    .ok_or_else(|| DedupError::Fatal(format!("unknown verdict byte {code}")))?;
            }
        }
        Ok(verdicts)
    }

    /// Sends the claim calls (one per group, in group order) and returns their replies in
    /// that order: one pipeline on a single Redis; on a cluster one pipeline per master,
    /// all masters at once. Each pipeline ends with `WAIT` when claims must be durable:
    /// on the same connection, after the calls, so it counts exactly their writes.
    async fn run_claims(&mut self, calls: Vec<redis::Cmd>) -> Result<Vec<Vec<u8>>, DedupError> {
        let wait = self.wait;
        let groups: Vec<u32> = (0..self.groups).collect();
        let slots_of: Vec<u16> = groups.iter().map(|&g| slot_of(&self.frontier_key(g))).collect();
        let result = match self.connection().await? {
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
            Err(e) => {
                self.conn = None;
                return Err(DedupError::classify(e));
            }
        };
        // The WAIT replies follow the groups' replies; the fewest replicas counts.
        let acked = values.split_off(groups.len());
        if let Some(w) = wait {
            let fewest = acked.iter().map(|v| redis::from_redis_value_ref::<i64>(v).unwrap_or(0)).min().unwrap_or(0);
            if fewest < i64::from(w.replicas) {
                return Err(DedupError::Transient(format!(
                    "claims acknowledged by {fewest} of the {} replicas redis.wait_replicas asks for within {:?} \
                     (redis.wait_timeout); claiming again",
                    w.replicas, w.timeout
                )));
            }
        }
        values
            .into_iter()
            .map(|v| redis::from_redis_value::<Vec<u8>>(v).map_err(|e| DedupError::Fatal(format!("claim reply: {e}"))))
            .collect()
    }

    /// Per partition, what each key group says: the highest offset claimed, its record
    /// time, and where its state is exact from (`position::merge_frontiers` merges them).
    pub async fn frontiers(
        &mut self,
        partitions: &[i32],
    ) -> Result<BTreeMap<i32, Vec<Option<CacheFrontier>>>, DedupError> {
        if partitions.is_empty() {
            return Ok(BTreeMap::new());
        }
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
                    claimed: u48(&v[..6]),
                    clock: Secs::from_be_bytes(v[6..10].try_into().expect("4 bytes")),
                    exact_from: u48(&v[10..16]),
                });
                out.entry(p).or_default().push(f);
            }
        }
        Ok(out)
    }

    /// Before a warm-up of `partition` from `lookback` (because the cache lost what lies
    /// before its boundary): from now on its re-reads are decided by the cache only from
    /// `boundary` on (`claim.lua`, `restart`), in every key group.
    pub async fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) -> Result<(), DedupError> {
        let cmds = (0..self.groups)
            .map(|g| {
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.restart_fn).arg(1).arg(self.frontier_key(g)).arg(partition).arg(lookback).arg(boundary);
                cmd
            })
            .collect();
        self.each(cmds).await.map(drop)
    }

    /// The cross-partition decisions of `partition` in `[from, to]` still in the cache
    /// (made by a live member whose flush may not have recorded them yet).
    pub async fn cached_pins(&mut self, partition: i32, from: i64, to: i64) -> Result<BTreeMap<i64, Pin>, DedupError> {
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

    /// Deletes the entries of `shards` last seen before `cutoff`; returns how many.
    pub async fn sweep(&mut self, shards: std::ops::Range<u32>, cutoff: Secs) -> Result<u64, DedupError> {
        let mut by_group: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for s in shards {
            by_group.entry(self.group_of(s)).or_default().push(self.shard_key(s));
        }
        if by_group.is_empty() {
            return Ok(0);
        }
        let cmds = by_group
            .values()
            .map(|keys| {
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.sweep_fn).arg(keys.len()).arg(keys).arg(cutoff);
                cmd
            })
            .collect();
        let mut removed = 0;
        for reply in self.each(cmds).await? {
            removed +=
                redis::from_redis_value::<u64>(reply).map_err(|e| DedupError::Fatal(format!("sweep reply: {e}")))?;
        }
        Ok(removed)
    }

    /// Refuses a Redis that may evict dedup entries: a forgotten entry lets a duplicate
    /// count twice. On a cluster every node is asked, replicas too (a replica becomes
    /// the master of its slots in a failover). A server that hides its configuration
    /// (managed Redis without `CONFIG`) cannot be checked; that is logged, not refused.
    pub async fn check_eviction_policy(&mut self) -> Result<(), DedupError> {
        let config_get = || redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").clone();
        let answers: Vec<(String, Result<Value, RedisError>)> = match self.connection().await? {
            Conn::Single(conn) => vec![("Redis".to_string(), config_get().query_async(conn).await)],
            Conn::Cluster { conn, slots } => {
                let asks = slots.nodes.iter().map(|(host, port)| {
                    let mut conn = conn.clone();
                    let route =
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port });
                    async move { (format!("Redis node {host}:{port}"), conn.route_command(config_get(), route).await) }
                });
                join_all(asks).await
            }
        };
        for (node, answer) in answers {
            match answer.map_err(DedupError::classify) {
                Ok(v) => {
                    let v: Vec<String> = redis::from_redis_value(v).unwrap_or_default();
                    match v.get(1).map(String::as_str) {
                        Some("noeviction") | None => {}
                        Some(policy) => {
                            return Err(DedupError::Fatal(format!(
                                "{node} has maxmemory-policy {policy}, which can evict dedup state and let \
                                 duplicates count twice; set maxmemory-policy noeviction on every Redis server"
                            )))
                        }
                    }
                }
                Err(DedupError::Transient(e)) => {
                    self.conn = None;
                    return Err(DedupError::Transient(e));
                }
                Err(DedupError::Fatal(e)) => {
                    tracing::warn!(error = %e, %node, "cannot read Redis maxmemory-policy; make sure it is noeviction");
                }
            }
        }
        Ok(())
    }

    /// Round trip for readiness checks (every node of a cluster).
    pub async fn ping(&mut self) -> Result<(), DedupError> {
        self.each(vec![redis::cmd("PING")]).await.map(drop)
    }
}

/// The garbage collector of the shared cache, run by every member: it walks all shards
/// once per quarter of `max_record_lag` (starting at a random shard, so members spread
/// out) and deletes entries whose last sighting is more than `window + max_record_lag`
/// before the wall clock. A member lagging less than `max_record_lag` never needs them;
/// one lagging more stops trusting the cache (`pipeline`). Errors are logged and the
/// walk goes on: a missed sweep only costs memory.
pub async fn sweep_forever(
    mut cache: SharedCache,
    window: Duration,
    max_record_lag: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    use rand::Rng;
    const TICK: Duration = Duration::from_secs(1);
    let shards = cache.shards();
    let cycle = (max_record_lag / 4).max(Duration::from_secs(60));
    let per_tick = ((u64::from(shards) * TICK.as_millis() as u64).div_ceil(cycle.as_millis() as u64)).max(1) as u32;
    let mut cursor = rand::rng().random_range(0..shards);
    let mut ticker = tokio::time::interval(TICK);
    let mut failures = 0u64;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let horizon = (window + max_record_lag).as_secs() as i64;
        let cutoff = (chrono::Utc::now().timestamp() - horizon).clamp(0, i64::from(Secs::MAX)) as Secs;
        let end = (cursor + per_tick).min(shards);
        match cache.sweep(cursor..end, cutoff).await {
            Ok(removed) => metrics::counter!(crate::telemetry::DEDUP_SWEPT).increment(removed),
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(error = %e, failures, "sweeping the dedup cache failed; retrying next tick");
                }
            }
        }
        cursor = if end >= shards { 0 } else { end };
    }
}

/// The claim task of a member: applies each poll batch's claims in the order they were
/// handed over (the cache's decisions depend on that order), retrying while Redis is
/// unavailable — dedup is never skipped — so the member can decode the next poll batch
/// while one is in flight. The verdicts come back in the same order on the receiver
/// `start` returns, one answer per batch (a batch without claims is answered at once,
/// in its turn).
pub struct Claimer {
    // Unbounded: the member loop bounds what it hands over (two batches in flight,
    // fewer than that reaching it while consumption is paused), and must never block
    // here, or it would stop polling Kafka and be evicted from the group.
    tx: tokio::sync::mpsc::UnboundedSender<Vec<Claim>>,
}

/// The verdicts of the handed-over batches, in order.
pub type Verdicts = tokio::sync::mpsc::Receiver<Result<Vec<Verdict>, DedupError>>;

impl Claimer {
    pub fn start(
        mut cache: SharedCache,
        max_backoff: Duration,
        health: std::sync::Arc<crate::health::Health>,
    ) -> (Claimer, Verdicts) {
        use crate::telemetry as t;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Claim>>();
        let (answer_tx, answers) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let log_limit = t::RateLimiter::new(Duration::from_secs(5));
            while let Some(claims) = rx.recv().await {
                let mut backoff = crate::pipeline::Backoff::new(max_backoff);
                let answer = loop {
                    match cache.claim(&claims).await {
                        Ok(v) => {
                            health.set_claims_failing(None);
                            break Ok(v);
                        }
                        Err(e) if e.is_fatal() => break Err(e),
                        Err(e) => {
                            // The member loop pauses consumption while this is set.
                            let trouble = crate::health::RedisTrouble::of(&e.to_string());
                            health.set_claims_failing(Some(trouble));
                            metrics::counter!(t::REDIS_ERRORS, "kind" => trouble.label()).increment(1);
                            metrics::counter!(t::REDIS_RETRIES).increment(1);
                            if log_limit.allow("redis", std::time::Instant::now()).is_some() {
                                tracing::warn!(error = %e, "dedup failed; retrying with backoff");
                            }
                            if answer_tx.is_closed() {
                                return; // nobody waits any more (shutdown)
                            }
                            tokio::time::sleep(backoff.next_delay()).await;
                        }
                    }
                };
                if answer_tx.send(answer).await.is_err() {
                    return;
                }
            }
        });
        (Claimer { tx }, answers)
    }

    /// Hands one poll batch's claims over.
    pub fn claim(&self, claims: Vec<Claim>) {
        let _ = self.tx.send(claims);
    }
}
