//! The shared dedup cache in Redis: the Redis Function `claim.lua` and its client.
//!
//! Layout, per topic and key group `g`, under `redis.key_prefix` (`claim.lua` has the
//! value formats):
//! - `<prefix>{<topic>:<g>}:s:<shard>`: the `dedup.shards` hashes of entries
//!   (fingerprint → per partition that sighted the click: its chain's start, whether
//!   it counted, and the latest sighting's record time; 12 bytes each);
//! - `<prefix>{<topic>:<g>}:frontier`: per partition, the highest offset claimed in the
//!   group and its record time (a claim at or below it is a re-read);
//! - `<prefix>{<topic>:<g>}:x:<partition>`: cross-partition decisions not yet durable.
//!
//! One `FCALL` per key group per poll batch claims its clicks, in order, atomically. The
//! sweeper ([`SharedCache::sweep`]) deletes entries last seen more than `window +
//! max_record_lag` ago: garbage collection, never a decision (see `mod.rs`).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError};
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
    /// Redis is unreachable, slow, loading, out of memory or read-only: retry with backoff.
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
            ErrorKind::Server(S::NoPerm) => {
                DedupError::Fatal(format!("{text} (the ACL user needs +fcall, +function, +hget, +hmget and +ping)"))
            }
            ErrorKind::Extension if text.contains("WRONGPASS") || text.contains("NOAUTH") => DedupError::Fatal(text),
            // A bug in the function, or a server without functions (Redis < 7.0).
            _ if text.contains("user_function") || text.contains("unknown command 'FCALL'") => {
                DedupError::Fatal(format!("{text} (clickagg needs Redis >= 7.0 with functions)"))
            }
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

/// A client of one topic's shared cache. It reconnects (and reloads the function
/// library) lazily after any error, so the caller's retry loop is the only recovery path.
pub struct SharedCache {
    client: redis::Client,
    conn: Option<MultiplexedConnection>,
    config: AsyncConnectionConfig,
    key_prefix: String,
    topic: String,
    shards: u32,
    /// Key groups: every call touches one group only, so a Redis Cluster can spread the
    /// groups over its nodes (a group is a hash tag). One on a single Redis.
    groups: u32,
    window: Secs,
    claim_fn: String,
    sweep_fn: String,
    restart_fn: String,
    library: String,
}

