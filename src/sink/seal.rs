//! The sealer's reads and writes (`seal`, `sql/008_sealed_hours.sql`), and the seal
//! state a billing read splits on.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use clickhouse::query::RowCursor;
use clickhouse::Row;
use serde::{Deserialize, Serialize};

use super::{classify, Sink, SinkError, SEALED_DAY, SEALED_HOUR, SEALS, SEAL_PROGRESS, TABLE, TOUCHED};
use crate::sealing::plan::ROW_WEIGHT_SQL;
use crate::sealing::split::{Marker, SealRecord, SealState};
use crate::sealing::Grain;

/// How long the read that computes a day of seals from the minute rows may take. It
/// reads every minute row of the stretch once through `FINAL`, so it is not bounded by
/// `clickhouse.request_timeout`; past this it counts as a transient failure and the
/// round is tried again.
const COMPUTE_TIMEOUT: Duration = Duration::from_secs(600);

/// The sealer's progress on a topic (`clickagg_seal_progress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// The first hour not sealed yet; `None` before the first round that found rows.
    pub frontier: Option<u32>,
    /// The start of the last complete round (server time): markers older than it by
    /// more than the slack are handled.
    pub scanned_from: u32,
}

/// One ad's minute rows in one hour, summed: its clicks and its share of the hour's
/// version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Row, Deserialize)]
pub struct HourAd {
    pub hour: u32,
    pub ad_id: u64,
    pub clicks: u64,
    pub weight: u64,
}

/// One ad's sealed hours of one day, summed: its clicks and the sum of their versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Row, Deserialize)]
pub struct DayAd {
    pub ad_id: u64,
    pub clicks: u64,
    pub version: u64,
}

/// A row of a sealed table: `(ad_id, clicks, version)`.
pub type SealedRow = (u64, u64, u64);

#[derive(Row, Serialize)]
struct HourOut<'a> {
    topic: &'a str,
    hour: u32,
    ad_id: u64,
    clicks: u64,
    version: u64,
}

#[derive(Row, Serialize)]
struct DayOut<'a> {
    topic: &'a str,
    day: u32,
    ad_id: u64,
    clicks: u64,
    version: u64,
}

/// A seal record to write (`clickagg_seals`).
#[derive(Debug, Clone, PartialEq, Eq, Row, Serialize)]
pub struct RecordOut {
    pub topic: String,
    pub grain: &'static str,
    pub bucket: u32,
    pub version: u64,
    pub computed_at: u32,
    pub positions: String,
}

/// The sealed table and time column of a grain.
fn sealed_table(grain: Grain) -> (&'static str, &'static str) {
    match grain {
        Grain::Day => (SEALED_DAY, "day"),
        _ => (SEALED_HOUR, "hour"),
    }
}

/// The `grain` column's word for a grain.
pub fn grain_word(grain: Grain) -> &'static str {
    match grain {
        Grain::Minute => "minute",
        Grain::Hour => "hour",
        Grain::Day => "day",
    }
}

impl Sink {
    /// The server's clock (Unix s): every time the sealer compares with a marker's
    /// `written_at` is taken here, on the same kind of clock.
    pub async fn server_now(&self) -> Result<u32, SinkError> {
        self.timed(self.client.query("SELECT toUInt32(now()) AS now").fetch_one::<u32>()).await
    }

