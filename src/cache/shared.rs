//! The client: one handle per task of a member, sharing its namespace; connecting (and
//! loading the function library), and the key layout (`mod.rs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster::ClusterConfig;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{AsyncConnectionConfig, RedisError, Value};
use siphasher::sip128::SipHasher13;

use super::error::DedupError;
use super::target::{Conn, RedisTarget, SlotMap, Wait};
use crate::config::{ConfigError, RedisSettings};
use crate::dedup::Secs;

const CLAIM_LUA: &str = include_str!("claim.lua");

/// The layout of the cache's entries, part of every namespace's name beside the
/// settings: a member of a version that reads entries otherwise never decides in (or
/// from) a namespace written under this one; it moves the cache to a namespace of its
/// own, warmed up from the log, and a member of the other version meeting it stops.
/// `f2`: items judged ahead of their partition's clock (claim.lua's 17-byte items).
/// `f3`: a partition's first records judged ahead of no clock (reach 0), kept by the
/// sweeper until the partition has one (issue 35): the same bytes, decided otherwise.
const CACHE_FORMAT: &str = "f3";

/// The function library's version: a hash of its source, so two clickagg versions with
/// different code never call each other's functions.
fn library_version() -> String {
    let h = SipHasher13::new_with_keys(0, 0).hash(CLAIM_LUA.as_bytes());
    format!("{:08x}", h.h1 as u32)
}

/// A client of one topic's shared cache. It reconnects (and reloads the function
/// library) lazily after any error, so the caller's retry loop is the only recovery path.
///
/// Every handle of one member ([`SharedCache::handle`]) shares the namespace the member
/// uses and the topic's partition count; each keeps its own connection.
pub struct SharedCache {
    pub(super) target: RedisTarget,
    pub(super) conn: Option<Conn>,
    pub(super) timeout: Duration,
    pub(super) key_prefix: String,
    pub(super) topic: String,
    pub(super) shards: u32,
    /// Key groups: every call touches one group only, so a Redis Cluster can spread the
    /// groups over its nodes (a group is a hash tag). One on a single Redis.
    pub(super) groups: u32,
    /// Replicas that must hold a claim before its verdict is used (`None`: the master's
    /// answer is enough).
    pub(super) wait: Option<Wait>,
    pub(super) window: Secs,
    /// Names the decision settings the member runs with (`dedup.window`, the fingerprint
    /// key, `dedup.shards`, the validation limits): part of every namespace's name, so
    /// a member never decides in a namespace built under other settings.
    pub(super) settings_tag: String,
    /// The namespace this member decides in, shared by its handles.
    pub(super) namespace: Arc<Mutex<Option<String>>>,
    /// The topic's partition count, shared by the member's handles: a fresh sighting is
    /// decided only while all of them are ready.
    pub(super) partitions: Arc<AtomicU32>,
    /// Per key group and partition, the frontier this handle's claims reached there,
    /// acknowledged, in the namespace named first: a group whose frontier is behind it
    /// lost writes.
    pub(super) acked: (String, BTreeMap<(u32, i32), i64>),
    pub(super) functions: Functions,
    pub(super) library: String,
}

/// The names of the library's functions in this version.
#[derive(Clone)]
pub(super) struct Functions {
    pub(super) claim: String,
    pub(super) sweep: String,
    pub(super) restart: String,
    pub(super) open: String,
    pub(super) renew: String,
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
    pub(super) fn library_name(&self) -> String {
        format!("clickagg_dedup_{}", library_version())
    }

