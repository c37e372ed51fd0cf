//! Metrics and what logs share: every metric name in one place, and the rate limiter
//! that keeps a flood of bad records from flooding the logs (the binary sets up the
//! log subscriber itself, `main.rs`).
//!
//! Labels are bounded: `partition` (the topic's partition count), `reason` (the closed
//! set of [`RejectReason`](crate::click::RejectReason)s) and a few fixed words. Never
//! `ad_id` or `click_id`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const RECORDS_CONSUMED: &str = "clickagg_records_consumed_total";
pub const CLICKS_COUNTED: &str = "clickagg_clicks_counted_total";
pub const DUPLICATES_DROPPED: &str = "clickagg_duplicates_dropped_total";
pub const REDELIVERIES: &str = "clickagg_redelivered_clicks_total";
pub const INVALID_RECORDS: &str = "clickagg_invalid_records_total";
/// Dead letters the broker acknowledged, per `reason` (the record's rejection).
pub const DEAD_LETTERS: &str = "clickagg_dead_letters_produced_total";
pub const WARMUP_RECORDS: &str = "clickagg_warmup_records_total";
pub const CROSS_PARTITION_DUPLICATES: &str = "clickagg_cross_partition_duplicates_total";
pub const RECORD_LAG: &str = "clickagg_record_lag_seconds";
pub const DEDUP_REBUILDS: &str = "clickagg_dedup_rebuilds_total";
pub const DEDUP_SWEPT: &str = "clickagg_dedup_entries_swept_total";
/// Poll batches read again from a sighting that had to wait until other partitions'
/// dedup state was rebuilt from the log (after the cache was lost).
pub const DEDUP_WAITS: &str = "clickagg_dedup_waits_total";
/// Partitions this member reads that lag the wall clock far enough that the sweeper
/// keeps sightings for them (`dedup.max_record_lag`).
pub const DEDUP_HELD_PARTITIONS: &str = "clickagg_dedup_held_partitions";
pub const FLUSH_DURATION: &str = "clickagg_flush_duration_seconds";
/// Seconds from a counted click's record timestamp until the flush holding it is durable
/// (from then on `query` sees it).
pub const FRESHNESS: &str = "clickagg_freshness_seconds";
/// Counted clicks by record timestamp in tenths of a second, for [`FRESHNESS`]. Whole
/// seconds (the dedup clock's unit) would make every click look up to a second older
/// than it is; tenths keep a flush's map to a few entries.
pub type ClicksByTenth = std::collections::BTreeMap<u64, u64>;

/// The [`ClicksByTenth`] key of a record timestamp (ms); none before the epoch.
pub fn tenth_of_millis(ms: i64) -> Option<u64> {
    u64::try_from(ms).ok().map(|ms| ms / 100)
}

/// Seconds from a [`ClicksByTenth`] key to `now` (Unix seconds); never negative (a
/// producer clock ahead).
pub fn age_seconds(now: f64, tenth: u64) -> f64 {
    (now - tenth as f64 / 10.0).max(0.0)
}

