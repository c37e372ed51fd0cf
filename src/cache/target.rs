//! Where the cache lives (one Redis or a Redis Cluster), how to reach it, and which
//! master of a cluster serves which key.

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::Value;

use crate::config::{ConfigError, RedisSettings};

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
