//! The writes of a flush: pins, clock checkpoints, the minute rows, then the markers of
//! the hours those rows touched, each idempotent.

use std::collections::{BTreeMap, HashMap};

use clickhouse::Row;
use serde::{Deserialize, Serialize};

use super::{stored_version, Sink, SinkError, Writer, TABLE, TOUCHED};
use crate::aggregate::{BatchRow, PinRow};
use crate::click::Minute;
use crate::dedup::{Checkpoint, Secs};

#[derive(Row, Serialize)]
struct MinuteOut<'a> {
    ad_id: u64,
    minute: u32,
    topic: &'a str,
    partition: u32,
    batch_start: u64,
    clicks: u64,
    version: u64,
}

impl<'a> MinuteOut<'a> {
    fn of(r: &BatchRow, topic: &'a str, writer: Writer) -> Self {
        MinuteOut {
            ad_id: r.key.ad_id,
            minute: r.key.minute.epoch_seconds(),
            topic,
            partition: r.partition as u32,
            batch_start: r.batch_start as u64,
            clicks: r.clicks,
            version: stored_version(r.version, writer),
        }
    }
}

/// A marker: the rows of a write touched this hour of this partition (`sql/008`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Row, Serialize)]
pub(super) struct TouchedOut<'a> {
    pub topic: &'a str,
    pub hour: u32,
    pub partition: u32,
    /// The highest stored version among those rows (`clickagg status` reads it).
    pub version: u64,
}

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
            clock: c.clock.get().map_or(0, Secs::get),
            has_clock: u8::from(c.clock.get().is_some()),
            pending: c.clock.pending().map_or(0, Secs::get),
            has_pending: u8::from(c.clock.pending().is_some()),
        }
    }
}

impl Sink {
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

    /// Writes the minute rows of one flush, then one marker per hour and partition they
    /// touched (`clickagg_touched`). Idempotent: the rows carry their batch ID and
    /// version, and a marker written again only says the hour was written again.
    ///
    /// The markers come after the rows, and the caller commits nothing before both are
    /// durable: a sealer that finds a marker reads the rows it stands for, and a crash
    /// between the two leaves the batch uncommitted, so it is read, flushed and marked
    /// again (`seal`).
    pub async fn insert(&self, topic: &str, rows: &[BatchRow], writer: Writer) -> Result<(), SinkError> {
        tracing::debug!(rows = rows.len(), "flushing");
        if rows.is_empty() {
            return Ok(());
        }
        // One INSERT per block of at most MAX_MONTHS_PER_INSERT months.
        for block in insert_blocks(rows) {
            self.timed(async {
                let mut insert = self.client.insert::<MinuteOut>(TABLE).await?;
                for r in block {
                    insert.write(&MinuteOut::of(r, topic, writer)).await?;
                }
                insert.end().await
            })
            .await?;
        }
        stop_point!("flush:after-minute-rows");
        let markers = touched(topic, rows, writer);
        self.timed(async {
            let mut insert = self.client.insert::<TouchedOut>(TOUCHED).await?;
            for m in &markers {
                insert.write(m).await?;
            }
            insert.end().await
        })
        .await
    }
}

/// The markers of a write: per hour and partition its rows fall in, the highest stored
/// version among them. A superseding replay's markers carry the offset it reached, as a
/// plain replay's do: `status` reads a partition's last flushed offset from them.
pub(super) fn touched<'a>(topic: &'a str, rows: &[BatchRow], writer: Writer) -> Vec<TouchedOut<'a>> {
    let writer = match writer {
        Writer::Supersede { .. } => Writer::Replay,
        w => w,
    };
    let mut top: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    for r in rows {
        let m = r.key.minute.epoch_seconds();
        let version = top.entry((m - m % 3_600, r.partition as u32)).or_default();
        *version = (*version).max(stored_version(r.version, writer));
    }
    top.into_iter().map(|((hour, partition), version)| TouchedOut { topic, hour, partition, version }).collect()
}

/// The most calendar months one INSERT may write. Current ClickHouse refuses a block
/// over more than `max_partitions_per_insert_block` (100) partitions with code 252,
/// whatever the retry, and the minute table is partitioned by day there; on servers
/// before 21.x it is by month (`schema::for_server`). Three whole months hold at most 92
/// days, and a month's rows stay in one INSERT, so one part per month and flush: 18.16
/// reads `FINAL` with buffers per part, and a 12-year backfill split by 100 days made
/// twice the parts and ran out of its per-query memory (3.73 GiB) in the current-ClickHouse check.
pub const MAX_MONTHS_PER_INSERT: usize = 3;

