//! What a superseding replay (`replay --supersede`) reads from the minute rows: the
//! generation it writes at, and the rows of its batches it did not write again.

use std::collections::BTreeMap;

use super::{generation_sql, Sink, SinkError, TABLE};
use crate::aggregate::{BatchRow, BucketKey};
use crate::click::Minute;

/// `partition = p AND batch_start >= s AND batch_start < e OR …` for `ranges`, whose
/// starts are batch boundaries: the rows of the batches the ranges cover.
fn within(ranges: &BTreeMap<i32, (i64, i64)>) -> String {
    let terms: Vec<String> = ranges
        .iter()
        .map(|(p, (s, e))| format!("(partition = {p} AND batch_start >= {s} AND batch_start < {e})"))
        .collect();
    if terms.is_empty() {
        "0".to_string()
    } else {
        format!("({})", terms.join(" OR "))
    }
}

impl Sink {
    /// The generation a superseding replay of `ranges` writes at: one more than the
    /// highest generation among the rows of those batches (1 when none was superseded).
    pub async fn next_supersede_generation(
        &self,
        topic: &str,
        ranges: &BTreeMap<i32, (i64, i64)>,
        batch_offsets: u64,
    ) -> Result<u64, SinkError> {
        let sql = format!(
            "SELECT toUInt64(max({})) FROM {TABLE} WHERE topic = ? AND {}",
            generation_sql(batch_offsets),
            within(ranges)
        );
        let highest: u64 = self.timed(self.client.query(&sql).bind(topic).fetch_one()).await?;
        Ok(highest + 1)
    }

    /// The buckets of the batches of `ranges` that no row of `generation` replaced: the
    /// superseding replay found no click for them, so their count is zero. Returned as
    /// rows of zero clicks cut at the batch's first offset, which a write at `generation`
    /// makes outrank whatever they held.
    pub async fn buckets_not_superseded(
        &self,
        topic: &str,
        ranges: &BTreeMap<i32, (i64, i64)>,
        batch_offsets: u64,
        generation: u64,
    ) -> Result<Vec<BatchRow>, SinkError> {
        let sql = format!(
            "SELECT ad_id, toUInt32(minute), partition, batch_start FROM {TABLE} WHERE topic = ? AND {} \
             GROUP BY ad_id, minute, partition, batch_start HAVING max({}) < ? \
             ORDER BY partition, batch_start, ad_id, minute",
            within(ranges),
            generation_sql(batch_offsets)
        );
        let rows: Vec<(u64, u32, u32, u64)> =
            self.timed(self.client.query(&sql).bind(topic).bind(generation).fetch_all()).await?;
        Ok(rows
            .into_iter()
            .map(|(ad_id, minute, partition, batch_start)| BatchRow {
                key: BucketKey { ad_id, minute: Minute::from_epoch_seconds(minute) },
                partition: partition as i32,
                batch_start: batch_start as i64,
                clicks: 0,
                version: batch_start as i64,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rows_of_a_supersede_are_those_of_its_batches() {
        let ranges = BTreeMap::from([(0, (1000, 3000)), (3, (0, 500))]);
        assert_eq!(
            within(&ranges),
            "((partition = 0 AND batch_start >= 1000 AND batch_start < 3000) OR \
             (partition = 3 AND batch_start >= 0 AND batch_start < 500))"
        );
        assert_eq!(within(&BTreeMap::new()), "0");
    }
}
