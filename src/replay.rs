//! `clickagg replay`: backfill by re-reading a range of the topic through the same
//! stages as the live pipeline (decode → dead letters → dedup → aggregate → flush).
//!
//! Why a replay changes no correct count (docs/DESIGN.md §5 and §6): each partition counts
//! from a batch boundary (the requested offset rounded down), so every batch is rebuilt
//! from its first offset; and every dedup decision is a function of the log: the replay
//! rebuilds its own dedup state by first reading, without counting, the window of record
//! time before that boundary (`position`), and follows the cross-partition decisions
//! the live members recorded (`clickagg_pins`). So every row it writes is one the live
//! pipeline wrote or would write — same `(clicks, version)`, or a lower version, which
//! loses — whether or not Redis still holds anything. It never touches Redis: its state
//! lives in its own memory and is gone when it ends.
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

use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::flusher::{Flusher, FlusherConfig};
use crate::health::Health;
use crate::pipeline::{BatchStats, RecordedPins, Stages, StagesConfig};
use crate::planner::{Planner, ReplayPlan};
use crate::position::BatchOffsets;
use crate::position::{self, Start};
use crate::retry::FatalSignal;
use crate::sink::Sink;
use crate::sink::Writer;
use crate::source::{self, RangeReader, Ranges};
use crate::time::parse_time_ms;

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
    /// Rewrite the range so that its rows replace every row written before in its
    /// batches, the members' included: to repair a wrong past count (guide, "Repairing
    /// a range"). Whole batches only, each already committed by the group; `--to` is
    /// rounded up to the end of its batch (down, for a partition with no record at or
    /// after it: the batch open at its log end is left to the members).
    #[arg(long)]
    pub supersede: bool,
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

/// What one partition offers: (low, high) watermarks, the offset for `--from`, for `--to`.
#[derive(Debug, Clone, Copy)]
pub struct PartitionMarks {
    pub low: i64,
    pub high: i64,
    pub from: Option<i64>,
    pub to: Option<i64>,
}

/// The ranges a replay counts, from the broker's answers: from the batch boundary at or
/// below `--from` (the log end when no record is that late) to `--to`. Pure, so it is
/// tested alone.
pub fn plan_ranges(n: BatchOffsets, marks: &BTreeMap<i32, PartitionMarks>) -> Ranges {
    let mut ranges = Ranges::default();
    for (&p, m) in marks {
        let start = position::boundary(n, m.low, m.high, Some(m.from.unwrap_or(m.high)));
        let end = m.to.unwrap_or(m.high).min(m.high);
        ranges.partitions.insert(p, (start, end.max(start)));
    }
    ranges
}

/// The partitions whose counted range ends at their log end because no record of theirs
/// is stamped at or after `--to <time>`: everything they hold lies before it.
pub type EndedBefore = std::collections::BTreeSet<i32>;

/// The offsets a replay counts, each partition's log start, and the partitions with no
/// record at or after `--to` (a time), from the broker.
pub fn counted_ranges(s: &Settings, from: &StartAt, to: StopAt) -> Result<(Ranges, BTreeMap<i32, i64>, EndedBefore)> {
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
    let counted = plan_ranges(s.batch_offsets(), &marks);
    let ended = match to {
        StopAt::Time(_) => marks.iter().filter(|(_, m)| m.to.is_none()).map(|(&p, _)| p).collect(),
        StopAt::Latest => EndedBefore::new(),
    };
    Ok((counted, marks.iter().map(|(&p, m)| (p, m.low)).collect(), ended))
}

/// What a superseding replay rewrites.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Superseding {
    /// The whole batches it rewrites, per partition `[start, end)`.
    pub whole: Ranges,
    /// Per partition with no record at or after `--to`, the part of its range in the batch
    /// still open at its log end, `[start, log end)`: left as the members write it.
    pub left_open: BTreeMap<i32, (i64, i64)>,
}

