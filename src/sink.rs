//! The ClickHouse sink: migrations, the idempotent batch-row insert, the batch-size
//! registry, and the billing reads shared by `verify`, `query` and `reconcile`.
//!
//! The client is configured for every server the project supports: no compression
//! (the Debian 18.16 server's HTTP handler fails on the crate's LZ4 frames and the
//! SELECT comes back empty without an error) and no schema validation (18.16 has no
//! `RowBinaryWithNamesAndTypes`).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use clickhouse::{Client, Compression, Row};
use serde::{Deserialize, Serialize};

use crate::aggregate::{BatchRow, BucketKey, Grain, PinRow};
use crate::click::Minute;
use crate::config::ClickHouseSettings;
use crate::dedup::{Checkpoint, PartitionClock, Pin};

pub const TABLE: &str = "ad_clicks_minute";

/// The DDL in `sql/`, applied in order by `clickagg migrate`.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("001_ad_clicks_minute.sql", include_str!("../sql/001_ad_clicks_minute.sql")),
    ("002_clickagg_topics.sql", include_str!("../sql/002_clickagg_topics.sql")),
    ("003_clickagg_pins.sql", include_str!("../sql/003_clickagg_pins.sql")),
    ("004_ad_clicks_rollups.sql", include_str!("../sql/004_ad_clicks_rollups.sql")),
    ("005_clickagg_backfills.sql", include_str!("../sql/005_clickagg_backfills.sql")),
    ("006_clickagg_clocks.sql", include_str!("../sql/006_clickagg_clocks.sql")),
    ("007_clickagg_settings.sql", include_str!("../sql/007_clickagg_settings.sql")),
];