/// `toYYYYMM(minute)`: the row's calendar month.
fn year_month(minute: Minute) -> u32 {
    use chrono::Datelike;
    let t = chrono::DateTime::from_timestamp(i64::from(minute.epoch_seconds()), 0)
        .expect("u32 seconds are always a valid timestamp");
    t.year() as u32 * 100 + t.month()
}

/// The INSERT blocks of one flush: each holds the rows of at most
/// [`MAX_MONTHS_PER_INSERT`] months, in flush order; months are taken in the order
/// their first row appears. A flush within 3 months (every live flush) stays one INSERT.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate::BucketKey;
    fn row(ad_id: u64, minute: Minute) -> BatchRow {
        BatchRow { key: BucketKey { ad_id, minute }, partition: 0, batch_start: 0, clicks: 1, version: 0 }
    }

    /// The first minute of the `n`th month after January 2000 (UTC).
    fn month(n: u32) -> Minute {
        let start = chrono::NaiveDate::from_ymd_opt(2000 + (n / 12) as i32, n % 12 + 1, 1).unwrap();
        Minute::from_epoch_seconds(start.and_hms_opt(0, 0, 0).unwrap().and_utc().timestamp() as u32)
    }

    #[test]
    fn a_flush_over_many_months_is_split_into_inserts_of_at_most_three_whole_months_in_row_order() {
        // 150 months (a 12-year backfill), interleaved: rows of one month are far apart.
        let rows: Vec<BatchRow> = (0..1000u64).map(|i| row(i, month((i * 7 % 150) as u32))).collect();
        let blocks = insert_blocks(&rows);
        assert_eq!(blocks.len(), 50);
        let mut seen = Vec::new();
        let mut month_blocks: HashMap<u32, usize> = HashMap::new();
        for (b, block) in blocks.iter().enumerate() {
            let months: std::collections::BTreeSet<u32> = block.iter().map(|r| year_month(r.key.minute)).collect();
            assert!(months.len() <= MAX_MONTHS_PER_INSERT, "{} months in one insert", months.len());
            let days: std::collections::BTreeSet<u32> =
                block.iter().map(|r| r.key.minute.epoch_seconds() / 86_400).collect();
            assert!(days.len() <= 100, "{} days in one insert: over a day-partitioned table's limit", days.len());
            for m in months {
                assert_eq!(*month_blocks.entry(m).or_insert(b), b, "month {m} split over two inserts");
            }
            // Each block keeps the flush's order.
            assert!(block.windows(2).all(|w| w[0].key.ad_id < w[1].key.ad_id));
            seen.extend(block.iter().map(|r| r.key.ad_id));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>(), "every row exactly once");
    }

    #[test]
    fn a_flush_within_three_months_stays_one_insert_in_flush_order() {
        let rows: Vec<BatchRow> = (0..500u64).map(|i| row(i, month((i % 3) as u32))).collect();
        let blocks = insert_blocks(&rows);
        assert_eq!(blocks.len(), 1);
        assert!(blocks[0].iter().map(|r| r.key.ad_id).eq(0..500));
        assert!(insert_blocks(std::iter::empty()).is_empty());
    }

    #[test]
    fn a_write_marks_each_hour_and_partition_it_touched_with_its_highest_version() {
        let at = |ad, secs, partition, version| BatchRow {
            key: BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(secs) },
            partition,
            batch_start: 0,
            clicks: 1,
            version,
        };
        let rows = [at(1, 7_200 + 60, 0, 5), at(2, 7_200 + 3_540, 0, 9), at(1, 10_800, 0, 7), at(1, 7_200, 3, 2)];
        let m = |hour, partition, version| TouchedOut { topic: "t", hour, partition, version };
        assert_eq!(
            touched("t", &rows, Writer::Member),
            [m(7_200, 0, 19), m(7_200, 3, 5), m(10_800, 0, 15)],
            "hours are UTC hours; versions are stored ones (2 x offset + rank)"
        );
        assert_eq!(touched("t", &rows[..1], Writer::Replay), [m(7_200, 0, 10)]);
        assert!(touched("t", &[], Writer::Member).is_empty());
    }

    #[test]
    fn months_are_utc_calendar_months() {
        assert_eq!(year_month(month(0)), 200001);
        assert_eq!(year_month(month(13)), 200102);
        assert_eq!(year_month(Minute::from_epoch_seconds(1_764_460_740)), 202511); // 2025-11-29T23:59Z
        assert_eq!(year_month(Minute::from_epoch_seconds(u32::MAX)), 210602);
    }
}
