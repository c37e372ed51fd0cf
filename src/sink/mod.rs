//! The ClickHouse sink: a handle on one database ([`Sink`]) and what clickagg asks of
//! it, one file each — the error classes (`error`), the tables and their cluster
//! form (`schema`), the writes of a flush (`write`), the reads (`read`), the
//! per-topic registries (`registry`), the sealer's reads and writes (`seal`), and
//! closed billing periods with their adjustments (`periods`).
//!
//! The client is configured for every server the project supports: no compression
//! (the Debian 18.16 server's HTTP handler fails on the crate's LZ4 frames and the
//! SELECT comes back empty without an error) and no schema validation (18.16 has no
//! `RowBinaryWithNamesAndTypes`). Without validation a RowBinary answer is bytes the
//! client cuts into rows, so every request asks the server to hold its answer until the
//! query ends (`wait_end_of_query=1`): a query that fails then answers an error status,
//! never rows followed by an exception text. Every value a request carries is bound
//! (`?`), never spliced into the SQL; only identifiers (table, database and cluster
//! names) are quoted into it.

pub mod billing;
mod error;
#[cfg(test)]
pub(crate) mod fake_server;
pub mod periods;
pub mod read;
mod registry;
mod schema;
pub mod seal;
mod supersede;
mod write;

use std::time::Duration;

use clickhouse::{Client, Compression};

pub use error::{class_of, classify, Class, SinkError, CODES};
pub use read::{Billing, LastFlush};
pub use registry::{RulesHistory, RulesVersion, REGISTRATION_SETTLE_SECS};
pub use schema::{cluster_statements, MIGRATIONS, SHARDING};
pub use write::MAX_MONTHS_PER_INSERT;

use crate::config::ClickHouseSettings;

/// The minute rows every flush writes (`sql/001`).
pub const TABLE: &str = "ad_clicks_minute";
/// Sealed hours and days, their records, the touched-hour markers and the sealer's
/// progress (`sql/008`).
pub const SEALED_HOUR: &str = "ad_clicks_sealed_hour";
pub const SEALED_DAY: &str = "ad_clicks_sealed_day";
pub const SEALS: &str = "clickagg_seals";
pub const TOUCHED: &str = "clickagg_touched";
pub const SEAL_PROGRESS: &str = "clickagg_seal_progress";
/// Closed billing periods: their totals, their records, and adjustments (`sql/009`).
pub const CLOSED: &str = "clickagg_closed";
pub const CLOSES: &str = "clickagg_closes";
pub const ADJUSTMENTS: &str = "clickagg_adjustments";

/// Who writes a row. Rows of a live member outrank a replay's at the same offset: a
/// replay that read a cross-partition copy before any member did counted it by its own
/// partition's rule, while the member that reads it decides (and pins) which copy
/// counts. Everything else they decide alike, so the rank only settles that race.
///
/// A superseding replay (`replay --supersede`) outranks every row written before it in
/// the batches it rewrites: its rows are stored as if cut `generation` whole batches
/// further on, past any offset a member or an earlier generation could have reached in
/// that batch. Within a generation, a later cut still outranks an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Replay,
    Member,
    Supersede { generation: u64, batch_offsets: u64 },
}

/// The stored `version` of a row cut at `offset`: twice the offset, plus the writer's
/// rank; a superseding replay's offset is moved `generation` batches on.
pub fn stored_version(offset: i64, writer: Writer) -> u64 {
    let offset = offset.max(0) as u64;
    match writer {
        Writer::Replay => offset * 2,
        Writer::Member => offset * 2 + 1,
        Writer::Supersede { generation, batch_offsets } => (offset + generation * batch_offsets) * 2,
    }
}

/// The generation of a stored `version` in the batch starting at `batch_start` (0: a
/// member's or a plain replay's row; rows of clickagg ≤ 0.1, stored as the bare offset,
/// are generation 0 too).
pub fn generation_of(version: u64, batch_start: u64, batch_offsets: u64) -> u64 {
    (version / 2).saturating_sub(batch_start) / batch_offsets.max(1)
}

