//! Typed settings: defaults < TOML file (`--config`) < environment
//! (`CLICKAGG__SECTION__KEY`) < command-line flags.
//!
//! Unknown keys are rejected wherever they come from, so a typo fails at startup
//! instead of silently running with a default. Secrets are [`Secret`]s: they print as
//! `[redacted]` in `Debug`, in `clickagg config` and in every error message.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::aggregate::BatchOffsets;
use crate::click::Limits;

/// A secret value: never printed, never serialized in clear.
#[derive(Clone)]
pub struct Secret(SecretString);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(SecretString::from(s.into()))
    }

    /// The only way to read the value: at the call that hands it to a client library.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Environment values that look like numbers or booleans (`PASSWORD=12345`)
        // arrive typed; a secret is whatever text was written.
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = String;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
                Ok(v.to_string())
            }
        }
        d.deserialize_any(Text).map(Secret::new)
    }
}

/// A URL that may carry secrets: a password in its user info (`redis://user:pass@host`),
/// in a query parameter (`?password=`, `?token=`) or in a fragment. Displayed, logged and
/// serialized with all of them replaced by `[redacted]` ([`redact_url`]).
#[derive(Clone)]
pub struct SecretUrl(Secret);

impl SecretUrl {
    pub fn new(s: impl Into<String>) -> SecretUrl {
        SecretUrl(Secret::new(s))
    }

    pub fn expose(&self) -> &str {
        self.0.expose()
    }

    /// The URL as it may be shown: see [`redact_url`]. A comma-separated list (the seed
    /// nodes of a Redis Cluster) is redacted URL by URL.
    pub fn redacted(&self) -> String {
        self.expose().split(',').map(|u| redact_url(u.trim())).collect::<Vec<_>>().join(",")
    }

    /// The URLs of a comma-separated list (one URL: itself).
    pub fn list(&self) -> Vec<&str> {
        self.expose().split(',').map(str::trim).filter(|u| !u.is_empty()).collect()
    }
}

/// `url` with the password of its user info, the value of every query parameter and its
/// fragment replaced by `[redacted]`. What stays shows where a client connects and which
/// parameters are set: scheme, user name, host, port, path, parameter names. A query
/// parameter without `=` could be a bare token, so it is replaced whole.
pub fn redact_url(url: &str) -> String {
    // Unparseable: show nothing of it rather than risk printing a secret.
    let Ok(mut u) = url::Url::parse(url) else { return "[unparseable URL redacted]".to_string() };
    if u.password().is_some() && u.set_password(Some("[redacted]")).is_err() {
        return "[URL redacted]".to_string();
    }
    if let Some(query) = u.query() {
        let redacted: Vec<String> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('=') {
                Some((name, _)) => format!("{name}=[redacted]"),
                None => "[redacted]".to_string(),
            })
            .collect();
        u.set_query(Some(&redacted.join("&")));
    }
    if u.fragment().is_some() {
        u.set_fragment(Some("[redacted]"));
    }
    u.to_string()
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for SecretUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for SecretUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(SecretUrl::new)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub kafka: KafkaSettings,
    pub redis: RedisSettings,
    pub dedup: DedupSettings,
    pub clickhouse: ClickHouseSettings,
    pub pipeline: PipelineSettings,
    pub validation: ValidationSettings,
    pub dead_letter: DeadLetterSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    pub topic: String,
    /// The consumer group of `clickagg run`.
    pub group: String,
    /// Static membership (`group.instance.id`): a restarted pod keeps its partitions
    /// without a rebalance if it comes back within the session timeout.
    pub group_instance_id: Option<String>,
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub max_poll_interval: Duration,
    /// `security.protocol`: plaintext, ssl, sasl_plaintext or sasl_ssl.
    pub security_protocol: Option<String>,
    /// `sasl.mechanism`: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<Secret>,
    pub ssl_ca_location: Option<PathBuf>,
    pub ssl_certificate_location: Option<PathBuf>,
    pub ssl_key_location: Option<PathBuf>,
    pub ssl_key_password: Option<Secret>,
    /// Any other librdkafka property, passed through verbatim (values are treated as
    /// secrets when printed, since they may hold credentials).
    pub properties: BTreeMap<String, Secret>,
}

impl Default for KafkaSettings {
    fn default() -> Self {
        KafkaSettings {
            brokers: "127.0.0.1:9092".into(),
            topic: "clicks".into(),
            group: "clickagg".into(),
            group_instance_id: None,
            session_timeout: Duration::from_secs(45),
            max_poll_interval: Duration::from_secs(300),
            security_protocol: None,
            sasl_mechanism: None,
            sasl_username: None,
            sasl_password: None,
            ssl_ca_location: None,
            ssl_certificate_location: None,
            ssl_key_location: None,
            ssl_key_password: None,
            properties: BTreeMap::new(),
        }
    }
}

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
            key_prefix: "clickagg:dedup:".into(),
            dedup_ttl: None,
            timeout: Duration::from_secs(5),
        }
    }
}

