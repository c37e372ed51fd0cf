//! The ClickHouse sink: migrations, the idempotent batch-row insert, the batch-size
//! registry, and the billing reads shared by `verify`, `query` and `reconcile`.
//!
//! The client is configured for every server the project supports: no compression
//! (the Debian 18.16 server's HTTP handler fails on the crate's LZ4 frames and the
//! SELECT comes back empty without an error) and no schema validation (18.16 has no
//! `RowBinaryWithNamesAndTypes`).

use std::collections::BTreeMap;
use std::time::Duration;

use clickhouse::{Client, Compression, Row};
use serde::{Deserialize, Serialize};

use crate::aggregate::{BatchRow, BucketKey, Grain, PinRow};
use crate::click::Minute;
use crate::config::ClickHouseSettings;
use crate::dedup::Pin;

pub const TABLE: &str = "ad_clicks_minute";

/// The DDL in `sql/`, applied in order by `clickagg migrate`.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("001_ad_clicks_minute.sql", include_str!("../sql/001_ad_clicks_minute.sql")),
    ("002_clickagg_topics.sql", include_str!("../sql/002_clickagg_topics.sql")),
    ("003_clickagg_pins.sql", include_str!("../sql/003_clickagg_pins.sql")),
    ("004_ad_clicks_rollups.sql", include_str!("../sql/004_ad_clicks_rollups.sql")),
];

/// The table and time column of each grain.
pub fn table_of(grain: Grain) -> (&'static str, &'static str) {
    match grain {
        Grain::Minute => (TABLE, "minute"),
        Grain::Hour => ("ad_clicks_hour", "hour"),
        Grain::Day => ("ad_clicks_day", "day"),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The server is down, overloaded or timed out: keep the rows and retry.
    #[error("ClickHouse unavailable: {0}")]
    Transient(String),
    /// Retrying cannot help (missing table, wrong password, schema mismatch).
    #[error("ClickHouse refused the request: {0}")]
    Fatal(String),
}

impl SinkError {
    pub fn is_fatal(&self) -> bool {
        matches!(self, SinkError::Fatal(_))
    }
}

/// ClickHouse error codes where a retry cannot succeed until an operator acts.
const FATAL_CODES: &[u32] = &[
    16,  // NO_SUCH_COLUMN_IN_TABLE
    27,  // CANNOT_PARSE_INPUT_ASSERTION_FAILED
    33,  // CANNOT_READ_ALL_DATA (row shape does not match the table)
    47,  // UNKNOWN_IDENTIFIER
    53,  // TYPE_MISMATCH
    60,  // UNKNOWN_TABLE
    62,  // SYNTAX_ERROR
    81,  // UNKNOWN_DATABASE
    164, // READONLY
    192, // UNKNOWN_USER
    193, // WRONG_PASSWORD
    194, // REQUIRED_PASSWORD
    195, // IP_ADDRESS_NOT_ALLOWED
    497, // ACCESS_DENIED
    516, // AUTHENTICATION_FAILED
];

/// The `Code: N` of a ClickHouse exception message, if any.
fn error_code(message: &str) -> Option<u32> {
    let rest = &message[message.find("Code: ")? + 6..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

pub fn classify(e: clickhouse::error::Error) -> SinkError {
    use clickhouse::error::Error as E;
    match e {
        E::BadResponse(msg) => match error_code(&msg) {
            Some(code) if FATAL_CODES.contains(&code) => SinkError::Fatal(msg),
            _ => SinkError::Transient(msg),
        },
        E::Network(_) | E::TimedOut => SinkError::Transient(e.to_string()),
        other => SinkError::Fatal(other.to_string()),
    }
}

/// Who writes a row. Rows of a live member outrank a replay's at the same offset: a
/// replay that read a cross-partition copy before any member did counted it by its own
/// partition's rule, while the member that reads it decides (and pins) which copy
/// counts. Everything else they decide alike, so the rank only settles that race.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Replay = 0,
    Member = 1,
}

/// The stored `version` of a row cut at `offset`: twice the offset, plus the writer's rank.
pub fn stored_version(offset: i64, writer: Writer) -> u64 {
    (offset.max(0) as u64) * 2 + writer as u64
}

/// A row of each table; the time column is named after its grain.
macro_rules! row_out {
    ($name:ident, $time:ident) => {
        #[derive(Row, Serialize)]
        struct $name<'a> {
            ad_id: u64,
            $time: u32,
            topic: &'a str,
            partition: u32,
            batch_start: u64,
            clicks: u64,
            version: u64,
        }

        impl<'a> $name<'a> {
            fn of(r: &BatchRow, topic: &'a str, writer: Writer) -> Self {
                $name {
                    ad_id: r.key.ad_id,
                    $time: r.key.minute.epoch_seconds(),
                    topic,
                    partition: r.partition as u32,
                    batch_start: r.batch_start as u64,
                    clicks: r.clicks,
                    version: stored_version(r.version, writer),
                }
            }
        }
    };
}
row_out!(MinuteOut, minute);
row_out!(HourOut, hour);
row_out!(DayOut, day);

#[derive(Row, Serialize, Deserialize)]
struct PinOut<'a> {
    topic: &'a str,
    partition: u32,
    offset: u64,
    verdict: u8,
}

