//! Where a reader starts in a partition (DESIGN.md §4 and §7).
//!
//! Every reader counts from a batch boundary, so each batch it writes is rebuilt from
//! its first offset. Before that boundary it may read a stretch of the log without
//! counting (a *warm-up*) to give its dedup state the sightings the definition needs:
//! the records of the last window of record time. Which stretch depends on where the
//! state comes from:
//!
//! - a **private scope** (replay, reconcile, a member that cannot trust the cache)
//!   starts empty and reads the whole lookback;
//! - the **shared cache** already holds everything up to its frontier (the highest
//!   offset claimed), so a member reads only the part of the lookback past the
//!   frontier, and nothing when the frontier reaches the boundary. Offsets at or below
//!   the frontier are re-reads, decided from what the cache recorded.
//!
//! The functions here are pure; the broker and Redis look-ups they need are in
//! `source` and `dedup`.

use crate::aggregate::BatchOffsets;
use crate::dedup::Secs;

/// Where a reader starts one partition, and how it decides there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Start {
    pub partition: i32,
    /// The first offset read.
    pub read_from: i64,
    /// The first offset counted, a batch boundary; `[read_from, count_from)` only
    /// rebuilds dedup state.
    pub count_from: i64,
    /// The partition clock just before `read_from` (`None`: reading from `read_from`
    /// gives the exact clock, because every earlier record is stamped earlier).
    pub clock: Option<Secs>,
    pub scope: Scope,
}

/// Where a reader's decisions come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The shared cache in Redis; offsets up to `reread_until` were claimed before.
    Shared { reread_until: Option<i64> },
    /// State rebuilt from the log by this reader alone.
    Private,
}

/// What the broker and the cache say about one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    /// The batch boundary to count from.
    pub boundary: i64,
    /// The partition clock just before `boundary`.
    pub clock_before: Option<Secs>,
    /// The first offset whose records can matter to dedup decisions from `boundary` on
    /// (`source::lookback_starts`); `boundary` when none can.
    pub lookback: i64,
}

/// The batch boundary a reader counts from when asked to start at `requested`: the
/// boundary at or below it, or — when retention removed that boundary — the first one
/// after the log start. `None` asks for the log start.
pub fn boundary(n: BatchOffsets, low: i64, high: i64, requested: Option<i64>) -> i64 {
    let o = requested.unwrap_or(low).clamp(low, high.max(low));
    let start = n.start_of(o);
    if start < low {
        n.boundary_at_or_after(low)
    } else {
        start
    }
}

/// A reader with its own state: it reads the whole lookback.
pub fn private_start(partition: i32, m: Marks) -> Start {
    let warm = m.lookback < m.boundary;
    Start {
        partition,
        read_from: m.lookback,
        count_from: m.boundary,
        clock: if warm { None } else { m.clock_before },
        scope: Scope::Private,
    }
}

/// What the shared cache says of a partition (`dedup::SharedCache::frontiers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFrontier {
    /// The highest offset claimed.
    pub claimed: i64,
    /// The partition clock at `claimed`.
    pub clock: Secs,
    /// The first offset the cache's state is exact for (after a warm-up rebuilt lost
    /// state, the boundary that warm-up counted from).
    pub exact_from: i64,
}

/// A partition's frontier over the cache's key groups (one on a single Redis, `redis.
/// slot_groups` on a Redis Cluster), from what each group says of it, for a reader
/// counting from `m.boundary`.
///
/// Every poll batch's claims reach every group, with the batch's highest offset per
/// partition (`claim.lua`, marks), so the groups agree once all calls of a batch
/// succeeded. They disagree in two ways:
/// - **Some groups are ahead** (a crash or a failed call between the calls of one
///   batch): the cache is complete up to the lowest frontier; the claims between it and
///   the highest are re-reads in the groups ahead and first claims in the others,
///   decided as the first time. The lowest frontier is the partition's.
/// - **Some groups know nothing of the partition** while others do: those lost their
///   state (a Redis node that lost its data, or a failover to a replica the member did
///   not wait for). They count as what the restart before the warm-up writes into them
///   (nothing claimed before the lookback, exact only from the boundary), and the
///   others keep their say: where one of them is exact only from a later offset, the
///   reader still rebuilds privately. The second value says a group was lost, for the log.
pub fn merge_frontiers(groups: &[Option<CacheFrontier>], m: Marks) -> (Option<CacheFrontier>, bool) {
    let known = groups.iter().flatten().count();
    if known == 0 {
        return (None, false);
    }
    let restarted = CacheFrontier { claimed: m.lookback - 1, clock: 0, exact_from: m.boundary };
    let all = groups.iter().map(|g| g.unwrap_or(restarted));
    let lowest = all.clone().min_by_key(|f| f.claimed).expect("not empty");
    let exact_from = all.map(|f| f.exact_from).max().expect("not empty");
    (Some(CacheFrontier { exact_from, ..lowest }), known < groups.len())
}

