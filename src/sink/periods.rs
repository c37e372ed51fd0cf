//! Closed billing periods and their adjustments (`sql/009_billing_periods.sql`): the
//! reads and writes `close` and the sealer's adjustment step make.

use std::collections::BTreeMap;

use clickhouse::Row;
use serde::{Deserialize, Serialize};

use super::{Sink, SinkError, ADJUSTMENTS, CLOSED, CLOSES, TABLE};
use crate::sealing::period::{Adjustment, Period, PeriodKind};

/// The record of one close (`clickagg_closes`).
#[derive(Debug, Clone, PartialEq, Eq, Row, Deserialize)]
pub struct Close {
    pub period: String,
    pub start: u32,
    pub close_id: u64,
    pub ads: u64,
    pub clicks: u64,
    /// JSON: partition → the group's committed offset at the close.
    pub positions: String,
    pub forced: u8,
    /// Server time taken before the totals were read.
    pub computed_at: u32,
    /// Server time the record was written (set by the server; not written from here).
    pub closed_at: u32,
}

impl Close {
    pub fn period(&self) -> Option<Period> {
        PeriodKind::from_word(&self.period).map(|kind| Period { kind, start: self.start })
    }
}

#[derive(Row, Serialize)]
struct ClosedOut<'a> {
    topic: &'a str,
    period: &'a str,
    start: u32,
    close_id: u64,
    ad_id: u64,
    clicks: u64,
}

#[derive(Row, Serialize)]
struct AdjustmentOut<'a> {
    topic: &'a str,
    period: &'a str,
    start: u32,
    ad_id: u64,
    seq: u32,
    delta: i64,
    batches: &'a str,
    detected_at: u32,
}

/// One adjustment as stored.
#[derive(Debug, Clone, PartialEq, Eq, Row, Deserialize, Serialize)]
pub struct AdjustmentRow {
    pub ad_id: u64,
    pub seq: u32,
    pub delta: i64,
    pub batches: String,
    pub detected_at: u32,
}

// Aliases other than the columns' names: 18.16 substitutes aliases everywhere, and an
// alias named after the column it converts can read as cyclic there.
const CLOSE_COLUMNS: &str = "period, toUInt32(start) AS start_s, close_id, ads, clicks, positions, forced, \
                             toUInt32(computed_at) AS computed_s, toUInt32(closed_at) AS closed_s";

impl Sink {
    /// Every close of `topic`: per period the one that counts, the first written (the
    /// earliest record, then the lowest close_id).
    pub async fn closes(&self, topic: &str) -> Result<Vec<Close>, SinkError> {
        let sql =
            format!("SELECT {CLOSE_COLUMNS} FROM {CLOSES} WHERE topic = ? ORDER BY period, start, closed_at, close_id");
        let all: Vec<Close> = self.timed(self.client.query(&sql).bind(topic).fetch_all()).await?;
        let mut first: BTreeMap<(String, u32), Close> = BTreeMap::new();
        for c in all {
            first.entry((c.period.clone(), c.start)).or_insert(c);
        }
        Ok(first.into_values().collect())
    }

    /// The close of `period`, if it has one (the one [`Sink::closes`] names).
    pub async fn close_of(&self, topic: &str, period: Period) -> Result<Option<Close>, SinkError> {
        Ok(self.closes(topic).await?.into_iter().find(|c| c.period() == Some(period)))
    }

    /// Writes a close's totals, all of them in one INSERT.
    pub async fn insert_closed(
        &self,
        topic: &str,
        period: Period,
        close_id: u64,
        totals: &BTreeMap<u64, u64>,
    ) -> Result<(), SinkError> {
        if totals.is_empty() {
            return Ok(());
        }
        let block = totals.len().max(1_048_576).to_string();
        self.timed(async {
            let mut insert = self.client.insert::<ClosedOut>(CLOSED).await?.with_option("max_insert_block_size", block);
            for (&ad_id, &clicks) in totals {
                let row = ClosedOut { topic, period: period.kind.word(), start: period.start, close_id, ad_id, clicks };
                insert.write(&row).await?;
            }
            insert.end().await
        })
        .await
    }