impl SharedCache {
    pub fn new(
        client: redis::Client,
        key_prefix: &str,
        topic: &str,
        shards: u32,
        groups: u32,
        window: Duration,
        timeout: Duration,
    ) -> SharedCache {
        let config =
            AsyncConnectionConfig::new().set_connection_timeout(Some(timeout)).set_response_timeout(Some(timeout));
        let v = library_version();
        let library = CLAIM_LUA
            .replacen("name=clickagg_dedup_v1", &format!("name=clickagg_dedup_{v}"), 1)
            .replace("'clickagg_claim_v1'", &format!("'clickagg_claim_{v}'"))
            .replace("'clickagg_sweep_v1'", &format!("'clickagg_sweep_{v}'"))
            .replace("'clickagg_restart_v1'", &format!("'clickagg_restart_{v}'"));
        SharedCache {
            client,
            conn: None,
            config,
            key_prefix: key_prefix.to_string(),
            topic: topic.to_string(),
            shards,
            groups: groups.max(1),
            window: window.as_secs().try_into().unwrap_or(Secs::MAX),
            claim_fn: format!("clickagg_claim_{v}"),
            sweep_fn: format!("clickagg_sweep_{v}"),
            restart_fn: format!("clickagg_restart_{v}"),
            library,
        }
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    fn group_of(&self, shard: u32) -> u32 {
        shard % self.groups
    }

    /// `<prefix>{<topic>:<group>}:`: the braces make the group a Redis Cluster hash tag.
    fn group_prefix(&self, group: u32) -> String {
        format!("{}{{{}:{group}}}:", self.key_prefix, self.topic)
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

    async fn connection(&mut self) -> Result<MultiplexedConnection, DedupError> {
        if self.conn.is_none() {
            let mut conn = self
                .client
                .get_multiplexed_async_connection_with_config(&self.config)
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
            self.conn = Some(conn);
        }
        Ok(self.conn.clone().expect("just connected"))
    }

    /// Runs `pipe`; on failure the connection is dropped so the next call starts afresh
    /// (and reloads the library, in case Redis restarted without it).
    async fn query<T: redis::FromRedisValue>(&mut self, pipe: &redis::Pipeline) -> Result<T, DedupError> {
        let mut conn = self.connection().await?;
        pipe.query_async(&mut conn).await.map_err(|e| {
            self.conn = None;
            DedupError::classify(e)
        })
    }

    /// Claims every click, in order, with one `FCALL` per key group (pipelined);
    /// verdicts come back in input order. A click appearing twice is decided in order.
    pub async fn claim(&mut self, claims: &[Claim]) -> Result<Vec<Verdict>, DedupError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        // Per group: the claims' positions in `claims`, in order.
        let mut by_group: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, c) in claims.iter().enumerate() {
            by_group.entry(self.group_of(c.fingerprint.shard(self.shards))).or_default().push(i);
        }
        let mut pipe = redis::pipe();
        for (&group, members) in &by_group {
            let mut partitions: Vec<i32> = members.iter().map(|&i| claims[i].sighting.partition).collect();
            partitions.sort_unstable();
            partitions.dedup();
            let mut keys = vec![self.frontier_key(group)];
            keys.extend(partitions.iter().map(|&p| self.x_key(group, p)));
            let mut index: HashMap<u32, u16> = HashMap::new();
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
            pipe.cmd("FCALL")
                .arg(&self.claim_fn)
                .arg(keys.len())
                .arg(&keys)
                .arg(self.window)
                .arg(blob)
                .arg(named.join(","));
        }
        let replies: Vec<Vec<u8>> = self.query(&pipe).await?;
        let mut verdicts = vec![Verdict::Undecidable; claims.len()];
        for ((_, members), codes) in by_group.iter().zip(&replies) {
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

    /// Per partition, what the cache says over every group: the highest offset claimed,
    /// its record time, and where its state is exact from.
    pub async fn frontiers(&mut self, partitions: &[i32]) -> Result<BTreeMap<i32, CacheFrontier>, DedupError> {
        if partitions.is_empty() {
            return Ok(BTreeMap::new());
        }
        let mut pipe = redis::pipe();
        for g in 0..self.groups {
            pipe.cmd("HMGET").arg(self.frontier_key(g)).arg(partitions);
        }
        let replies: Vec<Vec<Option<Vec<u8>>>> = self.query(&pipe).await?;
        let u48 = |b: &[u8]| {
            let mut x = [0u8; 8];
            x[2..].copy_from_slice(b);
            i64::from_be_bytes(x)
        };
        let mut out: BTreeMap<i32, CacheFrontier> = BTreeMap::new();
        for values in replies {
            for (&p, v) in partitions.iter().zip(values) {
                let Some(v) = v.filter(|v| v.len() == 16) else { continue };
                let f = CacheFrontier {
                    claimed: u48(&v[..6]),
                    clock: Secs::from_be_bytes(v[6..10].try_into().expect("4 bytes")),
                    exact_from: u48(&v[10..16]),
                };
                let merged = match out.get(&p) {
                    None => f,
                    Some(o) => {
                        let newer = if f.claimed > o.claimed { f } else { *o };
                        CacheFrontier { exact_from: o.exact_from.max(f.exact_from), ..newer }
                    }
                };
                out.insert(p, merged);
            }
        }
        Ok(out)
    }

    /// Before a warm-up of `partition` from `lookback` (because the cache lost what lies
    /// before its boundary): from now on its re-reads are decided by the cache only from
    /// `boundary` on (`claim.lua`, `restart`).
    pub async fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) -> Result<(), DedupError> {
        let mut pipe = redis::pipe();
        for g in 0..self.groups {
            pipe.cmd("FCALL")
                .arg(&self.restart_fn)
                .arg(1)
                .arg(self.frontier_key(g))
                .arg(partition)
                .arg(lookback)
                .arg(boundary)
                .ignore();
        }
        self.query::<()>(&pipe).await
    }

    /// The cross-partition decisions of `partition` in `[from, to]` still in the cache
    /// (made by a live member whose flush may not have recorded them yet).
    pub async fn cached_pins(&mut self, partition: i32, from: i64, to: i64) -> Result<BTreeMap<i64, Pin>, DedupError> {
        let mut pipe = redis::pipe();
        for g in 0..self.groups {
            pipe.cmd("ZRANGEBYSCORE").arg(self.x_key(g, partition)).arg(from).arg(to);
        }
        let replies: Vec<Vec<i64>> = self.query(&pipe).await?;
        Ok(replies.into_iter().flatten().filter_map(|m| Some((m / 4, Pin::from_code((m % 4) as u8)?))).collect())
    }

    /// Drops cached cross-partition decisions below each partition's committed offset:
    /// the flush before that commit recorded them in ClickHouse.
    pub async fn trim_cached_pins(&mut self, committed: &BTreeMap<i32, i64>) -> Result<(), DedupError> {
        if committed.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for g in 0..self.groups {
            for (&p, &c) in committed {
                pipe.cmd("ZREMRANGEBYSCORE").arg(self.x_key(g, p)).arg("-inf").arg(format!("({c}")).ignore();
            }
        }
        self.query::<()>(&pipe).await
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
        let mut pipe = redis::pipe();
        for keys in by_group.values() {
            pipe.cmd("FCALL").arg(&self.sweep_fn).arg(keys.len()).arg(keys).arg(cutoff);
        }
        let removed: Vec<u64> = self.query(&pipe).await?;
        Ok(removed.iter().sum())
    }

    /// Refuses a Redis that may evict dedup entries: a forgotten entry lets a duplicate
    /// count twice. A server that hides its configuration (managed Redis without
    /// `CONFIG`) cannot be checked; that is logged, not refused.
    pub async fn check_eviction_policy(&mut self) -> Result<(), DedupError> {
        let mut pipe = redis::pipe();
        pipe.cmd("CONFIG").arg("GET").arg("maxmemory-policy");
        match self.query::<(Vec<String>,)>(&pipe).await.map(|(v,)| v) {
            Ok(v) => match v.get(1).map(String::as_str) {
                Some("noeviction") | None => Ok(()),
                Some(policy) => Err(DedupError::Fatal(format!(
                    "Redis has maxmemory-policy {policy}, which can evict dedup state and let duplicates count \
                     twice; set maxmemory-policy noeviction on the Redis server"
                ))),
            },
            Err(DedupError::Transient(e)) => Err(DedupError::Transient(e)),
            Err(DedupError::Fatal(e)) => {
                tracing::warn!(error = %e, "cannot read Redis maxmemory-policy; make sure it is noeviction");
                Ok(())
            }
        }
    }

    /// Round trip for readiness checks.
    pub async fn ping(&mut self) -> Result<(), DedupError> {
        let mut pipe = redis::pipe();
        pipe.cmd("PING");
        self.query::<(String,)>(&pipe).await.map(drop)
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