#[derive(Row, Deserialize)]
struct BillingRow {
    ad_id: u64,
    minute: u32,
    clicks: u64,
}

/// Billing counts per bucket, as read through `FINAL`.
pub type Billing = BTreeMap<BucketKey, u64>;

/// A handle on one ClickHouse database. Cheap to clone.
#[derive(Clone)]
pub struct Sink {
    client: Client,
    server: Client,
    database: String,
    timeout: Duration,
}

impl Sink {
    pub fn new(s: &ClickHouseSettings) -> Sink {
        // Idle connections close before ClickHouse's own 3 s keep-alive timeout does.
        let builder = || {
            let mut b = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
            b.pool_idle_timeout(Duration::from_secs(2));
            b
        };
        let base = match &s.tls_ca_file {
            Some(ca) => Client::with_http_client(builder().build(https_connector_trusting(ca))),
            None if s.url.starts_with("https://") => Client::default(),
            // Plain HTTP needs no TLS connector, whose set-up (loading the system's CA
            // bundle) costs a `clickagg query` about 60 ms of its start-up.
            None => Client::with_http_client(builder().build(hyper_util::client::legacy::connect::HttpConnector::new())),
        };
        let mut server = base
            .with_url(s.url.as_str())
            .with_user(s.user.as_str())
            .with_compression(Compression::None)
            .with_validation(false);
        if let Some(password) = &s.password {
            server = server.with_password(password.expose());
        }
        let client = server.clone().with_database(s.database.as_str());
        Sink { client, server, database: s.database.clone(), timeout: s.request_timeout }
    }

    pub fn database(&self) -> &str {
        &self.database
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

    /// Creates the database and applies every migration; safe to run any number of times.
    pub async fn migrate(&self) -> Result<Vec<&'static str>, SinkError> {
        let create_db = format!("CREATE DATABASE IF NOT EXISTS {}", quote_ident(&self.database));
        self.timed(self.server.query(&create_db).execute()).await?;
        let mut applied = Vec::new();
        for (name, sql) in MIGRATIONS {
            for statement in statements(sql) {
                self.execute(&statement).await?;
            }
            applied.push(*name);
        }
        for grain in [Grain::Hour, Grain::Day] {
            if self.backfill(grain).await? {
                applied.push(match grain {
                    Grain::Hour => "backfill of ad_clicks_hour",
                    _ => "backfill of ad_clicks_day",
                });
            }
        }
        Ok(applied)
    }

    /// Fills an empty roll-up from the minute rows: per batch and hour (or day), the sum
    /// of the batch's latest minute rows, with the latest of their versions. Returns
    /// whether it wrote anything.
    async fn backfill(&self, grain: Grain) -> Result<bool, SinkError> {
        let (table, time) = table_of(grain);
        let count = |t: &str| format!("SELECT count() FROM {t}");
        let empty = self.timed(self.client.query(&count(table)).fetch_one::<u64>()).await? == 0;
        if !empty || self.timed(self.client.query(&count(TABLE)).fetch_one::<u64>()).await? == 0 {
            return Ok(false);
        }
        let start = if grain == Grain::Hour { "toStartOfHour" } else { "toStartOfDay" };
        self.execute(&format!(
            "INSERT INTO {table} (ad_id, {time}, topic, partition, batch_start, clicks, version) \
             SELECT ad_id, {start}(minute) AS {time}, topic, partition, batch_start, sum(clicks), max(version) \
             FROM {TABLE} FINAL GROUP BY ad_id, {time}, topic, partition, batch_start"
        ))
        .await?;
        Ok(true)
    }

    /// Round trip for readiness checks.
    pub async fn ping(&self) -> Result<(), SinkError> {
        self.timed(self.client.query("SELECT 1").fetch_one::<u8>()).await.map(drop)
    }