/// On a ClickHouse cluster, how the rows of each table the migrations create are spread
/// over the shards (the `Distributed` table's sharding key). Billing reads `FINAL` per
/// shard and sums across shards, so every version of a row and every row of one (ad,
/// time bucket) must land on the same shard: all of them share the `ad_id`. The pins
/// of a partition stay together for its reads; a topic's batch-size registrations on one
/// shard make the earliest one visible to every member that reads them.
pub const SHARDING: &[(&str, &str)] = &[
    (TABLE, "cityHash64(ad_id)"),
    ("ad_clicks_hour", "cityHash64(ad_id)"),
    ("ad_clicks_day", "cityHash64(ad_id)"),
    ("clickagg_pins", "cityHash64(topic, partition)"),
    ("clickagg_topics", "cityHash64(topic)"),
    ("clickagg_backfills", "cityHash64(name)"),
    ("clickagg_clocks", "cityHash64(topic, partition)"),
    ("clickagg_settings", "cityHash64(topic)"),
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

impl crate::retry::Retryable for SinkError {
    fn is_fatal(&self) -> bool {
        SinkError::is_fatal(self)
    }
}

impl SinkError {
    pub fn is_fatal(&self) -> bool {
        matches!(self, SinkError::Fatal(_))
    }
}

/// What to do about a ClickHouse error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The server is down, overloaded, or behind on merges or replication: the same
    /// request succeeds later. The flush keeps its rows and retries with backoff;
    /// consumption pauses at `pipeline.max_unflushed_buckets`; nothing is committed.
    Transient,
    /// The same request fails the same way until an operator changes something: the
    /// member stops with the server's message and this advice.
    Fatal(&'static str),
}

const SCHEMA: &str = "the tables do not match this clickagg: run `clickagg migrate` on clickhouse.database";
const MISSING: &str = "run `clickagg migrate`, or check clickhouse.database";
const CREDENTIALS: &str = "check clickhouse.user and clickhouse.password, or the credentials in clickhouse.url";
const GRANTS: &str =
    "grant clickhouse.user SELECT, INSERT and CREATE on clickhouse.database in a profile that is not readonly";
const LIMITS: &str = "a limit in clickhouse.user's settings profile refuses this request every time: raise it";
const SERVER: &str = "the server cannot run this request: see its log";
/// The policy for a code missing from [`CODES`].
const UNCLASSIFIED: &str = "clickagg does not know this error code to be temporary, so it stops rather than retry \
     the request forever; a restart resumes from the last commit without losing or double-counting a click";

/// Every ClickHouse error code clickagg's requests (row and pin INSERTs, billing and
/// registry SELECTs, the migrations) can meet, and what to do about it. One table, so
/// that no error is retried forever by accident: a code that is not listed is fatal
/// ([`UNCLASSIFIED`]). Transient means an outage of the server, not of clickagg's
/// request; codes that depend on the request (a setting's limit, the data, the
/// schema) are fatal.
pub const CODES: &[(u32, &str, Class)] = &[
    (6, "CANNOT_PARSE_TEXT", Class::Fatal(SCHEMA)),
    (8, "THERE_IS_NO_COLUMN", Class::Fatal(SCHEMA)),
    (10, "NOT_FOUND_COLUMN_IN_BLOCK", Class::Fatal(SCHEMA)),
    (16, "NO_SUCH_COLUMN_IN_TABLE", Class::Fatal(SCHEMA)),
    (20, "NUMBER_OF_COLUMNS_DOESNT_MATCH", Class::Fatal(SCHEMA)),
    (27, "CANNOT_PARSE_INPUT_ASSERTION_FAILED", Class::Fatal(SCHEMA)),
    (33, "CANNOT_READ_ALL_DATA", Class::Fatal(SCHEMA)),
    (43, "ILLEGAL_TYPE_OF_ARGUMENT", Class::Fatal(SCHEMA)),
    (44, "ILLEGAL_COLUMN", Class::Fatal(SCHEMA)),
    (46, "UNKNOWN_FUNCTION", Class::Fatal(SERVER)),
    (47, "UNKNOWN_IDENTIFIER", Class::Fatal(SCHEMA)),
    (48, "NOT_IMPLEMENTED", Class::Fatal(SERVER)),
    (49, "LOGICAL_ERROR", Class::Fatal(SERVER)),
    (53, "TYPE_MISMATCH", Class::Fatal(SCHEMA)),
    (60, "UNKNOWN_TABLE", Class::Fatal(MISSING)),
    (62, "SYNTAX_ERROR", Class::Fatal(SERVER)),
    (73, "UNKNOWN_FORMAT", Class::Fatal(SERVER)),
    (81, "UNKNOWN_DATABASE", Class::Fatal(MISSING)),
    (115, "UNKNOWN_SETTING", Class::Fatal(SERVER)),
    (117, "INCORRECT_DATA", Class::Fatal(SCHEMA)),
    (158, "TOO_MANY_ROWS", Class::Fatal(LIMITS)),
    (159, "TIMEOUT_EXCEEDED", Class::Transient),
    (160, "TOO_SLOW", Class::Transient),
    (164, "READONLY", Class::Fatal(GRANTS)),
    (192, "UNKNOWN_USER", Class::Fatal(CREDENTIALS)),
    (193, "WRONG_PASSWORD", Class::Fatal(CREDENTIALS)),
    (194, "REQUIRED_PASSWORD", Class::Fatal(CREDENTIALS)),
    (195, "IP_ADDRESS_NOT_ALLOWED", Class::Fatal(CREDENTIALS)),
    (201, "QUOTA_EXPIRED", Class::Transient),
    (202, "TOO_MANY_SIMULTANEOUS_QUERIES", Class::Transient),
    (203, "NO_FREE_CONNECTION", Class::Transient),
    (209, "SOCKET_TIMEOUT", Class::Transient),
    (210, "NETWORK_ERROR", Class::Transient),
    (225, "NO_ZOOKEEPER", Class::Transient),
    (236, "ABORTED", Class::Transient),
    (241, "MEMORY_LIMIT_EXCEEDED", Class::Transient),
    (242, "TABLE_IS_READ_ONLY", Class::Transient),
    (243, "NOT_ENOUGH_SPACE", Class::Transient),
    // Also "too many partitions for single INSERT block", which is fatal: see classify.
    (252, "TOO_MANY_PARTS", Class::Transient),
    (279, "ALL_CONNECTION_TRIES_FAILED", Class::Transient),
    (285, "TOO_FEW_LIVE_REPLICAS", Class::Transient),
    (286, "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE", Class::Transient),
    (290, "LIMIT_EXCEEDED", Class::Fatal(LIMITS)),
    (291, "DATABASE_ACCESS_DENIED", Class::Fatal(GRANTS)),
    (307, "TOO_MANY_BYTES", Class::Fatal(LIMITS)),
    (319, "UNKNOWN_STATUS_OF_INSERT", Class::Transient),
    (364, "RECEIVED_ERROR_TOO_MANY_REQUESTS", Class::Transient),
    (373, "SESSION_IS_LOCKED", Class::Transient),
    (384, "PART_IS_TEMPORARILY_LOCKED", Class::Transient),
    (394, "QUERY_WAS_CANCELLED", Class::Transient),
    (396, "TOO_MANY_ROWS_OR_BYTES", Class::Fatal(LIMITS)),
    (439, "CANNOT_SCHEDULE_TASK", Class::Transient),
    (473, "DEADLOCK_AVOIDED", Class::Transient),
    (497, "ACCESS_DENIED", Class::Fatal(GRANTS)),
    (516, "AUTHENTICATION_FAILED", Class::Fatal(CREDENTIALS)),
    (999, "KEEPER_EXCEPTION", Class::Transient),
    (1000, "POCO_EXCEPTION", Class::Transient),
];

/// The class of `code` by [`CODES`]; an unlisted code is fatal.
pub fn class_of(code: u32) -> Class {
    CODES.iter().find(|(c, _, _)| *c == code).map_or(Class::Fatal(UNCLASSIFIED), |&(_, _, class)| class)
}

/// What a proxy or load balancer in front of ClickHouse says while the server is away;
/// any other answer without a ClickHouse error code means clickhouse.url is wrong.
const TRANSIENT_HTTP: &[&str] = &["Too Many Requests", "Bad Gateway", "Service Unavailable", "Gateway Timeout"];

/// The `Code: N` of a ClickHouse exception message, if any.
fn error_code(message: &str) -> Option<u32> {
    let rest = &message[message.find("Code: ")? + 6..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Retry or stop, by [`CODES`].
pub fn classify(e: clickhouse::error::Error) -> SinkError {
    use clickhouse::error::Error as E;
    let fatal = |msg: String, fix: &str| SinkError::Fatal(format!("{msg} ({fix})"));
    match e {
        E::BadResponse(msg) => match error_code(&msg) {
            None if TRANSIENT_HTTP.iter().any(|t| msg.contains(t)) => SinkError::Transient(msg),
            None => fatal(msg, "not an answer from ClickHouse: check clickhouse.url"),
            // TOO_MANY_PARTS has two meanings: merges behind (they catch up), or one
            // INSERT over more partitions than the server's setting allows, which fails
            // every time. clickagg keeps to 100, the setting's default.
            Some(252) if msg.contains("Too many partitions for single INSERT block") => fatal(
                msg,
                "clickagg writes up to 100 months per INSERT: set max_partitions_per_insert_block to 100 \
                 or more in clickhouse.user's settings profile",
            ),
            // A cluster node that died mid-request: the node clickagg talks to reports
            // the lost connection with the code of the read that failed (32
            // ATTEMPT_TO_READ_AFTER_EOF, 33 CANNOT_READ_ALL_DATA, …) and names the node
            // it was receiving from. An outage of that node, not a fault of the request;
            // the insert is idempotent, so repeating it is safe.
            Some(_) if msg.contains("while receiving packet from") => SinkError::Transient(msg),
            Some(code) => match class_of(code) {
                Class::Transient => SinkError::Transient(msg),
                Class::Fatal(fix) => fatal(msg, fix),
            },
        },
        E::Network(_) | E::TimedOut => SinkError::Transient(e.to_string()),
        // The client cannot build the request or read the answer: the same next time.
        other => fatal(other.to_string(), SERVER),
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

#[derive(Row, Serialize)]
struct ClockRow<'a> {
    topic: &'a str,
    partition: u32,
    boundary: u64,
    clock: u32,
    has_clock: u8,
    pending: u32,
    has_pending: u8,
}

impl<'a> ClockRow<'a> {
    fn of(topic: &'a str, c: &Checkpoint) -> ClockRow<'a> {
        ClockRow {
            topic,
            partition: c.partition as u32,
            boundary: c.boundary as u64,
            clock: c.clock.get().unwrap_or(0),
            has_clock: u8::from(c.clock.get().is_some()),
            pending: c.clock.pending().unwrap_or(0),
            has_pending: u8::from(c.clock.pending().is_some()),
        }
    }
}

#[derive(Row, Deserialize)]
struct ClockIn {
    #[allow(dead_code)] // selected so the row reads the same as it is written
    partition: u32,
    boundary: u64,
    clock: u32,
    has_clock: u8,
    pending: u32,
    has_pending: u8,
}

impl ClockIn {
    fn checkpoint(self) -> (i64, PartitionClock) {
        let clock = PartitionClock::from_parts(
            (self.has_clock == 1).then_some(self.clock),
            (self.has_pending == 1).then_some(self.pending),
        );
        (self.boundary as i64, clock)
    }
}

#[derive(Row, Deserialize)]
struct BillingRow {
    ad_id: u64,
    minute: u32,
    clicks: u64,
}

/// The last durable flush of a partition, as its rows show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastFlush {
    /// The highest offset read when a row of the partition was cut: everything up to it
    /// is durable (a later record that changed no count leaves no row).
    pub through_offset: i64,
    /// When that flush's rows were written, server time (Unix s).
    pub written_at: u32,
}

/// One recorded settings version of a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesVersion {
    pub version: u32,
    pub rules: crate::dedup::Rules,
    /// Per partition, the first offset decided under this version (a batch boundary);
    /// version 1 holds from the start of every partition.
    pub effective: BTreeMap<i32, i64>,
    /// The Kafka topic's ID when this version was recorded.
    pub topic_id: Option<String>,
}

/// The settings versions of a topic, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RulesHistory {
    pub versions: Vec<RulesVersion>,
    /// How old (server seconds) the first registration is.
    pub first_age_secs: Option<i64>,
}

impl RulesHistory {
    pub fn latest(&self) -> Option<&RulesVersion> {
        self.versions.last()
    }

    /// The version that decides `offset` of `partition`.
    pub fn at(&self, partition: i32, offset: i64) -> Option<&RulesVersion> {
        self.versions.iter().rev().find(|v| v.version == 1 || v.effective.get(&partition).is_none_or(|&e| offset >= e))
    }

    /// Where the latest version starts deciding `partition` (0: from the start).
    pub fn latest_from(&self, partition: i32) -> i64 {
        self.latest().filter(|v| v.version > 1).and_then(|v| v.effective.get(&partition).copied()).unwrap_or(0)
    }
}

/// Billing counts per bucket, as read through `FINAL`.
pub type Billing = BTreeMap<BucketKey, u64>;

/// How old (server seconds) the earliest batch-size registration must be before a
/// member decides on it: registrations have whole-second times, so one written in the
/// same second by a racing member is visible a second later, plus a second for its
/// insert to complete.
pub const REGISTRATION_SETTLE_SECS: i64 = 2;

/// A handle on one ClickHouse database. Cheap to clone.
#[derive(Clone)]
pub struct Sink {
    client: Client,
    server: Client,
    database: String,
    timeout: Duration,
    /// The cluster the tables live on (`clickhouse.cluster`), for the DDL.
    cluster: Option<String>,
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
        let base = match &s.tls_ca_file {
            Some(ca) => Client::with_http_client(builder().build(https_connector_trusting(ca))),
            None if endpoint.url.starts_with("https://") => Client::default(),
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
            .with_validation(false);
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
        Sink { client, server, database: s.database.clone(), timeout: s.request_timeout, cluster: s.cluster.clone() }
    }

    /// The cluster the tables live on, if any.
    pub fn cluster(&self) -> Option<&str> {
        self.cluster.as_deref()
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
    /// On a cluster (`clickhouse.cluster`) every table is created `ON CLUSTER`: a
    /// replicated table `<name>_local` on every node and a `Distributed` table `<name>`
    /// over them, which everything else reads and writes ([`cluster_statements`]).
    pub async fn migrate(&self) -> Result<Vec<&'static str>, SinkError> {
        let on_cluster = self.cluster.as_deref().map(|c| format!(" ON CLUSTER {}", quote_ident(c))).unwrap_or_default();
        let create_db = format!("CREATE DATABASE IF NOT EXISTS {}{on_cluster}", quote_ident(&self.database));
        self.timed(self.server.query(&create_db).execute()).await?;
        let mut applied = Vec::new();
        for (name, sql) in MIGRATIONS {
            for statement in statements(sql) {
                match &self.cluster {
                    None => self.execute(&statement).await?,
                    Some(cluster) => {
                        let forms = cluster_statements(&statement, &self.database, cluster)
                            .map_err(|e| SinkError::Fatal(format!("migration {name}: {e}")))?;
                        for statement in forms {
                            self.execute(&statement).await?;
                        }
                    }
                }
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

    /// Fills a roll-up from the minute rows written before it existed, once (recorded
    /// in `clickagg_backfills`): per batch and hour (or day), the sum of the batch's
    /// latest minute rows, with the latest of their versions — the row the flush itself
    /// writes for that batch and hour, so rows the flush already wrote are replaced by
    /// equal ones, and an interrupted backfill is simply run again. Returns whether it
    /// wrote anything.
    async fn backfill(&self, grain: Grain) -> Result<bool, SinkError> {
        let (table, time) = table_of(grain);
        let done = format!("SELECT count() FROM clickagg_backfills FINAL WHERE name = '{table}'");
        if self.timed(self.client.query(&done).fetch_one::<u64>()).await? > 0 {
            return Ok(false);
        }
        let minute_rows = format!("SELECT count() FROM {TABLE}");
        let wrote = self.timed(self.client.query(&minute_rows).fetch_one::<u64>()).await? > 0;
        if wrote {
            tracing::info!(table, "backfilling from the minute rows (minutes for a large table)");
            let start = if grain == Grain::Hour { "toStartOfHour" } else { "toStartOfDay" };
            let fill = format!(
                "INSERT INTO {table} (ad_id, {time}, topic, partition, batch_start, clicks, version) \
                 SELECT ad_id, {start}(minute) AS {time}, topic, partition, batch_start, sum(clicks), max(version) \
                 FROM {TABLE} FINAL GROUP BY ad_id, {time}, topic, partition, batch_start"
            );
            // Not bounded by clickhouse.timeout: it reads every minute row once.
            self.client.query(&fill).execute().await.map_err(classify)?;
        }
        self.execute(&format!("INSERT INTO clickagg_backfills (name) VALUES ('{table}')")).await?;
        Ok(wrote)
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

    /// Records partition clocks at batch boundaries. Idempotent: every reader that
    /// crosses a boundary computes the same clock there.
    pub async fn insert_clocks(&self, topic: &str, clocks: &[Checkpoint]) -> Result<(), SinkError> {
        if clocks.is_empty() {
            return Ok(());
        }
        let write = async {
            let mut insert = self.client.insert::<ClockRow>("clickagg_clocks").await?;
            for c in clocks {
                insert.write(&ClockRow::of(topic, c)).await?;
            }
            insert.end().await
        };
        self.timed(write).await
    }

    /// The recorded clock at the highest boundary of `partition` in `[low, at]`.
    pub async fn clock_at_or_below(
        &self,
        topic: &str,
        partition: i32,
        low: i64,
        at: i64,
    ) -> Result<Option<(i64, PartitionClock)>, SinkError> {
        self.checkpoint(topic, partition, low, at, None).await
    }

    /// The recorded clock at the highest boundary of `partition` in `[low, at]` before
    /// which every record's time lies below `below` (a lookback: nothing before it can
    /// matter to decisions at or after `below` + the window).
    pub async fn clock_before_time(
        &self,
        topic: &str,
        partition: i32,
        low: i64,
        at: i64,
        below: u32,
    ) -> Result<Option<(i64, PartitionClock)>, SinkError> {
        self.checkpoint(topic, partition, low, at, Some(below)).await
    }

    async fn checkpoint(
        &self,
        topic: &str,
        partition: i32,
        low: i64,
        at: i64,
        below: Option<u32>,
    ) -> Result<Option<(i64, PartitionClock)>, SinkError> {
        if at < low.max(0) {
            return Ok(None);
        }
        let time = if below.is_some() { "AND (has_clock = 0 OR clock < ?)" } else { "" };
        let sql = format!(
            "SELECT partition, boundary, clock, has_clock, pending, has_pending FROM clickagg_clocks \
             WHERE topic = ? AND partition = ? AND boundary >= ? AND boundary <= ? {time} \
             ORDER BY boundary DESC LIMIT 1"
        );
        let mut q = self.client.query(&sql).bind(topic).bind(partition as u32).bind(low.max(0) as u64).bind(at as u64);
        if let Some(b) = below {
            q = q.bind(b);
        }
        let rows: Vec<ClockIn> = self.timed(q.fetch_all::<ClockIn>()).await?;
        Ok(rows.into_iter().next().map(|r| r.checkpoint()))
    }

    /// Writes one flush. Idempotent: the rows carry their batch ID and version.
    /// Rows of every grain go to their table: the roll-ups first, the minute rows last,
    /// so that once the minute rows are there, so is everything derived from them.
    pub async fn insert(&self, topic: &str, rows: &[BatchRow], writer: Writer) -> Result<(), SinkError> {
        // One INSERT per table and per block of at most MAX_MONTHS_PER_INSERT months.
        macro_rules! write {
            ($out:ident, $table:expr, $block:expr) => {
                self.timed(async {
                    let mut insert = self.client.insert::<$out>($table).await?;
                    for r in $block {
                        insert.write(&$out::of(r, topic, writer)).await?;
                    }
                    insert.end().await
                })
                .await?
            };
        }
        tracing::debug!(rows = rows.len(), "flushing");
        for grain in [Grain::Day, Grain::Hour, Grain::Minute] {
            for block in insert_blocks(rows.iter().filter(|r| r.grain == grain)) {
                match grain {
                    Grain::Day => write!(DayOut, table_of(grain).0, block),
                    Grain::Hour => write!(HourOut, table_of(grain).0, block),
                    Grain::Minute => write!(MinuteOut, TABLE, block),
                }
            }
        }
        Ok(())
    }

    /// Records `batch_offsets` for `topic`, or checks it against the recorded value.
    ///
    /// Two members starting at once with different values must not both pass: each
    /// writes its value first (when it finds none) and then reads every registration
    /// back, and the earliest one (ties broken by the smaller value) is the topic's;
    /// anyone else refuses. The earliest is decided only once it is
    /// [`REGISTRATION_SETTLE_SECS`] old by the server's clock: a racing member's write
    /// that sorts before it (the same second, a smaller value) has landed by then. Read
    /// at once, a member could pass on its own row alone and the racer on its smaller one.
    pub async fn register_batch_offsets(&self, topic: &str, batch_offsets: u64) -> Result<(), SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            batch_offsets: u64,
            age_secs: i64,
        }
        let registered = || async {
            self.timed(
                self.client
                    .query(
                        "SELECT batch_offsets, toInt64(now()) - toInt64(registered_at) AS age_secs \
                         FROM clickagg_topics WHERE topic = ? ORDER BY registered_at, batch_offsets LIMIT 1",
                    )
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await
        };
        let mut first = registered().await?.into_iter().next();
        if first.is_none() {
            let sql = format!(
                "INSERT INTO clickagg_topics (topic, batch_offsets) VALUES ({}, {batch_offsets})",
                quote_literal(topic)
            );
            self.execute(&sql).await?;
            first = registered().await?.into_iter().next();
        }
        while let Some(r) = first.as_ref().filter(|r| r.age_secs < REGISTRATION_SETTLE_SECS) {
            let wait = (REGISTRATION_SETTLE_SECS - r.age_secs.max(0)) as u64;
            tokio::time::sleep(Duration::from_secs(wait)).await;
            first = registered().await?.into_iter().next();
        }
        match first {
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

    /// The settings versions recorded for `topic`, oldest first ([`RulesHistory`]); when
    /// none is recorded yet, `ours` becomes version 1 (with the topic's ID). Members
    /// racing on a new topic all read the same winner: the earliest registration (ties:
    /// the smaller JSON), decided once it is [`REGISTRATION_SETTLE_SECS`] old.
    pub async fn register_rules(
        &self,
        topic: &str,
        ours: &crate::dedup::Rules,
        topic_id: Option<&str>,
    ) -> Result<RulesHistory, SinkError> {
        let mut history = self.rules_history(topic).await?;
        if history.versions.is_empty() {
            self.record_rules(topic, 1, ours, &BTreeMap::new(), topic_id.unwrap_or_default()).await?;
            history = self.rules_history(topic).await?;
        }
        while let Some(age) = history.first_age_secs.filter(|&a| a < REGISTRATION_SETTLE_SECS) {
            tokio::time::sleep(Duration::from_secs((REGISTRATION_SETTLE_SECS - age.max(0)) as u64)).await;
            history = self.rules_history(topic).await?;
        }
        if history.versions.is_empty() {
            return Err(SinkError::Transient(format!("the settings registration of {topic:?} is not visible yet")));
        }
        Ok(history)
    }

    /// Records a settings version of `topic`.
    pub async fn record_rules(
        &self,
        topic: &str,
        version: u32,
        rules: &crate::dedup::Rules,
        effective: &BTreeMap<i32, i64>,
        topic_id: &str,
    ) -> Result<(), SinkError> {
        let rules = serde_json::to_string(rules).expect("rules serialize");
        let effective = serde_json::to_string(effective).expect("offsets serialize");
        let sql = "INSERT INTO clickagg_settings (topic, version, rules, effective, topic_id) VALUES (?, ?, ?, ?, ?)";
        self.timed(
            self.client.query(sql).bind(topic).bind(version).bind(rules).bind(effective).bind(topic_id).execute(),
        )
        .await
    }

    /// The Kafka ID recorded for `topic` (a settings row of version 0), if any.
    pub async fn recorded_topic_id(&self, topic: &str) -> Result<Option<String>, SinkError> {
        let ids: Vec<String> = self
            .timed(
                self.client
                    .query(
                        "SELECT topic_id FROM clickagg_settings WHERE topic = ? AND topic_id != '' \
                         ORDER BY registered_at, topic_id LIMIT 1",
                    )
                    .bind(topic)
                    .fetch_all::<String>(),
            )
            .await?;
        Ok(ids.into_iter().next())
    }

    /// Records the Kafka ID of `topic` (as a settings row of version 0, which holds no
    /// settings).
    pub async fn record_topic_id(&self, topic: &str, id: &str) -> Result<(), SinkError> {
        let sql =
            "INSERT INTO clickagg_settings (topic, version, rules, effective, topic_id) VALUES (?, 0, '', '{}', ?)";
        self.timed(self.client.query(sql).bind(topic).bind(id).execute()).await
    }

    /// Every settings version recorded for `topic`; of racing registrations of one
    /// version, the earliest (ties: the smaller JSON).
    pub async fn rules_history(&self, topic: &str) -> Result<RulesHistory, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            version: u32,
            rules: String,
            effective: String,
            topic_id: String,
            age_secs: i64,
        }
        let rows: Vec<R> = self
            .timed(
                self.client
                    .query(
                        "SELECT version, rules, effective, topic_id, toInt64(now()) - toInt64(registered_at) AS age_secs \
                         FROM clickagg_settings WHERE topic = ? AND version > 0 ORDER BY version, registered_at, rules",
                    )
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await?;
        let mut history = RulesHistory::default();
        for r in rows {
            if history.versions.last().is_some_and(|v| v.version == r.version) {
                continue;
            }
            let bad = |what: &str, e: serde_json::Error| {
                SinkError::Fatal(format!(
                    "clickagg_settings of {topic:?}, version {}: unreadable {what}: {e}",
                    r.version
                ))
            };
            history.first_age_secs.get_or_insert(r.age_secs);
            history.versions.push(RulesVersion {
                version: r.version,
                rules: serde_json::from_str(&r.rules).map_err(|e| bad("rules", e))?,
                effective: serde_json::from_str(&r.effective).map_err(|e| bad("offsets", e))?,
                topic_id: Some(r.topic_id).filter(|id| !id.is_empty()),
            });
        }
        Ok(history)
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

    /// Per partition of `topic`, the last durable flush: the highest offset its rows
    /// cover and when they were written (server time, Unix s); with the server's clock.
    ///
    /// Read from the daily roll-up: every flush writes it with the same versions as the
    /// minute rows (at most one row per ad, day and batch, so far fewer to scan).
    pub async fn last_flushes(&self, topic: &str) -> Result<(BTreeMap<i32, LastFlush>, u32), SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            partition: u32,
            version: u64,
            written_at: u32,
        }
        #[derive(Row, Deserialize)]
        struct Now {
            now: u32,
        }
        let (day, _) = table_of(Grain::Day);
        let sql = format!(
            "SELECT partition, max(version) AS version, toUInt32(max(written_at)) AS written_at \
             FROM {day} WHERE topic = ? GROUP BY partition"
        );
        let rows: Vec<R> = self.timed(self.client.query(&sql).bind(topic).fetch_all::<R>()).await?;
        let now = self.timed(self.client.query("SELECT toUInt32(now()) AS now").fetch_one::<Now>()).await?;
        let flushes = rows
            .into_iter()
            .map(|r| {
                // The inverse of `stored_version`: the rank is the low bit.
                let last = LastFlush { through_offset: (r.version / 2) as i64, written_at: r.written_at };
                (r.partition as i32, last)
            })
            .collect();
        Ok((flushes, now.now))
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

/// The most `toYYYYMM(minute)` partitions of the table one INSERT may write: current
/// ClickHouse refuses a block over more (`max_partitions_per_insert_block`, default
/// 100) with code 252, whatever the retry.
pub const MAX_MONTHS_PER_INSERT: usize = 100;

/// `toYYYYMM(minute)`: the table's partition of a row.
fn year_month(minute: Minute) -> u32 {
    use chrono::Datelike;
    let t = chrono::DateTime::from_timestamp(i64::from(minute.epoch_seconds()), 0)
        .expect("u32 seconds are always a valid timestamp");
    t.year() as u32 * 100 + t.month()
}

/// The INSERT blocks of one flush: each holds the rows of at most
/// [`MAX_MONTHS_PER_INSERT`] months, in flush order; months are taken in the order
/// their first row appears. A flush within 100 months stays one INSERT.
///
/// Writing a flush in several INSERTs keeps it idempotent: every row carries its batch
/// ID and version, so a retry after a failure between blocks writes the blocks already
/// written again, harmlessly, and nothing is committed until all are written.
fn insert_blocks<'a>(rows: impl IntoIterator<Item = &'a BatchRow>) -> Vec<Vec<&'a BatchRow>> {
    let mut blocks: Vec<Vec<&BatchRow>> = Vec::new();
    let mut block_of_month: HashMap<u32, usize> = HashMap::new();
    let mut months_in_last_block = 0;
    for r in rows {
        let month = year_month(r.key.minute);
        let block = match block_of_month.get(&month) {
            Some(&b) => b,
            None => {
                if blocks.is_empty() || months_in_last_block == MAX_MONTHS_PER_INSERT {
                    blocks.push(Vec::new());
                    months_in_last_block = 0;
                }
                months_in_last_block += 1;
                block_of_month.insert(month, blocks.len() - 1);
                blocks.len() - 1
            }
        };
        blocks[block].push(r);
    }
    blocks
}

/// The cluster form of one migration statement: a `CREATE TABLE IF NOT EXISTS <t> (…)
/// ENGINE = <E>(<args>) …` becomes, `ON CLUSTER cluster`, the replicated table
/// `<t>_local` (engine `Replicated<E>` keeping its arguments, its data in ZooKeeper under
/// `/clickhouse/tables/{shard}/<database>/<t>_local`, one replica per node `{replica}`:
/// the cluster's macros) and the `Distributed` table `<t>` over it, sharded by
/// [`SHARDING`]. The columns, sorting key and partitioning stay those of the single-node
/// file, so the two forms cannot drift apart. Any other statement has no cluster form.
pub fn cluster_statements(statement: &str, database: &str, cluster: &str) -> Result<Vec<String>, String> {
    let rest = statement
        .strip_prefix("CREATE TABLE IF NOT EXISTS ")
        .ok_or_else(|| format!("only CREATE TABLE IF NOT EXISTS has a cluster form, not {:.40}…", statement))?;
    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    let columns_and_engine = &rest[name.len()..];
    let at = columns_and_engine.find("ENGINE = ").ok_or_else(|| format!("table {name} has no ENGINE = clause"))?;
    let (columns, engine_clause) = columns_and_engine.split_at(at);
    let engine_clause = &engine_clause["ENGINE = ".len()..];
    let engine_end = engine_clause.find(char::is_whitespace).unwrap_or(engine_clause.len());
    let (engine, settings) = engine_clause.split_at(engine_end);
    let (engine_name, args) = match engine.split_once('(') {
        Some((n, a)) => (n, a.trim_end_matches(')')),
        None => (engine, ""),
    };
    if !engine_name.ends_with("MergeTree") {
        return Err(format!("table {name} has engine {engine_name}, which has no replicated form"));
    }
    let key = SHARDING
        .iter()
        .find(|(t, _)| *t == name)
        .map(|(_, k)| *k)
        .ok_or_else(|| format!("table {name} has no sharding key in sink::SHARDING"))?;
    let local = format!("{name}_local");
    let (db, on) = (quote_ident(database), format!("ON CLUSTER {}", quote_ident(cluster)));
    let zk_path = quote_literal(&format!("/clickhouse/tables/{{shard}}/{database}/{local}"));
    let args = if args.is_empty() { String::new() } else { format!(", {args}") };
    Ok(vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {db}.{local} {on}{columns}ENGINE = Replicated{engine_name}({zk_path}, '{{replica}}'{args}){settings}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {db}.{name} {on} AS {db}.{local} ENGINE = Distributed({}, {db}, {local}, {key})",
            quote_ident(cluster)
        ),
    ])
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

    fn row(ad_id: u64, minute: Minute) -> BatchRow {
        BatchRow {
            key: BucketKey { ad_id, minute },
            grain: Grain::Minute,
            partition: 0,
            batch_start: 0,
            clicks: 1,
            version: 0,
        }
    }

    /// The first minute of the `n`th month after January 2000 (UTC).
    fn month(n: u32) -> Minute {
        let start = chrono::NaiveDate::from_ymd_opt(2000 + (n / 12) as i32, n % 12 + 1, 1).unwrap();
        Minute::from_epoch_seconds(start.and_hms_opt(0, 0, 0).unwrap().and_utc().timestamp() as u32)
    }

    #[test]
    fn a_flush_over_more_than_100_months_is_split_into_inserts_of_at_most_100_in_row_order() {
        // 250 months, interleaved: rows of one month are far apart in the flush.
        let rows: Vec<BatchRow> = (0..1000u64).map(|i| row(i, month((i * 7 % 250) as u32))).collect();
        let blocks = insert_blocks(&rows);
        assert_eq!(blocks.len(), 3);
        let mut seen = Vec::new();
        for block in &blocks {
            let months: std::collections::BTreeSet<u32> = block.iter().map(|r| year_month(r.key.minute)).collect();
            assert!(months.len() <= MAX_MONTHS_PER_INSERT, "{} months in one insert", months.len());
            // Each block keeps the flush's order.
            assert!(block.windows(2).all(|w| w[0].key.ad_id < w[1].key.ad_id));
            seen.extend(block.iter().map(|r| r.key.ad_id));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>(), "every row exactly once");
    }

    #[test]
    fn a_flush_within_100_months_stays_one_insert_in_flush_order() {
        let rows: Vec<BatchRow> = (0..500u64).map(|i| row(i, month((i % 100) as u32))).collect();
        let blocks = insert_blocks(&rows);
        assert_eq!(blocks.len(), 1);
        assert!(blocks[0].iter().map(|r| r.key.ad_id).eq(0..500));
        assert!(insert_blocks(std::iter::empty()).is_empty());
    }

    #[test]
    fn months_are_utc_calendar_months() {
        assert_eq!(year_month(month(0)), 200001);
        assert_eq!(year_month(month(13)), 200102);
        assert_eq!(year_month(Minute::from_epoch_seconds(1_764_460_740)), 202511); // 2025-11-29T23:59Z
        assert_eq!(year_month(Minute::from_epoch_seconds(u32::MAX)), 210602);
    }

    fn bad(msg: &str) -> SinkError {
        classify(clickhouse::error::Error::BadResponse(msg.into()))
    }

    #[test]
    fn no_error_that_a_retry_cannot_fix_is_retried() {
        // The same request fails the same way however often it is sent.
        for fatal in [
            "Code: 252, e.displayText() = DB::Exception: Too many partitions for single INSERT block (more than 100). \
             The limit is controlled by 'max_partitions_per_insert_block' setting",
            "Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 100). (TOO_MANY_PARTS)",
            "Code: 1234567. DB::Exception: an error this version of clickagg has never heard of",
            "404 Not Found",
            "<html><body>Welcome to nginx!</body></html>",
        ] {
            assert!(bad(fatal).is_fatal(), "{fatal}");
        }
        // Overload, merges behind, a restart: the same request succeeds later.
        for transient in [
            "Code: 252, e.displayText() = DB::Exception: Too many parts (300). Merges are processing \
             significantly slower than inserts.",
            "Code: 202. DB::Exception: Too many simultaneous queries. Maximum: 100. (TOO_MANY_SIMULTANEOUS_QUERIES)",
            "Code: 241. DB::Exception: Memory limit (total) exceeded (MEMORY_LIMIT_EXCEEDED)",
            "503 Service Unavailable",
            "<html><head><title>502 Bad Gateway</title></head></html>",
            // A replica killed while a Distributed insert wrote to it (scripts/test-cluster).
            "Code: 32, e.displayText() = DB::Exception: Attempt to read after eof: while receiving packet from \
             127.0.0.1:19002: Insertion status:\nWrote 1 blocks and 90 rows on shard 0 replica 0, 127.0.0.1:19000 \
             (average 0 ms per block)\n, e.what() = DB::Exception",
            "Code: 32. DB::Exception: Attempt to read after eof: while receiving packet from node-3:9000. \
             (ATTEMPT_TO_READ_AFTER_EOF)",
        ] {
            assert!(!bad(transient).is_fatal(), "{transient}");
        }
        assert!(!classify(clickhouse::error::Error::TimedOut).is_fatal());
        assert!(!classify(clickhouse::error::Error::Network("connection reset".into())).is_fatal());
    }

    #[test]
    fn every_code_in_the_table_is_classified_as_listed_in_both_message_formats() {
        for &(code, name, class) in CODES {
            let old = format!("Code: {code}, e.displayText() = DB::Exception: something, e.what() = DB::Exception");
            let new = format!("Code: {code}. DB::Exception: something. ({name}) (version 25.8.1.1 (official build))");
            for msg in [old, new] {
                assert_eq!(bad(&msg).is_fatal(), matches!(class, Class::Fatal(_)), "{name}: {msg}");
            }
        }
    }

    #[test]
    fn the_table_lists_each_code_once_in_order() {
        assert!(CODES.windows(2).all(|w| w[0].0 < w[1].0), "codes sorted and unique");
        assert!(CODES.iter().all(|(_, name, _)| name.chars().all(|c| c.is_ascii_uppercase() || c == '_')));
    }

    #[test]
    fn fatal_errors_say_what_to_change() {
        let says = |msg: &str, advice: &str| {
            let e = bad(msg).to_string();
            assert!(e.contains(advice), "{e}");
        };
        says("Code: 193. DB::Exception: Wrong password for user clickagg", "clickhouse.password");
        says("Code: 60. DB::Exception: Table it.ad_clicks_minute doesn't exist", "clickagg migrate");
        says("Code: 164. DB::Exception: Cannot execute query in readonly mode", "grant clickhouse.user");
        says("Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 10)", "max_partitions");
        says("Code: 4242. DB::Exception: new", "restart resumes from the last commit");
        says("404 Not Found", "check clickhouse.url");
    }

    #[test]
    fn every_grain_has_its_table() {
        let tables: Vec<&str> = Grain::ALL.iter().map(|&g| table_of(g).0).collect();
        assert_eq!(tables, ["ad_clicks_minute", "ad_clicks_hour", "ad_clicks_day"]);
        assert_eq!(statements(MIGRATIONS[3].1).len(), 2);
    }

    #[test]
    fn every_table_the_migrations_create_has_a_cluster_form() {
        let mut tables = Vec::new();
        for (name, sql) in MIGRATIONS {
            for statement in statements(sql) {
                let forms = cluster_statements(&statement, "db", "c").unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(forms.len(), 2);
                assert!(
                    forms[0].contains("ENGINE = Replicated") && forms[0].contains("ON CLUSTER `c`"),
                    "{}",
                    forms[0]
                );
                assert!(forms[1].contains("ENGINE = Distributed(`c`, `db`, "), "{}", forms[1]);
                tables.push(forms[1].split(' ').nth(5).unwrap().to_string());
            }
        }
        assert_eq!(
            tables,
            [
                "`db`.ad_clicks_minute",
                "`db`.clickagg_topics",
                "`db`.clickagg_pins",
                "`db`.ad_clicks_hour",
                "`db`.ad_clicks_day",
                "`db`.clickagg_backfills",
                "`db`.clickagg_clocks",
                "`db`.clickagg_settings"
            ]
        );
        for grain in Grain::ALL {
            assert!(SHARDING.iter().any(|(t, k)| *t == table_of(grain).0 && *k == "cityHash64(ad_id)"));
        }
    }

    #[test]
    fn a_cluster_table_keeps_the_columns_keys_and_engine_arguments_of_the_single_node_one() {
        let minute = &statements(MIGRATIONS[0].1)[0];
        let forms = cluster_statements(minute, "clickagg", "clickagg_cluster").unwrap();
        assert!(forms[0].starts_with("CREATE TABLE IF NOT EXISTS `clickagg`.ad_clicks_minute_local ON CLUSTER `clickagg_cluster`\n(\n    ad_id       UInt64,"), "{}", forms[0]);
        assert!(forms[0].contains(
            "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/clickagg/ad_clicks_minute_local', '{replica}', version)\nPARTITION BY toYYYYMM(minute)\nORDER BY (ad_id, minute, topic, partition, batch_start)"
        ), "{}", forms[0]);
        assert_eq!(
            forms[1],
            "CREATE TABLE IF NOT EXISTS `clickagg`.ad_clicks_minute ON CLUSTER `clickagg_cluster` AS `clickagg`.ad_clicks_minute_local \
             ENGINE = Distributed(`clickagg_cluster`, `clickagg`, ad_clicks_minute_local, cityHash64(ad_id))"
        );
        // An engine without arguments gets only the replication ones.
        let topics = cluster_statements(&statements(MIGRATIONS[1].1)[0], "d", "c").unwrap();
        assert!(topics[0].contains("ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/d/clickagg_topics_local', '{replica}')\nORDER BY topic"), "{}", topics[0]);
        assert!(cluster_statements("ALTER TABLE t ADD COLUMN x UInt8", "d", "c").is_err());
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
