//! `clickagg reconcile`: recount distinct click IDs per ad per minute straight from the
//! topic, independently of Redis and of the live pipeline, and diff against ClickHouse.
//!
//! The recount applies the same validation as the pipeline (`click::decode`, judged
//! against record timestamps) and keeps the first sighting of each click ID in
//! `(record timestamp, partition, offset)` order. It assumes what the dedup window
//! assumes: repeats of a click arrive within `redis.dedup_ttl` of it.
//!
//! Memory stays bounded for any range: matching clicks are spilled to `K` files by a
//! hash of their click ID, then each file is deduplicated on its own (a click ID and all
//! its repeats land in the same file). `K` grows with the number of records scanned so
//! that at most `--max-clicks-in-memory` IDs are held at once.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use rdkafka::consumer::BaseConsumer;
use tracing::info;

use crate::aggregate::BucketKey;
use crate::click::Minute;
use crate::config::Settings;
use crate::replay::parse_time_ms;
use crate::sink::Sink;
use crate::source::{self, RangeReader, Ranges};
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
    /// Most click IDs deduplicated in memory at once; more records spill to more files.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_clicks_in_memory: u64,
    /// Directory for spill files (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
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
    pub spill_files: usize,
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

/// One matching click in a spill file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sighting {
    click_id: String,
    key: BucketKey,
    /// First-sighting order: record timestamp, partition, offset.
    order: (i64, i32, i64),
}

impl Sighting {
    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        let id = self.click_id.as_bytes();
        w.write_all(&(id.len() as u32).to_le_bytes())?;
        w.write_all(id)?;
        w.write_all(&self.key.ad_id.to_le_bytes())?;
        w.write_all(&self.key.minute.epoch_seconds().to_le_bytes())?;
        w.write_all(&self.order.0.to_le_bytes())?;
        w.write_all(&self.order.1.to_le_bytes())?;
        w.write_all(&self.order.2.to_le_bytes())
    }

    fn read(r: &mut impl Read) -> std::io::Result<Option<Sighting>> {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let mut id = vec![0u8; u32::from_le_bytes(len) as usize];
        r.read_exact(&mut id)?;
        let mut b8 = [0u8; 8];
        let mut b4 = [0u8; 4];
        r.read_exact(&mut b8)?;
        let ad_id = u64::from_le_bytes(b8);
        r.read_exact(&mut b4)?;
        let minute = Minute::from_epoch_seconds(u32::from_le_bytes(b4));
        r.read_exact(&mut b8)?;
        let ts = i64::from_le_bytes(b8);
        r.read_exact(&mut b4)?;
        let partition = i32::from_le_bytes(b4);
        r.read_exact(&mut b8)?;
        let offset = i64::from_le_bytes(b8);
        let click_id = String::from_utf8(id).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok(Some(Sighting { click_id, key: BucketKey { ad_id, minute }, order: (ts, partition, offset) }))
    }
}

fn spill_index(click_id: &str, files: usize) -> usize {
    let mut h = DefaultHasher::new();
    click_id.hash(&mut h);
    (h.finish() % files as u64) as usize
}

/// Deduplicates one spill file and adds its first sightings to `counts`.
fn count_spill_file(path: &std::path::Path, counts: &mut BTreeMap<BucketKey, u64>) -> std::io::Result<()> {
    let mut r = BufReader::new(std::fs::File::open(path)?);
    let mut first: HashMap<String, ((i64, i32, i64), BucketKey)> = HashMap::new();
    while let Some(s) = Sighting::read(&mut r)? {
        match first.get_mut(&s.click_id) {
            Some(slot) if s.order < slot.0 => *slot = (s.order, s.key),
            Some(_) => {}
            None => {
                first.insert(s.click_id, (s.order, s.key));
            }
        }
    }
    for (_, key) in first.into_values() {
        *counts.entry(key).or_default() += 1;
    }
    Ok(())
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
    let ranges = tokio::task::spawn_blocking(move || scan_ranges(&settings, scan_from, scan_to)).await??;
    let total = ranges.records();
    let files = total.div_ceil(args.max_clicks_in_memory.max(1)).max(1) as usize;
    info!(records = total, spill_files = files, "reconcile: scanning the topic");

    let tmp;
    let dir = match &args.spill_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let paths: Vec<PathBuf> = (0..files).map(|i| dir.join(format!("reconcile-{i:04}.bin"))).collect();
    let mut writers =
        paths.iter().map(|p| std::fs::File::create(p).map(BufWriter::new)).collect::<std::io::Result<Vec<_>>>()?;

    let group = format!("{}-reconcile", s.kafka.group);
    let mut reader = RangeReader::new(&s.kafka, &group, &ranges, s.validation.limits(), s.pipeline.max_poll_records)?;
    let mut scanned = 0u64;
    while let Some(batch) = reader.next_batch().await.context("reading the topic")? {
        scanned += batch.len() as u64;
        for r in batch {
            let Ok(click) = r.outcome else { continue };
            if click.minute < from || click.minute >= to {
                continue;
            }
            let sighting = Sighting {
                key: BucketKey { ad_id: click.ad_id, minute: click.minute },
                order: (r.timestamp_ms.unwrap_or(i64::MAX), r.partition, r.offset),
                click_id: click.click_id.as_str().to_string(),
            };
            sighting.write(&mut writers[spill_index(&sighting.click_id, files)])?;
        }
    }
    for mut w in writers {
        w.flush()?;
    }
    let mut expected = BTreeMap::new();
    for p in &paths {
        count_spill_file(p, &mut expected)?;
        if args.spill_dir.is_some() {
            std::fs::remove_file(p)?;
        }
    }

    let actual = Sink::new(&s.clickhouse).billing(Some(&s.kafka.topic), Some(from), Some(to)).await?;
    Ok(Report {
        from,
        to,
        records_scanned: scanned,
        spill_files: files,
        diff: verify::diff(&expected, &actual),
        elapsed: started.elapsed(),
    })
}