/// The whole batches a superseding replay rewrites: `counted` (which starts at batch
/// boundaries) with each end rounded up to the end of its batch. Refused, naming the
/// partition, when a batch is not yet committed by the group: a member still writing it
/// would lose its later rows to the supersede's. Pure, so it is tested alone.
///
/// A partition of `ended` (no record at or after `--to`) is read to its log end, and
/// everything it holds lies before `--to`. Its last batch is still open: the records
/// that will fill it come after `--to`, and their member rows would lose to the
/// supersede's, so that batch is left out (`left_open`) and its end rounded down instead:
/// the batches before it are complete, and superseded once the group committed them.
/// Rounded up, it was refused for as long as the partition stayed idle.
pub fn supersede_ranges(
    n: BatchOffsets,
    counted: &Ranges,
    committed: &BTreeMap<i32, Option<i64>>,
    ended: &EndedBefore,
) -> std::result::Result<Superseding, String> {
    let n = n.get() as i64;
    let mut out = Superseding::default();
    for (&p, &(start, end)) in &counted.partitions {
        if end <= start {
            continue;
        }
        let end = if ended.contains(&p) {
            let whole = end / n * n;
            if whole < end {
                out.left_open.insert(p, (whole.max(start), end));
            }
            if whole <= start {
                continue;
            }
            whole
        } else {
            (end + n - 1) / n * n
        };
        match committed.get(&p).copied().flatten() {
            Some(c) if c >= end => {
                out.whole.partitions.insert(p, (start, end));
            }
            c => {
                let at = c.map_or("nothing committed".to_string(), |c| format!("committed up to {c}"));
                return Err(format!(
                    "partition {p}: the batch [{}, {end}) is not finished by the group ({at}); --supersede \
                     rewrites only batches the members are done with: give an earlier --to, or wait",
                    end - n
                ));
            }
        }
    }
    Ok(out)
}

/// What a superseding replay did on top of a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Superseded {
    /// The generation its rows were written at.
    pub generation: u64,
    /// The buckets of its batches it found no click for, written as zero.
    pub zeroed: u64,
}

/// What a replay did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// The offsets counted (the warm-up before them is in `stats.warmup`).
    pub ranges: Ranges,
    pub stats: BatchStats,
    pub rows_written: u64,
    pub elapsed: Duration,
    pub superseded: Option<Superseded>,
    /// Batches open at a partition's log end that a superseding replay left to the members
    /// (`Superseding::left_open`).
    pub left_open: BTreeMap<i32, (i64, i64)>,
}

impl Summary {
    pub fn report(&self) -> String {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let s = &self.stats;
        let mut superseded = self.superseded.map_or(String::new(), |x| {
            format!(
                "; superseded every earlier row of its batches (generation {}, {} buckets found empty and written \
                 as 0)",
                x.generation, x.zeroed
            )
        });
        for (p, (from, to)) in &self.left_open {
            superseded += &format!(
                "; partition {p} has no record at or after --to: offsets [{from}, {to}) lie in the batch still open at \
                 its log end, left as the members write it (supersede again once that batch is complete)"
            );
        }
        format!(
            "replayed {} records in {:.1}s ({:.0} records/s): {} counted, {} duplicates ({} copies on other \
             partitions), {} invalid; {} rows written; {} records read before the range to rebuild dedup state{}",
            s.records,
            secs,
            (s.records + s.warmup) as f64 / secs,
            s.counted,
            s.duplicates,
            s.cross_partition,
            s.invalid,
            self.rows_written,
            s.warmup,
            superseded
        )
    }
}

