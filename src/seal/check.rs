//! Whether the sealed hours and days say what the minute rows say: for the chaos run's
//! report and the tests. Every hour and day with a seal record is compared (read
//! through `FINAL` on both sides, an ad with 0 clicks counting as absent).

use std::collections::{BTreeMap, BTreeSet};

use crate::sink::{quote_literal, Sink, SinkError, SEALED_DAY, SEALED_HOUR, SEALS, TABLE};

/// What the comparison found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Agreement {
    /// Sealed hours and days compared.
    pub hours: usize,
    pub days: usize,
    /// One line per table that disagrees, with examples; empty when both agree.
    pub problems: Vec<String>,
}

/// Compares every sealed hour and day of `topic` with its minute rows.
pub async fn agreement(sink: &Sink, topic: &str) -> Result<Agreement, SinkError> {
    let t = quote_literal(topic);
    let mut out = Agreement::default();
    for (grain, table, time, start) in
        [("hour", SEALED_HOUR, "hour", "toStartOfHour"), ("day", SEALED_DAY, "day", "toStartOfDay")]
    {
        let sealed_buckets = format!("SELECT bucket FROM {SEALS} WHERE topic = {t} AND grain = '{grain}'");
        let buckets: BTreeSet<u32> = read(sink, &format!("SELECT DISTINCT toUInt32(bucket) FROM ({sealed_buckets})"))
            .await?
            .into_iter()
            .collect();
        let minutes = sums(
            sink,
            &format!(
                "SELECT ad_id, toUInt32({start}(minute)) AS t, sum(clicks) FROM {TABLE} FINAL \
                 WHERE topic = {t} AND {start}(minute) IN ({sealed_buckets}) GROUP BY ad_id, t"
            ),
        )
        .await?;
        let sealed = sums(
            sink,
            &format!(
                "SELECT ad_id, toUInt32({time}) AS t, sum(clicks) FROM {table} FINAL \
                 WHERE topic = {t} AND {time} IN ({sealed_buckets}) GROUP BY ad_id, t"
            ),
        )
        .await?;
        let keys: BTreeSet<&(u64, u32)> = minutes.keys().chain(sealed.keys()).collect();
        let differ: Vec<String> = keys
            .into_iter()
            .filter(|k| minutes.get(k) != sealed.get(k))
            .map(|(ad, at)| {
                let (m, s) = (minutes.get(&(*ad, *at)).unwrap_or(&0), sealed.get(&(*ad, *at)).unwrap_or(&0));
                format!("ad {ad} at {at}: minutes {m}, sealed {s}")
            })
            .collect();
        if !differ.is_empty() {
            out.problems.push(format!(
                "{} (ad, {time}) of {table} differ from the minute rows: {}",
                differ.len(),
                differ.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
        match grain {
            "hour" => out.hours = buckets.len(),
            _ => out.days = buckets.len(),
        }
    }
    Ok(out)
}

/// (ad, bucket) → clicks, without zeros.
async fn sums(sink: &Sink, sql: &str) -> Result<BTreeMap<(u64, u32), u64>, SinkError> {
    let rows: Vec<(u64, u32, u64)> = read(sink, sql).await?;
    Ok(rows.into_iter().filter(|r| r.2 > 0).map(|(ad, t, c)| ((ad, t), c)).collect())
}

async fn read<T: clickhouse::RowOwned + clickhouse::RowRead>(sink: &Sink, sql: &str) -> Result<Vec<T>, SinkError> {
    sink.client().query(sql).fetch_all::<T>().await.map_err(crate::sink::classify)
}
