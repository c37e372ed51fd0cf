//! `clickagg explain`: which batches make up one billing count. Every count is a sum
//! over batch rows (`sql/001_ad_clicks_minute.sql`): per Kafka partition, the batch's
//! first offset, the offset its row was cut at, the clicks counted in between and who
//! wrote it. Listed here so that a disputed minute can be traced to offset ranges of
//! the topic, which `kcat` or a replay can read again.
//!
//! With `--records` it reads those offset ranges again and decides them the way a replay
//! does (the window before each range rebuilt from the log, the recorded cross-partition
//! decisions followed): the click IDs that counted, and those that did not with the
//! reason. Every decision is a function of the log (docs/DESIGN.md §7), so this re-read
//! decides as the member did, and the clicks it counts add up to the count.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use clap::{Args, ValueEnum};
use rdkafka::consumer::{CommitMode, Consumer as _};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::click::{rfc3339, Minute};
use crate::config::Settings;
use crate::dedup::Verdict;
use crate::pipeline::{RecordedPins, Stages, StagesConfig, Traced};
use crate::planner::{plan_replay, Planner, ReplayPlan};
use crate::sink::read::BatchOfCount;
use crate::sink::{read_version, Sink, Writer};
use crate::source::{self, ClickIds, RangeReader, Ranges};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExplainFormat {
    /// Aligned columns and a total line, for people.
    Table,
    /// One JSON object: the count and its batches.
    Json,
}

/// Which batches (partition, offset range, writer) make up the count of one ad in one
/// minute. Their clicks add up to what `query --by minute` prints for that bucket.
#[derive(Debug, Args, Clone)]
pub struct ExplainArgs {
    /// The ad.
    #[arg(long = "ad", value_name = "ID")]
    pub ad: u64,
    /// The minute (UTC), RFC 3339 (2026-11-30T08:15:00Z); a time inside a minute means
    /// that minute.
    #[arg(long, value_parser = parse_minute)]
    pub minute: DateTime<Utc>,
    /// Only rows aggregated from this Kafka topic. Default: every topic in the table.
    #[arg(long, value_name = "TOPIC")]
    pub only_topic: Option<String>,
    #[arg(long, value_enum, default_value_t = ExplainFormat::Table)]
    pub format: ExplainFormat,
    /// Also read the batches' records from Kafka again and show, per record of this ad
    /// and minute, whether it counted, and why not.
    #[arg(long)]
    pub records: bool,
}

/// One batch of a count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Batch {
    pub topic: String,
    pub partition: u32,
    /// The batch's first offset.
    pub first_offset: u64,
    /// The offset the row was cut at: the batch's clicks of this bucket are those read
    /// from `first_offset` through here.
    pub last_offset: i64,
    pub clicks: u64,
    /// `member` (a consumer of the group), `replay`, or `supersede` (`replay
    /// --supersede`, which outranks every earlier row of the batch).
    pub writer: &'static str,
    /// For `supersede`: its generation (each superseding replay of a batch is one more).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// The stored version (2 x `last_offset` + 1 for a member, + 0 for a replay; for a
    /// superseding replay 2 x (`last_offset` + generation x batch size)).
    pub version: u64,
    pub written_at: String,
    /// With `--records`: this ad's clicks of this minute among the batch's offsets, as
    /// re-read and decided again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub records: Option<Vec<RecordVerdict>>,
    /// With `--records`, why they could not be read (retention deleted them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub records_missing: Option<String>,
}

/// One record of a batch as `--records` decides it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecordVerdict {
    pub offset: i64,
    pub click_id: String,
    pub counted: bool,
    /// Why it counted or not.
    pub reason: String,
}

/// A count and the batches it is the sum of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub ad_id: u64,
    pub minute: String,
    pub clicks: u64,
    pub batches: Vec<Batch>,
    /// With `--records`: how many of the records listed counted (equal to `clicks` when
    /// every batch could be read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub records_counted: Option<u64>,
}

