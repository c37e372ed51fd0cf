//! The Redis section of the settings: where the dedup cache lives and how durable a
//! claim must be before its verdict is used.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::secrets::{Secret, SecretUrl};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// `redis://` or `rediss://` (TLS); may carry `user:password@`. Several URLs,
    /// comma-separated, are the seed nodes of a Redis Cluster.
    pub url: SecretUrl,
    /// A Redis Cluster: the dedup cache spreads its keys over `slot_groups` hash tags
    /// and sends each master the claims of the groups it serves. Implied by several
    /// URLs in `url`; `true` with one URL uses it as the only seed node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<bool>,
    /// Key groups of the cache on a Redis Cluster (16 by default): each is one hash tag,
    /// so one slot, and every poll batch sends each group one call. More groups spread
    /// the cache more evenly over more masters, at a call per group per batch. Part of
    /// the key names: another value starts another cache, warmed up from the log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot_groups: Option<u32>,
    /// Replicas that must acknowledge a poll batch's claims (`WAIT`) before their
    /// verdicts are used: a claim a master lost in a failover before its replica had it
    /// would let a later copy of the click count again. Default 1 on a cluster, 0 on a
    /// single Redis (set it there when Sentinel may promote a replica).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_replicas: Option<u32>,
    /// How long a `WAIT` may take before the claims count as failed (and are claimed
    /// again): a replica that answers later is as good as down.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// ACL user, if not in the URL.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// PEM file of the CA that signed the server certificate, for `rediss://` with a
    /// private CA (public CAs are trusted from the system store).
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate, for a Redis that verifies its clients
    /// (`tls-auth-clients yes`); with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM PKCS#8 private key of `tls_cert_file` (`BEGIN PRIVATE KEY`).
    pub tls_key_file: Option<PathBuf>,
    /// Redis Sentinel: the master is the one the Sentinels name, asked again at every
    /// connection, so a member follows a failover. `redis.url` is then left unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sentinel: Option<SentinelSettings>,
    /// Prefix of every dedup key; lets several deployments share one Redis.
    pub key_prefix: String,
    /// Deprecated name of `dedup.window`, still read so existing configurations keep
    /// their window; `dedup.window` wins when both are set.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub dedup_ttl: Option<Duration>,
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for RedisSettings {
    fn default() -> Self {
        RedisSettings {
            url: SecretUrl::new("redis://127.0.0.1:6379/"),
            cluster: None,
            slot_groups: None,
            wait_replicas: None,
            wait_timeout: Duration::from_secs(1),
            username: None,
            password: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            sentinel: None,
            key_prefix: "clickagg:dedup:".into(),
            dedup_ttl: None,
            timeout: Duration::from_secs(5),
        }
    }
}

/// A Redis master found through Redis Sentinel.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SentinelSettings {
    /// The name the Sentinels monitor the master under (`sentinel monitor <name> …`).
    pub master: String,
    /// The Sentinels, `redis://host:26379` each (`rediss://` for TLS), comma-separated;
    /// a Sentinel's own credentials go in its URL's user info. The data nodes are
    /// reached the same way (TLS or not), as `redis.username` with `redis.password`,
    /// trusting `redis.tls_ca_file` and presenting `redis.tls_cert_file` if set.
    pub urls: SecretUrl,
}

impl Default for SentinelSettings {
    fn default() -> Self {
        SentinelSettings { master: String::new(), urls: SecretUrl::new("") }
    }
}

/// How durable a claim must be before its verdict is used: acknowledged by `replicas`
/// replicas of the master that made it (`WAIT`), within `timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisWait {
    pub replicas: u32,
    pub timeout: Duration,
}

impl RedisSettings {
    /// Whether the dedup cache is a Redis Cluster: `redis.cluster`, or several seed nodes.
    pub fn is_cluster(&self) -> bool {
        self.sentinel.is_none() && self.cluster.unwrap_or(self.url.list().len() > 1)
    }

    /// What the claims wait for: `redis.wait_replicas` (1 on a cluster and behind
    /// Sentinel, whose failovers promote a replica; 0 on a single Redis).
    pub fn wait(&self) -> Option<RedisWait> {
        let replicated = self.is_cluster() || self.sentinel.is_some();
        let replicas = self.wait_replicas.unwrap_or(u32::from(replicated));
        (replicas > 0).then_some(RedisWait { replicas, timeout: self.wait_timeout })
    }

    /// Key groups of the cache: `slot_groups` on a cluster (16 by default), one otherwise.
    pub fn groups(&self) -> u32 {
        if self.is_cluster() {
            self.slot_groups.unwrap_or(16)
        } else {
            1
        }
    }
}
