//! The ClickHouse section of the settings: where the counts go, as whom, and on which
//! cluster.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::secrets::{Secret, SecretUrl};

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
    /// PEM client certificate, for a server that verifies its clients (ClickHouse's
    /// `verificationMode strict`, or a proxy in front of it); with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM PKCS#8 private key of `tls_cert_file` (`BEGIN PRIVATE KEY`).
    pub tls_key_file: Option<PathBuf>,
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
            tls_cert_file: None,
            tls_key_file: None,
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