/// What a stored `version` of a row of the batch starting at `batch_start` says: the
/// offset the row was cut at, and who wrote it.
pub fn read_version(version: u64, batch_start: u64, batch_offsets: u64) -> (i64, Writer) {
    let generation = generation_of(version, batch_start, batch_offsets);
    if generation > 0 {
        let offset = version / 2 - generation * batch_offsets;
        return (offset as i64, Writer::Supersede { generation, batch_offsets });
    }
    let writer = if version % 2 == 1 { Writer::Member } else { Writer::Replay };
    ((version / 2) as i64, writer)
}

/// The stored version SQL of the generation of a row, as [`generation_of`].
pub fn generation_sql(batch_offsets: u64) -> String {
    format!("intDiv(if(intDiv(version, 2) > batch_start, intDiv(version, 2) - batch_start, 0), {batch_offsets})")
}

/// A handle on one ClickHouse database. Cheap to clone.
#[derive(Clone)]
pub struct Sink {
    client: Client,
    server: Client,
    database: String,
    timeout: Duration,
    /// The cluster the tables live on (`clickhouse.cluster`), for the DDL.
    cluster: Option<String>,
    /// `seal.slack` in seconds: how close to a seal a marker makes billing reads take
    /// that hour from the minute rows (`sealing::split`).
    seal_slack: u32,
}

impl Sink {
    pub fn new(s: &ClickHouseSettings) -> Sink {
        // Settings are validated when they load, the endpoint with them.
        let endpoint = s.endpoint().expect("clickhouse.url is checked by Settings::validate");
        // Idle connections close before ClickHouse's own 3 s keep-alive timeout does.
        let builder = || {
            let mut b = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
            b.pool_idle_timeout(Duration::from_secs(2));
            b
        };
        let tls_files = s.tls_ca_file.is_some() || s.tls_cert_file.is_some();
        let base = match https_connector(s) {
            Some(connector) => Client::with_http_client(builder().build(connector)),
            None if endpoint.url.starts_with("https://") && !tls_files => Client::default(),
            // Plain HTTP needs no TLS connector, whose set-up (loading the system's CA
            // bundle) costs a `clickagg query` about 60 ms of its start-up.
            None => {
                Client::with_http_client(builder().build(hyper_util::client::legacy::connect::HttpConnector::new()))
            }
        };
        let mut server = base
            .with_url(endpoint.url)
            .with_user(endpoint.user)
            .with_compression(Compression::None)
            .with_validation(false)
            // Every read sees every write acknowledged before it: pins, clocks, settings,
            // markers and seals that other members wrote decide what this one counts, and
            // on a replicated server (a cluster read through `Distributed`, ClickHouse
            // Cloud behind its load balancer) the replica that answers may lag. A replica
            // that lacks a part written with a quorum refuses the read (code 289, retried)
            // instead of answering without it; on a table that is not replicated the
            // setting changes nothing.
            .with_option("select_sequential_consistency", "1")
            // The whole answer is held by the server until the query ends (in memory,
            // then a temporary file), so a query that fails sends an error status and
            // its code, never rows followed by an exception. Without it, a failure after
            // the first block (a timeout, the memory limit, a node lost mid-read) comes
            // after HTTP 200 and the rows sent so far: 18.16 appends the exception as
            // plain text, which the client does not recognise (it looks for current
            // servers' markers), and RowBinary without validation decodes it as rows.
            // A parameter of the HTTP handler, not a setting: 18.16 and current servers
            // take it alike.
            .with_option("wait_end_of_query", "1");
        if let Some(password) = &endpoint.password {
            server = server.with_password(password.expose());
        }
        if s.cluster.is_some() {
            // An INSERT into a Distributed table answers once every shard holds its rows,
            // not once they are queued on this node to be sent later: a flush is durable
            // only then, and only then may its offsets be committed.
            server = server.with_option("insert_distributed_sync", "1");
            let quorum = s.quorum();
            if quorum > 0 {
                // ...and on `quorum` replicas of each shard, so losing the one that took
                // the insert loses no row (ClickHouse replicates asynchronously).
                server = server
                    .with_option("insert_quorum", quorum.to_string())
                    .with_option("insert_quorum_timeout", s.insert_quorum_timeout.as_millis().to_string());
            }
        }
        let client = server.clone().with_database(s.database.as_str());
        let seal_slack = crate::config::SealSettings::default().slack.as_secs() as u32;
        Sink {
            client,
            server,
            database: s.database.clone(),
            timeout: s.request_timeout,
            cluster: s.cluster.clone(),
            seal_slack,
        }
    }

