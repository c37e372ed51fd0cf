//! The Kafka section of the settings, and the client properties exactly-once depends on.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::secrets::Secret;

/// Consumer properties exactly-once depends on, set by clickagg and nowhere else: an
/// override in `kafka.properties` is refused when the settings load. `isolation.level`
/// keeps aborted transactions out; the others keep offsets moving only through
/// clickagg's commits.
pub const EXACTLY_ONCE_PROPERTIES: &[&str] =
    &["isolation.level", "enable.auto.commit", "enable.auto.offset.store", "auto.commit.enable"];

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
    /// `security.protocol`.
    pub security_protocol: Option<SecurityProtocol>,
    /// `sasl.mechanism`.
    pub sasl_mechanism: Option<SaslMechanism>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<Secret>,
    pub ssl_ca_location: Option<PathBuf>,
    pub ssl_certificate_location: Option<PathBuf>,
    pub ssl_key_location: Option<PathBuf>,
    pub ssl_key_password: Option<Secret>,
    /// OAUTHBEARER with OpenID Connect (`sasl_mechanism = "OAUTHBEARER"`): the token
    /// endpoint of the identity provider, which librdkafka asks for a token with the
    /// client credentials below, and again before it expires.
    pub oauth_token_endpoint_url: Option<String>,
    pub oauth_client_id: Option<String>,
    pub oauth_client_secret: Option<Secret>,
    /// The scope asked for, if the provider wants one.
    pub oauth_scope: Option<String>,
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
            oauth_token_endpoint_url: None,
            oauth_client_id: None,
            oauth_client_secret: None,
            oauth_scope: None,
            properties: BTreeMap::new(),
        }
    }
}

/// Declares a setting whose value is one of a fixed list, read in any case: the list,
/// the parser and the error message come from one place.
macro_rules! one_of {
    ($(#[$doc:meta])* $name:ident, $setting:literal, { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The value as librdkafka takes it.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $name::ALL.iter().copied().find(|v| v.as_str().eq_ignore_ascii_case(s)).ok_or_else(|| {
                    let all: Vec<&str> = $name::ALL.iter().map(|v| v.as_str()).collect();
                    format!("{} must be one of {}", $setting, all.join(", "))
                })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

one_of!(
    /// `kafka.security_protocol`.
    SecurityProtocol, "kafka.security_protocol", {
        Plaintext => "plaintext",
        Ssl => "ssl",
        SaslPlaintext => "sasl_plaintext",
        SaslSsl => "sasl_ssl",
    }
);

one_of!(
    /// `kafka.sasl_mechanism`.
    SaslMechanism, "kafka.sasl_mechanism", {
        Plain => "PLAIN",
        ScramSha256 => "SCRAM-SHA-256",
        ScramSha512 => "SCRAM-SHA-512",
        OauthBearer => "OAUTHBEARER",
        Gssapi => "GSSAPI",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_enumerated_setting_reads_any_case_and_names_every_value_it_accepts() {
        assert_eq!("SASL_SSL".parse::<SecurityProtocol>(), Ok(SecurityProtocol::SaslSsl));
        assert_eq!("scram-sha-512".parse::<SaslMechanism>(), Ok(SaslMechanism::ScramSha512));
        let e = "KERBEROS".parse::<SaslMechanism>().unwrap_err();
        assert_eq!(e, "kafka.sasl_mechanism must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI");
    }
}