impl Explanation {
    /// `batch_offsets` is the topic's batch size, which reads a superseding replay's
    /// versions back.
    pub fn new(ad_id: u64, minute: Minute, batch_offsets: u64, rows: Vec<BatchOfCount>) -> Explanation {
        let batches: Vec<Batch> = rows
            .into_iter()
            .map(|r| {
                let (last_offset, writer) = read_version(r.version, r.batch_start, batch_offsets);
                Batch {
                    topic: r.topic,
                    partition: r.partition,
                    first_offset: r.batch_start,
                    last_offset,
                    clicks: r.clicks,
                    writer: match writer {
                        Writer::Member => "member",
                        Writer::Replay => "replay",
                        Writer::Supersede { .. } => "supersede",
                    },
                    generation: match writer {
                        Writer::Supersede { generation, .. } => Some(generation),
                        _ => None,
                    },
                    version: r.version,
                    written_at: rfc3339(r.written_at),
                    records: None,
                    records_missing: None,
                }
            })
            .collect();
        let clicks = batches.iter().map(|b| b.clicks).sum();
        Explanation { ad_id, minute: minute.to_rfc3339(), clicks, batches, records_counted: None }
    }

    /// Fills in each batch's records from what a re-read decided (`traced`, per topic, in
    /// the order applied, warm-up included) and the click IDs it kept.
    pub fn add_records(&mut self, ad_id: u64, minute: Minute, topic: &str, traced: &[Traced], ids: &ClickIds) {
        // Per (partition, fingerprint), the latest sighting read so far: the one a
        // duplicate is judged against.
        let mut latest: HashMap<(i32, u128), i64> = HashMap::new();
        let mut verdicts: BTreeMap<(i32, i64), RecordVerdict> = BTreeMap::new();
        for t in traced {
            let Some(click) = &t.click else { continue };
            let earlier = latest.insert((t.partition, click.click_id.0), t.offset);
            if t.warm || click.ad_id != ad_id || click.minute != minute {
                continue;
            }
            let (counted, reason) = reason_for(t.verdict, earlier);
            let click_id = ids.get(&(t.partition, t.offset)).cloned().unwrap_or_default();
            verdicts.insert((t.partition, t.offset), RecordVerdict { offset: t.offset, click_id, counted, reason });
        }
        for b in self.batches.iter_mut().filter(|b| b.topic == topic && b.records_missing.is_none()) {
            let p = b.partition as i32;
            let range = (p, b.first_offset as i64)..=(p, b.last_offset);
            b.records = Some(verdicts.range(range).map(|(_, v)| v.clone()).collect());
        }
        self.records_counted =
            Some(self.batches.iter().flat_map(|b| b.records.iter().flatten()).filter(|r| r.counted).count() as u64);
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "ad {}, minute {}: {} clicks from {} batch rows",
            self.ad_id,
            self.minute,
            self.clicks,
            self.batches.len()
        );
        if self.batches.is_empty() {
            return out;
        }
        let topic_width = self.batches.iter().map(|b| b.topic.len()).max().unwrap_or(0).max(5);
        let _ = writeln!(
            out,
            "{:<topic_width$}  {:>9}  {:>25}  {:>8}  {:<12}  written at",
            "topic", "partition", "offsets", "clicks", "writer"
        );
        for b in &self.batches {
            let _ = writeln!(
                out,
                "{:<topic_width$}  {:>9}  {:>25}  {:>8}  {:<12}  {}",
                b.topic,
                b.partition,
                format!("{}..={}", b.first_offset, b.last_offset),
                b.clicks,
                // A superseding replay's rows with their generation: `supersede g2`.
                b.generation.map_or(b.writer.to_string(), |g| format!("{} g{g}", b.writer)),
                b.written_at
            );
        }
        let _ = writeln!(out, "{:<topic_width$}  {:>9}  {:>25}  {:>8}", "total", "", "", self.clicks);
        let Some(counted) = self.records_counted else { return out };
        for b in &self.batches {
            let _ = writeln!(
                out,
                "\n{} partition {}, offsets {}..={}:",
                b.topic, b.partition, b.first_offset, b.last_offset
            );
            if let Some(why) = &b.records_missing {
                let _ = writeln!(out, "  records not read: {why}");
            }
            for r in b.records.iter().flatten() {
                let verdict = if r.counted { "counted" } else { "not counted" };
                let _ = writeln!(out, "  {:>12}  {:<40}  {:<11}  {}", r.offset, r.click_id, verdict, r.reason);
            }
        }
        let _ = writeln!(out, "\nrecords counted: {counted} (the count: {})", self.clicks);
        out
    }
}