    /// Writes the record of a close of `topic`; the server stamps `closed_at`.
    pub async fn insert_close_record(&self, topic: &str, c: &Close) -> Result<(), SinkError> {
        let sql = format!(
            "INSERT INTO {CLOSES} (topic, period, start, close_id, ads, clicks, positions, forced, computed_at) \
             VALUES (?, ?, toDateTime(?, 'UTC'), ?, ?, ?, ?, ?, toDateTime(?, 'UTC'))"
        );
        let q = self.client.query(&sql).bind(topic).bind(&c.period).bind(c.start).bind(c.close_id);
        let q = q.bind(c.ads).bind(c.clicks).bind(&c.positions).bind(c.forced).bind(c.computed_at);
        self.timed(q.execute()).await
    }

    /// The totals of one close.
    pub async fn closed_totals(&self, topic: &str, close: &Close) -> Result<BTreeMap<u64, u64>, SinkError> {
        let sql = format!(
            "SELECT ad_id, any(clicks) FROM {CLOSED} \
             WHERE topic = ? AND period = ? AND start = toDateTime(?, 'UTC') AND close_id = ? GROUP BY ad_id"
        );
        let q = self.client.query(&sql).bind(topic).bind(&close.period).bind(close.start).bind(close.close_id);
        let rows: Vec<(u64, u64)> = self.timed(q.fetch_all()).await?;
        Ok(rows.into_iter().collect())
    }

    /// Every adjustment of `period`, by ad and sequence.
    pub async fn adjustments_of(&self, topic: &str, period: Period) -> Result<Vec<AdjustmentRow>, SinkError> {
        let sql = format!(
            "SELECT ad_id, seq, delta, batches, toUInt32(detected_at) AS detected_s FROM {ADJUSTMENTS} FINAL \
             WHERE topic = ? AND period = ? AND start = toDateTime(?, 'UTC') ORDER BY ad_id, seq"
        );
        let q = self.client.query(&sql).bind(topic).bind(period.kind.word()).bind(period.start);
        self.timed(q.fetch_all()).await
    }

    /// Writes one detection's adjustments in one INSERT.
    pub async fn insert_adjustments(
        &self,
        topic: &str,
        period: Period,
        adjustments: &[(Adjustment, String)],
        detected_at: u32,
    ) -> Result<(), SinkError> {
        if adjustments.is_empty() {
            return Ok(());
        }
        self.timed(async {
            let mut insert = self.client.insert::<AdjustmentOut>(ADJUSTMENTS).await?;
            for (a, batches) in adjustments {
                let row = AdjustmentOut {
                    topic,
                    period: period.kind.word(),
                    start: period.start,
                    ad_id: a.ad_id,
                    seq: a.seq,
                    delta: a.delta,
                    batches,
                    detected_at,
                };
                insert.write(&row).await?;
            }
            insert.end().await
        })
        .await
    }

    /// Per ad of `since`, the batch rows (`partition:batch_start`) of the ad in `period`
    /// written at or after the ad's time there (server time): which batches moved. One
    /// read for every ad (`since` is not empty).
    pub async fn batches_written_since(
        &self,
        topic: &str,
        period: Period,
        since: &BTreeMap<u64, u32>,
    ) -> Result<BTreeMap<u64, Vec<String>>, SinkError> {
        let sql = format!(
            "SELECT ad_id, partition, batch_start, toUInt32(max(written_at)) FROM {TABLE} \
             WHERE ad_id IN (SELECT arrayJoin(CAST(? AS Array(UInt64)))) \
             AND minute >= toDateTime(?, 'UTC') AND minute < toDateTime(?, 'UTC') \
             AND topic = ? AND written_at >= toDateTime(?, 'UTC') \
             GROUP BY ad_id, partition, batch_start ORDER BY ad_id, partition, batch_start"
        );
        let ads: Vec<u64> = since.keys().copied().collect();
        let earliest = since.values().copied().min().unwrap_or(0);
        let q = self.client.query(&sql).bind(ads).bind(period.start).bind(period.end()).bind(topic).bind(earliest);
        let rows: Vec<(u64, u32, u64, u32)> = self.timed(q.fetch_all()).await?;
        let mut moved: BTreeMap<u64, Vec<String>> = BTreeMap::new();
        for (ad, p, batch_start, written_at) in rows {
            if since.get(&ad).is_some_and(|&t| written_at >= t) {
                moved.entry(ad).or_default().push(format!("{p}:{batch_start}"));
            }
        }
        Ok(moved)
    }
}
