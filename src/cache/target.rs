//! Where the cache lives (one Redis or a Redis Cluster), how to reach it, and which
//! master of a cluster serves which key.

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, Value};

use crate::config::{ConfigError, RedisSettings};

/// Where the cache lives: one Redis (or a primary with replicas behind one address), a
/// master found through Redis Sentinel, or a Redis Cluster reached through seed nodes.
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // built once per member; boxing buys nothing
pub enum RedisTarget {
    Single(redis::Client),
    Sentinel(SentinelTarget),
    Cluster(ClusterClient),
}

/// A Redis master as the Sentinels name it. Asked again at every connection: a member
/// reconnects after any error, so after a failover its next connection is to the
/// promoted replica. The master is asked directly (`SENTINEL get-master-addr-by-name`),
/// not through the redis crate's Sentinel client, so that the data nodes take the same
/// TLS settings (a private CA, a client certificate) as a single Redis does.
#[derive(Clone)]
pub struct SentinelTarget {
    sentinels: Vec<redis::Client>,
    master: String,
    /// The settings the data nodes are reached with (scheme, credentials, TLS files).
    data: RedisSettings,
}

impl RedisTarget {
    /// The Redis the dedup cache lives in: one server, a master behind Sentinel, or a
    /// cluster through its seeds.
    pub fn from_settings(r: &RedisSettings) -> Result<RedisTarget, ConfigError> {
        if let Some(sentinel) = &r.sentinel {
            let sentinels = sentinel
                .urls
                .list()
                .into_iter()
                .map(|url| RedisTarget::client_at(r, url, false))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(RedisTarget::Sentinel(SentinelTarget {
                sentinels,
                master: sentinel.master.clone(),
                data: r.clone(),
            }));
        }
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
        RedisTarget::client_at(r, r.url.expose(), true)
    }

    /// A client of the Redis at `url`, with `r`'s TLS files; with `r`'s credentials too
    /// when `credentials` (a Sentinel takes its own, from its URL).
    fn client_at(r: &RedisSettings, url: &str, credentials: bool) -> Result<redis::Client, ConfigError> {
        let shown = crate::config::redact_url(url);
        let invalid = |e: redis::RedisError| ConfigError::Invalid(format!("redis URL {shown}: {}", kind_str(&e)));
        let mut info: redis::ConnectionInfo = redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?;
        if credentials {
            let mut redis_settings = info.redis_settings().clone();
            if let Some(user) = &r.username {
                redis_settings = redis_settings.set_username(user.clone());
            }
            if let Some(password) = &r.password {
                redis_settings = redis_settings.set_password(password.expose());
            }
            info = info.set_redis_settings(redis_settings);
        }
        let (ca, cert, key) = (r.tls_ca_file.as_deref(), r.tls_cert_file.as_deref(), r.tls_key_file.as_deref());
        if ca.is_none() && cert.is_none() {
            return redis::Client::open(info).map_err(invalid);
        }
        let files = crate::config::tls::load("redis", ca, cert, key).map_err(ConfigError::Invalid)?;
        let certs = redis::TlsCertificates {
            client_tls: files
                .identity
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig { client_cert: cert.clone(), client_key: key.clone() }),
            root_cert: files.ca.clone(),
        };
        redis::Client::build_with_tls(info, certs).map_err(invalid)
    }

    /// A connection to the one Redis, or to the master the Sentinels name now; `None`
    /// for a cluster, whose client connects itself.
    pub async fn connect_single(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Option<Result<MultiplexedConnection, RedisError>> {
        match self {
            RedisTarget::Single(client) => Some(client.get_multiplexed_async_connection_with_config(config).await),
            RedisTarget::Sentinel(s) => Some(s.connect(config).await),
            RedisTarget::Cluster(_) => None,
        }
    }
}

impl SentinelTarget {
    /// Asks the Sentinels in turn for the master's address, connects to it and checks
    /// that it is a master: a Sentinel can name a demoted one for a moment during a
    /// failover, and a replica would refuse every claim (READONLY) anyway.
    async fn connect(&self, config: &AsyncConnectionConfig) -> Result<MultiplexedConnection, RedisError> {
        let mut last = RedisError::from((ErrorKind::MasterNameNotFoundBySentinel, "no Sentinel named the master"));
        for sentinel in &self.sentinels {
            let addr: Result<Option<(String, u16)>, RedisError> = async {
                let mut conn = sentinel.get_multiplexed_async_connection_with_config(config).await?;
                redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(&self.master).query_async(&mut conn).await
            }
            .await;
            let (host, port) = match addr {
                Ok(Some(addr)) => addr,
                Ok(None) => {
                    last = RedisError::from((
                        ErrorKind::MasterNameNotFoundBySentinel,
                        "a Sentinel does not know the master",
                        self.master.clone(),
                    ));
                    continue;
                }
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let scheme = if self.sentinels_use_tls() { "rediss" } else { "redis" };
            let client = RedisTarget::client_at(&self.data, &format!("{scheme}://{host}:{port}/"), true)
                .map_err(|e| RedisError::from((ErrorKind::InvalidClientConfig, "redis master", e.to_string())))?;
            let mut conn = client.get_multiplexed_async_connection_with_config(config).await?;
            let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
            if matches!(role.first(), Some(Value::BulkString(r)) if r.as_slice() == b"master") {
                return Ok(conn);
            }
            last = RedisError::from((
                ErrorKind::Io,
                "the master the Sentinels name is not a master (yet)",
                format!("{host}:{port}"),
            ));
        }
        Err(last)
    }

    fn sentinels_use_tls(&self) -> bool {
        self.data.sentinel.as_ref().is_some_and(|s| s.urls.list().iter().all(|u| u.starts_with("rediss://")))
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
pub(super) type Node = (String, u16);

/// Which master serves which slots, and every node (replicas too). Only to bundle the
/// calls of the groups one master serves into one pipeline: a stale map costs a
/// redirect or a retry, never a wrong answer (each node refuses keys it does not serve).
#[derive(Debug, Default, Clone)]
pub(super) struct SlotMap {
    pub(super) masters: Vec<(u16, u16, Node)>,
    pub(super) nodes: Vec<Node>,
}

impl SlotMap {
    pub(super) fn master_of(&self, slot: u16) -> Option<&Node> {
        self.masters.iter().find(|(from, to, _)| (*from..=*to).contains(&slot)).map(|(_, _, n)| n)
    }

    /// From a `CLUSTER SLOTS` reply: `[[from, to, [host, port, id, …], replica…], …]`.
    pub(super) fn parse(reply: &Value) -> Option<SlotMap> {
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

#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection),
    Cluster { conn: ClusterConnection, slots: SlotMap },
}