    /// The cluster the tables live on, if any.
    pub fn cluster(&self) -> Option<&str> {
        self.cluster.as_deref()
    }

    pub fn database(&self) -> &str {
        &self.database
    }

    /// Billing reads with `seal.slack` other than its default.
    pub fn with_seal_slack(mut self, slack: std::time::Duration) -> Sink {
        self.seal_slack = slack.as_secs().clamp(1, u64::from(u32::MAX)) as u32;
        self
    }

    /// The client bound to the configured database, for read-only commands (`query`).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The configured request timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn timed<T>(
        &self,
        fut: impl std::future::Future<Output = clickhouse::error::Result<T>>,
    ) -> Result<T, SinkError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(classify),
            Err(_) => Err(SinkError::Transient(format!("no answer within {:?}", self.timeout))),
        }
    }

    /// Runs one statement in the configured database.
    pub async fn execute(&self, sql: &str) -> Result<(), SinkError> {
        self.timed(self.client.query(sql).execute()).await
    }

    /// Round trip for readiness checks.
    pub async fn ping(&self) -> Result<(), SinkError> {
        self.timed(self.client.query("SELECT 1").fetch_one::<u8>()).await.map(drop)
    }
}

/// An HTTPS connector with the private CA and the client certificate of the settings,
/// or `None` when there are none. The files are the copy read when the settings were
/// validated (`config::tls`): one rotated or removed since changes nothing. Should they
/// be unreadable here (settings never validated), the connector trusts only the system's
/// CAs and presents no certificate, and the server's refusal says what is wrong.
fn https_connector(
    s: &ClickHouseSettings,
) -> Option<hyper_tls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>> {
    use hyper_util::client::legacy::connect::HttpConnector;
    let (ca, cert, key) = (s.tls_ca_file.as_deref(), s.tls_cert_file.as_deref(), s.tls_key_file.as_deref());
    if ca.is_none() && cert.is_none() {
        return None;
    }
    let mut tls = native_tls::TlsConnector::builder();
    match crate::config::tls::load("clickhouse", ca, cert, key) {
        Ok(files) => {
            if let Some(ca) = files.ca.as_deref().and_then(|pem| native_tls::Certificate::from_pem(pem).ok()) {
                tls.add_root_certificate(ca);
            }
            if let Some(id) =
                files.identity.as_ref().and_then(|(cert, key)| native_tls::Identity::from_pkcs8(cert, key).ok())
            {
                tls.identity(id);
            }
        }
        Err(problem) => tracing::error!(%problem, "ClickHouse TLS files unreadable; trusting the system's CAs only"),
    }
    let tls = tls.build().ok()?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(Duration::from_secs(60)));
    Some(hyper_tls::HttpsConnector::from((http, tls.into())))
}

/// Quotes an identifier with backticks (database names come from configuration).
pub fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('\\', "\\\\").replace('`', "\\`"))
}

