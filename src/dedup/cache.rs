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
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, Value};
use siphasher::sip128::SipHasher13;

use super::clock::Secs;
use super::decide::{ClaimMode, Pin, Sighting, Verdict};
use super::fingerprint::Fingerprint;
use crate::config::{ConfigError, RedisSettings};
use crate::health::RedisTrouble;
use crate::position::CacheFrontier;

const CLAIM_LUA: &str = include_str!("claim.lua");

/// Bytes of one packed claim (`claim.lua`, `CLAIM`).
const CLAIM_SIZE: usize = 28;

/// One group's answer to a claim call: `OK` or `LOST`, a verdict byte per claim, and the
/// partitions that are not ready (or, when lost, why).
type ClaimReply = (String, Vec<u8>, String);

/// One click to claim: its fingerprint, where it was sighted, and how (`ClaimMode`).
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub fingerprint: Fingerprint,
    pub sighting: Sighting,
    pub mode: ClaimMode,
}

/// One poll batch's claims, with the generation of the reader each came from (a reader
/// rewound after a wait gets a new one).
#[derive(Debug, Clone, Default)]
pub struct ClaimBatch {
    pub claims: Vec<Claim>,
    pub generations: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// Redis is unreachable, slow, loading, out of memory, read-only, failing over, or
    /// its replicas did not acknowledge the claims in time: retry with backoff. `trouble`
    /// says which, classified once where the Redis error is read.
    #[error("Redis unavailable: {message}")]
    Transient { trouble: RedisTrouble, message: String },
    /// Retrying cannot help (bad credentials, missing ACL permission, a Redis without
    /// functions, a setting that can lose dedup state): stop with this message.
    #[error("Redis refused the dedup cache: {0}")]
    Fatal(String),
    /// The cache no longer holds what this member relied on: its data is gone (a Redis
    /// restarted without persistence, a failover to an empty replica, FLUSHALL, keys
    /// deleted), another member moved it to a new namespace, or it lost writes this
    /// member saw acknowledged. Nothing was decided; [`SharedCache::recover`] says what
    /// to do.
    #[error("the dedup cache lost what this member relied on ({0})")]
    Lost(Lost),
}

/// What a claim found lost, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The key group that answered.
    pub group: u32,
    /// `namespace`: the group holds another namespace (`detail`, empty for none);
    /// `frontier`: the group's frontier of partition `detail` is behind what this member
    /// saw acknowledged (lost writes).
    pub why: String,
    pub detail: String,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.why.as_str() {
            "namespace" if self.detail.is_empty() => write!(f, "key group {} holds no dedup state at all", self.group),
            "namespace" => write!(f, "key group {} holds another namespace, {}", self.group, self.detail),
            "frontier" => {
                write!(f, "key group {} lost claims of partition {} it had acknowledged", self.group, self.detail)
            }
            other => write!(f, "key group {}: {other} {}", self.group, self.detail),
        }
    }
}

/// What a member does after [`DedupError::Lost`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// A racing member left one key group on a namespace it then gave up; the group is
    /// set right and the claims can be made again.
    Retry,
    /// The cache starts over in this namespace: every partition's state must be rebuilt
    /// from the log before its reader decides anything again.
    Renewed(String),
}

