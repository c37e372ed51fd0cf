//! `clickagg explain`: which batches make up one billing count. Every count is a sum
//! over batch rows (`sql/001_ad_clicks_minute.sql`): per Kafka partition, the batch's
//! first offset, the offset its row was cut at, the clicks counted in between and who
//! wrote it. Listed here so that a disputed minute can be traced to offset ranges of
//! the topic, which `kcat` or a replay can read again.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::click::{rfc3339, Minute};
use crate::config::Settings;
use crate::sink::read::BatchOfCount;
use crate::sink::{read_version, Sink, Writer};

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
    /// `member` (a consumer of the group) or `replay`.
    pub writer: &'static str,
    /// The stored version (2 x `last_offset` + 1 for a member, + 0 for a replay).
    pub version: u64,
    pub written_at: String,
}

/// A count and the batches it is the sum of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub ad_id: u64,
    pub minute: String,
    pub clicks: u64,
    pub batches: Vec<Batch>,
}

impl Explanation {
    pub fn new(ad_id: u64, minute: Minute, rows: Vec<BatchOfCount>) -> Explanation {
        let batches: Vec<Batch> = rows
            .into_iter()
            .map(|r| {
                let (last_offset, writer) = read_version(r.version);
                Batch {
                    topic: r.topic,
                    partition: r.partition,
                    first_offset: r.batch_start,
                    last_offset,
                    clicks: r.clicks,
                    writer: match writer {
                        Writer::Member => "member",
                        Writer::Replay => "replay",
                    },
                    version: r.version,
                    written_at: rfc3339(r.written_at),
                }
            })
            .collect();
        Explanation { ad_id, minute: minute.to_rfc3339(), clicks: batches.iter().map(|b| b.clicks).sum(), batches }
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
            "{:<topic_width$}  {:>9}  {:>25}  {:>8}  {:<6}  written at",
            "topic", "partition", "offsets", "clicks", "writer"
        );
        for b in &self.batches {
            let _ = writeln!(
                out,
                "{:<topic_width$}  {:>9}  {:>25}  {:>8}  {:<6}  {}",
                b.topic,
                b.partition,
                format!("{}..={}", b.first_offset, b.last_offset),
                b.clicks,
                b.writer,
                b.written_at
            );
        }
        let _ = writeln!(out, "{:<topic_width$}  {:>9}  {:>25}  {:>8}", "total", "", "", self.clicks);
        out
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
    let e = Explanation::new(args.ad, minute, rows);
    match args.format {
        ExplainFormat::Table => print!("{}", e.table()),
        ExplainFormat::Json => println!("{}", serde_json::to_string(&e).expect("an explanation serializes")),
    }
    Ok(std::process::ExitCode::SUCCESS)
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
        let e = Explanation::new(12, minute, vec![row(0, 1000, 3, 2 * 1999 + 1), row(3, 5000, 2, 2 * 5042)]);
        assert_eq!(e.clicks, 5);
        assert_eq!((e.batches[0].first_offset, e.batches[0].last_offset, e.batches[0].writer), (1000, 1999, "member"));
        assert_eq!((e.batches[1].first_offset, e.batches[1].last_offset, e.batches[1].writer), (5000, 5042, "replay"));
        let table = e.table();
        assert!(table.starts_with("ad 12, minute 2026-12-01T00:00:00Z: 5 clicks from 2 batch rows\n"), "{table}");
        assert!(table.contains("1000..=1999") && table.contains("5000..=5042"), "{table}");
        assert!(table.lines().last().unwrap().starts_with("total") && table.trim_end().ends_with(" 5"), "{table}");
        let json: serde_json::Value = serde_json::to_value(&e).unwrap();
        assert_eq!(json["batches"][1]["writer"], "replay");
        assert_eq!(json["clicks"], 5);
    }

    #[test]
    fn a_count_without_rows_says_so() {
        let e = Explanation::new(7, Minute::from_epoch_seconds(60), vec![]);
        assert_eq!(e.table(), "ad 7, minute 1970-01-01T00:01:00Z: 0 clicks from 0 batch rows\n");
    }
}