/// Unix time of the last durable flush that covered a partition.
pub const LAST_FLUSH: &str = "clickagg_last_flush_timestamp_seconds";
/// 1 when `/readyz` says ready; computed when `/metrics` is scraped.
pub const READY: &str = "clickagg_ready";
/// Flushes dropped unwritten: decided in a dedup cache that was lost since.
pub const FENCED_FLUSHES: &str = "clickagg_fenced_flushes_total";
pub const FLUSHES: &str = "clickagg_flushes_total";
pub const ROWS_FLUSHED: &str = "clickagg_rows_flushed_total";
pub const COMMITTED_OFFSET: &str = "clickagg_committed_offset";
pub const CONSUMER_LAG: &str = "clickagg_consumer_lag";
pub const REBALANCES: &str = "clickagg_rebalances_total";
pub const ASSIGNED_PARTITIONS: &str = "clickagg_assigned_partitions";
pub const REDIS_ERRORS: &str = "clickagg_redis_errors_total";
pub const REDIS_RETRIES: &str = "clickagg_redis_retries_total";
pub const CLICKHOUSE_ERRORS: &str = "clickagg_clickhouse_errors_total";
pub const CLICKHOUSE_RETRIES: &str = "clickagg_clickhouse_retries_total";
pub const KAFKA_ERRORS: &str = "clickagg_kafka_errors_total";
/// Schema registry requests that failed (an outage: retried, never a dead letter).
pub const SCHEMA_REGISTRY_ERRORS: &str = "clickagg_schema_registry_errors_total";
/// Schema IDs the registry answered (each once per process).
pub const SCHEMAS_FETCHED: &str = "clickagg_schemas_fetched_total";
/// The `op` label values of [`KAFKA_ERRORS`]: what the member was doing with Kafka.
pub const KAFKA_OPS: [&str; 4] = ["client", "consume", "commit", "dead_letter"];
pub const BUCKETS_HELD: &str = "clickagg_unflushed_buckets";
pub const PAUSED: &str = "clickagg_consumption_paused";
/// ClickHouse errors whose code `sink::CODES` does not list: retried (the code is logged).
pub const CLICKHOUSE_UNKNOWN_ERRORS: &str = "clickagg_clickhouse_unknown_errors_total";
/// Record batches the Kafka client could not decode (a codec it lacks, a CRC mismatch,
/// corrupt compressed data); the first one stops consumption (`CONSUMPTION_STOPPED`).
pub const UNDECODABLE_BATCHES: &str = "clickagg_undecodable_batches_total";
/// 1 once consumption stopped for good (until a restart): a batch could not be decoded.
pub const CONSUMPTION_STOPPED: &str = "clickagg_consumption_stopped";
/// Records read whose claims Redis has not answered yet (poll batches in flight).
pub const RECORDS_AWAITING_CLAIMS: &str = "clickagg_records_awaiting_claims";
/// Hours and days sealed for the first time, per `grain` (`hour`, `day`).
pub const SEALS: &str = "clickagg_seals_total";
/// Sealed hours and days sealed again because their minute rows changed, per `grain`.
pub const RESEALS: &str = "clickagg_reseals_total";
pub const ADJUSTMENTS: &str = "clickagg_adjustments_total";
/// How far behind the server's clock the end of the newest sealed hour is (every
/// member reports it, whichever holds the sealer's lease).
pub const SEAL_LAG: &str = "clickagg_seal_lag_seconds";
/// Sealing rounds that failed (and were tried again).
pub const SEAL_ERRORS: &str = "clickagg_seal_errors_total";
/// Where each of a member's tasks spends its time: `stage` is the task (`loop`, `claimer`,
/// `flusher`), `state` what it did (`busy`, or what it waited for). Microseconds, as a
/// counter: `rate()` of it is the fraction of a core.
pub const STAGE_TIME: &str = "clickagg_stage_microseconds_total";
/// Records per poll batch the loop takes in (each is one claim call per key group).
pub const POLL_BATCH_RECORDS: &str = "clickagg_poll_batch_records";
/// 1, labelled with what was built: `version`, and `git_sha`, `rustc` where known.
pub const BUILD_INFO: &str = "clickagg_build_info";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric clickagg exports, with the `# HELP` text `/metrics` gives it: one place,
/// so a new metric without a description fails the test below.
const DESCRIPTIONS: &[(&str, Kind, &str)] = &[
    (RECORDS_CONSUMED, Kind::Counter, "Records read from the click topic and taken into the pipeline."),
    (CLICKS_COUNTED, Kind::Counter, "Clicks counted: valid and not a duplicate within the dedup window."),
    (DUPLICATES_DROPPED, Kind::Counter, "Valid clicks not counted: a record with the same click ID came within the dedup window before."),
    (REDELIVERIES, Kind::Counter, "Clicks read again (after a crash or rebalance) that count as they did the first time: the same sighting, not a duplicate."),
    (INVALID_RECORDS, Kind::Counter, "Records rejected, by reason (the dead-letter reason)."),
    (DEAD_LETTERS, Kind::Counter, "Dead letters the broker acknowledged, by the rejection reason of their record."),
    (WARMUP_RECORDS, Kind::Counter, "Records read before a partition's batch boundary to rebuild its dedup state, not counted."),
    (CROSS_PARTITION_DUPLICATES, Kind::Counter, "Clicks not counted because a copy on another partition was counted first."),
    (RECORD_LAG, Kind::Gauge, "Seconds the partition's record time lags the wall clock, at the last poll batch."),
    (DEDUP_REBUILDS, Kind::Counter, "Partitions whose dedup state was rebuilt from the log, by reason (undecidable re-read, cache lost)."),
    (DEDUP_SWEPT, Kind::Counter, "Dedup cache entries the sweeper deleted once past the dedup window and dedup.max_record_lag."),
    (DEDUP_WAITS, Kind::Counter, "Poll batches claimed again after waiting for other partitions' dedup state to be rebuilt."),
    (DEDUP_HELD_PARTITIONS, Kind::Gauge, "Partitions this member reads that lag enough that the sweeper keeps their sightings."),
    (FLUSH_DURATION, Kind::Histogram, "Seconds a flush took to make its rows durable in ClickHouse."),
    (FRESHNESS, Kind::Histogram, "Seconds from a counted click's record timestamp until its count was durable in ClickHouse."),
    (LAST_FLUSH, Kind::Gauge, "Unix time of the last durable flush that covered the partition."),
    (READY, Kind::Gauge, "1 when /readyz answers 200: Redis and ClickHouse reachable and claims accepted."),
    (FLUSHES, Kind::Counter, "Flushes made durable in ClickHouse."),
    (FENCED_FLUSHES, Kind::Counter, "Flushes dropped unwritten because the dedup cache they were decided in was lost since."),
    (ROWS_FLUSHED, Kind::Counter, "Minute rows written to ClickHouse (hours and days are sealed from them later)."),
    (COMMITTED_OFFSET, Kind::Gauge, "The offset this member last committed for the partition (a batch boundary)."),
    (CONSUMER_LAG, Kind::Gauge, "Records between the partition's committed offset and its log end (librdkafka's statistics)."),
    (REBALANCES, Kind::Counter, "Rebalance callbacks, by kind (assign, revoke)."),
    (ASSIGNED_PARTITIONS, Kind::Gauge, "Partitions this member owns; 0 for a standby."),
    (REDIS_ERRORS, Kind::Counter, "Failed Redis claim requests, by kind (unreachable, out_of_memory, read_only, rebuilding)."),
    (REDIS_RETRIES, Kind::Counter, "Redis claim requests retried after an error."),
    (CLICKHOUSE_ERRORS, Kind::Counter, "Failed ClickHouse flush attempts."),
    (CLICKHOUSE_RETRIES, Kind::Counter, "ClickHouse flush attempts retried after a transient error."),
    (KAFKA_ERRORS, Kind::Counter, "Kafka errors, by what the member was doing (client, consume, commit, dead_letter)."),
    (SCHEMA_REGISTRY_ERRORS, Kind::Counter, "Schema registry requests that failed: an outage, waited out and retried, never a dead letter."),
    (SCHEMAS_FETCHED, Kind::Counter, "Schema IDs looked up in the schema registry or the schema files, each once per process."),
    (BUCKETS_HELD, Kind::Gauge, "Changed count buckets held in memory until a flush makes them durable."),
    (PAUSED, Kind::Gauge, "1 while consumption is paused (Redis refusing claims, or too many unflushed buckets)."),
    (CLICKHOUSE_UNKNOWN_ERRORS, Kind::Counter, "ClickHouse errors whose code clickagg's table does not list (the log names it); retried like an outage."),
    (UNDECODABLE_BATCHES, Kind::Counter, "Record batches the Kafka client could not decode (a codec it lacks, a CRC mismatch, corrupt data)."),
    (CONSUMPTION_STOPPED, Kind::Gauge, "1 once consumption stopped until a restart, because a record batch could not be decoded."),
    (RECORDS_AWAITING_CLAIMS, Kind::Gauge, "Records read whose Redis claims have not been answered yet."),
    (STAGE_TIME, Kind::Counter, "Microseconds each task (stage: loop, claimer, flusher) spent per state (busy, or what it waited for)."),
    (POLL_BATCH_RECORDS, Kind::Histogram, "Records per poll batch the loop takes in."),
    (SEALS, Kind::Counter, "Hours and days sealed for the first time, by grain (hour, day)."),
    (RESEALS, Kind::Counter, "Sealed hours and days sealed again because their minute rows changed, by grain."),
    (
        ADJUSTMENTS,
        Kind::Counter,
        "Adjustments written to closed billing periods (a closed period's counts changed after its close).",
    ),
    (SEAL_LAG, Kind::Gauge, "Seconds the end of the newest sealed hour lies behind the server's clock."),
    (SEAL_ERRORS, Kind::Counter, "Sealing rounds that failed (and were tried again)."),
    (BUILD_INFO, Kind::Gauge, "Always 1; the labels say which clickagg runs: version, git_sha and rustc where known."),
];