    /// Records cross-partition decisions. Idempotent: a re-read that makes one again
    /// writes the same row.
    pub async fn insert_pins(&self, topic: &str, pins: &[PinRow]) -> Result<(), SinkError> {
        if pins.is_empty() {
            return Ok(());
        }
        let write = async {
            let mut insert = self.client.insert::<PinOut>("clickagg_pins").await?;
            for p in pins {
                let row =
                    PinOut { topic, partition: p.partition as u32, offset: p.offset as u64, verdict: p.pin as u8 };
                insert.write(&row).await?;
            }
            insert.end().await
        };
        self.timed(write).await
    }

    /// The recorded cross-partition decisions of `partition` in offsets `[from, to]`.
    pub async fn pins(&self, topic: &str, partition: i32, from: i64, to: i64) -> Result<BTreeMap<i64, Pin>, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            offset: u64,
            verdict: u8,
        }
        let rows: Vec<R> = self
            .timed(
                self.client
                    .query(
                        "SELECT offset, any(verdict) AS verdict FROM clickagg_pins \
                         WHERE topic = ? AND partition = ? AND offset >= ? AND offset <= ? GROUP BY offset",
                    )
                    .bind(topic)
                    .bind(partition as u32)
                    .bind(from.max(0) as u64)
                    .bind(to.max(0) as u64)
                    .fetch_all::<R>(),
            )
            .await?;
        Ok(rows.into_iter().filter_map(|r| Some((r.offset as i64, Pin::from_code(r.verdict)?))).collect())
    }

    /// Writes one flush. Idempotent: the rows carry their batch ID and version.
    /// Rows of every grain go to their table: the roll-ups first, the minute rows last,
    /// so that once the minute rows are there, so is everything derived from them.
    pub async fn insert(&self, topic: &str, rows: &[BatchRow], writer: Writer) -> Result<(), SinkError> {
        if rows.is_empty() {
            return Ok(());
        }
        tracing::debug!(rows = rows.len(), "flushing");
        let of = |g: Grain| rows.iter().filter(move |r| r.grain == g);
        let write = async {
            if of(Grain::Day).next().is_some() {
                let mut insert = self.client.insert::<DayOut>(table_of(Grain::Day).0).await?;
                for r in of(Grain::Day) {
                    insert.write(&DayOut::of(r, topic, writer)).await?;
                }
                insert.end().await?;
            }
            if of(Grain::Hour).next().is_some() {
                let mut insert = self.client.insert::<HourOut>(table_of(Grain::Hour).0).await?;
                for r in of(Grain::Hour) {
                    insert.write(&HourOut::of(r, topic, writer)).await?;
                }
                insert.end().await?;
            }
            if of(Grain::Minute).next().is_some() {
                let mut insert = self.client.insert::<MinuteOut>(TABLE).await?;
                for r in of(Grain::Minute) {
                    insert.write(&MinuteOut::of(r, topic, writer)).await?;
                }
                insert.end().await?;
            }
            Ok(())
        };
        self.timed(write).await
    }

    /// Records `batch_offsets` for `topic`, or checks it against the recorded value.
    ///
    /// Two members starting at once with different values must not both pass: each
    /// writes its value first and then reads every registration back, and the earliest
    /// one (ties broken by the smaller value) is the topic's; anyone else refuses.
    pub async fn register_batch_offsets(&self, topic: &str, batch_offsets: u64) -> Result<(), SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            batch_offsets: u64,
        }
        let registered = || async {
            self.timed(
                self.client
                    .query(
                        "SELECT batch_offsets FROM clickagg_topics WHERE topic = ? \
                         ORDER BY registered_at, batch_offsets LIMIT 1",
                    )
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await
        };
        if registered().await?.is_empty() {
            let sql = format!(
                "INSERT INTO clickagg_topics (topic, batch_offsets) VALUES ({}, {batch_offsets})",
                quote_literal(topic)
            );
            self.execute(&sql).await?;
        }
        match registered().await?.first() {
            Some(r) if r.batch_offsets == batch_offsets => Ok(()),
            Some(r) => Err(SinkError::Fatal(format!(
                "topic {topic:?} is aggregated into {}.{TABLE} with batch_offsets = {}; \
                 refusing to use {batch_offsets}: batches cut with another size would overlap the stored ones. \
                 Set pipeline.batch_offsets to the recorded value, or write into a new database.",
                self.database, r.batch_offsets
            ))),
            None => Err(SinkError::Transient(format!("the registration of {topic:?} is not visible yet"))),
        }
    }

    /// The highest batch start stored per partition of `topic`: the guard against a
    /// topic that was deleted and recreated (its offsets restart at 0 and would collide
    /// with old batch IDs).
    pub async fn max_batch_start(&self, topic: &str) -> Result<BTreeMap<i32, i64>, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            partition: u32,
            batch_start: u64,
        }
        let rows: Vec<R> = self
            .timed(
                self.client
                    .query(&format!(
                        "SELECT partition, max(batch_start) AS batch_start FROM {TABLE} WHERE topic = ? GROUP BY partition"
                    ))
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await?;
        Ok(rows.into_iter().map(|r| (r.partition as i32, r.batch_start as i64)).collect())
    }

    /// Billing counts per bucket for `topic` (all topics when `None`) in `[from, to)`.
    pub async fn billing(
        &self,
        topic: Option<&str>,
        from: Option<Minute>,
        to: Option<Minute>,
    ) -> Result<Billing, SinkError> {
        let mut filters = Vec::new();
        if let Some(t) = topic {
            filters.push(format!("topic = {}", quote_literal(t)));
        }
        if let Some(f) = from {
            filters.push(format!("minute >= toDateTime({}, 'UTC')", f.epoch_seconds()));
        }
        if let Some(t) = to {
            filters.push(format!("minute < toDateTime({}, 'UTC')", t.epoch_seconds()));
        }
        let filter = if filters.is_empty() { String::new() } else { format!("WHERE {}", filters.join(" AND ")) };
        let sql = format!(
            "SELECT ad_id, toUInt32(minute) AS minute, sum(clicks) AS clicks \
             FROM {TABLE} FINAL {filter} GROUP BY ad_id, minute"
        );
        let rows: Vec<BillingRow> = self.timed(self.client.query(&sql).fetch_all::<BillingRow>()).await?;
        Ok(rows
            .into_iter()
            .map(|r| (BucketKey { ad_id: r.ad_id, minute: Minute::from_epoch_seconds(r.minute) }, r.clicks))
            .collect())
    }
}