/// Quotes a string literal.
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Regression (issue 35): ClickHouse 18.16 answers a query that fails after its first
    // block with HTTP 200, the rows, then the exception as plain text. The client looks
    // for the text of current servers only (`__exception__`, or a last chunk ending in
    // `))\n`), and with validation off the text decoded as rows: a read came back Ok,
    // its tail made up.
    #[tokio::test]
    async fn a_read_that_fails_after_its_first_block_is_an_error_never_rows() {
        let rows: Vec<u8> = [3_600u32, 7_200, 10_800].iter().flat_map(|h| h.to_le_bytes()).collect();
        let text = fake_server::timeout_18_16(4);
        let server = fake_server::serve(move |r| {
            if r.params.get("wait_end_of_query").map(String::as_str) == Some("1") {
                // The whole answer is held until the query ends, so a failure has sent
                // nothing yet: an error status, as 18.16 and current servers answer.
                fake_server::Answer::Error { status: 500, text: text.clone() }
            } else {
                fake_server::Answer::BrokenOff { rows: rows.clone(), text: text.clone() }
            }
        })
        .await;
        let settings = crate::config::ClickHouseSettings {
            url: crate::secrets::SecretUrl::new(server.url.clone()),
            ..Default::default()
        };
        let sink = Sink::new(&settings);
        match sink.touched_since("clicks", 0).await {
            Ok(hours) => panic!("a broken-off answer read as {} hours: {hours:?}", hours.len()),
            Err(e) => {
                assert!(!e.is_fatal(), "a timeout is retried: {e}");
                assert!(e.to_string().contains("Code: 159"), "{e}");
            }
        }
    }

    // Regression (issue 35): a client built after the CA file was rotated away panicked
    // (`clickhouse.tls_ca_file …: No such file`): members build clients after start (the
    // sealer, commands). Now every client takes the copy read when the settings loaded.
    #[test]
    fn a_ca_file_removed_after_the_settings_loaded_does_not_panic_a_client_built_later() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, include_str!("../../tests/fixtures/tls/ca.pem")).unwrap();
        let mut s = crate::config::Settings::default();
        s.clickhouse.url = crate::config::SecretUrl::new("https://127.0.0.1:8443");
        s.clickhouse.tls_ca_file = Some(ca.clone());
        s.validate().expect("valid settings");
        std::fs::remove_file(&ca).unwrap();
        let sink = Sink::new(&s.clickhouse);
        assert_eq!(sink.database(), "clickagg");
    }

    #[test]
    fn the_sealed_hours_migration_creates_every_sealed_table() {
        let created = |file: &str| -> Vec<String> {
            let (_, sql) = MIGRATIONS.iter().find(|(name, _)| *name == file).unwrap();
            schema::statements(sql)
                .iter()
                .map(|s| {
                    s.trim_start_matches("CREATE TABLE IF NOT EXISTS ").split_whitespace().next().unwrap().to_string()
                })
                .collect()
        };
        assert_eq!(created("008_sealed_hours.sql"), [SEALED_HOUR, SEALED_DAY, SEALS, TOUCHED, SEAL_PROGRESS]);
        assert_eq!(created("009_billing_periods.sql"), [CLOSED, CLOSES, ADJUSTMENTS]);
    }

    use proptest::prelude::*;

    proptest! {
        /// Any row of a superseding generation outranks every row of the same batch
        /// written before it (members', replays', earlier generations'), a later cut
        /// outranks an earlier one within a generation, and the version reads back as
        /// the offset and writer it was stored from.
        #[test]
        fn a_supersede_generation_outranks_every_earlier_row_of_its_batch(
            n in 1u64..100_000, batch in 0u64..1_000_000, a in 0u64..100_000, b in 0u64..100_000, g in 1u64..50,
        ) {
            let start = batch * n;
            let (a, b) = (start + a % n, start + b % n);
            let sup = |g: u64| Writer::Supersede { generation: g, batch_offsets: n };
            let mut earlier = vec![Writer::Member, Writer::Replay];
            if g > 1 {
                earlier.push(sup(g - 1));
            }
            for earlier in earlier {
                prop_assert!(stored_version(b as i64, sup(g)) > stored_version(a as i64, earlier));
            }
            if a < b {
                prop_assert!(stored_version(b as i64, sup(g)) > stored_version(a as i64, sup(g)));
            }
            for w in [Writer::Member, Writer::Replay, sup(g)] {
                prop_assert_eq!(read_version(stored_version(a as i64, w), start, n), (a as i64, w));
            }
            prop_assert_eq!(generation_of(stored_version(a as i64, sup(g)), start, n), g);
            prop_assert_eq!(generation_of(stored_version(a as i64, Writer::Member), start, n), 0);
        }
    }

    #[test]
    fn literals_and_identifiers_are_escaped() {
        assert_eq!(quote_literal("a'b\\"), "'a\\'b\\\\'");
        assert_eq!(quote_ident("we`ird"), "`we\\`ird`");
    }
}
