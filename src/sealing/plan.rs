//! What a sealing round computes, as pure functions: which hours are due, how hours
//! are read in chunks, which days follow, and the versions of hours and days.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::position::BatchOffsets;

pub const HOUR: u32 = 3_600;
pub const DAY: u32 = 86_400;

pub fn floor_hour(t: u32) -> u32 {
    t - t % HOUR
}

pub fn floor_day(t: u32) -> u32 {
    t - t % DAY
}

/// What Kafka and the recorded clocks say of one partition of the topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PartitionPosition {
    pub partition: i32,
    /// The group's committed offset: the flushed position, everything before it durable
    /// (a restart reads from the batch boundary at or below it).
    pub committed: Option<i64>,
    pub log_start: i64,
    pub log_end: i64,
    /// The partition clock recorded at the highest boundary at or below `committed`
    /// (`clickagg_clocks`), Unix seconds.
    pub clock: Option<u32>,
}

impl PartitionPosition {
    /// How far the partition's durable position has passed in record time, Unix
    /// seconds: the recorded clock at its committed boundary; `now` when nothing but
    /// its open batch is left to read (its next records are stamped about now); `None`
    /// when records wait and nothing says how far the commits got, which holds every
    /// hour back.
    ///
    /// A heuristic, not a guarantee: a producer whose clock lags can still send a click
    /// for an hour this calls passed (within `validation.max_lateness` of its own
    /// timestamp). Its minute rows then re-seal the hour (`seal`); this only keeps such
    /// re-seals rare.
    pub fn passed(&self, n: BatchOffsets, now: u32) -> Option<u32> {
        let caught_up =
            self.log_end <= self.log_start || self.committed.is_some_and(|c| c >= n.start_of(self.log_end - 1));
        match (caught_up, self.clock) {
            (true, clock) => Some(clock.map_or(now, |c| c.max(now))),
            (false, clock) => clock,
        }
    }
}

/// The first hour not due yet: every hour before it ended at least `lateness` before
/// each partition's position ([`PartitionPosition::passed`]); `None` when a partition
/// holds every hour back or there is none.
pub fn due_until(positions: &[PartitionPosition], n: BatchOffsets, lateness: u32, now: u32) -> Option<u32> {
    let mut least: Option<u32> = None;
    for p in positions {
        let passed = p.passed(n, now)?;
        least = Some(least.map_or(passed, |l| l.min(passed)));
    }
    // An hour [h, h + 1 h) is due when h + 1 h + lateness <= least.
    least.map(|l| floor_hour(l.saturating_sub(lateness)))
}