    pub async fn seal_progress(&self, topic: &str) -> Result<Progress, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            n: u64,
            frontier: u32,
            scanned_from: u32,
        }
        let sql = format!(
            "SELECT count() AS n, toUInt32(max(frontier)) AS frontier, toUInt32(max(scanned_from)) AS scanned_from \
             FROM {SEAL_PROGRESS} WHERE topic = ?"
        );
        let r = self.timed(self.client.query(&sql).bind(topic).fetch_one::<R>()).await?;
        Ok(Progress { frontier: (r.n > 0).then_some(r.frontier), scanned_from: r.scanned_from })
    }

    pub async fn record_seal_progress(&self, topic: &str, p: Progress) -> Result<(), SinkError> {
        let sql = format!(
            "INSERT INTO {SEAL_PROGRESS} (topic, frontier, scanned_from) \
             VALUES (?, toDateTime(?, 'UTC'), toDateTime(?, 'UTC'))"
        );
        let frontier = p.frontier.unwrap_or(0);
        self.timed(self.client.query(&sql).bind(topic).bind(frontier).bind(p.scanned_from).execute()).await
    }

    /// The hours of `topic` with a marker written at or after `since` (server time).
    pub async fn touched_since(&self, topic: &str, since: u32) -> Result<BTreeSet<u32>, SinkError> {
        let sql = format!(
            "SELECT DISTINCT toUInt32(hour) FROM {TOUCHED} WHERE topic = ? AND written_at >= toDateTime(?, 'UTC')"
        );
        let hours: Vec<u32> = self.timed(self.client.query(&sql).bind(topic).bind(since).fetch_all()).await?;
        Ok(hours.into_iter().collect())
    }

    /// The first minute with a row of `topic` at or after `from`, if any.
    pub async fn first_minute(&self, topic: &str, from: u32) -> Result<Option<u32>, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            n: u64,
            first: u32,
        }
        let sql = format!(
            "SELECT count() AS n, toUInt32(min(minute)) AS first FROM {TABLE} \
             PREWHERE topic = ? AND minute >= toDateTime(?, 'UTC')"
        );
        let r = self.timed(self.client.query(&sql).bind(topic).bind(from).fetch_one::<R>()).await?;
        Ok((r.n > 0).then_some(r.first))
    }

    /// The minute rows of `hours` (one UTC day at most) through `FINAL`, summed per hour
    /// and ad, ordered by hour then ad: one read, one snapshot of the table.
    pub async fn hour_sums(&self, topic: &str, hours: &[u32]) -> Result<RowCursor<HourAd>, SinkError> {
        let (Some(&first), Some(&last)) = (hours.first(), hours.last()) else {
            return Err(SinkError::Fatal("no hours to read".into()));
        };
        // PREWHERE before FINAL is exact here: every condition is on sorting-key columns,
        // so it keeps or drops every version of a row together.
        let sql = format!(
            "SELECT toUInt32(toStartOfHour(minute)) AS hour, ad_id, sum(clicks) AS clicks, sum({ROW_WEIGHT_SQL}) AS weight \
             FROM {TABLE} FINAL \
             PREWHERE topic = ? AND minute >= toDateTime(?, 'UTC') AND minute < toDateTime(?, 'UTC') \
               AND has(?, toUInt32(toStartOfHour(minute))) \
             GROUP BY hour, ad_id ORDER BY hour, ad_id"
        );
        self.client
            .query(&sql)
            .bind(topic)
            .bind(first)
            .bind(last + 3_600)
            .bind(hours.to_vec())
            .with_option("max_execution_time", COMPUTE_TIMEOUT.as_secs().to_string())
            .fetch::<HourAd>()
            .map_err(classify)
    }

    /// The next row of a cursor, bounded like the read that computes it.
    pub async fn next_hour_sum(&self, cursor: &mut RowCursor<HourAd>) -> Result<Option<HourAd>, SinkError> {
        match tokio::time::timeout(COMPUTE_TIMEOUT, cursor.next()).await {
            Ok(r) => r.map_err(classify),
            Err(_) => Err(SinkError::Transient(format!("no answer within {COMPUTE_TIMEOUT:?}"))),
        }
    }

    /// Per bucket of `[from, to)`, the highest version in the sealed table of `grain`.
    pub async fn sealed_versions(
        &self,
        grain: Grain,
        topic: &str,
        from: u32,
        to: u32,
    ) -> Result<BTreeMap<u32, u64>, SinkError> {
        let (table, time) = sealed_table(grain);
        let sql = format!(
            "SELECT toUInt32({time}) AS t, max(version) AS v FROM {table} \
             WHERE topic = ? AND {time} >= toDateTime(?, 'UTC') AND {time} < toDateTime(?, 'UTC') GROUP BY t"
        );
        let rows: Vec<(u32, u64)> =
            self.timed(self.client.query(&sql).bind(topic).bind(from).bind(to).fetch_all()).await?;
        Ok(rows.into_iter().collect())
    }

    /// The ads with a row in the sealed `grain` bucket, through `FINAL`.
    pub async fn sealed_ads(&self, grain: Grain, topic: &str, bucket: u32) -> Result<BTreeSet<u64>, SinkError> {
        let (table, time) = sealed_table(grain);
        let sql = format!("SELECT ad_id FROM {table} FINAL WHERE topic = ? AND {time} = toDateTime(?, 'UTC')");
        let ads: Vec<u64> = self.timed(self.client.query(&sql).bind(topic).bind(bucket).fetch_all()).await?;
        Ok(ads.into_iter().collect())
    }

    /// Writes one seal's rows in one INSERT of one block, so that it becomes one part:
    /// on one server a seal is there whole or not at all. (Exactness does not rest on
    /// it: the seal record comes only after the rows, and each row is a whole ad.)
    pub async fn insert_sealed(
        &self,
        grain: Grain,
        topic: &str,
        bucket: u32,
        rows: &[SealedRow],
    ) -> Result<(), SinkError> {
        if rows.is_empty() {
            return Ok(());
        }
        let (table, _) = sealed_table(grain);
        // The default block is 1 048 576 rows; a larger seal would be split into parts.
        let block = rows.len().max(1_048_576).to_string();
        let write = async {
            match grain {
                Grain::Day => {
                    let mut insert =
                        self.client.insert::<DayOut>(table).await?.with_option("max_insert_block_size", block);
                    for &(ad_id, clicks, version) in rows {
                        insert.write(&DayOut { topic, day: bucket, ad_id, clicks, version }).await?;
                    }
                    insert.end().await
                }
                _ => {
                    let mut insert =
                        self.client.insert::<HourOut>(table).await?.with_option("max_insert_block_size", block);
                    for &(ad_id, clicks, version) in rows {
                        insert.write(&HourOut { topic, hour: bucket, ad_id, clicks, version }).await?;
                    }
                    insert.end().await
                }
            }
        };
        self.timed(write).await
    }

    pub async fn insert_seal_records(&self, records: &[RecordOut]) -> Result<(), SinkError> {
        if records.is_empty() {
            return Ok(());
        }
        self.timed(async {
            let mut insert = self.client.insert::<RecordOut>(SEALS).await?;
            for r in records {
                insert.write(r).await?;
            }
            insert.end().await
        })
        .await
    }

    /// Per recorded bucket of `grain` in `[from, to)`, the highest recorded version.
    pub async fn recorded_versions(
        &self,
        grain: Grain,
        topic: &str,
        from: u32,
        to: u32,
    ) -> Result<BTreeMap<u32, u64>, SinkError> {
        let sql = format!(
            "SELECT toUInt32(bucket) AS t, max(version) AS v FROM {SEALS} \
             WHERE topic = ? AND grain = ? AND bucket >= toDateTime(?, 'UTC') AND bucket < toDateTime(?, 'UTC') GROUP BY t"
        );
        let rows: Vec<(u32, u64)> = self
            .timed(self.client.query(&sql).bind(topic).bind(grain_word(grain)).bind(from).bind(to).fetch_all())
            .await?;
        Ok(rows.into_iter().collect())
    }

    /// The sealed hours of `day` summed per ad, through `FINAL`: clicks and versions.
    pub async fn day_sums(&self, topic: &str, day: u32) -> Result<Vec<DayAd>, SinkError> {
        let sql = format!(
            "SELECT ad_id, sum(clicks) AS clicks, sum(version) AS version FROM {SEALED_HOUR} FINAL \
             WHERE topic = ? AND hour >= toDateTime(?, 'UTC') AND hour < toDateTime(?, 'UTC') GROUP BY ad_id"
        );
        let read = self.client.query(&sql).bind(topic).bind(day).bind(day + 86_400).fetch_all::<DayAd>();
        match tokio::time::timeout(COMPUTE_TIMEOUT, read).await {
            Ok(r) => r.map_err(classify),
            Err(_) => Err(SinkError::Transient(format!("no answer within {COMPUTE_TIMEOUT:?}"))),
        }
    }

    /// What a billing read of `[from, to)` needs to split: the seal records and the
    /// latest markers of the days the range overlaps, and the topics that may have
    /// minute rows there (one topic, or every topic registered, marked or sealed). One
    /// request.
    pub async fn seal_state(&self, topic: Option<&str>, from: u32, to: u32) -> Result<SealState, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            kind: u8,
            topic: String,
            at: u32,
            version: u64,
            time: u32,
        }
        let from = from - from % 86_400;
        let only = "(? = '' OR topic = ?)";
        let sql = format!(
            "SELECT toUInt8(if(grain = 'day', 2, 1)) AS kind, topic, toUInt32(bucket) AS at, version, \
                    toUInt32(computed_at) AS time \
             FROM {SEALS} WHERE {only} AND bucket >= toDateTime(?, 'UTC') AND bucket < toDateTime(?, 'UTC') \
             UNION ALL \
             SELECT toUInt8(3) AS kind, topic, toUInt32(hour) AS at, toUInt64(0) AS version, \
                    toUInt32(max(written_at)) AS time \
             FROM {TOUCHED} WHERE {only} AND hour >= toDateTime(?, 'UTC') AND hour < toDateTime(?, 'UTC') \
             GROUP BY topic, hour \
             UNION ALL \
             SELECT toUInt8(4) AS kind, topic, toUInt32(max(frontier)) AS at, toUInt64(0) AS version, \
                    toUInt32(0) AS time \
             FROM {SEAL_PROGRESS} WHERE {only} GROUP BY topic \
             UNION ALL \
             SELECT toUInt8(0) AS kind, topic, toUInt32(0) AS at, toUInt64(0) AS version, toUInt32(0) AS time \
             FROM (SELECT topic FROM clickagg_topics UNION ALL SELECT topic FROM {TOUCHED}) \
             WHERE {only} GROUP BY topic"
        );
        let t = topic.unwrap_or("");
        let q = self.client.query(&sql).bind(t).bind(t).bind(from).bind(to).bind(t).bind(t).bind(from).bind(to);
        let rows: Vec<R> = self.timed(q.bind(t).bind(t).bind(t).bind(t).fetch_all()).await?;
        let mut state = SealState::default();
        if let Some(t) = topic {
            state.topics.insert(t.to_string());
        }
        for r in rows {
            match r.kind {
                0 => {
                    state.topics.insert(r.topic);
                }
                3 => state.markers.push(Marker { topic: r.topic, hour: r.at, written_at: r.time }),
                // Not a topic of its own: a frontier alone says nothing is there.
                4 => {
                    state.frontiers.insert(r.topic, r.at);
                }
                kind => {
                    state.topics.insert(r.topic.clone());
                    let grain = if kind == 2 { Grain::Day } else { Grain::Hour };
                    state.records.push(SealRecord {
                        topic: r.topic,
                        grain,
                        bucket: r.at,
                        version: r.version,
                        computed_at: r.time,
                    });
                }
            }
        }
        Ok(state)
    }
}