/// Gives every metric its `# HELP` text and sets [`BUILD_INFO`]; once, after the
/// recorder is installed.
fn describe() {
    for &(name, kind, help) in DESCRIPTIONS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
    process_collector().describe();
    let mut labels = vec![("version", env!("CARGO_PKG_VERSION"))];
    labels.extend(option_env!("CLICKAGG_BUILD_GIT_SHA").map(|sha| ("git_sha", sha)));
    labels.extend(option_env!("CLICKAGG_BUILD_RUSTC").map(|v| ("rustc", v)));
    let labels: Vec<metrics::Label> = labels.into_iter().map(|(k, v)| metrics::Label::new(k, v)).collect();
    metrics::gauge!(BUILD_INFO, labels).set(1.0);
}

/// The standard process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_open_fds`, `process_start_time_seconds`, …), read from the OS.
fn process_collector() -> &'static metrics_process::Collector {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// Reads the process metrics now: called when `/metrics` is scraped, so they are never
/// older than the scrape.
pub fn collect_process_metrics() {
    process_collector().collect();
}

/// Explicit flush-duration buckets, seconds: a healthy flush takes milliseconds, a
/// struggling server seconds.
const FLUSH_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Freshness buckets, seconds: the target is the flush interval plus a second.
const FRESHNESS_BUCKETS: &[f64] = &[0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0];

