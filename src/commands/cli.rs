//! Command-line flags. Every connection flag is also settable as an environment
//! variable `CLICKAGG__SECTION__KEY` or in the TOML file; flags win (see `config`).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::Override;

#[derive(Debug, Parser)]
#[command(name = "clickagg", version, about = "Exactly-once per-ad per-minute click counts from Kafka into ClickHouse")]
pub struct Cli {
    /// TOML configuration file (sections as in `clickagg config`).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub common: CommonFlags,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the ClickHouse database and tables (idempotent).
    Migrate(MigrateArgs),
    /// Run one member of the consumer group until SIGINT/SIGTERM.
    Run,
    /// Generate seeded click events into the topic and write the ground truth.
    Produce(ProduceArgs),
    /// Compare billing counts in ClickHouse with a ground-truth file; exit 0 on an exact
    /// match, 4 when the counts differ, 1 when it could not compare.
    Verify(VerifyArgs),
    /// Billing counts from ClickHouse per ad and minute, hour or day, exact (read through FINAL).
    Query(crate::query::QueryArgs),
    /// The batches (partition, offset range, writer) whose rows make up the count of one
    /// ad in one minute.
    Explain(crate::explain::ExplainArgs),
    /// Freeze the billing totals of a day or month once it is sealed; later changes to
    /// it become adjustments (guide, "Billing periods and disputes"). Exit 4 when the
    /// period is not sealed yet.
    Close(crate::close::CloseArgs),
    /// Backfill: re-read a range of the topic into ClickHouse; idempotent.
    Replay(crate::replay::ReplayArgs),
    /// Recount distinct clicks from the topic for a time range and diff against ClickHouse;
    /// exit 0 on an exact match, 4 when the counts differ, 1 when it could not compare.
    Reconcile(crate::reconcile::ReconcileArgs),
    /// Seal the hours and days that are due and re-seal those written since (one round,
    /// as a member's sealer runs it); idempotent.
    Seal(SealArgs),
    /// The consumer group from Kafka and ClickHouse: each partition's owner, lag and last
    /// durable flush; exit 4 when a partition stalled.
    Status(super::status::StatusArgs),
    /// Print the effective configuration (defaults < file < environment < flags), secrets redacted.
    Config,
    /// The settings that decide which clicks count, as the topic records them; change
    /// them on purpose (guide, "Changing what counts").
    #[command(subcommand)]
    Settings(super::settings::SettingsCommand),
}

/// Connection and pipeline flags shared by every command.
#[derive(Debug, Args, Default)]
pub struct CommonFlags {
    /// Kafka bootstrap servers [env: CLICKAGG__KAFKA__BROKERS]
    #[arg(long, global = true)]
    pub brokers: Option<String>,
    /// Topic of click events [env: CLICKAGG__KAFKA__TOPIC]
    #[arg(long, global = true)]
    pub topic: Option<String>,
    /// Consumer group of `run` [env: CLICKAGG__KAFKA__GROUP]
    #[arg(long, global = true)]
    pub group: Option<String>,
    /// Static group membership ID [env: CLICKAGG__KAFKA__GROUP_INSTANCE_ID]
    #[arg(long, global = true)]
    pub group_instance_id: Option<String>,
    /// Redis URL, redis:// or rediss:// [env: CLICKAGG__REDIS__URL]
    #[arg(long, global = true)]
    pub redis_url: Option<String>,
    /// Dedup window in record time, e.g. 24h [env: CLICKAGG__DEDUP__WINDOW]
    #[arg(long, global = true, alias = "dedup-ttl")]
    pub dedup_window: Option<String>,
    /// ClickHouse HTTP(S) URL [env: CLICKAGG__CLICKHOUSE__URL]
    #[arg(long, global = true)]
    pub clickhouse_url: Option<String>,
    /// ClickHouse user [env: CLICKAGG__CLICKHOUSE__USER]
    #[arg(long, global = true)]
    pub clickhouse_user: Option<String>,
    /// ClickHouse password [env: CLICKAGG__CLICKHOUSE__PASSWORD]
    #[arg(long, global = true)]
    pub clickhouse_password: Option<String>,
    /// ClickHouse database [env: CLICKAGG__CLICKHOUSE__DATABASE]
    #[arg(long, global = true)]
    pub clickhouse_database: Option<String>,
    /// Batch size in offsets; fixed per topic [env: CLICKAGG__PIPELINE__BATCH_OFFSETS]
    #[arg(long, global = true)]
    pub batch_offsets: Option<u64>,
    /// Flush interval, e.g. 1s [env: CLICKAGG__PIPELINE__FLUSH_INTERVAL]
    #[arg(long, global = true)]
    pub flush_interval: Option<String>,
    /// How long shutdown may flush and commit, e.g. 30s [env: CLICKAGG__PIPELINE__DRAIN_TIMEOUT]
    #[arg(long, global = true)]
    pub drain_timeout: Option<String>,
    /// Address of the status page, /metrics, /livez, /readyz [env: CLICKAGG__HTTP__ADDR]
    #[arg(long, global = true)]
    pub http_addr: Option<String>,
    /// Log format: human or json [env: CLICKAGG__LOG__FORMAT]
    #[arg(long, global = true)]
    pub log_format: Option<String>,
}

