//! `clickagg replay`: backfill by re-reading a range of the topic through the same
//! stages as the live pipeline (decode → dead letters → dedup → aggregate → flush).
//!
//! Why a replay changes no correct count (DESIGN.md §4): each partition starts at a
//! batch boundary (the requested offset rounded down), so every batch is rebuilt from
//! its first offset and every row it writes is one the live pipeline wrote or would
//! write — same `(clicks, version)` or a lower version, which loses. Dedup decisions are
//! the same too: the owner tokens in Redis name positions in the log, not consumers.
//!
//! The replay reads by direct assignment (no consumer group, nothing committed) up to
//! the end captured when it starts, so it finishes even while producers keep writing.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::aggregate::BatchOffsets;
use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::dedup::Dedup;
use crate::health::Health;
use crate::pipeline::{BatchStats, Interrupted, Stages, StagesConfig};
use crate::sink::Sink;
use crate::source::{self, RangeReader, Ranges};

#[derive(Debug, Args, Clone)]
pub struct ReplayArgs {
    /// Where to start: `earliest`, an RFC 3339 time (record timestamps), or explicit
    /// offsets `PARTITION:OFFSET,…`. Rounded down to a batch boundary.
    #[arg(long, default_value = "earliest")]
    pub from: String,
    /// Where to stop (exclusive): `latest` (the log end when the replay starts) or an
    /// RFC 3339 time.
    #[arg(long, default_value = "latest")]
    pub to: String,
    /// Do not produce dead letters for rejected records (they are still counted).
    #[arg(long)]
    pub no_dead_letters: bool,
}

/// A start position as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartAt {
    Earliest,
    Time(i64),
    Offsets(BTreeMap<i32, i64>),
}

/// An end position as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopAt {
    Latest,
    Time(i64),
}

/// RFC 3339 or a plain date (its UTC midnight), in milliseconds; as `query` reads times.
pub fn parse_time_ms(s: &str) -> Option<i64> {
    crate::query::parse_time(s).ok().map(|t| t.timestamp_millis())
}

impl std::str::FromStr for StartAt {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "earliest" {
            return Ok(StartAt::Earliest);
        }
        if let Some(t) = parse_time_ms(s) {
            return Ok(StartAt::Time(t));
        }
        let mut offsets = BTreeMap::new();
        for part in s.split(',') {
            let (p, o) = part
                .split_once(':')
                .ok_or_else(|| format!("--from {s:?}: expected earliest, an RFC 3339 time or PARTITION:OFFSET,…"))?;
            let p: i32 = p.trim().parse().map_err(|_| format!("--from: bad partition {p:?}"))?;
            let o: i64 = o.trim().parse().map_err(|_| format!("--from: bad offset {o:?}"))?;
            offsets.insert(p, o);
        }
        Ok(StartAt::Offsets(offsets))
    }
}

impl std::str::FromStr for StopAt {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "latest" {
            return Ok(StopAt::Latest);
        }
        parse_time_ms(s).map(StopAt::Time).ok_or_else(|| format!("--to {s:?}: expected latest or an RFC 3339 time"))
    }
}

/// Where a partition's replay starts: the batch boundary at or below `requested`
/// (the log end when nothing is requested), or — when retention removed that
/// boundary — the first boundary after the log start.
pub fn start_offset(n: BatchOffsets, low: i64, high: i64, requested: Option<i64>) -> i64 {
    let o = requested.unwrap_or(high).clamp(low, high);
    let start = n.start_of(o);
    if start < low {
        n.boundary_at_or_after(low)
    } else {
        start
    }
}

/// What one partition offers: (low, high) watermarks, the offset for `--from`, for `--to`.
#[derive(Debug, Clone, Copy)]
pub struct PartitionMarks {
    pub low: i64,
    pub high: i64,
    pub from: Option<i64>,
    pub to: Option<i64>,
}

/// The ranges a replay reads, from the broker's answers. Pure, so it is tested alone.
pub fn plan_ranges(n: BatchOffsets, marks: &BTreeMap<i32, PartitionMarks>) -> Ranges {
    let mut ranges = Ranges::default();
    for (&p, m) in marks {
        let start = start_offset(n, m.low, m.high, m.from);
        let end = m.to.unwrap_or(m.high).min(m.high);
        ranges.partitions.insert(p, (start, end.max(start)));
    }
    ranges
}