/// The offsets whose record timestamps fall in `[from_ms, to_ms)` (by the broker's
/// time index), per partition.
fn scan_ranges(s: &Settings, from_ms: i64, to_ms: i64) -> Result<Ranges> {
    let consumer: BaseConsumer = source::lookup_consumer(&s.kafka)?;
    let topic = &s.kafka.topic;
    let timeout = Duration::from_secs(15);
    let parts = source::partitions(&consumer, topic, timeout)?;
    let starts = source::offsets_for_time(&consumer, topic, &parts, from_ms, timeout)?;
    let ends: BTreeMap<i32, Option<i64>> =
        source::offsets_for_time(&consumer, topic, &parts, to_ms, timeout)?.into_iter().collect();
    let mut ranges = Ranges::default();
    for (p, start) in starts {
        let (low, high) = rdkafka::consumer::Consumer::fetch_watermarks(&consumer, topic, p, timeout)?;
        let start = start.unwrap_or(high).max(low);
        let end = ends.get(&p).copied().flatten().unwrap_or(high).min(high);
        ranges.partitions.insert(p, (start, end.max(start)));
    }
    Ok(ranges)
}

impl Report {
    pub fn render(&self, limit: usize) -> String {
        format!(
            "reconciled {} .. {} ({} records scanned, {} spill file(s), {:.1}s)\n{}",
            self.from,
            self.to,
            self.records_scanned,
            self.spill_files,
            self.elapsed.as_secs_f64(),
            self.diff.report(limit)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sighting(id: &str, ad: u64, order: (i64, i32, i64)) -> Sighting {
        Sighting { click_id: id.into(), key: BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(600) }, order }
    }

    #[test]
    fn the_range_covers_whole_minutes_with_an_exclusive_end() {
        let (f, t) = minute_range(90_000, 150_000).unwrap();
        assert_eq!((f.epoch_seconds(), t.epoch_seconds()), (60, 180));
        let (_, t) = minute_range(0, 120_000).unwrap();
        assert_eq!(t.epoch_seconds(), 120);
        assert!(minute_range(120_000, 60_000).is_err());
    }

    #[test]
    fn a_spill_file_keeps_the_first_sighting_of_each_click() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.bin");
        let mut w = BufWriter::new(std::fs::File::create(&path).unwrap());
        // "a" repeated, its later copy claims another ad: the earlier one wins.
        sighting("a", 2, (20, 0, 7)).write(&mut w).unwrap();
        sighting("a", 1, (10, 0, 3)).write(&mut w).unwrap();
        sighting("b", 1, (11, 1, 0)).write(&mut w).unwrap();
        sighting("weird\tid\n", 1, (12, 1, 1)).write(&mut w).unwrap();
        w.flush().unwrap();
        drop(w);
        let mut counts = BTreeMap::new();
        count_spill_file(&path, &mut counts).unwrap();
        let k = |ad| BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(600) };
        assert_eq!(counts, BTreeMap::from([(k(1), 3)]));
    }

    #[test]
    fn repeats_of_a_click_always_land_in_the_same_spill_file() {
        for files in [1, 2, 7, 64] {
            assert_eq!(spill_index("abc", files), spill_index("abc", files));
            assert!(spill_index("abc", files) < files);
        }
    }
}