/// An HTTP(S) connector that also trusts the CA in `ca_file` (PEM). The file was checked
/// when the settings were loaded; a certificate that does not parse is fatal here.
fn https_connector_trusting(
    ca_file: &std::path::Path,
) -> hyper_tls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector> {
    use hyper_util::client::legacy::connect::HttpConnector;
    let pem = std::fs::read(ca_file).unwrap_or_else(|e| panic!("clickhouse.tls_ca_file {}: {e}", ca_file.display()));
    let ca = native_tls::Certificate::from_pem(&pem)
        .unwrap_or_else(|e| panic!("clickhouse.tls_ca_file {}: not a PEM certificate: {e}", ca_file.display()));
    let tls = native_tls::TlsConnector::builder()
        .add_root_certificate(ca)
        .build()
        .expect("a TLS connector with one extra root certificate");
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(Duration::from_secs(60)));
    hyper_tls::HttpsConnector::from((http, tls.into()))
}

/// Splits a migration file into statements (`;` at the end of a line ends one).
fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in sql.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--") || trimmed.is_empty() {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if trimmed.ends_with(';') {
            out.push(current.trim().trim_end_matches(';').to_string());
            current.clear();
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_string());
    }
    out
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

    #[test]
    fn error_codes_decide_retry_or_stop() {
        let fatal = clickhouse::error::Error::BadResponse(
            "Code: 60, e.displayText() = DB::Exception: Table x doesn't exist".into(),
        );
        assert!(classify(fatal).is_fatal());
        let busy =
            clickhouse::error::Error::BadResponse("Code: 202. DB::Exception: Too many simultaneous queries".into());
        assert!(!classify(busy).is_fatal());
        assert!(!classify(clickhouse::error::Error::TimedOut).is_fatal());
    }

    #[test]
    fn every_grain_has_its_table() {
        let tables: Vec<&str> = Grain::ALL.iter().map(|&g| table_of(g).0).collect();
        assert_eq!(tables, ["ad_clicks_minute", "ad_clicks_hour", "ad_clicks_day"]);
        assert_eq!(statements(MIGRATIONS[3].1).len(), 2);
    }

    #[test]
    fn migrations_split_into_statements_without_comments() {
        let s = statements(MIGRATIONS[0].1);
        assert_eq!(s.len(), 1);
        assert!(s[0].starts_with("CREATE TABLE IF NOT EXISTS ad_clicks_minute"));
        assert!(!s[0].ends_with(';'));
    }

    #[test]
    fn literals_and_identifiers_are_escaped() {
        assert_eq!(quote_literal("a'b\\"), "'a\\'b\\\\'");
        assert_eq!(quote_ident("we`ird"), "`we\\`ird`");
    }
}