impl crate::retry::Retryable for DedupError {
    fn is_fatal(&self) -> bool {
        DedupError::is_fatal(self)
    }
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
            _ => DedupError::Transient { trouble: RedisTrouble::of(&e), message: text },
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self, DedupError::Fatal(_))
    }

    /// A transient failure that is not Redis refusing writes.
    fn unreachable(message: impl Into<String>) -> DedupError {
        DedupError::Transient { trouble: RedisTrouble::Unreachable, message: message.into() }
    }

    /// Why Redis refuses claims, when it does so for a while.
    pub fn trouble(&self) -> Option<RedisTrouble> {
        match self {
            DedupError::Transient { trouble, .. } => Some(*trouble),
            _ => None,
        }
    }

    pub fn is_lost(&self) -> bool {
        matches!(self, DedupError::Lost(_))
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
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // built once per member; boxing buys nothing
pub enum RedisTarget {
    Single(redis::Client),
    Cluster(ClusterClient),
}

impl RedisTarget {
    /// The Redis the dedup cache lives in: one server, or a cluster through its seeds.
    pub fn from_settings(r: &RedisSettings) -> Result<RedisTarget, ConfigError> {
        if !r.is_cluster() {
            return RedisTarget::client(r).map(RedisTarget::Single);
        }
        let invalid = |e: redis::RedisError| ConfigError::Invalid(format!("redis.url {}: {}", r.url, kind_str(&e)));
        let mut b = redis::cluster::ClusterClient::builder(r.url.list())
            .connection_timeout(r.timeout)
            .response_timeout(r.timeout)
            // Few retries inside the client: the claimer's own backoff covers longer outages
            // (a failover) and reports them (readiness, metrics).
            .retries(3);
        if let Some(user) = &r.username {
            b = b.username(user);
        }
        if let Some(password) = &r.password {
            b = b.password(password.expose());
        }
        b.build().map(RedisTarget::Cluster).map_err(invalid)
    }

    /// The client of one Redis, with credentials from the URL or from `username`/`password`.
    pub fn client(r: &RedisSettings) -> Result<redis::Client, ConfigError> {
        let invalid = |e: redis::RedisError| ConfigError::Invalid(format!("redis.url {}: {}", r.url, kind_str(&e)));
        let mut info: redis::ConnectionInfo =
            redis::IntoConnectionInfo::into_connection_info(r.url.expose()).map_err(invalid)?;
        let mut redis_settings = info.redis_settings().clone();
        if let Some(user) = &r.username {
            redis_settings = redis_settings.set_username(user.clone());
        }
        if let Some(password) = &r.password {
            redis_settings = redis_settings.set_password(password.expose());
        }
        info = info.set_redis_settings(redis_settings);
        match &r.tls_ca_file {
            None => redis::Client::open(info).map_err(invalid),
            Some(path) => {
                let root_cert = std::fs::read(path)
                    .map_err(|e| ConfigError::Invalid(format!("redis.tls_ca_file {}: {e}", path.display())))?;
                let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) };
                redis::Client::build_with_tls(info, certs).map_err(invalid)
            }
        }
    }
}

/// A Redis error without its detail, which may quote the URL (and its password).
fn kind_str(e: &redis::RedisError) -> String {
    format!("{:?}", e.kind())
}

impl From<redis::Client> for RedisTarget {
    fn from(client: redis::Client) -> RedisTarget {
        RedisTarget::Single(client)
    }
}

/// How durable a claim must be before its verdict is used (`redis.wait_replicas`).
pub type Wait = crate::config::RedisWait;

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
///
/// Every handle of one member ([`SharedCache::handle`]) shares the namespace the member
/// uses and the topic's partition count; each keeps its own connection.
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
    /// Names the decision settings the member runs with (`dedup.window`, the fingerprint
    /// key, `dedup.shards`, the validation limits): part of every namespace's name, so
    /// a member never decides in a namespace built under other settings.
    settings_tag: String,
    /// The namespace this member decides in, shared by its handles.
    namespace: Arc<Mutex<Option<String>>>,
    /// The topic's partition count, shared by the member's handles: a fresh sighting is
    /// decided only while all of them are ready.
    partitions: Arc<AtomicU32>,
    /// Per partition, the frontier this handle's claims reached, acknowledged, in the
    /// namespace named first: a group whose frontier is behind it lost writes.
    acked: (String, BTreeMap<i32, i64>),
    functions: Functions,
    library: String,
}

/// The names of the library's functions in this version.
#[derive(Clone)]
struct Functions {
    claim: String,
    sweep: String,
    restart: String,
    open: String,
    renew: String,
}

impl SharedCache {
    pub fn new(
        target: impl Into<RedisTarget>,
        key_prefix: &str,
        topic: &str,
        shards: u32,
        groups: u32,
        window: Secs,
        timeout: Duration,
    ) -> SharedCache {
        let v = library_version();
        let mut library = CLAIM_LUA.replacen("name=clickagg_dedup_v1", &format!("name=clickagg_dedup_{v}"), 1);
        for f in ["claim", "sweep", "restart", "open", "renew"] {
            library = library.replace(&format!("'clickagg_{f}_v1'"), &format!("'clickagg_{f}_{v}'"));
        }
        SharedCache {
            target: target.into(),
            conn: None,
            timeout,
            key_prefix: key_prefix.to_string(),
            topic: topic.to_string(),
            shards,
            groups: groups.max(1),
            wait: None,
            window,
            settings_tag: "0".to_string(),
            namespace: Arc::new(Mutex::new(None)),
            partitions: Arc::new(AtomicU32::new(0)),
            acked: (String::new(), BTreeMap::new()),
            functions: Functions {
                claim: format!("clickagg_claim_{v}"),
                sweep: format!("clickagg_sweep_{v}"),
                restart: format!("clickagg_restart_{v}"),
                open: format!("clickagg_open_{v}"),
                renew: format!("clickagg_renew_{v}"),
            },
            library,
        }
    }