impl CommonFlags {
    /// The flags that were given, as configuration overrides.
    pub fn overrides(&self) -> Vec<Override> {
        let mut o: Vec<Override> = Vec::new();
        let mut put = |key: &'static str, v: Option<figment::value::Value>| {
            if let Some(v) = v {
                o.push((key, v));
            }
        };
        put("kafka.brokers", self.brokers.clone().map(Into::into));
        put("kafka.topic", self.topic.clone().map(Into::into));
        put("kafka.group", self.group.clone().map(Into::into));
        put("kafka.group_instance_id", self.group_instance_id.clone().map(Into::into));
        put("redis.url", self.redis_url.clone().map(Into::into));
        put("dedup.window", self.dedup_window.clone().map(Into::into));
        put("clickhouse.url", self.clickhouse_url.clone().map(Into::into));
        put("clickhouse.user", self.clickhouse_user.clone().map(Into::into));
        put("clickhouse.password", self.clickhouse_password.clone().map(Into::into));
        put("clickhouse.database", self.clickhouse_database.clone().map(Into::into));
        put("pipeline.batch_offsets", self.batch_offsets.map(Into::into));
        put("pipeline.flush_interval", self.flush_interval.clone().map(Into::into));
        put("pipeline.drain_timeout", self.drain_timeout.clone().map(Into::into));
        put("http.addr", self.http_addr.clone().map(Into::into));
        put("log.format", self.log_format.clone().map(Into::into));
        o
    }
}