/// A member using the shared cache, which says `frontier` of the partition. A boundary
/// below where the cache is exact from cannot use it: the member rebuilds privately.
pub fn shared_start(partition: i32, m: Marks, frontier: Option<CacheFrontier>) -> Start {
    if frontier.is_some_and(|f| m.boundary < f.exact_from) {
        return private_start(partition, m);
    }
    let reread_until = frontier.map(|f| f.claimed).filter(|&f| f >= m.boundary);
    let covered = m.lookback >= m.boundary || frontier.is_some_and(|f| f.claimed + 1 >= m.boundary);
    if covered {
        return Start {
            partition,
            read_from: m.boundary,
            count_from: m.boundary,
            clock: m.clock_before,
            scope: Scope::Shared { reread_until },
        };
    }
    // The cache lacks sightings between its frontier (or the lookback) and the boundary.
    let (read_from, clock) = match frontier {
        Some(f) if f.claimed + 1 > m.lookback => (f.claimed + 1, Some(f.clock)),
        _ => (m.lookback, None),
    };
    Start { partition, read_from, count_from: m.boundary, clock, scope: Scope::Shared { reread_until: None } }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: u64) -> BatchOffsets {
        BatchOffsets::new(v).unwrap()
    }

    const M: Marks = Marks { boundary: 1_000, clock_before: Some(5_000), lookback: 400 };

    fn at(claimed: i64, clock: Secs) -> Option<CacheFrontier> {
        Some(CacheFrontier { claimed, clock, exact_from: 0 })
    }

    #[test]
    fn a_start_is_rounded_down_to_its_batch_or_up_past_retention() {
        assert_eq!(boundary(n(100), 0, 1_000, Some(250)), 200);
        assert_eq!(boundary(n(100), 0, 1_000, Some(300)), 300);
        assert_eq!(boundary(n(100), 150, 1_000, Some(160)), 200);
        assert_eq!(boundary(n(100), 150, 1_000, None), 200);
        assert_eq!(boundary(n(100), 0, 1_050, Some(5_000)), 1_000, "past the log end: its last batch");
    }

    #[test]
    fn a_private_reader_reads_the_whole_lookback_and_takes_the_clock_from_it() {
        let s = private_start(3, M);
        assert_eq!((s.read_from, s.count_from, s.clock, s.scope), (400, 1_000, None, Scope::Private));
        let quiet = Marks { lookback: 1_000, ..M };
        assert_eq!(private_start(3, quiet).clock, Some(5_000), "nothing to read before: the clock is looked up");
    }

    #[test]
    fn a_cache_whose_frontier_reaches_the_boundary_needs_no_warm_up() {
        let s = shared_start(0, M, at(999, 5_000));
        assert_eq!((s.read_from, s.clock, s.scope), (1_000, Some(5_000), Scope::Shared { reread_until: None }));
        let ahead = shared_start(0, M, at(1_733, 5_100));
        assert_eq!((ahead.read_from, ahead.scope), (1_000, Scope::Shared { reread_until: Some(1_733) }));
    }

    #[test]
    fn a_cache_behind_the_boundary_is_warmed_up_from_its_frontier_or_the_lookback() {
        let s = shared_start(0, M, at(700, 4_800));
        assert_eq!((s.read_from, s.count_from, s.clock), (701, 1_000, Some(4_800)));
        let far_behind = shared_start(0, M, at(100, 4_000));
        assert_eq!((far_behind.read_from, far_behind.clock), (400, None));
        let lost = shared_start(0, M, None);
        assert_eq!((lost.read_from, lost.clock), (400, None));
        assert_eq!(lost.scope, Scope::Shared { reread_until: None });
    }

    #[test]
    fn a_boundary_below_where_a_rebuilt_cache_is_exact_is_read_privately() {
        let rebuilt = Some(CacheFrontier { claimed: 1_500, clock: 5_200, exact_from: 1_200 });
        assert_eq!(shared_start(0, M, rebuilt), private_start(0, M));
        let later = Marks { boundary: 1_200, ..M };
        assert!(matches!(shared_start(0, later, rebuilt).scope, Scope::Shared { .. }));
    }

    #[test]
    fn key_groups_merge_to_the_lowest_frontier_and_a_group_that_lost_the_partition_is_restarted() {
        let f = |claimed, exact_from| Some(CacheFrontier { claimed, clock: claimed as Secs, exact_from });
        assert_eq!(merge_frontiers(&[None, None], M), (None, false), "never read");
        assert_eq!(merge_frontiers(&[f(700, 0)], M), (f(700, 0), false), "a single Redis");
        // A crash between the calls of one batch: one group is a batch ahead.
        assert_eq!(merge_frontiers(&[f(900, 0), f(700, 0), f(900, 0)], M), (f(700, 0), false));
        // A restart made one group exact only from a later boundary: the stricter wins.
        assert_eq!(merge_frontiers(&[f(900, 500), f(900, 0)], M), (f(900, 500), false));
        // One group lost its state: it counts as restarted at the lookback (400) and
        // exact from the boundary (1 000), so the member warms up from the lookback...
        let lost = merge_frontiers(&[f(1_200, 0), None], M);
        assert_eq!(lost, (Some(CacheFrontier { claimed: 399, clock: 0, exact_from: 1_000 }), true));
        assert_eq!(shared_start(0, M, lost.0).read_from, 400);
        // ...unless another group is exact only from beyond the boundary: private.
        let stricter = merge_frontiers(&[f(1_200, 1_100), None], M).0;
        assert_eq!(shared_start(0, M, stricter), private_start(0, M));
    }

    #[test]
    fn nothing_within_the_window_before_the_boundary_means_nothing_to_warm_up() {
        let fresh_topic = Marks { boundary: 0, clock_before: None, lookback: 0 };
        assert_eq!(shared_start(0, fresh_topic, None).read_from, 0);
        let quiet = Marks { lookback: 1_000, ..M };
        assert_eq!(shared_start(0, quiet, None).read_from, 1_000);
    }
}