    /// The function library's name in this version.
    fn library_name(&self) -> String {
        format!("clickagg_dedup_{}", library_version())
    }

    /// The shared dedup cache of `topic`, as the settings describe it: where Redis is,
    /// its key groups, and the rules it decides by (window, shards, the name of its
    /// namespace).
    pub fn connect(r: &RedisSettings, rules: &crate::dedup::Rules, topic: &str) -> Result<SharedCache, ConfigError> {
        let window = rules.window();
        let cache = SharedCache::new(
            RedisTarget::from_settings(r)?,
            &r.key_prefix,
            topic,
            rules.shards,
            r.groups(),
            window,
            r.timeout,
        );
        Ok(cache.with_wait(r.wait()).with_settings_tag(&rules.tag()))
    }

    /// Uses a claim's verdict only once `wait.replicas` replicas acknowledged it.
    pub fn with_wait(mut self, wait: Option<Wait>) -> SharedCache {
        self.wait = wait.filter(|w| w.replicas > 0);
        self
    }

    /// Names the decision settings (see the field's doc).
    pub fn with_settings_tag(mut self, tag: &str) -> SharedCache {
        self.settings_tag = tag.to_string();
        self
    }

    /// Another handle of the same member: the same cache, namespace and partition
    /// count, its own connection.
    pub fn handle(&self) -> SharedCache {
        SharedCache {
            target: self.target.clone(),
            conn: None,
            timeout: self.timeout,
            key_prefix: self.key_prefix.clone(),
            topic: self.topic.clone(),
            shards: self.shards,
            groups: self.groups,
            wait: self.wait,
            window: self.window,
            settings_tag: self.settings_tag.clone(),
            namespace: self.namespace.clone(),
            partitions: self.partitions.clone(),
            acked: (String::new(), BTreeMap::new()),
            functions: self.functions.clone(),
            library: self.library.clone(),
        }
    }