/// Poll batch sizes, records.
const POLL_BATCH_BUCKETS: &[f64] = &[1.0, 10.0, 100.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0];

static PROMETHEUS: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder once per process, describes every metric, and
/// returns its handle.
pub fn metrics() -> PrometheusHandle {
    PROMETHEUS
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(FLUSH_DURATION.to_string()), FLUSH_BUCKETS)
                .expect("buckets are not empty")
                .set_buckets_for_metric(Matcher::Full(FRESHNESS.to_string()), FRESHNESS_BUCKETS)
                .expect("buckets are not empty")
                .set_buckets_for_metric(Matcher::Full(POLL_BATCH_RECORDS.to_string()), POLL_BATCH_BUCKETS)
                .expect("buckets are not empty")
                .install_recorder()
                .expect("the Prometheus recorder is installed once");
            describe();
            handle
        })
        .clone()
}

/// Publishes every counter at 0 (each label value of the labelled ones) and registers
/// the histograms, so dashboards and alerts see the series before the first event (a
/// missing series reads as "no data", not as zero: a ratio or an alert over it would
/// never be evaluated). The per-partition gauges appear with their partitions.
/// `redis_error_kinds` are the `kind` labels of the Redis error counter
/// (`readiness::RedisTrouble`).
pub fn register_zeroes(redis_error_kinds: &[&'static str]) {
    for name in [
        RECORDS_CONSUMED,
        CLICKS_COUNTED,
        DUPLICATES_DROPPED,
        REDELIVERIES,
        WARMUP_RECORDS,
        CROSS_PARTITION_DUPLICATES,
        DEDUP_SWEPT,
        DEDUP_WAITS,
        FLUSHES,
        FENCED_FLUSHES,
        ROWS_FLUSHED,
        REDIS_RETRIES,
        CLICKHOUSE_ERRORS,
        CLICKHOUSE_RETRIES,
        SEAL_ERRORS,
        SCHEMA_REGISTRY_ERRORS,
        SCHEMAS_FETCHED,
        ADJUSTMENTS,
    ] {
        metrics::counter!(name).absolute(0);
    }
    for grain in ["hour", "day"] {
        metrics::counter!(SEALS, "grain" => grain).absolute(0);
        metrics::counter!(RESEALS, "grain" => grain).absolute(0);
    }
    for reason in crate::click::RejectReason::ALL {
        metrics::counter!(INVALID_RECORDS, "reason" => reason.as_str()).absolute(0);
        metrics::counter!(DEAD_LETTERS, "reason" => reason.as_str()).absolute(0);
    }
    for op in KAFKA_OPS {
        metrics::counter!(KAFKA_ERRORS, "op" => op).absolute(0);
    }
    // A registered histogram is exported with every bucket at 0.
    let _ = metrics::histogram!(FLUSH_DURATION);
    let _ = metrics::histogram!(FRESHNESS);
    for reason in ["undecidable", "lost"] {
        metrics::counter!(DEDUP_REBUILDS, "reason" => reason).absolute(0);
    }
    // The `kind` values `member` counts; a series that appeared only at the first
    // rebalance would read as "no data" to an alert on revokes.
    for kind in ["assign", "revoke"] {
        metrics::counter!(REBALANCES, "kind" => kind).absolute(0);
    }
    for &kind in redis_error_kinds {
        metrics::counter!(REDIS_ERRORS, "kind" => kind).absolute(0);
    }
    metrics::gauge!(PAUSED).set(0.0);
    metrics::counter!(UNDECODABLE_BATCHES).absolute(0);
    metrics::counter!(CLICKHOUSE_UNKNOWN_ERRORS).absolute(0);
    metrics::gauge!(CONSUMPTION_STOPPED).set(0.0);
    // A standby (more members than partitions) is never assigned any: 0, not "no data".
    metrics::gauge!(ASSIGNED_PARTITIONS).set(0.0);
    metrics::gauge!(RECORDS_AWAITING_CLAIMS).set(0.0);
    metrics::gauge!(READY).set(0.0);
    metrics::gauge!(BUCKETS_HELD).set(0.0);
    // 0 until the member's first look at the sealer's progress, moments after it starts.
    metrics::gauge!(SEAL_LAG).set(0.0);
}

/// Attributes a task's time to what it was doing, for [`STAGE_TIME`]: each `mark` books
/// the time since the previous one under `state`.
pub struct StageClock {
    stage: &'static str,
    since: Instant,
}

impl StageClock {
    pub fn new(stage: &'static str) -> StageClock {
        StageClock { stage, since: Instant::now() }
    }

    pub fn mark(&mut self, state: &'static str) {
        let now = Instant::now();
        let micros = now.duration_since(self.since).as_micros() as u64;
        metrics::counter!(STAGE_TIME, "stage" => self.stage, "state" => state).increment(micros);
        self.since = now;
    }
}

/// Lets one log line per key through per interval and counts the rest, so a topic full
/// of garbage produces a summary every few seconds instead of a line per record.
pub struct RateLimiter {
    interval: Duration,
    state: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl RateLimiter {
    pub fn new(interval: Duration) -> RateLimiter {
        RateLimiter { interval, state: Mutex::new(HashMap::new()) }
    }

    /// `Some(suppressed)` when a line for `key` may be logged now, with the number of
    /// lines suppressed since the last one.
    pub fn allow(&self, key: &'static str, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().expect("not poisoned");
        match state.get_mut(key) {
            Some((last, suppressed)) if now.duration_since(*last) < self.interval => {
                *suppressed += 1;
                None
            }
            Some((last, suppressed)) => {
                *last = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                state.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freshness_is_measured_from_the_record_timestamp_to_a_tenth_of_a_second() {
        // Stamped 0.9 s into a second, durable 0.2 s later: 0.2 s old, not 1.1 s (as
        // whole seconds of record time made it).
        let stamped_ms = 1_700_000_000_900;
        let tenth = tenth_of_millis(stamped_ms).unwrap();
        let age = age_seconds(1_700_000_001.1, tenth);
        assert!((age - 0.2).abs() < 1e-6, "{age}");
        assert_eq!(tenth_of_millis(-1), None, "before the epoch: no age");
        assert_eq!(age_seconds(1_000.0, 10_050), 0.0, "a producer clock ahead is not negative");
    }

    #[test]
    fn every_metric_name_of_this_module_has_a_description() {
        // The names are the `pub const NAME: &str = "clickagg_…";` items above.
        let source = include_str!("telemetry.rs");
        let names: Vec<&str> = source
            .lines()
            .filter(|l| l.starts_with("pub const ") && l.contains(": &str = \"clickagg_"))
            .filter_map(|l| l.split('"').nth(1))
            .collect();
        assert!(names.len() >= 30, "{names:?}");
        for name in &names {
            let described: Vec<_> = DESCRIPTIONS.iter().filter(|(n, _, _)| n == name).collect();
            assert_eq!(described.len(), 1, "{name}: described {} times", described.len());
            assert!(described[0].2.ends_with('.'), "{name}: a sentence");
        }
        assert_eq!(DESCRIPTIONS.len(), names.len(), "a description of a name that is not a constant here");
    }

    #[test]
    fn the_rate_limiter_lets_one_line_through_per_interval_and_counts_the_rest() {
        let rl = RateLimiter::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(rl.allow("a", t0), Some(0));
        assert_eq!(rl.allow("a", t0 + Duration::from_secs(1)), None);
        assert_eq!(rl.allow("a", t0 + Duration::from_secs(2)), None);
        assert_eq!(rl.allow("b", t0 + Duration::from_secs(2)), Some(0));
        assert_eq!(rl.allow("a", t0 + Duration::from_secs(6)), Some(2));
    }
}