/// What counts as a duplicate, and how the Redis cache of that decision is kept
/// (README, "What counts").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DedupSettings {
    /// The dedup window `W`, in record time: a click counts unless a record with the same
    /// click ID lies less than `W` before it in its partition. Whole seconds.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub window: Option<Duration>,
    /// How far behind the wall clock, in record time, the sweeper keeps sightings for
    /// readers that do not say they lag: it deletes entries last seen more than `window +
    /// max_record_lag` ago, but never within `window` of the record time a lagging reader
    /// has reached (a reader lagging more than half of this says so). Shape the Redis
    /// memory: entries live about `window + max_record_lag`.
    #[serde(with = "humantime_serde")]
    pub max_record_lag: Duration,
    /// Hashes the cache is spread over (a power of two, 4096 to 2^24). Size it so each
    /// holds 64 to 200 entries: clicks per (`window` + `max_record_lag`) / 100. Recorded
    /// per topic: change it with `clickagg settings change`.
    pub shards: u32,
    /// Key of the click-ID fingerprint (SipHash): set a secret of your own so nobody can
    /// make two click IDs collide on purpose. Recorded per topic (by an identifier, never
    /// the key): change it with `clickagg settings change`.
    pub fingerprint_key: Secret,
}

impl Default for DedupSettings {
    fn default() -> Self {
        DedupSettings {
            window: None,
            max_record_lag: Duration::from_secs(6 * 3600),
            shards: 1 << 16,
            fingerprint_key: Secret::new("clickagg-default-fingerprint-key"),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClickHouseSettings {
    /// HTTP(S) endpoint; may carry the user and password, in its user info
    /// (`https://user:pass@host`) or as `?user=…&password=…` ([`endpoint`](Self::endpoint)).
    pub url: SecretUrl,
    pub user: String,
    pub password: Option<Secret>,
    pub database: String,
    /// PEM file of the CA that signed the server certificate, for `https://` with a
    /// private CA (public CAs are trusted from the system store).
    pub tls_ca_file: Option<PathBuf>,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// The ClickHouse cluster (`remote_servers`) the tables live on: `migrate` creates
    /// replicated tables on every shard and a `Distributed` table over them, and every
    /// insert is synchronous (`insert_distributed_sync`) and waits for `insert_quorum`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// Replicas of a shard that must hold a flush's rows before the flush counts as
    /// durable (and its offsets are committed). Default 2 with `cluster`; 0 turns it off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insert_quorum: Option<u32>,
    /// How long an insert waits for its quorum before it fails (and is retried).
    #[serde(with = "humantime_serde")]
    pub insert_quorum_timeout: Duration,
}

impl Default for ClickHouseSettings {
    fn default() -> Self {
        ClickHouseSettings {
            url: SecretUrl::new("http://127.0.0.1:8123"),
            user: "default".into(),
            password: None,
            database: "clickagg".into(),
            tls_ca_file: None,
            request_timeout: Duration::from_secs(30),
            cluster: None,
            insert_quorum: None,
            insert_quorum_timeout: Duration::from_secs(15),
        }
    }
}

/// Where and as whom to connect to ClickHouse.
#[derive(Debug, Clone)]
pub struct ClickHouseEndpoint {
    /// `clickhouse.url` without user info and query.
    pub url: String,
    pub user: String,
    pub password: Option<Secret>,
}

impl ClickHouseSettings {
    /// Replicas an insert waits for: `insert_quorum`, 2 on a cluster by default.
    pub fn quorum(&self) -> u32 {
        self.insert_quorum.unwrap_or(if self.cluster.is_some() { 2 } else { 0 })
    }

    /// The endpoint `clickhouse.url`, `clickhouse.user` and `clickhouse.password` name.
    ///
    /// ClickHouse's HTTP interface takes credentials in the URL, as user info or as
    /// `user` and `password` query parameters, but the clickhouse client crate sends
    /// the user info nowhere and drops the whole query. So they are taken out of the URL
    /// here and given to the client as its user and password; a user or password in the
    /// URL wins over `clickhouse.user` / `clickhouse.password`, and a password in both
    /// places is refused as ambiguous. Any other query parameter is refused too, rather
    /// than silently dropped. Errors show the URL redacted.
    pub fn endpoint(&self) -> Result<ClickHouseEndpoint, String> {
        let shown = &self.url;
        let mut u =
            url::Url::parse(self.url.expose()).map_err(|e| format!("clickhouse.url {shown} is not a URL: {e}"))?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(format!("clickhouse.url {shown} must start with http:// or https://"));
        }
        let decoded = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let (mut user, mut password) =
            ((!u.username().is_empty()).then(|| decoded(u.username())), u.password().map(decoded));
        for (name, value) in u.query_pairs() {
            let slot = match &*name {
                "user" => &mut user,
                "password" => &mut password,
                _ => {
                    return Err(format!(
                        "clickhouse.url {shown}: only user and password may be query parameters (the ClickHouse \
                         client drops the query); set other ClickHouse settings in clickhouse.user's profile"
                    ))
                }
            };
            if slot.replace(value.into_owned()).is_some() {
                return Err(format!("clickhouse.url {shown} gives the {name} twice"));
            }
        }
        if password.is_some() && self.password.is_some() {
            return Err(format!(
                "clickhouse.url {shown} carries a password and clickhouse.password is set too: keep one"
            ));
        }
        u.set_query(None);
        u.set_fragment(None);
        if u.set_username("").and(u.set_password(None)).is_err() {
            return Err(format!("clickhouse.url {shown} has no host"));
        }
        Ok(ClickHouseEndpoint {
            url: u.to_string(),
            user: user.unwrap_or_else(|| self.user.clone()),
            password: password.map(Secret::new).or_else(|| self.password.clone()),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineSettings {
    /// Batch size in offsets (`N`): part of every batch ID, fixed per topic.
    pub batch_offsets: u64,
    /// How often changed buckets are written even if no batch completed.
    #[serde(with = "humantime_serde")]
    pub flush_interval: Duration,
    /// Records taken from the consumer per poll batch (one Redis pipeline each).
    pub max_poll_records: usize,
    /// Consumption pauses while more buckets than this are held unflushed (ClickHouse
    /// down or slow), which bounds memory.
    pub max_unflushed_buckets: usize,
    /// How long shutdown and partition revocation may spend flushing and committing.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Upper bound of the exponential backoff between retries of Redis and ClickHouse.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
}

impl Default for PipelineSettings {
    fn default() -> Self {
        PipelineSettings {
            batch_offsets: 10_000,
            flush_interval: Duration::from_secs(1),
            max_poll_records: 2_000,
            max_unflushed_buckets: 1_000_000,
            drain_timeout: Duration::from_secs(30),
            max_backoff: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidationSettings {
    pub max_payload_bytes: usize,
    pub max_click_id_len: usize,
    /// How far an event's `ts` may be ahead of its Kafka record timestamp.
    #[serde(with = "humantime_serde")]
    pub max_future_skew: Duration,
    /// How far an event's `ts` may be behind its Kafka record timestamp.
    #[serde(with = "humantime_serde")]
    pub max_lateness: Duration,
}

impl Default for ValidationSettings {
    fn default() -> Self {
        let l = Limits::default();
        ValidationSettings {
            max_payload_bytes: l.max_payload_bytes,
            max_click_id_len: l.max_click_id_len,
            max_future_skew: l.max_future_skew,
            max_lateness: l.max_lateness,
        }
    }
}

impl ValidationSettings {
    pub fn limits(&self) -> Limits {
        Limits {
            max_payload_bytes: self.max_payload_bytes,
            max_click_id_len: self.max_click_id_len,
            max_future_skew: self.max_future_skew,
            max_lateness: self.max_lateness,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadLetterSettings {
    /// Rejected records are produced to `topic`; when disabled they are only counted
    /// and logged (not recommended: a bad record then leaves no trace to replay).
    pub enabled: bool,
    /// Defaults to `<kafka.topic>.dlq`.
    pub topic: Option<String>,
}

impl Default for DeadLetterSettings {
    fn default() -> Self {
        DeadLetterSettings { enabled: true, topic: None }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// `/metrics`, `/livez` and `/readyz`. Port 0 picks a free port (logged at start).
    pub addr: SocketAddr,
    pub enabled: bool,
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings { addr: "127.0.0.1:9464".parse().expect("valid"), enabled: true }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    pub format: LogFormat,
    /// `RUST_LOG`-style filter; the `RUST_LOG` variable wins when set.
    pub filter: String,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings { format: LogFormat::Human, filter: "info".into() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration file {0} does not exist")]
    MissingFile(PathBuf),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// A flag override: a dotted key (`kafka.brokers`) and its value.
pub type Override = (&'static str, figment::value::Value);

impl Settings {
    /// Layers defaults < file < environment < flags and validates the result.
    pub fn load(file: Option<&Path>, overrides: Vec<Override>) -> Result<Settings, ConfigError> {
        Self::load_layers(file, overrides, Env::prefixed("CLICKAGG__").split("__"))
    }

    /// Like [`load`](Self::load), reading `CLICKAGG__…` variables from `vars` instead of
    /// the process environment (tests, and checks of deployment files).
    pub fn load_with_vars<'a>(
        file: Option<&Path>,
        overrides: Vec<Override>,
        vars: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Settings, ConfigError> {
        let mut env = Figment::new();
        for (k, v) in vars {
            if let Some(rest) = k.strip_prefix("CLICKAGG__") {
                let key = rest.to_ascii_lowercase().replace("__", ".");
                // Parsed the way figment's `Env` parses values (numbers, booleans, strings).
                let value: figment::value::Value = v.parse().expect("infallible");
                env = env.merge(Serialized::default(&key, value));
            }
        }
        Self::load_layers(file, overrides, env)
    }

    fn load_layers(
        file: Option<&Path>,
        overrides: Vec<Override>,
        env: impl figment::Provider,
    ) -> Result<Settings, ConfigError> {
        // Every struct is `#[serde(default)]`, so an empty figment yields the defaults.
        let mut figment = Figment::new();
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::MissingFile(path.to_path_buf()));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        figment = figment.merge(env);
        for (key, value) in overrides {
            figment = figment.merge(Serialized::default(key, value));
        }
        let settings: Settings = figment.extract().map_err(|e| ConfigError::Invalid(describe(e)))?;
        settings.validate()?;
        Ok(settings)
    }

    /// Cross-field checks, each saying what to change.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let p = &self.pipeline;
        if BatchOffsets::new(p.batch_offsets).is_none() {
            problems.push("pipeline.batch_offsets must be at least 1".to_string());
        }
        if p.max_poll_records == 0 {
            problems.push("pipeline.max_poll_records must be at least 1".to_string());
        }
        if p.flush_interval.is_zero() {
            problems.push("pipeline.flush_interval must be longer than 0".to_string());
        }
        if p.drain_timeout >= self.kafka.session_timeout {
            problems.push(format!(
                "pipeline.drain_timeout ({}) must be shorter than kafka.session_timeout ({}): \
                 a member still draining would be evicted from the group mid-commit; \
                 lower pipeline.drain_timeout or raise kafka.session_timeout",
                humantime::format_duration(p.drain_timeout),
                humantime::format_duration(self.kafka.session_timeout)
            ));
        }
        if p.flush_interval >= self.kafka.max_poll_interval {
            problems.push(format!(
                "pipeline.flush_interval ({}) must be shorter than kafka.max_poll_interval ({})",
                humantime::format_duration(p.flush_interval),
                humantime::format_duration(self.kafka.max_poll_interval)
            ));
        }
        let window = self.dedup_window();
        if self.validation.max_lateness > window {
            problems.push(format!(
                "validation.max_lateness ({}) exceeds dedup.window ({}): a late retry could arrive more than \
                 a window after its original and be counted twice; raise dedup.window or lower validation.max_lateness",
                humantime::format_duration(self.validation.max_lateness),
                humantime::format_duration(window)
            ));
        }
        if window < Duration::from_secs(1) || window.subsec_nanos() != 0 {
            problems.push("dedup.window must be a whole number of seconds, at least 1s".to_string());
        }
        if self.dedup.max_record_lag < Duration::from_secs(60) {
            problems.push("dedup.max_record_lag must be at least 1m".to_string());
        }
        if self.redis.key_prefix.contains(['{', '}']) {
            problems.push("redis.key_prefix must not contain braces: the dedup keys use them as hash tags".to_string());
        }
        if !self.dedup.shards.is_power_of_two() || !(1 << 12..=1 << 24).contains(&self.dedup.shards) {
            problems.push(format!(
                "dedup.shards ({}) must be a power of two from 4096 to 16777216 (the shard is part of the \
                 click fingerprint: fewer shards would leave it under 100 bits)",
                self.dedup.shards
            ));
        }
        for key in crate::source::EXACTLY_ONCE_PROPERTIES {
            if self.kafka.properties.contains_key(*key) {
                problems.push(format!(
                    "kafka.properties.\"{key}\" must not be set: clickagg sets it itself and exactly-once \
                     depends on its value (remove the override)"
                ));
            }
        }
        if self.kafka.topic.is_empty() || self.kafka.group.is_empty() || self.kafka.brokers.is_empty() {
            problems.push("kafka.brokers, kafka.topic and kafka.group must not be empty".to_string());
        }
        if self.dead_letter.enabled && self.dead_letter_topic() == self.kafka.topic {
            problems.push("dead_letter.topic must differ from kafka.topic".to_string());
        }
        if let Some(m) = &self.kafka.sasl_mechanism {
            if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"].contains(&m.as_str()) {
                problems.push(format!("kafka.sasl_mechanism {m:?} is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"));
            }
            if self.kafka.sasl_username.is_none() || self.kafka.sasl_password.is_none() {
                problems.push("kafka.sasl_mechanism needs kafka.sasl_username and kafka.sasl_password".to_string());
            }
        }
        if let Some(proto) = &self.kafka.security_protocol {
            let proto = proto.to_ascii_lowercase();
            if !["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"].contains(&proto.as_str()) {
                problems.push(format!(
                    "kafka.security_protocol {proto:?} is not one of plaintext, ssl, sasl_plaintext, sasl_ssl"
                ));
            }
        }
        let seeds = self.redis.url.list();
        if self.redis.tls_ca_file.is_some() && !seeds.iter().all(|u| u.starts_with("rediss://")) {
            problems.push("redis.tls_ca_file is set but redis.url does not start with rediss://".to_string());
        }
        if seeds.is_empty()
            || !seeds.iter().all(|u| {
                u.starts_with("redis://")
                    || u.starts_with("rediss://")
                    || (!self.redis_cluster() && u.starts_with("redis+unix://"))
            })
        {
            problems.push(format!("redis.url {} must start with redis:// or rediss://", self.redis.url));
        }
        if self.redis_cluster() && self.redis.tls_ca_file.is_some() {
            // The redis crate's cluster client takes a private CA only with rustls, which
            // clickagg does not build with.
            problems.push(
                "redis.tls_ca_file is not supported with a Redis Cluster: add the CA to the system's trust store \
                 and unset redis.tls_ca_file"
                    .to_string(),
            );
        }
        if seeds.len() > 1 && self.redis.cluster == Some(false) {
            problems.push(format!(
                "redis.url {} names several nodes, which only a Redis Cluster has: set redis.cluster = true, or give one URL",
                self.redis.url
            ));
        }
        if let Some(g) = self.redis.slot_groups {
            if !self.redis_cluster() {
                problems.push("redis.slot_groups only applies to a Redis Cluster (redis.cluster = true)".to_string());
            } else if !(1..=4096).contains(&g) {
                problems.push(format!("redis.slot_groups ({g}) must be from 1 to 4096"));
            }
        }
        if self.redis_wait().is_some() {
            let w = self.redis.wait_timeout;
            if w < Duration::from_millis(1) || w >= self.redis.timeout {
                problems.push(format!(
                    "redis.wait_timeout ({}) must be at least 1ms and shorter than redis.timeout ({}): a WAIT \
                     longer than the response timeout would count as a lost connection",
                    humantime::format_duration(w),
                    humantime::format_duration(self.redis.timeout)
                ));
            }
        }
        let ch = &self.clickhouse;
        if let Some(c) = &ch.cluster {
            if c.is_empty() || !c.chars().all(|x| x.is_ascii_alphanumeric() || x == '_') {
                problems.push(format!("clickhouse.cluster {c:?} must be a cluster name of letters, digits and _"));
            }
        } else if ch.insert_quorum.is_some_and(|q| q > 0) {
            problems.push("clickhouse.insert_quorum needs clickhouse.cluster (a single server has no replicas)".into());
        }
        if ch.quorum() > 0 && ch.insert_quorum_timeout >= ch.request_timeout {
            problems.push(format!(
                "clickhouse.insert_quorum_timeout ({}) must be shorter than clickhouse.request_timeout ({})",
                humantime::format_duration(ch.insert_quorum_timeout),
                humantime::format_duration(ch.request_timeout)
            ));
        }
        if let Some(path) = &self.clickhouse.tls_ca_file {
            if !self.clickhouse.url.expose().starts_with("https://") {
                problems
                    .push("clickhouse.tls_ca_file is set but clickhouse.url does not start with https://".to_string());
            }
            match std::fs::read(path).map(|pem| native_tls::Certificate::from_pem(&pem)) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    problems.push(format!("clickhouse.tls_ca_file {} is not a PEM certificate: {e}", path.display()))
                }
                Err(e) => problems.push(format!("clickhouse.tls_ca_file {}: {e}", path.display())),
            }
        }
        if let Err(problem) = self.clickhouse.endpoint() {
            problems.push(problem);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    /// The dedup window `W` (`dedup.window`, or the deprecated `redis.dedup_ttl`).
    pub fn dedup_window(&self) -> Duration {
        self.dedup.window.or(self.redis.dedup_ttl).unwrap_or(Duration::from_secs(24 * 3600))
    }

    pub fn batch_offsets(&self) -> BatchOffsets {
        BatchOffsets::new(self.pipeline.batch_offsets).expect("validated")
    }

    pub fn dead_letter_topic(&self) -> String {
        self.dead_letter.topic.clone().unwrap_or_else(|| format!("{}.dlq", self.kafka.topic))
    }

    /// The effective configuration as TOML, secrets redacted (`clickagg config`).
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).expect("settings always serialize")
    }

    /// The settings that decide which clicks count, as the topic records them.
    pub fn rules(&self) -> crate::dedup::Rules {
        let v = &self.validation;
        crate::dedup::Rules {
            window_secs: self.dedup_window().as_secs(),
            fingerprint_key_id: crate::dedup::Rules::key_id(self.dedup.fingerprint_key.expose()),
            shards: self.dedup.shards,
            max_payload_bytes: v.max_payload_bytes as u64,
            max_click_id_len: v.max_click_id_len as u64,
            max_future_skew_secs: v.max_future_skew.as_secs(),
            max_lateness_secs: v.max_lateness.as_secs(),
        }
    }

    /// The shared dedup cache of `kafka.topic`.
    pub fn shared_cache(&self) -> Result<crate::dedup::SharedCache, ConfigError> {
        let groups = if self.redis_cluster() { self.redis.slot_groups.unwrap_or(16) } else { 1 };
        Ok(crate::dedup::SharedCache::new(
            self.redis_target()?,
            &self.redis.key_prefix,
            &self.kafka.topic,
            self.dedup.shards,
            groups,
            self.dedup_window(),
            self.redis.timeout,
        )
        .with_wait(self.redis_wait())
        .with_settings_tag(&self.rules().tag()))
    }

    /// Whether the dedup cache is a Redis Cluster: `redis.cluster`, or several seed nodes.
    pub fn redis_cluster(&self) -> bool {
        self.redis.cluster.unwrap_or(self.redis.url.list().len() > 1)
    }

    /// What the claims wait for: `redis.wait_replicas` (1 on a cluster, 0 otherwise).
    pub fn redis_wait(&self) -> Option<crate::dedup::Wait> {
        let replicas = self.redis.wait_replicas.unwrap_or(u32::from(self.redis_cluster()));
        (replicas > 0).then_some(crate::dedup::Wait { replicas, timeout: self.redis.wait_timeout })
    }

    /// The Redis the dedup cache lives in: one server, or a cluster through its seeds.
    pub fn redis_target(&self) -> Result<crate::dedup::RedisTarget, ConfigError> {
        if !self.redis_cluster() {
            return self.redis_client().map(crate::dedup::RedisTarget::Single);
        }
        let invalid =
            |e: redis::RedisError| ConfigError::Invalid(format!("redis.url {}: {}", self.redis.url, e.kind_str()));
        let mut b = redis::cluster::ClusterClient::builder(self.redis.url.list())
            .connection_timeout(self.redis.timeout)
            .response_timeout(self.redis.timeout)
            // Few retries inside the client: the claimer's own backoff covers longer outages
            // (a failover) and reports them (readiness, metrics).
            .retries(3);
        if let Some(user) = &self.redis.username {
            b = b.username(user);
        }
        if let Some(password) = &self.redis.password {
            b = b.password(password.expose());
        }
        b.build().map(crate::dedup::RedisTarget::Cluster).map_err(invalid)
    }

    pub fn fingerprinter(&self) -> crate::dedup::Fingerprinter {
        crate::dedup::Fingerprinter::new(self.dedup.fingerprint_key.expose())
    }

    /// Decodes records as every reader does: these limits, this fingerprint key.
    pub fn decoder(&self) -> crate::source::Decoder {
        crate::source::Decoder { limits: self.validation.limits(), fingerprints: self.fingerprinter() }
    }

    /// The Redis client, with credentials from the URL or from `username`/`password`.
    pub fn redis_client(&self) -> Result<redis::Client, ConfigError> {
        let mut info: redis::ConnectionInfo = redis::IntoConnectionInfo::into_connection_info(self.redis.url.expose())
            .map_err(|e| ConfigError::Invalid(format!("redis.url {}: {}", self.redis.url, e.kind_str())))?;
        let mut redis_settings = info.redis_settings().clone();
        if let Some(user) = &self.redis.username {
            redis_settings = redis_settings.set_username(user.clone());
        }
        if let Some(password) = &self.redis.password {
            redis_settings = redis_settings.set_password(password.expose());
        }
        info = info.set_redis_settings(redis_settings);
        let invalid =
            |e: redis::RedisError| ConfigError::Invalid(format!("redis.url {}: {}", self.redis.url, e.kind_str()));
        match &self.redis.tls_ca_file {
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

trait KindStr {
    fn kind_str(&self) -> String;
}

impl KindStr for redis::RedisError {
    /// The error without its detail, which may quote the URL (and its password).
    fn kind_str(&self) -> String {
        format!("{:?}", self.kind())
    }
}

/// Figment's error text, which names the key and the source (file, env variable) but,
/// unlike some serde messages, never the offending value.
fn describe(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let path = e.path.join(".");
            let source = e.metadata.as_ref().map(|m| m.name.to_string()).unwrap_or_default();
            let what = match &e.kind {
                figment::error::Kind::UnknownField(field, expected) => {
                    format!("unknown key {field:?} (expected one of {})", expected.join(", "))
                }
                figment::error::Kind::InvalidType(_, expected) => format!("wrong type, expected {expected}"),
                figment::error::Kind::InvalidValue(_, expected) => format!("invalid value, expected {expected}"),
                other => other.to_string(),
            };
            if path.is_empty() {
                format!("{what} (from {source})")
            } else {
                format!("{path}: {what} (from {source})")
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
// figment's `Jail` closures return its (large) error type; that is its API, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    #[test]
    fn layers_apply_in_order_defaults_file_env_flags() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "c.toml",
                "[kafka]\nbrokers = \"file:9092\"\ntopic = \"from-file\"\ngroup = \"g-file\"\n",
            )?;
            jail.set_env("CLICKAGG__KAFKA__TOPIC", "from-env");
            jail.set_env("CLICKAGG__KAFKA__GROUP", "g-env");
            let s = Settings::load(Some(Path::new("c.toml")), vec![("kafka.group", "g-flag".into())]).unwrap();
            assert_eq!(s.kafka.brokers, "file:9092");
            assert_eq!(s.kafka.topic, "from-env");
            assert_eq!(s.kafka.group, "g-flag");
            assert_eq!(s.pipeline.batch_offsets, 10_000);
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_are_rejected_from_files_and_environment() {
        Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[kafka]\nbrokerz = \"x\"\n")?;
            let e = Settings::load(Some(Path::new("c.toml")), vec![]).unwrap_err().to_string();
            assert!(e.contains("brokerz"), "{e}");
            Ok(())
        });
        Jail::expect_with(|jail| {
            jail.set_env("CLICKAGG__PIPELINE__BATCH_OFSETS", "5");
            let e = Settings::load(None, vec![]).unwrap_err().to_string();
            assert!(e.contains("batch_ofsets"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn durations_parse_from_humane_strings() {
        Jail::expect_with(|jail| {
            jail.set_env("CLICKAGG__DEDUP__WINDOW", "36h");
            jail.set_env("CLICKAGG__PIPELINE__FLUSH_INTERVAL", "250ms");
            let s = Settings::load(None, vec![]).unwrap();
            assert_eq!(s.dedup_window(), Duration::from_secs(36 * 3600));
            assert_eq!(s.pipeline.flush_interval, Duration::from_millis(250));
            Ok(())
        });
    }

    #[test]
    fn the_deprecated_dedup_ttl_still_sets_the_window_unless_the_window_is_set() {
        Jail::expect_with(|jail| {
            jail.set_env("CLICKAGG__REDIS__DEDUP_TTL", "12h");
            assert_eq!(Settings::load(None, vec![]).unwrap().dedup_window(), Duration::from_secs(12 * 3600));
            jail.set_env("CLICKAGG__DEDUP__WINDOW", "30h");
            assert_eq!(Settings::load(None, vec![]).unwrap().dedup_window(), Duration::from_secs(30 * 3600));
            Ok(())
        });
    }

    #[test]
    fn cross_field_checks_say_what_to_change() {
        let mut s = Settings::default();
        s.pipeline.drain_timeout = Duration::from_secs(60);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("lower pipeline.drain_timeout or raise kafka.session_timeout"), "{e}");

        let mut s = Settings::default();
        s.validation.max_lateness = Duration::from_secs(48 * 3600);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("raise dedup.window"), "{e}");

        let mut s = Settings::default();
        s.kafka.properties.insert("isolation.level".into(), Secret::new("read_uncommitted"));
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("kafka.properties.\"isolation.level\" must not be set"), "{e}");

        let mut s = Settings::default();
        s.pipeline.batch_offsets = 0;
        assert!(s.validate().is_err());
    }

    #[test]
    fn secrets_never_print() {
        let mut s = Settings::default();
        s.clickhouse.password = Some(Secret::new("ch-hunter2"));
        s.kafka.sasl_password = Some(Secret::new("sasl-hunter2"));
        s.redis.url = SecretUrl::new("redis://user:redis-hunter2@127.0.0.1:6379/");
        s.kafka.properties.insert("sasl.oauthbearer.config".into(), Secret::new("prop-hunter2"));
        let printed = format!("{s:?}\n{}", s.to_redacted_toml());
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("redis://user:%5Bredacted%5D@127.0.0.1:6379/") || printed.contains("[redacted]"));
    }

    #[test]
    fn several_redis_urls_are_the_seed_nodes_of_a_cluster_and_claims_wait_for_a_replica() {
        let single = Settings::default();
        assert!(!single.redis_cluster());
        assert_eq!(single.redis_wait(), None, "a single Redis answers alone unless told otherwise");
        let vars = [("CLICKAGG__REDIS__URL", "redis://a:7001/,redis://b:7002/")];
        let s = Settings::load_with_vars(None, vec![], vars).unwrap();
        assert!(s.redis_cluster());
        assert_eq!(s.redis.url.list(), ["redis://a:7001/", "redis://b:7002/"]);
        assert_eq!(s.redis_wait(), Some(crate::dedup::Wait { replicas: 1, timeout: Duration::from_secs(1) }));
        assert_eq!(s.shared_cache().unwrap().groups(), 16);
        let one_seed = [("CLICKAGG__REDIS__URL", "redis://a:7001/"), ("CLICKAGG__REDIS__CLUSTER", "true")];
        let s = Settings::load_with_vars(None, vec![], one_seed).unwrap();
        assert!(s.redis_cluster());
        let tuned = [
            ("CLICKAGG__REDIS__URL", "redis://a:7001/,redis://b:7002/"),
            ("CLICKAGG__REDIS__SLOT_GROUPS", "64"),
            ("CLICKAGG__REDIS__WAIT_REPLICAS", "0"),
        ];
        let s = Settings::load_with_vars(None, vec![], tuned).unwrap();
        assert_eq!((s.shared_cache().unwrap().groups(), s.redis_wait()), (64, None));
    }

    #[test]
    fn cluster_settings_that_contradict_each_other_are_refused_with_what_to_change() {
        let refused = |vars: &[(&str, &str)], says: &str| {
            let e = Settings::load_with_vars(None, vec![], vars.iter().copied()).unwrap_err().to_string();
            assert!(e.contains(says), "{says} in {e}");
        };
        refused(
            &[("CLICKAGG__REDIS__URL", "redis://a:1/,redis://b:2/"), ("CLICKAGG__REDIS__CLUSTER", "false")],
            "set redis.cluster = true, or give one URL",
        );
        refused(&[("CLICKAGG__REDIS__SLOT_GROUPS", "8")], "redis.slot_groups only applies to a Redis Cluster");
        refused(
            &[("CLICKAGG__REDIS__CLUSTER", "true"), ("CLICKAGG__REDIS__WAIT_TIMEOUT", "10s")],
            "shorter than redis.timeout",
        );
        refused(&[("CLICKAGG__CLICKHOUSE__INSERT_QUORUM", "2")], "clickhouse.insert_quorum needs clickhouse.cluster");
        refused(&[("CLICKAGG__CLICKHOUSE__CLUSTER", "a-b")], "letters, digits and _");
        refused(
            &[("CLICKAGG__CLICKHOUSE__CLUSTER", "c"), ("CLICKAGG__CLICKHOUSE__INSERT_QUORUM_TIMEOUT", "1m")],
            "shorter than clickhouse.request_timeout",
        );
        let s = Settings::load_with_vars(None, vec![], [("CLICKAGG__CLICKHOUSE__CLUSTER", "c")]).unwrap();
        assert_eq!(s.clickhouse.quorum(), 2, "a cluster's inserts wait for two replicas by default");
    }

    #[test]
    fn every_seed_node_url_is_redacted() {
        let url = SecretUrl::new("redis://:pw1-hunter2@a:7001/,redis://u:pw2-hunter2@b:7002/?token=t-hunter2");
        let shown = url.to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("a:7001") && shown.contains("u:%5Bredacted%5D@b:7002"), "{shown}");
    }

    #[test]
    fn passwords_and_query_values_in_both_urls_never_print() {
        let redis = "rediss://u:redis-pw-hunter2@cache:6380/0?protocol=resp3&token=redis-q-hunter2#frag-hunter2";
        for clickhouse in
            ["https://ch:ch-pw-hunter2@clickhouse:8443/", "https://clickhouse:8443/?user=ch&password=ch-q-hunter2"]
        {
            let vars = [("CLICKAGG__REDIS__URL", redis), ("CLICKAGG__CLICKHOUSE__URL", clickhouse)];
            let s = Settings::load_with_vars(None, vec![], vars).unwrap();
            let printed = format!("{s:?}\n{}", s.to_redacted_toml());
            assert!(!printed.contains("hunter2"), "{printed}");
            // Where the services are stays visible, and which parameters are set.
            for visible in
                ["u:%5Bredacted%5D@cache:6380/0?protocol=[redacted]&token=[redacted]#[redacted]", "clickhouse:8443"]
            {
                assert!(printed.contains(visible), "{visible} in {printed}");
            }
        }
        assert_eq!(redact_url("http://h/?bare-hunter2&x=1"), "http://h/?[redacted]&x=[redacted]");
        assert_eq!(redact_url("not a url hunter2"), "[unparseable URL redacted]");
    }

    fn endpoint(url: &str, password: Option<&str>) -> Result<ClickHouseEndpoint, String> {
        let s = ClickHouseSettings {
            url: SecretUrl::new(url),
            password: password.map(Secret::new),
            ..ClickHouseSettings::default()
        };
        s.endpoint()
    }

    #[test]
    fn clickhouse_credentials_in_the_url_become_the_clients_user_and_password() {
        let e = endpoint("https://svc%40corp:p%2Bw%3Ahunter2@ch.example:8443/", None).unwrap();
        assert_eq!((e.url.as_str(), e.user.as_str()), ("https://ch.example:8443/", "svc@corp"));
        assert_eq!(e.password.unwrap().expose(), "p+w:hunter2");
        let e = endpoint("http://127.0.0.1:8123/?user=svc&password=a%26b+hunter2", None).unwrap();
        assert_eq!((e.url.as_str(), e.user.as_str()), ("http://127.0.0.1:8123/", "svc"));
        assert_eq!(e.password.unwrap().expose(), "a&b hunter2");
        let e = endpoint("http://127.0.0.1:8123", Some("from-setting")).unwrap();
        assert_eq!((e.url.as_str(), e.user.as_str()), ("http://127.0.0.1:8123/", "default"));
        assert_eq!(e.password.unwrap().expose(), "from-setting");
    }

    #[test]
    fn a_clickhouse_url_the_client_would_misread_is_refused_without_printing_it() {
        for (url, password, says) in [
            ("http://ch:8123/?password=hunter2&max_threads=8", None, "only user and password"),
            ("http://u:hunter2@ch:8123/", Some("other"), "keep one"),
            ("http://u:hunter2@ch:8123/?password=hunter2", None, "twice"),
            ("ftp://u:hunter2@ch/", None, "http:// or https://"),
            ("hunter2", None, "not a URL"),
        ] {
            let e = endpoint(url, password).unwrap_err();
            assert!(e.contains(says) && !e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn a_secret_that_looks_like_a_number_is_still_a_secret() {
        Jail::expect_with(|jail| {
            jail.set_env("CLICKAGG__CLICKHOUSE__PASSWORD", "12345");
            jail.set_env("CLICKAGG__KAFKA__SASL_PASSWORD", "true");
            let s = Settings::load(None, vec![]).unwrap();
            assert_eq!(s.clickhouse.password.unwrap().expose(), "12345");
            assert_eq!(s.kafka.sasl_password.unwrap().expose(), "true");
            Ok(())
        });
    }

    #[test]
    fn an_invalid_value_error_does_not_quote_the_value() {
        Jail::expect_with(|jail| {
            jail.set_env("CLICKAGG__HTTP__ADDR", "not-an-address-hunter2");
            let e = Settings::load(None, vec![]).unwrap_err().to_string();
            assert!(!e.contains("hunter2"), "{e}");
            assert!(e.contains("http.addr"), "{e}");
            Ok(())
        });
    }
}
