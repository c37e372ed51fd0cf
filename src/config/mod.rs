//! Typed settings: defaults < TOML file (`--config`) < environment
//! (`CLICKAGG__SECTION__KEY`) < command-line flags.
//!
//! Unknown keys are rejected wherever they come from, so a typo fails at startup
//! instead of silently running with a default. Secrets are [`Secret`]s (`secrets`): they
//! print as `[redacted]` in `Debug`, in `clickagg config` and in every error message.
//! Durations are parsed here, once, into what the code uses. The cross-field checks are
//! in `validate`; what a setting builds (a Redis client, the dedup cache, the decoder)
//! is built by that type from its section.

mod clickhouse;
mod kafka;
mod redis;
mod rules;
pub mod secret_files;
pub mod tls;
mod validate;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format as _, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::click::{Fields, Limits, TsUnit};
use crate::position::BatchOffsets;
pub use crate::secrets::{redact_url, Secret, SecretUrl};
pub use clickhouse::{ClickHouseEndpoint, ClickHouseSettings};
pub use kafka::{KafkaSettings, SaslMechanism, SecurityProtocol, EXACTLY_ONCE_PROPERTIES};
pub use redis::{RedisSettings, RedisWait, SentinelSettings};
pub use rules::{Reading, Rules};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub kafka: KafkaSettings,
    pub source: SourceSettings,
    pub redis: RedisSettings,
    pub dedup: DedupSettings,
    pub clickhouse: ClickHouseSettings,
    pub pipeline: PipelineSettings,
    pub validation: ValidationSettings,
    pub dead_letter: DeadLetterSettings,
    pub seal: SealSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
}

/// What counts as a duplicate, and how the Redis cache of that decision is kept
/// (guide, "What counts").
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
pub struct PipelineSettings {
    /// Batch size in offsets (`N`): part of every batch ID, fixed per topic.
    pub batch_offsets: u64,
    /// How often changed buckets are written even if no batch completed.
    #[serde(with = "humantime_serde")]
    pub flush_interval: Duration,
    /// Records taken from the consumer per poll batch (one Redis pipeline each).
    pub max_poll_records: usize,
    /// Poll batches whose claims may be in Redis at once: each is sent before the one
    /// before it is answered, and the verdicts are applied in order (`cache::claimer`).
    /// 1 waits for every answer before the next call.
    pub claims_in_flight: usize,
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
            claims_in_flight: 3,
            max_unflushed_buckets: 1_000_000,
            drain_timeout: Duration::from_secs(30),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// How the records of the topic are encoded: defined with the decoder, which it selects.
pub use crate::click::Format;

/// What the records of `kafka.topic` are.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceSettings {
    pub format: Format,
    pub schema_registry: SchemaRegistrySettings,
    /// Instead of a registry: a directory of schemas named by ID (`<id>.avsc`,
    /// `<id>.proto`; a Protobuf schema imports the other `.proto` files by name). A file,
    /// once written, must never change, as a registry never changes an ID's schema.
    pub schema_files: Option<PathBuf>,
}

