//! `clickagg reconcile`: recount the clicks per ad per minute straight from the topic,
//! independently of Redis and of the live pipeline's state, and diff against ClickHouse.
//!
//! The recount applies the definition of what counts (guide, "What counts";
//! `dedup::PrivateScope`): the same validation as the pipeline (`click::decode`, judged
//! against record timestamps), and per partition in offset order, a click counts unless
//! an earlier sighting of its ID lies within the dedup window on the partition's clock.
//! It reads, without counting, the window of record time before the scanned range, and
//! it honours the cross-partition decisions the live members recorded. Memory holds the
//! click IDs of one window per partition.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use rdkafka::consumer::BaseConsumer;
use tracing::info;

use crate::aggregate::BucketKey;
use crate::click::Minute;
use crate::config::Settings;
use crate::dedup::{Pin, PrivateScope, Sighting, Timeline};
use crate::sink::Sink;
use crate::source::{self, RangeReader, Ranges};
use crate::time::parse_time_ms;
use crate::verify::{self, Diff};

#[derive(Debug, Args, Clone)]
pub struct ReconcileArgs {
    /// Start of the event-time range (RFC 3339 or a date), rounded down to its minute.
    #[arg(long)]
    pub from: String,
    /// End of the event-time range (exclusive), rounded up to a minute.
    #[arg(long)]
    pub to: String,
    /// Extra record-time margin scanned on both sides, for producers whose record
    /// timestamps are not in offset order.
    #[arg(long, default_value = "10m")]
    pub scan_margin: humantime::Duration,
    /// Differences printed at most.
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
}

/// The outcome of a reconciliation.
#[derive(Debug, Clone)]
pub struct Report {
    pub from: Minute,
    pub to: Minute,
    pub records_scanned: u64,
    /// Records read before the range to rebuild the dedup state.
    pub warmup: u64,
    pub diff: Diff,
    pub elapsed: Duration,
}

/// The event-time range `[from, to)` as whole minutes.
pub fn minute_range(from_ms: i64, to_ms: i64) -> Result<(Minute, Minute)> {
    let from = Minute::from_millis(from_ms).context("--from is outside 1970..2106")?;
    let to_floor = Minute::from_millis(to_ms).context("--to is outside 1970..2106")?;
    let to = if i64::from(to_floor.epoch_seconds()) * 1000 == to_ms {
        to_floor
    } else {
        Minute::from_epoch_seconds(to_floor.epoch_seconds() + 60)
    };
    if to <= from {
        bail!("--to must be after --from");
    }
    Ok((from, to))
}