/// The hours of `[from, to)` (both hour-aligned) grouped by UTC day: each group is read
/// from the minute rows in one pass.
pub fn chunks_by_day(hours: impl IntoIterator<Item = u32>) -> Vec<Vec<u32>> {
    let mut by_day: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for h in hours {
        by_day.entry(floor_day(h)).or_default().push(floor_hour(h));
    }
    by_day
        .into_values()
        .map(|mut v| {
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect()
}

/// The next stretch of hours the frontier advances over: from `frontier` to the end of
/// its day or to `due_until`, whichever comes first; `None` when nothing is due.
pub fn next_stretch(frontier: u32, due_until: u32) -> Option<(u32, u32)> {
    (frontier < due_until).then(|| (frontier, due_until.min(floor_day(frontier) + DAY)))
}

/// Where the frontier goes after an empty stretch starting at `start`, given the next
/// minute row at or after it, or the first hour not due if that comes first (`until`):
/// over whole empty days, so that a gap of years costs one read. `None` keeps the
/// stretch, to be sealed as empty hours: it starts mid-day, or `until` lies within its
/// day (so its hours read as sealed rather than missing, and its day gets sealed).
pub fn skip_empty_days(start: u32, until: u32) -> Option<u32> {
    let day = floor_day(until);
    (start.is_multiple_of(DAY) && day > start).then_some(day)
}

/// What a computed seal does, given the highest version already in the sealed table
/// and the highest recorded one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Write its rows, then its record.
    Write,
    /// Its rows are there already, whole (a record of its version exists): only the
    /// record, so that its later `computed_at` says the rows are current.
    Record,
    /// A later computation was written already: nothing.
    Outranked,
}

pub fn decide(version: u64, in_table: Option<u64>, recorded: Option<u64>) -> Decision {
    if in_table.is_some_and(|v| v > version) || recorded.is_some_and(|v| v > version) {
        Decision::Outranked
    } else if recorded == Some(version) {
        Decision::Record
    } else {
        // Rows of this version without a record were cut short (or, on a cluster,
        // written to some shards only): written again, they change nothing but complete.
        Decision::Write
    }
}

/// The hours to compute again: those the markers name below the frontier (sealed or
/// not: a write to a gap the frontier jumped makes it worth sealing), and every hour
/// from `recompute_from` up to the frontier.
pub fn to_reseal(touched: &BTreeSet<u32>, frontier: u32, recompute_from: Option<u32>) -> BTreeSet<u32> {
    let mut hours: BTreeSet<u32> = touched.iter().copied().filter(|&h| h < frontier).collect();
    if let Some(from) = recompute_from {
        hours.extend((floor_hour(from)..frontier).step_by(HOUR as usize));
    }
    hours
}

/// The days of `hours` that lie wholly before `frontier`: a day is sealed from its 24
/// sealed hours.
pub fn complete_days(hours: impl IntoIterator<Item = u32>, frontier: u32) -> BTreeSet<u32> {
    hours.into_iter().map(floor_day).filter(|&d| d + DAY <= frontier).collect()
}

/// The weight of one minute row in its hour's version, as SQL over the row's stored
/// `version` and `batch_start` ([`row_weight`] is the same in Rust).
///
/// The version of a seal must grow with every change of the rows it is computed from
/// (rows are only added, or replaced by a row of the same batch and bucket with a
/// higher version), so that a later computation outranks an earlier one however the
/// writes interleave. The sum of `version + 1` over the rows does, but grows with the
/// offsets and would overflow 64 bits on large topics. Within one batch row the stored
/// version is `2 × offset + rank` with `offset >= batch_start`, so `version − 2 ×
/// batch_start + 2` grows with it and stays below `2 × batch_offsets + 2`. Rows of
/// clickagg ≤ 0.1 (version = offset) weigh 1: they only ever get replaced by current
/// rows, which weigh 2 or more.
pub const ROW_WEIGHT_SQL: &str = "if(version >= 2 * batch_start, version - 2 * batch_start + 2, 1)";

pub fn row_weight(version: u64, batch_start: u64) -> u64 {
    if version >= 2 * batch_start {
        version - 2 * batch_start + 2
    } else {
        1
    }
}

/// The version of a day: the sum of its 24 hours' versions, which grows with any of
/// them.
pub fn day_version(hours: &[u64]) -> u64 {
    hours.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn n(v: u64) -> BatchOffsets {
        BatchOffsets::new(v).unwrap()
    }

    fn at(committed: Option<i64>, log_end: i64, clock: Option<u32>) -> PartitionPosition {
        PartitionPosition { partition: 0, committed, log_start: 0, log_end, clock }
    }

    const NOW: u32 = 1_796_000_000;

    #[test]
    fn a_partition_has_passed_its_recorded_clock_or_now_once_only_its_open_batch_is_left() {
        // Records wait beyond the open batch: the clock at the committed boundary.
        assert_eq!(at(Some(1_000), 5_500, Some(77)).passed(n(1_000), NOW), Some(77));
        // Only the open batch [5000, 5500) is left: now.
        assert_eq!(at(Some(5_000), 5_500, Some(77)).passed(n(1_000), NOW), Some(NOW));
        // An empty partition, or one whose records retention deleted.
        let gone = PartitionPosition { log_start: 900, ..at(None, 900, None) };
        assert_eq!(gone.passed(n(1_000), NOW), Some(NOW));
        // Nothing committed and records waiting: no position.
        assert_eq!(at(None, 5_500, None).passed(n(1_000), NOW), None);
        // Committed, but no clock recorded at or below it yet.
        assert_eq!(at(Some(1_000), 5_500, None).passed(n(1_000), NOW), None);
    }

    #[test]
    fn an_hour_is_due_once_every_partition_passed_its_end_by_the_lateness() {
        let h = floor_hour(NOW) - 10 * HOUR;
        let lateness = 6 * HOUR;
        let passed = |t| at(Some(0), 5_000, Some(t));
        // The slowest partition decides: it passed h + 1 h + 6 h exactly: h is due.
        let ps = [passed(h + 7 * HOUR), passed(h + 9 * HOUR)];
        assert_eq!(due_until(&ps, n(1_000), lateness, NOW), Some(h + HOUR));
        // One second short: h is not.
        let ps = [passed(h + 7 * HOUR - 1), passed(h + 9 * HOUR)];
        assert_eq!(due_until(&ps, n(1_000), lateness, NOW), Some(h));
        // A partition without a position holds everything.
        let ps = [passed(h + 9 * HOUR), at(None, 10, None)];
        assert_eq!(due_until(&ps, n(1_000), lateness, NOW), None);
        assert_eq!(due_until(&[], n(1_000), lateness, NOW), None);
        // Caught up everywhere: everything up to now - lateness.
        assert_eq!(due_until(&[at(Some(0), 10, None)], n(1_000), lateness, NOW), Some(floor_hour(NOW - lateness)));
    }

    #[test]
    fn hours_are_read_by_day_and_stretches_end_at_day_ends() {
        let d = 20 * DAY;
        assert_eq!(
            chunks_by_day([d + 5 * HOUR, d - HOUR, d + 2 * HOUR, d + 5 * HOUR]),
            [vec![d - HOUR], vec![d + 2 * HOUR, d + 5 * HOUR]]
        );
        assert_eq!(next_stretch(d + 3 * HOUR, d + 40 * HOUR), Some((d + 3 * HOUR, d + DAY)));
        assert_eq!(next_stretch(d + 3 * HOUR, d + 5 * HOUR), Some((d + 3 * HOUR, d + 5 * HOUR)));
        assert_eq!(next_stretch(d + 5 * HOUR, d + 5 * HOUR), None);
    }

    #[test]
    fn only_whole_empty_days_before_later_rows_are_skipped() {
        let d = 20 * DAY;
        assert_eq!(skip_empty_days(d, d + 400 * DAY + 7), Some(d + 400 * DAY));
        assert_eq!(skip_empty_days(d + 3 * HOUR, d + 400 * DAY + 7), None, "mid-day: seal the day's rest");
        assert_eq!(skip_empty_days(d, d + 20 * HOUR), None, "rows (or the end of what is due) later this day");
    }

    #[test]
    fn a_seal_is_written_unless_a_later_one_was_and_recorded_only_when_already_whole() {
        assert_eq!(decide(7, None, None), Decision::Write, "first seal");
        assert_eq!(decide(0, None, None), Decision::Write, "an empty hour: no rows, a record");
        assert_eq!(decide(9, Some(7), Some(7)), Decision::Write, "a re-seal");
        assert_eq!(decide(7, Some(7), None), Decision::Write, "rows without a record: cut short");
        assert_eq!(decide(7, Some(7), Some(7)), Decision::Record);
        assert_eq!(decide(7, Some(9), None), Decision::Outranked, "a later seal's rows, unrecorded yet");
        assert_eq!(decide(7, Some(7), Some(9)), Decision::Outranked);
    }

    #[test]
    fn reseals_are_the_marked_hours_below_the_frontier_and_a_requested_range() {
        let d = 20 * DAY;
        let touched = BTreeSet::from([d, d + 5 * HOUR, d + 9 * HOUR]);
        assert_eq!(to_reseal(&touched, d + 6 * HOUR, None), BTreeSet::from([d, d + 5 * HOUR]));
        assert_eq!(
            to_reseal(&BTreeSet::new(), d + 3 * HOUR, Some(d + HOUR + 5)),
            BTreeSet::from([d + HOUR, d + 2 * HOUR])
        );
        assert_eq!(complete_days([d + 5 * HOUR, d + DAY + HOUR], d + DAY), BTreeSet::from([d]));
        assert_eq!(complete_days([d + 5 * HOUR], d + DAY - HOUR), BTreeSet::new());
    }

    /// The minute rows of one hour as `ReplacingMergeTree(version)` keeps them: per
    /// (batch, bucket) the row with the highest version.
    #[derive(Default, Clone)]
    struct Hour {
        rows: HashMap<(u64, u8), (u64, u64)>, // (batch_start, bucket) -> (version, clicks)
    }

    impl Hour {
        fn insert(&mut self, batch_start: u64, bucket: u8, version: u64, clicks: u64) {
            let slot = self.rows.entry((batch_start, bucket)).or_insert((version, clicks));
            if version >= slot.0 {
                *slot = (version, clicks);
            }
        }
        fn version(&self) -> u64 {
            self.rows.iter().map(|(&(b, _), &(v, _))| row_weight(v, b)).sum()
        }
        fn state(&self) -> Vec<((u64, u8), (u64, u64))> {
            let mut s: Vec<_> = self.rows.iter().map(|(&k, &v)| (k, v)).collect();
            s.sort_unstable();
            s
        }
    }

    proptest! {
        /// Writes only add rows or replace them with higher versions (a flush cut later
        /// in its batch, a member's row over a replay's): the hour's version grows with
        /// every change of its rows and stays put otherwise, so of two seals the one
        /// computed from later rows always has the higher version.
        #[test]
        fn an_hours_version_grows_with_every_change_of_its_rows(
            writes in prop::collection::vec((0u64..4, 0u8..3, 0u64..1_000, any::<bool>()), 1..60),
        ) {
            let n = 1_000;
            let mut hour = Hour::default();
            let mut seen = Vec::new();
            for (batch, bucket, offset_in_batch, member) in writes {
                let batch_start = (batch + 3) * n;
                let version = 2 * (batch_start + offset_in_batch) + u64::from(member);
                // A row's count is a function of the log at its version.
                let clicks = (version * 7 + u64::from(bucket)) % 50;
                let (before, v_before) = (hour.state(), hour.version());
                hour.insert(batch_start, bucket, version, clicks);
                let (after, v_after) = (hour.state(), hour.version());
                if after == before {
                    prop_assert_eq!(v_after, v_before);
                } else {
                    prop_assert!(v_after > v_before, "{} -> {}", v_before, v_after);
                }
                prop_assert!(v_after <= hour.rows.len() as u64 * (2 * n + 2), "bounded by the batch size");
                seen.push((v_after, after));
            }
            // Equal versions mean equal rows.
            for a in &seen {
                for b in &seen {
                    if a.0 == b.0 {
                        prop_assert_eq!(&a.1, &b.1);
                    }
                }
            }
        }
    }

    #[test]
    fn rows_of_older_versions_weigh_least_and_are_outgrown_by_their_replacements() {
        assert_eq!(row_weight(5_500, 5_000), 1, "version = offset (clickagg <= 0.1)");
        assert_eq!(row_weight(10_000, 5_000), 2, "a replay at the batch's first offset");
        assert_eq!(row_weight(10_001, 5_000), 3, "a member there");
        assert_eq!(row_weight(7, 0), 9, "batch 0: both forms are >= 2 x batch_start");
        assert_eq!(day_version(&[3, 0, 4]), 7);
    }
}