#[derive(Debug, Args, Clone)]
pub struct ProduceArgs {
    /// Records to send (duplicates and malformed records included).
    #[arg(long, default_value_t = 100_000)]
    pub count: u64,
    /// Records per second; 0 sends as fast as the broker takes them. With a rate, no
    /// record is sent before its simulated send time (its Kafka timestamp): a --start
    /// ahead of now starts the sends then.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Distinct ads; popularity is Zipf-distributed.
    #[arg(long, default_value_t = 1_000)]
    pub ads: u64,
    /// Zipf exponent of ad popularity (larger: hotter head).
    #[arg(long, default_value_t = 1.1)]
    pub zipf_exponent: f64,
    /// Fraction of records that repeat an earlier click.
    #[arg(long, default_value_t = 0.1)]
    pub duplicate_ratio: f64,
    /// Fraction of new clicks that arrive minutes late.
    #[arg(long, default_value_t = 0.02)]
    pub late_ratio: f64,
    /// Fraction of records that are malformed.
    #[arg(long, default_value_t = 0.01)]
    pub malformed_ratio: f64,
    /// Fraction of duplicates sent under another key, so they may land on another
    /// partition (producers that do not key by click ID).
    #[arg(long, default_value_t = 0.0)]
    pub cross_partition_ratio: f64,
    /// Fraction of the other duplicates (same key and partition) whose event time is
    /// in another minute than their original's: a retry re-stamped by its sender. The
    /// ground truth counts the original's minute.
    #[arg(long, alias = "retry-drift", default_value_t = 0.0)]
    pub retry_drift_ratio: f64,
    /// Partitions to create the topic with, if it does not exist.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Random seed: the same seed gives the same records. Without it a fresh seed is
    /// drawn (and printed): a run repeated within the dedup window with the same seed
    /// sends the same click IDs, which count once.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Event-time span the records cover, e.g. 10m.
    #[arg(long, default_value = "10m")]
    pub span: humantime::Duration,
    /// Event time of the first record (RFC 3339); default: now minus the span.
    #[arg(long)]
    pub start: Option<String>,
    /// Where to write the ground truth (CSV: ad_id,minute,clicks).
    #[arg(long, default_value = "truth.csv")]
    pub truth: PathBuf,
    /// How to write the records: json, or avro / protobuf in the Confluent wire format
    /// (magic byte, schema ID, then the payload). The same seed gives the same clicks
    /// and ground truth in every format.
    #[arg(long, default_value = "json")]
    pub format: crate::config::Format,
    /// The schema ID the avro / protobuf records name.
    #[arg(long, default_value_t = 1)]
    pub schema_id: u32,
    /// Which of the generator's schemas: 1, or 2 (1 with a field added).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub schema_revision: u8,
    /// Write the schema to this directory as `<schema-id>.avsc` / `.proto` (what
    /// source.schema_files reads); a file already there must hold the same schema.
    #[arg(long, value_name = "DIR")]
    pub schema_dir: Option<PathBuf>,
    /// Add this run's counts to those already in --truth (if it exists), once every
    /// record is sent, instead of replacing them: for a topic that several runs write
    /// to, whose whole count `verify` then checks (the Docker Compose demo).
    #[arg(long)]
    pub add_to_truth: bool,
}

#[derive(Debug, Args, Clone, Default)]
pub struct MigrateArgs {
    /// Create the tables on every node of this ClickHouse cluster (`remote_servers`):
    /// replicated tables on every shard and a Distributed table over them, all ON
    /// CLUSTER. The same as clickhouse.cluster, which `run`, `query` and the other
    /// commands need too [env: CLICKAGG__CLICKHOUSE__CLUSTER]
    #[arg(long, value_name = "NAME")]
    pub cluster: Option<String>,
}

#[derive(Debug, Args, Clone, Default)]
pub struct SealArgs {
    /// Seal every hour that ends at or before this time (RFC 3339, or a UTC date),
    /// instead of the hours the group's committed positions make due: after a backfill
    /// with no member running. Exactness does not depend on it (a later write to a
    /// sealed hour re-seals it).
    #[arg(long, value_parser = crate::time::parse_time)]
    pub through: Option<chrono::DateTime<chrono::Utc>>,
    /// Also compute every sealed hour from this time on again, and its day: a repair
    /// after minute rows were written by something that writes no markers.
    #[arg(long, value_parser = crate::time::parse_time)]
    pub recompute_from: Option<chrono::DateTime<chrono::Utc>>,
}

#[derive(Debug, Args, Clone)]
pub struct VerifyArgs {
    /// Ground-truth CSV written by `clickagg produce`.
    #[arg(long, value_name = "FILE")]
    pub expected: PathBuf,
    /// Compare the counts of all topics in the table, not only `kafka.topic`.
    #[arg(long)]
    pub all_topics: bool,
    /// Print the billing counts too.
    #[arg(long)]
    pub print: bool,
}