/// The Confluent-compatible Schema Registry the Avro and Protobuf records' schema IDs
/// refer to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchemaRegistrySettings {
    /// Base URL of the Confluent API (`http://host:8081`; Apicurio serves it at
    /// `…/apis/ccompat/v7`). `http://` or `https://`; may carry `user:password@`.
    pub url: Option<SecretUrl>,
    /// Basic-auth user, if not in the URL.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// PEM file of the CA that signed the registry's certificate, for `https://` with a
    /// private CA.
    pub tls_ca_file: Option<PathBuf>,
    /// One request's limit; a slower answer counts as an outage (retried).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for SchemaRegistrySettings {
    fn default() -> Self {
        SchemaRegistrySettings {
            url: None,
            username: None,
            password: None,
            tls_ca_file: None,
            timeout: Duration::from_secs(10),
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
    /// The unit of a numeric `ts`: `ms` (the default), `s`, `us`, or `auto` (by
    /// magnitude: below 10^11 seconds, below 10^14 milliseconds, else microseconds).
    pub ts_unit: TsUnit,
    /// Where each field is: a dotted path (`event.id`) into nested objects, records or
    /// messages.
    pub fields: Fields,
}

impl Default for ValidationSettings {
    fn default() -> Self {
        let l = Limits::default();
        ValidationSettings {
            max_payload_bytes: l.max_payload_bytes,
            max_click_id_len: l.max_click_id_len,
            max_future_skew: l.max_future_skew,
            max_lateness: l.max_lateness,
            ts_unit: l.ts_unit,
            fields: l.fields,
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
            fields: self.fields.clone(),
            ts_unit: self.ts_unit,
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

/// The sealer (guide, "Sealed hours"): one member of the group at a time compacts the
/// minute rows of settled hours into sealed hours and days.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SealSettings {
    /// Whether members run the sealer (one at a time, through a lease in Redis).
    /// `clickagg seal` seals either way.
    pub enabled: bool,
    /// How often a member checks for hours to seal and re-seal.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// The longest a write's touched-hour marker may take from its server time to being
    /// readable (an INSERT's duration, a quorum wait) plus the clock skew between
    /// ClickHouse servers. Markers are scanned this far back, and a sealed hour with a
    /// marker this close to its seal is read from the minute rows. Larger only costs
    /// re-seals; smaller than the real delay could leave a late click out of a seal.
    #[serde(with = "humantime_serde")]
    pub slack: Duration,
}

impl Default for SealSettings {
    fn default() -> Self {
        SealSettings { enabled: true, interval: Duration::from_secs(30), slack: Duration::from_secs(60) }
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
    /// Layers defaults < file < environment < flags and validates the result. A secret
    /// setting may come from the file a `<VAR>_FILE` variable names ([`secret_files`]).
    pub fn load(file: Option<&Path>, overrides: Vec<Override>) -> Result<Settings, ConfigError> {
        let env = || Env::prefixed("CLICKAGG__").split("__");
        let vars: Vec<(String, String)> = env().iter().map(|(k, v)| (k.as_str().to_string(), v)).collect();
        let from_files = secret_files::read(&vars)?;
        Self::load_layers(file, overrides, env().filter(|k| !secret_files::is_file_key(k.as_str())), from_files)
    }

    /// Like [`load`](Self::load), reading `CLICKAGG__…` variables from `vars` instead of
    /// the process environment (tests, and checks of deployment files). `<VAR>_FILE`
    /// variables read their files as `load` does.
    pub fn load_with_vars<'a>(
        file: Option<&Path>,
        overrides: Vec<Override>,
        vars: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Settings, ConfigError> {
        let vars: Vec<(String, String)> = vars
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix("CLICKAGG__")?;
                Some((rest.to_ascii_lowercase().replace("__", "."), v.to_string()))
            })
            .collect();
        let from_files = secret_files::read(&vars)?;
        let mut env = Figment::new();
        for (key, v) in vars.iter().filter(|(k, _)| !secret_files::is_file_key(k)) {
            // Parsed the way figment's `Env` parses values (numbers, booleans, strings).
            let value: figment::value::Value = v.parse().expect("infallible");
            env = env.merge(Serialized::default(key, value));
        }
        Self::load_layers(file, overrides, env, from_files)
    }

    fn load_layers(
        file: Option<&Path>,
        overrides: Vec<Override>,
        env: impl figment::Provider,
        from_files: Vec<(&'static str, figment::value::Value)>,
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
        // At the environment's precedence: a key is set by its variable or its file,
        // never both (`secret_files::read` refuses that).
        for (key, value) in from_files {
            figment = figment.merge(Serialized::default(key, value));
        }
        for (key, value) in overrides {
            figment = figment.merge(Serialized::default(key, value));
        }
        let settings: Settings = figment.extract().map_err(|e| ConfigError::Invalid(validate::describe(e)))?;
        settings.validate()?;
        Ok(settings)
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
    pub fn rules(&self) -> Rules {
        let v = &self.validation;
        Rules {
            window_secs: self.dedup_window().as_secs(),
            fingerprint_key_id: Rules::key_id(self.dedup.fingerprint_key.expose()),
            shards: self.dedup.shards,
            max_payload_bytes: v.max_payload_bytes as u64,
            max_click_id_len: v.max_click_id_len as u64,
            max_future_skew_secs: v.max_future_skew.as_secs(),
            max_lateness_secs: v.max_lateness.as_secs(),
            reading: Reading { format: self.source.format, fields: v.fields.clone(), ts_unit: v.ts_unit },
        }
    }
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