/// Asks the broker for watermarks and time-based offsets, then plans the ranges.
pub fn resolve(s: &Settings, from: &StartAt, to: StopAt) -> Result<Ranges> {
    let consumer: BaseConsumer = source::lookup_consumer(&s.kafka)?;
    let topic = &s.kafka.topic;
    let timeout = Duration::from_secs(15);
    let parts = source::partitions(&consumer, topic, timeout).with_context(|| format!("topic {topic}"))?;
    let from_offsets: BTreeMap<i32, Option<i64>> = match from {
        StartAt::Earliest => parts.iter().map(|&p| (p, Some(0))).collect(),
        StartAt::Time(t) => source::offsets_for_time(&consumer, topic, &parts, *t, timeout)?.into_iter().collect(),
        StartAt::Offsets(o) => {
            if let Some(p) = o.keys().find(|p| !parts.contains(p)) {
                bail!("--from names partition {p}, which {topic} does not have");
            }
            // Partitions not named are not replayed.
            o.iter().map(|(&p, &off)| (p, Some(off))).collect()
        }
    };
    let to_offsets: BTreeMap<i32, Option<i64>> = match to {
        StopAt::Latest => BTreeMap::new(),
        StopAt::Time(t) => source::offsets_for_time(&consumer, topic, &parts, t, timeout)?.into_iter().collect(),
    };
    let mut marks = BTreeMap::new();
    for (&p, &from) in &from_offsets {
        let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        marks.insert(p, PartitionMarks { low, high, from, to: to_offsets.get(&p).copied().flatten() });
    }
    Ok(plan_ranges(s.batch_offsets(), &marks))
}

/// What a replay did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub ranges: Ranges,
    pub stats: BatchStats,
    pub rows_written: u64,
    pub elapsed: Duration,
}

impl Summary {
    pub fn report(&self) -> String {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let s = &self.stats;
        format!(
            "replayed {} records in {:.1}s ({:.0} records/s): {} counted ({} already claimed by their own position), \
             {} duplicates, {} invalid, {} skipped; {} rows written",
            s.records,
            secs,
            s.records as f64 / secs,
            s.counted,
            s.redelivered,
            s.duplicates,
            s.invalid,
            s.skipped,
            self.rows_written
        )
    }
}

/// Runs the replay to its end (or until `shutdown`, after a final flush).
pub async fn replay(s: &Settings, args: &ReplayArgs, shutdown: CancellationToken) -> Result<Summary> {
    let from: StartAt = args.from.parse().map_err(anyhow::Error::msg)?;
    let to: StopAt = args.to.parse().map_err(anyhow::Error::msg)?;
    let started = Instant::now();
    let sink = Sink::new(&s.clickhouse);
    sink.register_batch_offsets(&s.kafka.topic, s.pipeline.batch_offsets).await?;

    let settings = s.clone();
    let ranges = tokio::task::spawn_blocking(move || resolve(&settings, &from, to)).await??;
    info!(ranges = ?ranges.partitions, records = ranges.records(), "replay planned");

    let dedup = Dedup::new(s.redis_client()?, s.redis.key_prefix.clone(), s.redis.dedup_ttl, s.redis.timeout);
    let dead_letters = if s.dead_letter.enabled && !args.no_dead_letters {
        let topic = s.dead_letter_topic();
        source::ensure_topic(&s.kafka, &topic, 1).await?;
        Some(DeadLetters::new(&s.kafka, topic, "replay")?)
    } else {
        None
    };
    let config = StagesConfig { commit_offsets: false, ..StagesConfig::from_settings(s) };
    let mut stages = Stages::new(config, dedup, dead_letters, sink, Health::new());
    stages.assign(&ranges.partitions.keys().copied().collect::<Vec<_>>());

    let group = format!("{}-replay", s.kafka.group);
    let mut reader = RangeReader::new(&s.kafka, &group, &ranges, s.validation.limits(), s.pipeline.max_poll_records)?;
    let progress = Progress::new(&ranges);
    let mut last_flush = Instant::now();
    loop {
        let batch = tokio::select! {
            _ = shutdown.cancelled() => break,
            b = reader.next_batch() => b.context("reading the topic")?,
        };
        let Some(records) = batch else { break };
        match stages.process(reader.consumer(), records, &shutdown).await {
            Ok(_) => {}
            Err(Interrupted::Shutdown) => break,
            Err(Interrupted::Fatal(e)) => return Err(e.into()),
        }
        if stages.has_complete_batches() || last_flush.elapsed() >= s.pipeline.flush_interval {
            let done = stages.flush(reader.consumer(), CommitMode::Async).await?;
            if done {
                last_flush = Instant::now();
            }
        }
        progress.update(&ranges, reader.positions(), &stages.totals);
    }
    let deadline = Instant::now() + s.pipeline.drain_timeout.max(Duration::from_secs(60));
    if !stages.flush_until(deadline, reader.consumer(), CommitMode::Async).await? {
        bail!(
            "ClickHouse did not take the last rows within the drain timeout; run the replay again (it is idempotent)"
        );
    }
    progress.finish();
    Ok(Summary { ranges, stats: stages.totals, rows_written: stages.rows_flushed, elapsed: started.elapsed() })
}

