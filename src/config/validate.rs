//! The cross-field checks of the settings, each saying what to change, and the text of
//! a settings error (which names the key and its source, never the value).

use std::time::Duration;

use super::kafka::{SaslMechanism, EXACTLY_ONCE_PROPERTIES};
use super::{tls, ConfigError, RedisSettings, Settings};
use crate::position::BatchOffsets;

impl Settings {
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
        if !(1..=64).contains(&p.claims_in_flight) {
            problems.push("pipeline.claims_in_flight must be between 1 and 64".to_string());
        }
        if self.seal.interval.is_zero() {
            problems.push("seal.interval must be longer than 0".to_string());
        }
        if self.seal.slack < Duration::from_secs(1) {
            problems.push("seal.slack must be at least 1s (markers carry whole seconds)".to_string());
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
        for key in EXACTLY_ONCE_PROPERTIES {
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
        if let Some(conflict) = self.validation.fields.conflict() {
            problems.push(conflict);
        }
        let registry = &self.source.schema_registry;
        let files = self.source.schema_files.is_some();
        if files && registry.url.is_some() {
            problems.push("source.schema_files and source.schema_registry.url are both set: keep one".to_string());
        }
        match (&registry.url, self.source.format.uses_registry()) {
            (None, true) if !files => problems.push(format!(
                "source.format = \"{}\" needs source.schema_registry.url (or source.schema_files): the records \
                 name their schema by its ID",
                self.source.format
            )),
            (Some(url), _) => {
                let scheme = url::Url::parse(url.expose()).ok().map(|u| u.scheme().to_string());
                if !matches!(scheme.as_deref(), Some("http" | "https")) {
                    problems.push(format!("source.schema_registry.url {url} must be an http:// or https:// URL"));
                } else if registry.tls_ca_file.is_some() && scheme.as_deref() != Some("https") {
                    problems.push(
                        "source.schema_registry.tls_ca_file is set but source.schema_registry.url is not https://"
                            .to_string(),
                    );
                }
            }
            (None, _) => {}
        }
        if registry.password.is_some() && registry.username.is_none() {
            problems.push("source.schema_registry.password needs source.schema_registry.username".to_string());
        }
        if registry.timeout.is_zero() {
            problems.push("source.schema_registry.timeout must be longer than 0".to_string());
        }
        if self.dead_letter.enabled && self.dead_letter_topic() == self.kafka.topic {
            problems.push("dead_letter.topic must differ from kafka.topic".to_string());
        }
        let k = &self.kafka;
        let property = |name: &str| k.properties.contains_key(name);
        match k.sasl_mechanism {
            Some(SaslMechanism::OauthBearer) => {
                // OIDC through the typed settings, or librdkafka's own properties
                // (`sasl.oauthbearer.method`, or an unsecured `sasl.oauthbearer.config`).
                let oidc = [k.oauth_client_id.is_some(), k.oauth_client_secret.is_some()];
                if k.oauth_token_endpoint_url.is_some() && oidc.contains(&false) {
                    problems.push(
                        "kafka.oauth_token_endpoint_url needs kafka.oauth_client_id and kafka.oauth_client_secret"
                            .to_string(),
                    );
                } else if k.oauth_token_endpoint_url.is_none()
                    && !property("sasl.oauthbearer.method")
                    && !property("sasl.oauthbearer.config")
                {
                    problems.push(
                        "kafka.sasl_mechanism OAUTHBEARER needs kafka.oauth_token_endpoint_url, kafka.oauth_client_id \
                         and kafka.oauth_client_secret (OpenID Connect client credentials)"
                            .to_string(),
                    );
                }
            }
            Some(SaslMechanism::Gssapi) if !cfg!(feature = "gssapi") => problems.push(
                "kafka.sasl_mechanism GSSAPI (Kerberos) is not built into this clickagg: build it with \
                 `cargo build --release --features gssapi` (needs libsasl2-dev)"
                    .to_string(),
            ),
            Some(SaslMechanism::Gssapi) => {}
            Some(_) if k.sasl_username.is_none() || k.sasl_password.is_none() => {
                problems.push("kafka.sasl_mechanism needs kafka.sasl_username and kafka.sasl_password".to_string());
            }
            _ => {}
        }
        if k.oauth_token_endpoint_url.is_some() && k.sasl_mechanism != Some(SaslMechanism::OauthBearer) {
            problems.push("kafka.oauth_token_endpoint_url needs kafka.sasl_mechanism = \"OAUTHBEARER\"".to_string());
        }
        let seeds = self.redis.url.list();
        // Behind Sentinel, the Sentinels' URLs say whether TLS is used (the data nodes
        // are reached the same way).
        let (tls_setting, tls_urls) = match &self.redis.sentinel {
            Some(sentinel) => ("redis.sentinel.urls", sentinel.urls.list()),
            None => ("redis.url", seeds.clone()),
        };
        for (setting, set) in [
            ("redis.tls_ca_file", self.redis.tls_ca_file.is_some()),
            ("redis.tls_cert_file", self.redis.tls_cert_file.is_some()),
        ] {
            if set && !tls_urls.iter().all(|u| u.starts_with("rediss://")) {
                problems.push(format!("{setting} is set but {tls_setting} does not start with rediss://"));
            }
        }
        let r = &self.redis;
        if let Err(problem) =
            tls::load("redis", r.tls_ca_file.as_deref(), r.tls_cert_file.as_deref(), r.tls_key_file.as_deref())
        {
            problems.push(problem);
        }
        if let Some(sentinel) = &self.redis.sentinel {
            if sentinel.master.is_empty() {
                problems.push("redis.sentinel.master must name the master the Sentinels monitor".to_string());
            }
            let urls = sentinel.urls.list();
            if urls.is_empty() || !urls.iter().all(|u| u.starts_with("redis://") || u.starts_with("rediss://")) {
                problems.push(format!(
                    "redis.sentinel.urls {} must list the Sentinels, each redis://host:port or rediss://host:port",
                    sentinel.urls
                ));
            }
            if self.redis.url.expose() != RedisSettings::default().url.expose() || self.redis.cluster.is_some() {
                problems.push(
                    "redis.sentinel finds the master through the Sentinels: leave redis.url and redis.cluster unset"
                        .to_string(),
                );
            }
        }
        if seeds.is_empty()
            || !seeds.iter().all(|u| {
                u.starts_with("redis://")
                    || u.starts_with("rediss://")
                    || (!self.redis.is_cluster() && u.starts_with("redis+unix://"))
            })
        {
            problems.push(format!("redis.url {} must start with redis:// or rediss://", self.redis.url));
        }
        if self.redis.is_cluster() && self.redis.tls_ca_file.is_some() {
            // The redis crate's cluster client takes a private CA only with rustls, which
            // clickagg does not build with.
            problems.push(
                "redis.tls_ca_file is not supported with a Redis Cluster: add the CA to the system's trust store \
                 and unset redis.tls_ca_file"
                    .to_string(),
            );
        }
        if self.redis.is_cluster() && self.redis.tls_cert_file.is_some() {
            // Likewise a client certificate (rustls only, in the redis crate's cluster client).
            problems.push("redis.tls_cert_file is not supported with a Redis Cluster".to_string());
        }
        if seeds.len() > 1 && self.redis.cluster == Some(false) {
            problems.push(format!(
                "redis.url {} names several nodes, which only a Redis Cluster has: set redis.cluster = true, or give one URL",
                self.redis.url
            ));
        }
        if let Some(g) = self.redis.slot_groups {
            if !self.redis.is_cluster() {
                problems.push("redis.slot_groups only applies to a Redis Cluster (redis.cluster = true)".to_string());
            } else if !(1..=4096).contains(&g) {
                problems.push(format!("redis.slot_groups ({g}) must be from 1 to 4096"));
            }
        }
        if self.redis.wait().is_some() {
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
            if ch.insert_quorum == Some(0) {
                // Without a quorum the replicas keep no record of which parts were
                // acknowledged, and a read from one that lags cannot tell it lacks them.
                problems.push(
                    "clickhouse.insert_quorum 0 on a cluster lets a member read decisions from a replica that has not \
                     fetched them yet: set it to 1 or more (2, the default, also survives the loss of a replica)"
                        .into(),
                );
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
        for (setting, set) in [
            ("clickhouse.tls_ca_file", ch.tls_ca_file.is_some()),
            ("clickhouse.tls_cert_file", ch.tls_cert_file.is_some()),
        ] {
            if set && !ch.url.expose().starts_with("https://") {
                problems.push(format!("{setting} is set but clickhouse.url does not start with https://"));
            }
        }
        if let Err(problem) =
            tls::load("clickhouse", ch.tls_ca_file.as_deref(), ch.tls_cert_file.as_deref(), ch.tls_key_file.as_deref())
        {
            problems.push(problem);
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
}

/// Figment's error text, which names the key and the source (file, env variable) but,
/// unlike some serde messages, never the offending value.
pub(super) fn describe(e: figment::Error) -> String {
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
    use crate::secrets::Secret;
    use figment::Jail;

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
            &[("CLICKAGG__CLICKHOUSE__CLUSTER", "c"), ("CLICKAGG__CLICKHOUSE__INSERT_QUORUM", "0")],
            "set it to 1 or more",
        );
        refused(
            &[("CLICKAGG__CLICKHOUSE__CLUSTER", "c"), ("CLICKAGG__CLICKHOUSE__INSERT_QUORUM_TIMEOUT", "1m")],
            "shorter than clickhouse.request_timeout",
        );
        let s = Settings::load_with_vars(None, vec![], [("CLICKAGG__CLICKHOUSE__CLUSTER", "c")]).unwrap();
        assert_eq!(s.clickhouse.quorum(), 2, "a cluster's inserts wait for two replicas by default");
    }

    #[test]
    fn the_reading_settings_load_from_the_environment_and_contradictions_are_refused() {
        let vars = [
            ("CLICKAGG__SOURCE__FORMAT", "protobuf"),
            ("CLICKAGG__SOURCE__SCHEMA_REGISTRY__URL", "http://u:hunter2@127.0.0.1:8081/apis/ccompat/v7"),
            ("CLICKAGG__VALIDATION__TS_UNIT", "auto"),
            ("CLICKAGG__VALIDATION__FIELDS__CLICK_ID", "event.id"),
            ("CLICKAGG__VALIDATION__FIELDS__AD_ID", "ad.id"),
            ("CLICKAGG__VALIDATION__FIELDS__TS", "meta.time"),
        ];
        let s = Settings::load_with_vars(None, vec![], vars).unwrap();
        assert_eq!(s.source.format, super::super::Format::Protobuf);
        assert_eq!(s.validation.ts_unit, crate::click::TsUnit::Auto);
        assert_eq!(s.validation.fields.ad_id.segments(), ["ad", "id"]);
        assert!(!s.to_redacted_toml().contains("hunter2"));
        assert!(s.to_redacted_toml().contains("ts_unit = \"auto\""));

        let refused = |vars: &[(&str, &str)], says: &str| {
            let e = Settings::load_with_vars(None, vec![], vars.iter().copied()).unwrap_err().to_string();
            assert!(e.contains(says), "{says} in {e}");
        };
        refused(&[("CLICKAGG__SOURCE__FORMAT", "avro")], "needs source.schema_registry.url");
        refused(&[("CLICKAGG__SOURCE__FORMAT", "xml")], "source.format");
        refused(&[("CLICKAGG__VALIDATION__TS_UNIT", "ns")], "validation.ts_unit");
        refused(&[("CLICKAGG__VALIDATION__FIELDS__TS", "a..b")], "not a field path");
        refused(
            &[("CLICKAGG__VALIDATION__FIELDS__TS", "ad"), ("CLICKAGG__VALIDATION__FIELDS__AD_ID", "ad.id")],
            "overlap",
        );
        refused(&[("CLICKAGG__SOURCE__SCHEMA_REGISTRY__URL", "ftp://x")], "http:// or https://");
        refused(
            &[("CLICKAGG__SOURCE__SCHEMA_REGISTRY__PASSWORD", "p")],
            "source.schema_registry.password needs source.schema_registry.username",
        );
    }

    #[test]
    fn managed_platform_settings_load_and_contradictions_are_refused() {
        let refused = |vars: &[(&str, &str)], says: &str| {
            let e = Settings::load_with_vars(None, vec![], vars.iter().copied()).unwrap_err().to_string();
            assert!(e.contains(says), "{says} in {e}");
        };
        // Redis Sentinel: the master's name and the Sentinels, and no redis.url beside them.
        let sentinel = [
            ("CLICKAGG__REDIS__SENTINEL__MASTER", "clickagg"),
            ("CLICKAGG__REDIS__SENTINEL__URLS", "redis://s1:26379/,redis://s2:26379/"),
        ];
        let s = Settings::load_with_vars(None, vec![], sentinel).unwrap();
        assert_eq!(s.redis.sentinel.as_ref().unwrap().urls.list().len(), 2);
        assert!(!s.redis.is_cluster());
        assert_eq!(s.redis.wait().map(|w| w.replicas), Some(1), "a failover promotes a replica: claims wait for one");
        refused(
            &[sentinel[0], sentinel[1], ("CLICKAGG__REDIS__URL", "redis://elsewhere:6379/")],
            "leave redis.url and redis.cluster unset",
        );
        refused(&[("CLICKAGG__REDIS__SENTINEL__URLS", "redis://s1:26379/")], "redis.sentinel.master must name");
        refused(&[sentinel[0], ("CLICKAGG__REDIS__SENTINEL__URLS", "http://s1:26379/")], "redis.sentinel.urls");
        refused(
            &[sentinel[0], sentinel[1], ("CLICKAGG__REDIS__TLS_CA_FILE", "/nonexistent/ca.pem")],
            "redis.tls_ca_file is set but redis.sentinel.urls does not start with rediss://",
        );
        // Client certificates: both files, readable, over TLS.
        refused(
            &[("CLICKAGG__REDIS__URL", "rediss://r:6380/"), ("CLICKAGG__REDIS__TLS_CERT_FILE", "/nonexistent/c.pem")],
            "go together",
        );
        refused(
            &[("CLICKAGG__CLICKHOUSE__TLS_CERT_FILE", "/x/c.pem"), ("CLICKAGG__CLICKHOUSE__TLS_KEY_FILE", "/x/k.pem")],
            "clickhouse.tls_cert_file is set but clickhouse.url does not start with https://",
        );
        refused(
            &[
                ("CLICKAGG__CLICKHOUSE__URL", "https://ch:8443"),
                ("CLICKAGG__CLICKHOUSE__TLS_CERT_FILE", "/nonexistent/c.pem"),
                ("CLICKAGG__CLICKHOUSE__TLS_KEY_FILE", "/nonexistent/k.pem"),
            ],
            "clickhouse.tls_cert_file /nonexistent/c.pem",
        );
        // OAUTHBEARER with OpenID Connect: the endpoint with the client's credentials.
        let oauth = [
            ("CLICKAGG__KAFKA__SECURITY_PROTOCOL", "sasl_ssl"),
            ("CLICKAGG__KAFKA__SASL_MECHANISM", "OAUTHBEARER"),
            ("CLICKAGG__KAFKA__OAUTH_TOKEN_ENDPOINT_URL", "https://idp/token"),
            ("CLICKAGG__KAFKA__OAUTH_CLIENT_ID", "clickagg"),
            ("CLICKAGG__KAFKA__OAUTH_CLIENT_SECRET", "hunter2"),
        ];
        let s = Settings::load_with_vars(None, vec![], oauth).unwrap();
        assert!(!s.to_redacted_toml().contains("hunter2"));
        let c = crate::source::client_config(&s.kafka);
        assert_eq!(c.get("sasl.oauthbearer.method"), Some("oidc"));
        assert_eq!(c.get("sasl.oauthbearer.token.endpoint.url"), Some("https://idp/token"));
        assert_eq!(c.get("sasl.oauthbearer.client.secret"), Some("hunter2"));
        refused(&oauth[..4], "needs kafka.oauth_client_id and kafka.oauth_client_secret");
        refused(&oauth[..2], "OAUTHBEARER needs kafka.oauth_token_endpoint_url");
        refused(&oauth[2..], "needs kafka.sasl_mechanism = \"OAUTHBEARER\"");
        // GSSAPI is a build feature.
        if !cfg!(feature = "gssapi") {
            refused(&[("CLICKAGG__KAFKA__SASL_MECHANISM", "GSSAPI")], "--features gssapi");
        }
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
