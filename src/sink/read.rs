//! The reads: recorded pins and clocks for readers, the last durable flush per
//! partition for `clickagg status`, and the billing counts.

use std::collections::BTreeMap;

use clickhouse::Row;
use serde::Deserialize;

use super::{Sink, SinkError, TABLE, TOUCHED};
use crate::aggregate::BucketKey;
use crate::click::Minute;
use crate::dedup::{PartitionClock, Pin, Secs};
use crate::sealing::Grain;

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
            (self.has_clock == 1).then_some(Secs::new(self.clock)),
            (self.has_pending == 1).then_some(Secs::new(self.pending)),
        );
        (self.boundary as i64, clock)
    }
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

/// Billing counts per bucket, as read through `FINAL`.
pub type Billing = BTreeMap<BucketKey, u64>;

impl Sink {
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

    /// The recorded clock at the highest boundary of `partition` in `[low, at]` with no
    /// jump pending: a reader starting there reads the click whose jump the next record
    /// may confirm (guide, "What counts"), so it can tell its dedup state when it does.
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
    /// matter to decisions at or after `below` + the window). The record just before a
    /// boundary may be judged ahead of the clock there (a jump not yet confirmed, the
    /// checkpoint's `pending`): its time is the pending one, so that must lie below too.
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
        let time = if below.is_some() {
            "AND (has_clock = 0 OR clock < ?) AND (has_pending = 0 OR pending < ?)"
        } else {
            "AND has_pending = 0"
        };
        let sql = format!(
            "SELECT partition, boundary, clock, has_clock, pending, has_pending FROM clickagg_clocks \
             WHERE topic = ? AND partition = ? AND boundary >= ? AND boundary <= ? {time} \
             ORDER BY boundary DESC LIMIT 1"
        );
        let mut q = self.client.query(&sql).bind(topic).bind(partition as u32).bind(low.max(0) as u64).bind(at as u64);
        if let Some(b) = below {
            q = q.bind(b).bind(b);
        }
        let rows: Vec<ClockIn> = self.timed(q.fetch_all::<ClockIn>()).await?;
        Ok(rows.into_iter().next().map(|r| r.checkpoint()))
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
    /// Read from the touched-hour markers: every flush writes, per hour and partition it
    /// touched, the highest version of its rows (about one row per hour and partition
    /// once merged, so far fewer to scan than the minute rows).
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
        let sql = format!(
            "SELECT partition, max(version) AS version, toUInt32(max(written_at)) AS written_at \
             FROM {TOUCHED} WHERE topic = ? GROUP BY partition"
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

    /// Billing counts per minute for `topic` (all topics when `None`) in `[from, to)`:
    /// the billing read (`billing`) by minute, as a map.
    pub async fn billing(
        &self,
        topic: Option<&str>,
        from: Option<Minute>,
        to: Option<Minute>,
    ) -> Result<Billing, SinkError> {
        let request = super::billing::BillingRequest {
            from: from.map_or(0, |m| m.epoch_seconds()),
            to: to.map_or(u32::MAX, |m| m.epoch_seconds()),
            by: Grain::Minute,
            ads: Vec::new(),
            topic: topic.map(str::to_string),
            top: None,
        };
        let rows = self.billing_rows(&request).await?;
        Ok(rows
            .into_iter()
            .map(|r| (BucketKey { ad_id: r.ad_id, minute: Minute::from_epoch_seconds(r.bucket) }, r.clicks))
            .collect())
    }
}

/// One batch's row of one (ad, minute) count, as the billing read takes it (`FINAL`:
/// the highest version of the row).
#[derive(Debug, Clone, PartialEq, Eq, Row, Deserialize)]
pub struct BatchOfCount {
    pub topic: String,
    pub partition: u32,
    pub batch_start: u64,
    pub clicks: u64,
    pub version: u64,
    /// When the row was written, Unix seconds.
    pub written_at: u32,
}

impl Sink {
    /// The batches whose rows make up the count of `ad_id` in `minute` (Unix seconds):
    /// of one topic, or of every topic (`None`), ordered by topic, partition and batch.
    pub async fn batches_of(
        &self,
        ad_id: u64,
        minute: u32,
        topic: Option<&str>,
    ) -> Result<Vec<BatchOfCount>, SinkError> {
        let sql = format!(
            "SELECT topic, partition, batch_start, clicks, version, toUInt32(written_at) AS written_at \
             FROM {TABLE} FINAL \
             WHERE ad_id = ? AND minute = toDateTime(?, 'UTC') AND (? = '' OR topic = ?) \
             ORDER BY topic, partition, batch_start"
        );
        let t = topic.unwrap_or("");
        let q = self.client.query(&sql).bind(ad_id).bind(minute).bind(t).bind(t);
        self.timed(q.fetch_all()).await
    }
}