/// A bar per partition with ETA on a terminal; a log line every 5 s otherwise.
struct Progress {
    bars: Option<(indicatif::MultiProgress, BTreeMap<i32, indicatif::ProgressBar>)>,
    last_log: std::sync::Mutex<Instant>,
}

impl Progress {
    fn new(ranges: &Ranges) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress { bars: None, last_log: std::sync::Mutex::new(Instant::now()) };
        }
        let multi = indicatif::MultiProgress::new();
        let style = indicatif::ProgressStyle::with_template(
            "partition {prefix:>3} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})",
        )
        .expect("valid template")
        .progress_chars("=> ");
        let bars = ranges
            .partitions
            .iter()
            .map(|(&p, &(start, end))| {
                let bar = multi.add(indicatif::ProgressBar::new((end - start) as u64));
                bar.set_style(style.clone());
                bar.set_prefix(p.to_string());
                (p, bar)
            })
            .collect();
        Progress { bars: Some((multi, bars)), last_log: std::sync::Mutex::new(Instant::now()) }
    }

    fn update(&self, ranges: &Ranges, positions: impl Iterator<Item = (i32, i64)>, totals: &BatchStats) {
        let positions: BTreeMap<i32, i64> = positions.collect();
        match &self.bars {
            Some((_, bars)) => {
                for (p, bar) in bars {
                    let (start, end) = ranges.partitions[p];
                    let at = positions.get(p).copied().unwrap_or(end);
                    bar.set_position((at - start) as u64);
                }
            }
            None => {
                let mut last = self.last_log.lock().expect("not poisoned");
                if last.elapsed() >= Duration::from_secs(5) {
                    *last = Instant::now();
                    let done: i64 = ranges
                        .partitions
                        .iter()
                        .map(|(p, &(start, end))| positions.get(p).copied().unwrap_or(end) - start)
                        .sum();
                    info!(read = done, of = ranges.records(), counted = totals.counted, "replay progress");
                }
            }
        }
    }

    fn finish(&self) {
        if let Some((_, bars)) = &self.bars {
            for bar in bars.values() {
                bar.finish();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: u64) -> BatchOffsets {
        BatchOffsets::new(v).unwrap()
    }

    #[test]
    fn a_start_in_the_middle_of_a_batch_is_rounded_down_to_its_boundary() {
        assert_eq!(start_offset(n(100), 0, 1000, Some(250)), 200);
        assert_eq!(start_offset(n(100), 0, 1000, Some(300)), 300);
    }

    #[test]
    fn a_boundary_removed_by_retention_moves_the_start_to_the_next_boundary() {
        assert_eq!(start_offset(n(100), 150, 1000, Some(160)), 200);
        assert_eq!(start_offset(n(100), 150, 1000, Some(0)), 200);
        assert_eq!(start_offset(n(100), 200, 1000, Some(0)), 200);
    }

    #[test]
    fn a_time_after_the_last_record_reads_nothing_but_the_open_batch() {
        // offsets_for_times finds no record: start at the log end's batch, end there too.
        let marks = BTreeMap::from([(0, PartitionMarks { low: 0, high: 1050, from: None, to: None })]);
        let r = plan_ranges(n(100), &marks);
        assert_eq!(r.partitions[&0], (1000, 1050));
    }

    #[test]
    fn the_end_is_captured_and_never_past_the_high_watermark() {
        let marks = BTreeMap::from([
            (0, PartitionMarks { low: 0, high: 500, from: Some(0), to: Some(700) }),
            (1, PartitionMarks { low: 0, high: 500, from: Some(120), to: Some(300) }),
        ]);
        let r = plan_ranges(n(100), &marks);
        assert_eq!(r.partitions[&0], (0, 500));
        assert_eq!(r.partitions[&1], (100, 300));
        assert_eq!(r.records(), 700);
    }

    #[test]
    fn positions_parse_from_the_command_line() {
        assert_eq!("earliest".parse::<StartAt>().unwrap(), StartAt::Earliest);
        assert_eq!("0:10,3:42".parse::<StartAt>().unwrap(), StartAt::Offsets(BTreeMap::from([(0, 10), (3, 42)])));
        assert_eq!("2026-11-30T00:00:00Z".parse::<StartAt>().unwrap(), StartAt::Time(1_795_996_800_000));
        assert_eq!("2026-11-30".parse::<StopAt>().unwrap(), StopAt::Time(1_795_996_800_000));
        assert_eq!("latest".parse::<StopAt>().unwrap(), StopAt::Latest);
        assert!("yesterday".parse::<StopAt>().is_err());
        assert!("nonsense".parse::<StartAt>().is_err());
    }
}