/// Runs the replay to its end (or until `shutdown`, after a final flush).
///
/// Every range is decided under the settings version the topic records for it
/// (`clickagg settings`): the window and validation limits of that version, whatever
/// this invocation's configuration says, so a backfill writes the rows the members
/// wrote. A range that crosses a settings change is replayed in one pass per version.
pub async fn replay(s: &Settings, args: &ReplayArgs, shutdown: CancellationToken) -> Result<Summary> {
    let from: StartAt = args.from.parse().map_err(anyhow::Error::msg)?;
    let to: StopAt = args.to.parse().map_err(anyhow::Error::msg)?;
    let started = Instant::now();
    let sink = Sink::new(&s.clickhouse);
    let ch = &sink;
    crate::planner::until_done("registering pipeline.batch_offsets", s.pipeline.max_backoff, &shutdown, || async {
        Ok(ch.register_batch_offsets(&s.kafka.topic, s.pipeline.batch_offsets).await?)
    })
    .await?;
    let history = crate::planner::until_done(
        "reading the recorded dedup settings",
        s.pipeline.max_backoff,
        &shutdown,
        || async { Ok(ch.register_rules(&s.kafka.topic, &s.rules(), None).await?) },
    )
    .await?;
    let settings = s.clone();
    let (counted, lows, ended) = tokio::task::spawn_blocking(move || counted_ranges(&settings, &from, to)).await??;
    let mut left_open = BTreeMap::new();
    let (counted, writer) = if args.supersede {
        let (k, group, topic) = (s.kafka.clone(), s.kafka.group.clone(), s.kafka.topic.clone());
        let offsets = tokio::task::spawn_blocking(move || crate::seal::due::group_offsets(&k, &group, &topic))
            .await?
            .context("reading the group's committed offsets")?;
        let committed = offsets.into_iter().map(|(p, (c, _, _))| (p, c)).collect();
        let Superseding { whole, left_open: open } =
            supersede_ranges(s.batch_offsets(), &counted, &committed, &ended).map_err(anyhow::Error::msg)?;
        for (p, (from, to)) in &open {
            tracing::warn!(
                partition = p,
                from,
                to,
                "no record at or after --to: these offsets lie in the batch still open at the partition's log end, \
                 which is left as the members write it (its later records would lose their rows to the supersede's)"
            );
        }
        left_open = open;
        let n = s.batch_offsets().get();
        let generation =
            crate::planner::until_done("reading the rows to supersede", s.pipeline.max_backoff, &shutdown, || async {
                Ok(ch.next_supersede_generation(&s.kafka.topic, &whole.partitions, n).await?)
            })
            .await?;
        info!(generation, ranges = ?whole.partitions, "superseding every earlier row of these batches");
        (whole, Writer::Supersede { generation, batch_offsets: n })
    } else {
        (counted, Writer::Replay)
    };

    let mut summary = Summary { ranges: counted.clone(), left_open, ..Summary::default() };
    for (i, version) in history.versions.iter().enumerate() {
        let next = history.versions.get(i + 1);
        let from_of = |v: &crate::sink::RulesVersion, p: i32| {
            if v.version == 1 {
                0
            } else {
                v.effective.get(&p).copied().unwrap_or(0)
            }
        };
        let mut part = Ranges::default();
        for (&p, &(start, end)) in &counted.partitions {
            let lo = start.max(from_of(version, p));
            let hi = end.min(next.map_or(i64::MAX, |n| from_of(n, p)));
            if lo < hi || (history.versions.len() == 1 && start == end) {
                part.partitions.insert(p, (lo, hi.max(lo)));
            }
        }
        if part.partitions.is_empty() {
            continue;
        }
        let under = s.with_recorded(&version.rules);
        if history.versions.len() > 1 || !s.rules().differences(&version.rules).is_empty() {
            info!(version = version.version, ranges = ?part.partitions, "replaying under the settings the topic records for these ranges");
        }
        let plan = crate::planner::plan_replay(&under, &sink, part, &lows).await?;
        let done = run_plan(&under, &sink, plan, args, writer, &shutdown).await?;
        summary.stats.add(&done.stats);
        summary.rows_written += done.rows_written;
        if shutdown.is_cancelled() {
            break;
        }
    }
    if let Writer::Supersede { generation, batch_offsets } = writer {
        if !shutdown.is_cancelled() {
            let zeroed = zero_what_was_not_superseded(s, &sink, &counted, generation, batch_offsets, &shutdown).await?;
            summary.superseded = Some(Superseded { generation, zeroed });
        }
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// After a superseding replay's rows are all written: the buckets of its batches that
/// still hold only earlier rows had no click in the replay, so they are written as zero
/// at its generation. Killed before (or during) this, the replay is run again: a new
/// generation rewrites every batch and then zeroes what it did not write.
async fn zero_what_was_not_superseded(
    s: &Settings,
    sink: &Sink,
    ranges: &Ranges,
    generation: u64,
    batch_offsets: u64,
    shutdown: &CancellationToken,
) -> Result<u64> {
    let topic = &s.kafka.topic;
    let rows =
        crate::planner::until_done("reading the rows not superseded", s.pipeline.max_backoff, shutdown, || async {
            Ok(sink.buckets_not_superseded(topic, &ranges.partitions, batch_offsets, generation).await?)
        })
        .await?;
    stop_point!("supersede:before-zeros");
    let writer = Writer::Supersede { generation, batch_offsets };
    crate::planner::until_done("writing the buckets found empty", s.pipeline.max_backoff, shutdown, || async {
        Ok(sink.insert(topic, &rows, writer).await?)
    })
    .await?;
    if !rows.is_empty() {
        info!(buckets = rows.len(), generation, "buckets of the superseded batches with no click written as 0");
    }
    Ok(rows.len() as u64)
}

/// Reads one plan through the stages and the flusher (no commits) to its end.
async fn run_plan(
    s: &Settings,
    sink: &Sink,
    plan: ReplayPlan,
    args: &ReplayArgs,
    writer: Writer,
    shutdown: &CancellationToken,
) -> Result<Summary> {
    let ReplayPlan { starts, counted: ranges, read } = plan;
    info!(ranges = ?ranges.partitions, records = ranges.records(), warmup = read.records() - ranges.records(), "replay planned");
    // Pins are loaded a window at a time as the readers advance (`Stages::ensure_pins`).
    let with_pins: Vec<(Start, RecordedPins)> =
        starts.into_iter().map(|st| (st, RecordedPins::before(st.read_from))).collect();
    let dead_letters = if s.dead_letter.enabled && !args.no_dead_letters {
        let topic = s.dead_letter_topic();
        source::ensure_topic(&s.kafka, &topic, 1).await?;
        Some(DeadLetters::new(source::producer_config(&s.kafka), &s.kafka.topic, topic, "replay")?)
    } else {
        None
    };
    let health = Health::new();
    let fatal = FatalSignal::default();
    let flusher = Flusher::start(FlusherConfig {
        sink: sink.clone(),
        topic: s.kafka.topic.clone(),
        writer,
        committer: None,
        dead_letters,
        cache: None,
        health: health.clone(),
        max_backoff: s.pipeline.max_backoff,
        fatal: fatal.clone(),
    });
    // No shared cache: every reader of a replay is private, and nothing of it touches Redis.
    let mut stages = Stages::new(StagesConfig::from_settings(s), health.board());
    let mut planner = Planner::for_replay(s, sink.clone())?;
    stages.assign(with_pins);

    let mut reader = RangeReader::for_settings(s, "replay", &read, crate::schema_registry::decoder(s)?)?;
    let progress = Progress::new(&read);
    let mut last_flush = Instant::now();
    loop {
        let batch = tokio::select! {
            _ = shutdown.cancelled() => break,
            message = fatal.raised() => bail!(message),
            b = reader.next_batch() => b.context("reading the topic")?,
        };
        let Some(records) = batch else { break };
        // Private state only: every verdict is made in `prepare`, none comes from Redis.
        planner.ensure_pins(&mut stages, &records, shutdown, s.pipeline.max_backoff).await?;
        let prepared = stages.prepare(records);
        stages.apply(prepared, Vec::new());
        // One flush per interval, as a member does: few large inserts, whatever the
        // batches do; a backlog half-way to the member's pause threshold cuts one early.
        let backlog = stages.unflushed_buckets() >= s.pipeline.max_unflushed_buckets / 2;
        if backlog || last_flush.elapsed() >= s.pipeline.flush_interval {
            flusher.send(cut(&mut stages, writer, reader.positions())).await;
            last_flush = Instant::now();
        }
        progress.update(&read, reader.positions(), &stages.totals);
    }
    // The last cut, at the end of the ranges or on SIGTERM / Ctrl-C (`shutdown`): by the
    // same rule as every other, so an interrupted supersede writes no batch part-way.
    let last = cut(&mut stages, writer, reader.positions());
    let deadline = Instant::now() + s.pipeline.drain_timeout.max(Duration::from_secs(60));
    if !flusher.drain(last, deadline).await {
        flusher.abandon();
        bail!(
            "ClickHouse did not take the last rows within the drain timeout; run the replay again (it is idempotent)"
        );
    }
    if let Ok(message) = tokio::time::timeout(Duration::ZERO, fatal.raised()).await {
        bail!(message);
    }
    progress.finish();
    Ok(Summary {
        ranges,
        stats: stages.totals,
        rows_written: flusher.rows_flushed(),
        elapsed: Duration::ZERO,
        superseded: None,
        left_open: BTreeMap::new(),
    })
}

/// A cut of a replay's rows; `reading` is where the reader is in each partition it has
/// not read to the end yet ([`RangeReader::positions`]).
///
/// A superseding replay cuts whole batches only: the complete ones, and the open batch of
/// every partition read to the end of its range (which ends at a batch end). Its rows are
/// stored above every row written before in their batches (`sink::stored_version`: the
/// lowest offset of generation `g` outranks the highest a member can reach), so a batch
/// cut part-way would replace the member's complete rows by a prefix of the batch, and
/// its counts would read short — sealed so, and adjusted in closed periods — until a
/// supersede ran to its end. That holds for the last cut too, after a SIGTERM or Ctrl-C:
/// the batches still open there are left as they are stored, and a run again rewrites
/// them. A plain replay's rows rank below the member's, so it cuts everything.
pub fn cut(stages: &mut Stages, writer: Writer, reading: impl Iterator<Item = (i32, i64)>) -> crate::pipeline::Job {
    match writer {
        Writer::Supersede { .. } => {
            let reading: std::collections::BTreeSet<i32> = reading.map(|(p, _)| p).collect();
            let finished: Vec<i32> = stages.counted_partitions().into_iter().filter(|p| !reading.contains(p)).collect();
            stages.cut_complete_batches(finished, CommitMode::Async)
        }
        Writer::Replay | Writer::Member => stages.cut(CommitMode::Async),
    }
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
    fn a_supersede_rewrites_whole_batches_the_group_has_committed_and_nothing_else() {
        let counted = Ranges { partitions: BTreeMap::from([(0, (1000, 2450)), (1, (300, 300)), (2, (0, 500))]) };
        let committed = BTreeMap::from([(0, Some(2500)), (1, None), (2, Some(700))]);
        let none_ended = EndedBefore::new();
        let whole = supersede_ranges(n(100), &counted, &committed, &none_ended).unwrap();
        // The end is rounded up to its batch's end; an empty range is left out.
        assert_eq!(whole.whole.partitions, BTreeMap::from([(0, (1000, 2500)), (2, (0, 500))]));
        assert!(whole.left_open.is_empty());
        // A batch the group is still in is refused, naming it.
        let behind = BTreeMap::from([(0, Some(2420)), (2, Some(700))]);
        let why = supersede_ranges(n(100), &counted, &behind, &none_ended).unwrap_err();
        assert!(
            why.contains("partition 0") && why.contains("[2400, 2500)") && why.contains("committed up to 2420"),
            "{why}"
        );
        let none = BTreeMap::from([(0, Some(2500)), (2, None)]);
        assert!(supersede_ranges(n(100), &counted, &none, &none_ended).unwrap_err().contains("nothing committed"));
    }

    // Issue 35, defect 6: `--to T` where a partition got no record after T (idle since):
    // its range ends at its log end, 2450, inside a batch no record will fill before
    // traffic resumes. Rounded up to 2500, it was refused ("not finished by the group
    // (committed up to 2450)") however long one waited. Its complete batches are
    // superseded; the open one is left to the members, whose rows for the records that
    // will fill it must not lose to the supersede's.
    #[test]
    fn a_partition_with_no_record_after_to_is_superseded_up_to_its_last_complete_batch() {
        // Partition 0 idle since T; partition 1 has records after T (its range ends at the
        // first, 730); partition 2 idle since T within its first batch.
        let counted = Ranges { partitions: BTreeMap::from([(0, (0, 2450)), (1, (0, 730)), (2, (0, 40))]) };
        let committed = BTreeMap::from([(0, Some(2450)), (1, Some(800)), (2, Some(40))]);
        let ended = EndedBefore::from([0, 2]);
        let s = supersede_ranges(n(100), &counted, &committed, &ended).unwrap();
        assert_eq!(s.whole.partitions, BTreeMap::from([(0, (0, 2400)), (1, (0, 800))]));
        assert_eq!(s.left_open, BTreeMap::from([(0, (2400, 2450)), (2, (0, 40))]));
        // Its complete batches must still be committed by the group: otherwise waiting helps.
        let behind = BTreeMap::from([(0, Some(2350)), (1, Some(800)), (2, Some(40))]);
        let why = supersede_ranges(n(100), &counted, &behind, &ended).unwrap_err();
        assert!(why.contains("partition 0") && why.contains("[2300, 2400)"), "{why}");
        // A log end on a batch boundary leaves nothing open.
        let even = Ranges { partitions: BTreeMap::from([(0, (0, 2400))]) };
        let s = supersede_ranges(n(100), &even, &committed, &ended).unwrap();
        assert_eq!((s.whole.partitions, s.left_open), (BTreeMap::from([(0, (0, 2400))]), BTreeMap::new()));
    }

    // Regression (issue 35): a SIGTERM during `replay --supersede` ended the run with the
    // ordinary cut, which wrote the open batch read part-way; stored above the member's
    // complete rows (generation versions), it read short until a supersede completed.
    #[test]
    fn a_superseding_replay_cuts_whole_batches_only_also_at_its_last_cut() {
        // Batches of 10, partitions 0 and 1 read privately from offset 0.
        let mut stages = crate::pipeline::test_support::reading();
        // Partition 0 superseding [0, 20), stopped after offset 14 (batch 10 read
        // part-way); partition 1 superseding [0, 10), read to its end (offsets 8 and 9
        // are transaction markers: nothing closes its batch but the end of the range).
        let clicks = crate::pipeline::test_support::clicks;
        let mut records = clicks(0, 0..15);
        records.extend(clicks(1, 0..8));
        let prepared = stages.prepare(records);
        stages.apply(prepared, Vec::new());
        let supersede = Writer::Supersede { generation: 1, batch_offsets: 10 };
        let job = cut(&mut stages, supersede, [(0, 15)].into_iter());
        let rows: Vec<(i32, i64, u64)> =
            job.flush.rows.iter().map(|r| (r.partition, r.batch_start, r.clicks)).collect();
        // Each row whole: the member's complete row of its batch holds as many clicks.
        assert_eq!(rows, [(0, 0, 10), (1, 0, 8)], "whole batches only, none read part-way");
        // What a row of batch 10 would have done: any offset of it at generation 1
        // outranks the member's complete row, whatever it holds.
        let partial = crate::sink::stored_version(14, supersede);
        assert!(partial > crate::sink::stored_version(19, Writer::Member));
        // A plain replay's rows rank below the member's: it cuts everything it read.
        let job = cut(&mut stages, Writer::Replay, [(0, 15)].into_iter());
        let rows: Vec<(i32, i64, u64)> =
            job.flush.rows.iter().map(|r| (r.partition, r.batch_start, r.clicks)).collect();
        assert_eq!(rows, [(0, 10, 5)]);
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