pub async fn reconcile(s: &Settings, args: &ReconcileArgs) -> Result<Report> {
    let started = Instant::now();
    let from_ms = parse_time_ms(&args.from).context("--from must be RFC 3339 or a date")?;
    let to_ms = parse_time_ms(&args.to).context("--to must be RFC 3339 or a date")?;
    let (from, to) = minute_range(from_ms, to_ms)?;

    // A valid click of minute m has a record timestamp in [m - skew, m + 1min + lateness).
    let margin = Duration::from(args.scan_margin).as_millis() as i64;
    let scan_from = i64::from(from.epoch_seconds()) * 1000 - s.validation.max_future_skew.as_millis() as i64 - margin;
    let scan_to = i64::from(to.epoch_seconds()) * 1000 + s.validation.max_lateness.as_millis() as i64 + margin;
    let settings = s.clone();
    let (scan, lows) = tokio::task::spawn_blocking(move || scan_ranges(&settings, scan_from, scan_to)).await??;
    let sink = Sink::new(&s.clickhouse);
    // Read from the lookback of each scanned range's batch boundary, with the clock
    // recorded there (`planner`).
    let n = s.batch_offsets();
    let at = scan
        .partitions
        .iter()
        .map(|(&p, &(start, _))| {
            (p, crate::position::Boundary { boundary: n.start_of(start).max(lows[&p]), low: lows[&p], high: i64::MAX })
        })
        .collect();
    let window = s.rules().window();
    let marks = crate::planner::marks(&sink, &s.kafka.topic, &at, window).await?;
    let read = Ranges {
        partitions: scan
            .partitions
            .iter()
            .map(|(&p, &(start, end))| (p, (marks[&p].lookback.0.min(start), end)))
            .collect(),
    };
    info!(records = scan.records(), warmup = read.records() - scan.records(), "reconcile: scanning the topic");

    let mut pins: BTreeMap<i32, BTreeMap<i64, Pin>> = BTreeMap::new();
    for (&p, &(start, end)) in &scan.partitions {
        pins.insert(p, sink.pins(&s.kafka.topic, p, start, end - 1).await?);
    }
    let window = s.rules().window();
    let mut scope = PrivateScope::new(window);
    let mut clocks: BTreeMap<i32, Timeline> = marks.iter().map(|(&p, m)| (p, Timeline::new(m.lookback.1))).collect();
    let mut expected: BTreeMap<BucketKey, u64> = BTreeMap::new();
    let (mut scanned, mut warmup) = (0u64, 0u64);
    let mut reader = RangeReader::for_settings(s, "reconcile", &read, crate::schema_registry::decoder(s)?)?;
    while let Some(batch) = reader.next_batch().await.context("reading the topic")? {
        for r in batch {
            let fingerprint = r.outcome.as_ref().ok().map(|c| c.click_id.0);
            let read = clocks.entry(r.partition).or_default().read(r.offset, r.timestamp_ms, fingerprint);
            if let Some((ahead, fp)) = read.confirms {
                scope.confirm(r.partition, fp, ahead, read.now);
            }
            let counting = r.offset >= scan.partitions[&r.partition].0;
            if counting {
                scanned += 1;
            } else {
                warmup += 1;
            }
            let Ok(click) = r.outcome else { continue };
            let pin = if counting { pins[&r.partition].get(&r.offset).copied() } else { None };
            let sighting = Sighting { partition: r.partition, offset: r.offset, clock: read.time, now: read.now };
            let verdict = scope.sight_at(click.click_id.0, sighting, pin);
            if counting && verdict.counts() && click.minute >= from && click.minute < to {
                *expected.entry(BucketKey { ad_id: click.ad_id, minute: click.minute }).or_default() += 1;
            }
        }
    }

    let actual = sink.billing(Some(&s.kafka.topic), Some(from), Some(to)).await?;
    Ok(Report {
        from,
        to,
        records_scanned: scanned,
        warmup,
        diff: verify::diff(&expected, &actual),
        elapsed: started.elapsed(),
    })
}

/// The offsets whose record timestamps fall in `[from_ms, to_ms)` (by the broker's
/// time index), per partition, and each partition's log start.
fn scan_ranges(s: &Settings, from_ms: i64, to_ms: i64) -> Result<(Ranges, BTreeMap<i32, i64>)> {
    let consumer: BaseConsumer = source::lookup_consumer(&s.kafka)?;
    let topic = &s.kafka.topic;
    let timeout = Duration::from_secs(15);
    let parts = source::partitions(&consumer, topic, timeout)?;
    let starts = source::offsets_for_time(&consumer, topic, &parts, from_ms, timeout)?;
    let ends: BTreeMap<i32, Option<i64>> =
        source::offsets_for_time(&consumer, topic, &parts, to_ms, timeout)?.into_iter().collect();
    let mut scan = Ranges::default();
    let mut lows = BTreeMap::new();
    for (p, start) in starts {
        let (low, high) = rdkafka::consumer::Consumer::fetch_watermarks(&consumer, topic, p, timeout)?;
        let start = start.unwrap_or(high).max(low);
        let end = ends.get(&p).copied().flatten().unwrap_or(high).min(high);
        scan.partitions.insert(p, (start, end.max(start)));
        lows.insert(p, low);
    }
    Ok((scan, lows))
}

impl Report {
    pub fn render(&self, limit: usize) -> String {
        format!(
            "reconciled {} .. {} ({} records scanned, {} read before them to rebuild dedup state, {:.1}s)\n{}",
            self.from,
            self.to,
            self.records_scanned,
            self.warmup,
            self.elapsed.as_secs_f64(),
            self.diff.report(limit)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_covers_whole_minutes_with_an_exclusive_end() {
        let (f, t) = minute_range(90_000, 150_000).unwrap();
        assert_eq!((f.epoch_seconds(), t.epoch_seconds()), (60, 180));
        let (_, t) = minute_range(0, 120_000).unwrap();
        assert_eq!(t.epoch_seconds(), 120);
        assert!(minute_range(120_000, 60_000).is_err());
    }
}