    /// The shared dedup cache of `topic`, as the settings describe it: where Redis is,
    /// its key groups, and the rules it decides by (window, shards, the name of its
    /// namespace).
    pub fn connect(r: &RedisSettings, rules: &crate::config::Rules, topic: &str) -> Result<SharedCache, ConfigError> {
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
        Ok(cache.with_wait(r.wait()).with_settings_tag(&format!("{}{CACHE_FORMAT}", rules.tag())))
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

    pub(super) fn group_of(&self, shard: u32) -> u32 {
        shard % self.groups
    }

    /// `<prefix>{<topic>:<group>}:`, or `<prefix>{<topic>:<group>/<groups>}:` with several
    /// groups: the braces make the group a Redis Cluster hash tag, and the group count is
    /// part of the name because it decides which group holds a click (another count is
    /// another cache, which starts empty and is warmed up from the log).
    pub(super) fn group_prefix(&self, group: u32) -> String {
        if self.groups == 1 {
            format!("{}{{{}:{group}}}:", self.key_prefix, self.topic)
        } else {
            format!("{}{{{}:{group}/{}}}:", self.key_prefix, self.topic, self.groups)
        }
    }

    /// The key holding group `group`'s namespace (the differential test deletes it, as a
    /// cache that lost its data has none).
    pub fn ns_key(&self, group: u32) -> String {
        format!("{}ns", self.group_prefix(group))
    }

    /// Where a renewal keeps the namespace it replaced (group 0), for the sweeper.
    pub(super) fn previous_ns_key(&self) -> String {
        format!("{}ns:previous", self.group_prefix(0))
    }

    /// The namespace in use; empty before [`open`](Self::open).
    pub fn namespace(&self) -> String {
        self.namespace.lock().expect("not poisoned").clone().unwrap_or_default()
    }

    pub(super) fn data_prefix(&self, group: u32, ns: &str) -> String {
        format!("{}{ns}:", self.group_prefix(group))
    }

    pub fn shard_key(&self, shard: u32) -> String {
        self.shard_key_in(shard, &self.namespace())
    }

    pub(super) fn shard_key_in(&self, shard: u32, ns: &str) -> String {
        format!("{}s:{shard:06x}", self.data_prefix(self.group_of(shard), ns))
    }

    pub(super) fn frontier_key(&self, group: u32) -> String {
        format!("{}frontier", self.data_prefix(group, &self.namespace()))
    }

    pub(super) fn x_key(&self, group: u32, partition: i32) -> String {
        format!("{}x:{partition}", self.data_prefix(group, &self.namespace()))
    }

    pub(super) fn holds_key(&self) -> String {
        format!("{}holds", self.data_prefix(0, &self.namespace()))
    }

    /// One command on the node serving key group `group`.
    pub(super) async fn query<T: redis::FromRedisValue>(
        &mut self,
        cmd: redis::Cmd,
        group: u32,
    ) -> Result<T, DedupError> {
        let _ = group; // routed by its key's slot
        let mut values = self.each(vec![cmd]).await?;
        redis::from_redis_value(values.pop().unwrap_or(Value::Nil))
            .map_err(|e| DedupError::Fatal(format!("unexpected reply: {e}")))
    }

    /// Opens the namespace unless this member already uses one.
    pub(super) async fn ensure_open(&mut self) -> Result<(), DedupError> {
        if self.namespace().is_empty() {
            self.open().await?;
        }
        Ok(())
    }

    pub(super) async fn connection(&mut self) -> Result<&mut Conn, DedupError> {
        if self.conn.is_none() {
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.timeout))
                .set_response_timeout(Some(self.timeout));
            let conn = match &self.target {
                RedisTarget::Single(_) | RedisTarget::Sentinel(_) => {
                    let mut conn =
                        self.target.connect_single(&config).await.expect("one Redis").map_err(DedupError::classify)?;
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
    pub(super) async fn each(&mut self, cmds: Vec<redis::Cmd>) -> Result<Vec<Value>, DedupError> {
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

#[cfg(test)]
mod tests {
    use crate::config::Settings;

    #[test]
    fn a_cluster_cache_takes_its_key_groups_and_wait_from_the_settings() {
        let vars =
            [("CLICKAGG__REDIS__URL", "redis://a:7001/,redis://b:7002/"), ("CLICKAGG__REDIS__SLOT_GROUPS", "64")];
        let s = Settings::load_with_vars(None, vec![], vars).unwrap();
        let cache = super::SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic).unwrap();
        assert_eq!((cache.groups(), cache.wait.map(|w| w.replicas)), (64, Some(1)));
        let single = Settings::default();
        let cache = super::SharedCache::connect(&single.redis, &single.rules(), &single.kafka.topic).unwrap();
        assert_eq!((cache.groups(), cache.wait.map(|w| w.replicas)), (1, None));
    }
}