    /// The topic's partition count (from the broker's metadata).
    pub fn set_partition_count(&self, n: u32) {
        self.partitions.store(n, Ordering::Relaxed);
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

    /// The key holding group `group`'s namespace.
    fn ns_key(&self, group: u32) -> String {
        format!("{}ns", self.group_prefix(group))
    }

    /// Where a renewal keeps the namespace it replaced (group 0), for the sweeper.
    fn previous_ns_key(&self) -> String {
        format!("{}ns:previous", self.group_prefix(0))
    }

    /// The namespace in use; empty before [`open`](Self::open).
    pub fn namespace(&self) -> String {
        self.namespace.lock().expect("not poisoned").clone().unwrap_or_default()
    }

    fn data_prefix(&self, group: u32, ns: &str) -> String {
        format!("{}{ns}:", self.group_prefix(group))
    }

    pub fn shard_key(&self, shard: u32) -> String {
        self.shard_key_in(shard, &self.namespace())
    }

    fn shard_key_in(&self, shard: u32, ns: &str) -> String {
        format!("{}s:{shard:06x}", self.data_prefix(self.group_of(shard), ns))
    }

    fn frontier_key(&self, group: u32) -> String {
        format!("{}frontier", self.data_prefix(group, &self.namespace()))
    }

    fn x_key(&self, group: u32, partition: i32) -> String {
        format!("{}x:{partition}", self.data_prefix(group, &self.namespace()))
    }

    fn holds_key(&self) -> String {
        format!("{}holds", self.data_prefix(0, &self.namespace()))
    }

    /// A new namespace name: the settings tag and 64 random bits.
    fn new_namespace_name(&self) -> String {
        format!("{}.{:016x}", self.settings_tag, rand::random::<u64>())
    }

    fn is_ours(&self, ns: &str) -> bool {
        ns.split_once('.').is_some_and(|(tag, _)| tag == self.settings_tag)
    }

    /// Joins the cache's namespace, creating it if the cache has none; a namespace built
    /// under other decision settings is replaced (the settings registry already said
    /// ours are the topic's), and one a key group lost is renewed. Returns the name.
    pub async fn open(&mut self) -> Result<String, DedupError> {
        let v0: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(0)).clone(), 0).await?;
        let ns = match v0 {
            Some(v) if self.is_ours(&v) => {
                let mut lost_group = false;
                for g in 1..self.groups {
                    let vg: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(g)).clone(), g).await?;
                    match vg {
                        None => lost_group = true,
                        Some(x) if x != v => self.set_ns(g, &v).await?,
                        Some(_) => {}
                    }
                }
                if lost_group {
                    return self.renew(&v).await;
                }
                v
            }
            Some(v) => return self.renew(&v).await,
            None => {
                let candidate = self.new_namespace_name();
                for g in 1..self.groups {
                    self.set_ns(g, &candidate).await?;
                }
                let open =
                    redis::cmd("FCALL").arg(&self.functions.open).arg(1).arg(self.ns_key(0)).arg(&candidate).clone();
                let winner: String = self.query(open, 0).await?;
                if winner != candidate {
                    for g in 1..self.groups {
                        self.set_ns(g, &winner).await?;
                    }
                }
                if !self.is_ours(&winner) {
                    return self.renew(&winner).await;
                }
                winner
            }
        };
        *self.namespace.lock().expect("not poisoned") = Some(ns.clone());
        Ok(ns)
    }

    /// Moves the cache from the namespace `lost` to a new one (unless another member
    /// already did: then to that one); returns its name.
    async fn renew(&mut self, lost: &str) -> Result<String, DedupError> {
        let candidate = self.new_namespace_name();
        for g in 1..self.groups {
            self.set_ns(g, &candidate).await?;
        }
        let renew = redis::cmd("FCALL")
            .arg(&self.functions.renew)
            .arg(2)
            .arg(self.ns_key(0))
            .arg(self.previous_ns_key())
            .arg(lost)
            .arg(&candidate)
            .clone();
        let winner: String = self.query(renew, 0).await?;
        if winner != candidate {
            for g in 1..self.groups {
                self.set_ns(g, &winner).await?;
            }
        }
        if !self.is_ours(&winner) {
            return Err(DedupError::Fatal(format!(
                "the dedup cache of {} was renewed by a member with other decision settings (namespace {winner}, \
                 ours are {}); run every member with the settings the topic records",
                self.topic, self.settings_tag
            )));
        }
        tracing::warn!(lost, namespace = %winner, "the dedup cache starts over in a new namespace");
        *self.namespace.lock().expect("not poisoned") = Some(winner.clone());
        self.acked.1.clear();
        Ok(winner)
    }

    /// What to do after a claim answered [`DedupError::Lost`]: set right a key group a
    /// racing renewal left behind, or move to (or adopt) a new namespace.
    pub async fn recover(&mut self, lost: &Lost) -> Result<Recovery, DedupError> {
        let ours = self.namespace();
        if lost.why == "frontier" {
            return self.renew(&ours).await.map(Recovery::Renewed);
        }
        let v0: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(0)).clone(), 0).await?;
        match v0 {
            None => self.renew(&ours).await.map(Recovery::Renewed),
            Some(v) if v != ours => {
                if !self.is_ours(&v) {
                    return self.renew(&v).await.map(Recovery::Renewed);
                }
                for g in 1..self.groups {
                    self.set_ns(g, &v).await?;
                }
                tracing::warn!(lost = %ours, namespace = %v, "another member moved the dedup cache to a new namespace");
                *self.namespace.lock().expect("not poisoned") = Some(v.clone());
                self.acked.1.clear();
                Ok(Recovery::Renewed(v))
            }
            // Group 0 holds ours: the group that answered lost its data, or holds what a
            // racing renewal wrote before it lost the race.
            Some(_) if lost.group != 0 && !lost.detail.is_empty() => {
                self.set_ns(lost.group, &ours).await?;
                Ok(Recovery::Retry)
            }
            Some(_) => self.renew(&ours).await.map(Recovery::Renewed),
        }
    }

    async fn set_ns(&mut self, group: u32, ns: &str) -> Result<(), DedupError> {
        let _: Value = self.query(redis::cmd("SET").arg(self.ns_key(group)).arg(ns).clone(), group).await?;
        Ok(())
    }

    /// One command on the node serving key group `group`.
    async fn query<T: redis::FromRedisValue>(&mut self, cmd: redis::Cmd, group: u32) -> Result<T, DedupError> {
        let _ = group; // routed by its key's slot
        let mut values = self.each(vec![cmd]).await?;
        redis::from_redis_value(values.pop().unwrap_or(Value::Nil))
            .map_err(|e| DedupError::Fatal(format!("unexpected reply: {e}")))
    }

    /// Opens the namespace unless this member already uses one.
    async fn ensure_open(&mut self) -> Result<(), DedupError> {
        if self.namespace().is_empty() {
            self.open().await?;
        }
        Ok(())
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
                    // A Redis that refuses writes (out of memory, a read-only replica) may
                    // still hold the library: then the connection is good for what it can do.
                    let loaded: Result<String, RedisError> =
                        redis::cmd("FUNCTION").arg("LOAD").arg(&self.library).query_async(&mut conn).await;
                    if let Err(e) = loaded {
                        if !e.to_string().contains("already exists") {
                            let name = self.library_name();
                            let listed: Result<Value, RedisError> = redis::cmd("FUNCTION")
                                .arg("LIST")
                                .arg("LIBRARYNAME")
                                .arg(&name)
                                .query_async(&mut conn)
                                .await;
                            if !matches!(listed, Ok(Value::Array(ref libs)) if !libs.is_empty()) {
                                return Err(DedupError::classify(e));
                            }
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
                        .ok_or_else(|| DedupError::unreachable("an unreadable CLUSTER SLOTS reply"))?;
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
    /// the poll batch's marks and what this handle saw acknowledged before.
    fn claim_call(&self, group: u32, members: &[usize], claims: &[Claim], marks: &[u8], expect: &[u8]) -> redis::Cmd {
        let mut partitions: Vec<i32> = members.iter().map(|&i| claims[i].sighting.partition).collect();
        partitions.sort_unstable();
        partitions.dedup();
        let mut keys = vec![self.ns_key(group), self.frontier_key(group)];
        keys.extend(partitions.iter().map(|&p| self.x_key(group, p)));
        // A u32 index: a poll batch may touch more shard hashes than a u16 counts.
        let mut index: BTreeMap<u32, u32> = BTreeMap::new();
        let mut blob = Vec::with_capacity(members.len() * CLAIM_SIZE);
        for &i in members {
            let c = &claims[i];
            let shard = c.fingerprint.shard(self.shards);
            let ki = *index.entry(shard).or_insert_with(|| {
                keys.push(self.shard_key(shard));
                keys.len() as u32
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
        cmd.arg(&self.functions.claim)
            .arg(keys.len())
            .arg(&keys)
            .arg(self.namespace())
            .arg(self.window)
            .arg(blob)
            .arg(named.join(","))
            .arg(marks)
            .arg(expect)
            .arg(self.partitions.load(Ordering::Relaxed));
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
        self.ensure_open().await?;
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
        // What this handle saw acknowledged: of the batch's partitions, or of all it
        // claimed for when this is an idle check.
        let ns = self.namespace();
        if self.acked.0 != ns {
            self.acked = (ns, BTreeMap::new());
        }
        let mut expect = Vec::new();
        for (&p, &o) in &self.acked.1 {
            if claims.is_empty() || marks.contains_key(&p) {
                expect.extend_from_slice(&(p as u16).to_be_bytes());
                expect.extend_from_slice(&(o as u64).to_be_bytes()[2..]);
            }
        }
        let calls: Vec<redis::Cmd> =
            (0..self.groups).map(|g| self.claim_call(g, &by_group[g as usize], claims, &mark_blob, &expect)).collect();
        let replies = self.run_claims(calls).await?;
        let mut verdicts = vec![Verdict::Undecidable; claims.len()];
        let mut unready = std::collections::BTreeSet::new();
        for (g, (members, reply)) in by_group.iter().zip(replies).enumerate() {
            let (status, codes, detail) = reply;
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
        // A partition with a sighting that waits did not reach its mark in the group that
        // held it: what is acknowledged of it stays where it was.
        let waiting: std::collections::BTreeSet<i32> = claims
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| **v == Verdict::Wait)
            .map(|(c, _)| c.sighting.partition)
            .collect();
        if !waiting.is_empty() {
            let unready: Vec<String> = unready.into_iter().collect();
            tracing::debug!(?waiting, unready = %unready.join(","), "sightings wait for other partitions' state");
        }
        for (&p, &(o, _)) in marks.iter().filter(|(p, _)| !waiting.contains(p)) {
            let seen = self.acked.1.entry(p).or_insert(o);
            *seen = (*seen).max(o);
        }
        Ok(verdicts)
    }

    /// Sends the claim calls (one per group, in group order) and returns their replies in
    /// that order: one pipeline on a single Redis; on a cluster one pipeline per master,
    /// all masters at once. Each pipeline ends with `WAIT` when claims must be durable:
    /// on the same connection, after the calls, so it counts exactly their writes.
    async fn run_claims(&mut self, calls: Vec<redis::Cmd>) -> Result<Vec<ClaimReply>, DedupError> {
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
                return Err(DedupError::unreachable(format!(
                    "claims acknowledged by {fewest} of the {} replicas redis.wait_replicas asks for within {:?} \
                     (redis.wait_timeout); claiming again",
                    w.replicas, w.timeout
                )));
            }
        }
        values
            .into_iter()
            .map(|v| {
                let (status, codes, detail): (String, Vec<u8>, String) =
                    redis::from_redis_value(v).map_err(|e| DedupError::Fatal(format!("claim reply: {e}")))?;
                Ok((status, codes, detail))
            })
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
                    clock: Secs::from_be_bytes(v[6..10].try_into().expect("4 bytes")),
                    exact_from: u48(&v[10..16]),
                });
                out.entry(p).or_default().push(f);
            }
        }
        Ok(out)
    }

    /// Before a reader counts `partition` from `boundary` after a warm-up from
    /// `lookback`: unless the cache is already past the lookback, its re-reads are
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
                Some(t) => redis::cmd("HSET").arg(&key).arg(p).arg(t).clone(),
                None => redis::cmd("HDEL").arg(&key).arg(p).clone(),
            })
            .collect();
        self.each(cmds).await.map(drop)
    }

    /// The lowest record time a lagging reader holds, if any.
    pub(super) async fn lowest_hold(&mut self) -> Result<Option<Secs>, DedupError> {
        let held: Vec<Secs> = self.query(redis::cmd("HVALS").arg(self.holds_key()).clone(), 0).await?;
        Ok(held.into_iter().min())
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
            .values()
            .map(|keys| {
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.functions.sweep).arg(keys.len()).arg(keys).arg(cutoff);
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

    /// After a full sweep cycle: the replaced namespace's remaining keys go, and with
    /// them the record that it exists.
    pub(super) async fn forget_previous(&mut self) -> Result<(), DedupError> {
        let previous: Option<String> = self.query(redis::cmd("GET").arg(self.previous_ns_key()).clone(), 0).await?;
        let Some(prev) = previous else { return Ok(()) };
        // The shard hashes went with the walk; what is left are the frontiers, the x sets
        // of the partitions those name, and the holds. No key scan: a KEYS over a shared
        // Redis would block it.
        let mut cmds = Vec::new();
        for g in 0..self.groups {
            let data = self.data_prefix(g, &prev);
            let frontier = format!("{data}frontier");
            let partitions: Vec<String> = self.query(redis::cmd("HKEYS").arg(&frontier).clone(), g).await?;
            cmds.extend(partitions.iter().map(|p| redis::cmd("UNLINK").arg(format!("{data}x:{p}")).clone()));
            cmds.push(redis::cmd("UNLINK").arg(frontier).clone());
        }
        cmds.push(redis::cmd("UNLINK").arg(format!("{}holds", self.data_prefix(0, &prev))).clone());
        cmds.push(redis::cmd("DEL").arg(self.previous_ns_key()).clone());
        self.each(cmds).await.map(drop)
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
                Err(e @ DedupError::Transient { .. }) => {
                    self.conn = None;
                    return Err(e);
                }
                Err(e) => {
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