/// Whether a verdict counts, and why, in words; `earlier` is the offset of the latest
/// earlier sighting of the click ID in the partition.
fn reason_for(verdict: Option<Verdict>, earlier: Option<i64>) -> (bool, String) {
    match verdict {
        Some(Verdict::First) => (true, "first sighting of its click ID on this partition within the window".into()),
        Some(Verdict::Own) => (true, "the sighting that counted, read again".into()),
        Some(Verdict::Duplicate) => (
            false,
            match earlier {
                Some(o) => format!("duplicate: sighted at offset {o} of this partition within the window"),
                None => "duplicate: sighted earlier on this partition within the window".into(),
            },
        ),
        Some(Verdict::UncountedDuplicate) => {
            (false, "duplicate of a copy that did not count, because a copy on another partition did (pinned)".into())
        }
        Some(Verdict::CrossDuplicate) => {
            (false, "copy of a click counted on another partition within the window (pinned)".into())
        }
        Some(v @ (Verdict::Undecidable | Verdict::Wait)) => (false, format!("not decided ({v:?})")),
        None => (false, "not decided".into()),
    }
}

fn parse_minute(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| format!("{s:?} is not RFC 3339 (2026-11-30T08:15:00Z)"))
}

pub async fn run(s: &Settings, args: &ExplainArgs) -> Result<std::process::ExitCode> {
    let seconds = u32::try_from(args.minute.timestamp())
        .with_context(|| format!("--minute {} is outside what ClickHouse DateTime holds", args.minute))?;
    let minute = Minute::from_epoch_seconds(seconds);
    let sink = Sink::new(&s.clickhouse);
    let rows = sink
        .batches_of(args.ad, minute.epoch_seconds(), args.only_topic.as_deref())
        .await
        .with_context(|| format!("reading the batch rows of the count in database {}", sink.database()))?;
    let mut e = Explanation::new(args.ad, minute, s.batch_offsets().get(), rows);
    if args.records {
        read_records(s, &sink, &mut e, args.ad, minute).await?;
    }
    match args.format {
        ExplainFormat::Table => print!("{}", e.table()),
        ExplainFormat::Json => println!("{}", serde_json::to_string(&e).expect("an explanation serializes")),
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Reads the batches' records again (`--records`): per topic and settings version, one
/// re-read of the hull of its batches' offsets per partition, decided as a replay
/// decides, under the settings the topic records for those offsets.
async fn read_records(s: &Settings, sink: &Sink, e: &mut Explanation, ad_id: u64, minute: Minute) -> Result<()> {
    e.records_counted = Some(0);
    let topics: std::collections::BTreeSet<String> = e.batches.iter().map(|b| b.topic.clone()).collect();
    for topic in topics {
        let mut on = s.clone();
        on.kafka.topic = topic.clone();
        let history = sink.rules_history(&topic).await.context("reading the recorded dedup settings")?;
        let consumer = source::lookup_consumer(&on.kafka)?;
        let mut lows = BTreeMap::new();
        // Per settings version, the settings it decides under and the offsets to decide again.
        let mut by_version: BTreeMap<u32, (Settings, Ranges)> = BTreeMap::new();
        for b in e.batches.iter_mut().filter(|b| b.topic == topic) {
            let p = b.partition as i32;
            let (first, last) = (b.first_offset as i64, b.last_offset);
            if let std::collections::btree_map::Entry::Vacant(e) = lows.entry(p) {
                let (low, _) = consumer
                    .fetch_watermarks(&topic, p, std::time::Duration::from_secs(15))
                    .with_context(|| format!("the offsets of {topic} partition {p}"))?;
                e.insert(low);
            }
            if lows[&p] > first {
                b.records_missing =
                    Some(format!("retention deleted them (the partition starts at offset {} now)", lows[&p]));
                continue;
            }
            let rules = history.at(p, first);
            let (_, ranges) = by_version.entry(rules.map_or(1, |v| v.version)).or_insert_with(|| {
                (rules.map_or_else(|| on.clone(), |v| on.with_recorded(&v.rules)), Ranges::default())
            });
            let range = ranges.partitions.entry(p).or_insert((first, last + 1));
            *range = (range.0.min(first), range.1.max(last + 1));
        }
        let (mut traced, mut ids) = (Vec::new(), ClickIds::new());
        for (under, ranges) in by_version.into_values() {
            let (more, more_ids) = trace(&under, sink, ranges, &lows).await?;
            traced.extend(more);
            ids.extend(more_ids);
        }
        e.add_records(ad_id, minute, &topic, &traced, &ids);
    }
    Ok(())
}

/// What a re-read decides for every record of `counted` (and of the warm-up before it),
/// with the click IDs of `counted`: the stages of a replay (private state, the recorded
/// pins) under settings `s`, with nothing written anywhere.
async fn trace(
    s: &Settings,
    sink: &Sink,
    counted: Ranges,
    lows: &BTreeMap<i32, i64>,
) -> Result<(Vec<Traced>, ClickIds)> {
    let within = counted.clone();
    let ReplayPlan { starts, read, .. } = plan_replay(s, sink, counted, lows).await?;
    let never = CancellationToken::new();
    let mut stages = Stages::new(StagesConfig::from_settings(s), Default::default());
    stages.trace_records();
    let mut planner = Planner::for_replay(s, sink.clone())?;
    stages.assign(starts.into_iter().map(|st| (st, RecordedPins::before(st.read_from))).collect());
    let mut reader = RangeReader::for_settings(s, "explain", &read, crate::schema_registry::decoder(s)?)?;
    reader.keep_click_ids(within);
    let mut traced = Vec::new();
    while let Some(records) = reader.next_batch().await.context("reading the topic")? {
        planner.ensure_pins(&mut stages, &records, &never, s.pipeline.max_backoff).await?;
        let prepared = stages.prepare(records);
        stages.apply(prepared, Vec::new());
        traced.extend(stages.take_trace());
        // The rows are not written: drop them as they pile up.
        if stages.unflushed_buckets() >= s.pipeline.max_unflushed_buckets {
            stages.cut(CommitMode::Async);
        }
    }
    Ok((traced, reader.take_click_ids()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(partition: u32, batch_start: u64, clicks: u64, version: u64) -> BatchOfCount {
        BatchOfCount { topic: "clicks".into(), partition, batch_start, clicks, version, written_at: 1_796_083_200 }
    }

    #[test]
    fn each_batch_reads_back_its_offset_range_and_writer_and_the_clicks_add_up() {
        let minute = Minute::from_epoch_seconds(1_796_083_200);
        let e = Explanation::new(
            12,
            minute,
            1000,
            vec![row(0, 1000, 3, 2 * 1999 + 1), row(3, 5000, 2, 2 * 5042), row(3, 6000, 4, 2 * (6010 + 2 * 1000))],
        );
        assert_eq!(e.clicks, 9);
        assert_eq!((e.batches[0].first_offset, e.batches[0].last_offset, e.batches[0].writer), (1000, 1999, "member"));
        assert_eq!((e.batches[1].first_offset, e.batches[1].last_offset, e.batches[1].writer), (5000, 5042, "replay"));
        // A superseding replay's row reads back as the offset it was cut at, generation 2.
        let b = &e.batches[2];
        assert_eq!((b.first_offset, b.last_offset, b.writer, b.generation), (6000, 6010, "supersede", Some(2)));
        let table = e.table();
        assert!(table.starts_with("ad 12, minute 2026-12-01T00:00:00Z: 9 clicks from 3 batch rows\n"), "{table}");
        assert!(table.contains("1000..=1999") && table.contains("5000..=5042"), "{table}");
        assert!(table.contains("6000..=6010") && table.contains("supersede g2"), "{table}");
        assert!(table.lines().last().unwrap().starts_with("total") && table.trim_end().ends_with(" 9"), "{table}");
        let json: serde_json::Value = serde_json::to_value(&e).unwrap();
        assert_eq!(json["batches"][1]["writer"], "replay");
        assert_eq!(json["batches"][2]["generation"], 2);
        assert!(json["batches"][1].get("generation").is_none());
        assert_eq!(json["clicks"], 9);
    }

    #[test]
    fn records_are_those_of_the_ad_and_minute_inside_each_batch_with_the_reason_they_counted_or_not() {
        use crate::click::Click;
        use crate::dedup::Fingerprint;
        let minute = Minute::from_epoch_seconds(1_796_083_200);
        let other = Minute::from_epoch_seconds(1_796_083_260);
        let t = |offset: i64, warm: bool, id: u128, ad_id: u64, minute: Minute, verdict: Verdict| Traced {
            partition: 0,
            offset,
            warm,
            click: Some(Click { click_id: Fingerprint(id), ad_id, ts_ms: 0, minute }),
            verdict: Some(verdict),
        };
        let traced = vec![
            // Warm-up: click 1 sighted before the batch.
            t(990, true, 1, 12, minute, Verdict::First),
            t(1000, false, 1, 12, minute, Verdict::Duplicate),
            t(1001, false, 2, 12, minute, Verdict::First),
            t(1002, false, 3, 12, other, Verdict::First),
            t(1003, false, 4, 99, minute, Verdict::First),
            t(1004, false, 5, 12, minute, Verdict::CrossDuplicate),
            Traced { partition: 0, offset: 1005, warm: false, click: None, verdict: None },
            t(1006, false, 2, 12, minute, Verdict::Duplicate),
            // Past the row's cut: not this row's.
            t(1500, false, 6, 12, minute, Verdict::First),
        ];
        let ids: ClickIds = [(1000, "c1"), (1001, "c2"), (1004, "c5"), (1006, "c2")]
            .into_iter()
            .map(|(o, id)| ((0, o), id.to_string()))
            .collect();
        let mut e = Explanation::new(12, minute, 1000, vec![row(0, 1000, 1, 2 * 1499 + 1)]);
        e.add_records(12, minute, "clicks", &traced, &ids);
        let records = e.batches[0].records.clone().unwrap();
        let listed: Vec<(i64, &str, bool)> =
            records.iter().map(|r| (r.offset, r.click_id.as_str(), r.counted)).collect();
        assert_eq!(listed, vec![(1000, "c1", false), (1001, "c2", true), (1004, "c5", false), (1006, "c2", false)]);
        assert!(records[0].reason.contains("offset 990"), "{records:?}");
        assert!(records[2].reason.contains("another partition"), "{records:?}");
        assert!(records[3].reason.contains("offset 1001"), "{records:?}");
        assert_eq!(e.records_counted, Some(1));
        let table = e.table();
        assert!(table.contains("records counted: 1 (the count: 1)"), "{table}");
        assert!(table.contains("c5") && table.contains("not counted"), "{table}");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["batches"][0]["records"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn a_count_without_rows_says_so() {
        let e = Explanation::new(7, Minute::from_epoch_seconds(60), 1000, vec![]);
        assert_eq!(e.table(), "ad 7, minute 1970-01-01T00:01:00Z: 0 clicks from 0 batch rows\n");
    }
}
