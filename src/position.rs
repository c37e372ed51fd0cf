//! Where a reader starts in a partition (docs/DESIGN.md §3 and §6).
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
//! The batches themselves are offset-aligned ([`BatchOffsets`]): a reader that starts
//! at a boundary rebuilds whole batches, and so does every reader after it.
//!
//! The functions here are pure; the broker and Redis look-ups they need are in
//! `source` and `cache` (the `planner` makes them).

use crate::dedup::{PartitionClock, Secs};

/// The batch size in offsets (`N`). Part of every batch's identity: changing it for a
/// topic whose rows already exist would make old and new batches overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOffsets(u64);

impl BatchOffsets {
    pub fn new(n: u64) -> Option<BatchOffsets> {
        (n > 0 && n <= i64::MAX as u64).then_some(BatchOffsets(n))
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The start of the batch containing `offset`.
    pub fn start_of(self, offset: i64) -> i64 {
        offset - offset.rem_euclid(self.0 as i64)
    }

    /// The first batch boundary at or after `offset`.
    pub fn boundary_at_or_after(self, offset: i64) -> i64 {
        let start = self.start_of(offset);
        if start == offset {
            offset
        } else {
            start + self.0 as i64
        }
    }
}

/// Where a reader starts one partition, and how it decides there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Start {
    pub partition: i32,
    /// The first offset read.
    pub read_from: i64,
    /// The first offset counted, a batch boundary; `[read_from, count_from)` only
    /// rebuilds dedup state.
    pub count_from: i64,
    /// The partition clock just before `read_from` (a recorded checkpoint, or a fresh
    /// clock at the log start).
    pub clock: PartitionClock,
    pub scope: Scope,
    /// The group's committed offset when the reader started (at least `count_from`):
    /// the reader commits only past it, so the group's position never moves back while
    /// it re-reads the open batch below it.
    pub commit_floor: i64,
}

/// Where a reader's decisions come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The shared cache in Redis; offsets up to `reread_until` were claimed before.
    Shared { reread_until: Option<i64> },
    /// State rebuilt from the log by this reader alone (a replay, reconcile: `resume`
    /// is `None`), or by a member re-reading what the cache cannot decide, which
    /// returns to the cache where it can ([`Resume`]).
    Private { resume: Option<Resume> },
}

/// Where a member reading privately returns to the shared cache: what the cache said of
/// the partition when the member left it. Offsets up to `claimed` are in the cache; the
/// member decides them privately (every cross-partition decision among them is pinned,
/// so its decisions are the ones made the first time). Offsets between `claimed` and
/// `exact_from` are sightings the cache's last warm-up did not reach: the member
/// decides them privately too and hands them to the cache as warm-up claims. From
/// `max(claimed + 1, exact_from)` on the cache holds everything before, and the member
/// decides through it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    pub claimed: i64,
    pub exact_from: i64,
}

impl Resume {
    /// The first offset decided through the shared cache again.
    pub fn shared_from(self) -> i64 {
        (self.claimed + 1).max(self.exact_from)
    }

    /// Whether a privately decided `offset` must also reach the cache as a warm-up claim.
    pub fn fills_cache(self, offset: i64) -> bool {
        offset > self.claimed && offset < self.exact_from
    }
}

/// Where a partition's reader counts from, and where its log starts and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    /// The batch boundary counted from.
    pub boundary: i64,
    /// The first offset the broker still holds.
    pub low: i64,
    /// The log end when planned.
    pub high: i64,
}

/// What the recorded clocks say about one partition, for a reader counting from
/// `boundary` (`source::marks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    /// The batch boundary to count from.
    pub boundary: i64,
    /// The nearest recorded clock at or below `boundary`: its offset and the clock just
    /// before it (the log start and a fresh clock when nothing is recorded).
    pub near: (i64, PartitionClock),
    /// Where reads that rebuild dedup state start, and the clock there: every record
    /// before it has a record time more than a window before `boundary`. `near` when
    /// nothing before `boundary` can matter.
    pub lookback: (i64, PartitionClock),
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

/// A reader with its own state: it reads the whole lookback; `resume` as in
/// [`Scope::Private`].
pub fn private_start(partition: i32, m: Marks, resume: Option<Resume>) -> Start {
    let (read_from, clock) = m.lookback;
    Start {
        partition,
        read_from,
        count_from: m.boundary,
        clock,
        scope: Scope::Private { resume },
        commit_floor: m.boundary,
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
    let restarted = CacheFrontier { claimed: m.lookback.0 - 1, clock: Secs::ZERO, exact_from: m.boundary };
    let all = groups.iter().map(|g| g.unwrap_or(restarted));
    let lowest = all.clone().min_by_key(|f| f.claimed).expect("not empty");
    let exact_from = all.map(|f| f.exact_from).max().expect("not empty");
    (Some(CacheFrontier { exact_from, ..lowest }), known < groups.len())
}

/// A member using the shared cache, which says `frontier` of the partition. A boundary
/// below where the cache is exact from cannot use it: the member re-reads privately up
/// to the frontier (its decisions there are the log's: pins cover every cross-partition
/// one), then decides through the cache again.
pub fn shared_start(partition: i32, m: Marks, frontier: Option<CacheFrontier>) -> Start {
    if let Some(f) = frontier.filter(|f| m.boundary < f.exact_from) {
        return private_start(partition, m, Some(Resume { claimed: f.claimed, exact_from: f.exact_from }));
    }
    let reread_until = frontier.map(|f| f.claimed).filter(|&f| f >= m.boundary);
    let covered = m.lookback.0 >= m.boundary || frontier.is_some_and(|f| f.claimed + 1 >= m.boundary);
    // Covered: the cache holds every sighting before the boundary. The reader still
    // starts at the nearest recorded clock, re-reading what lies between it and the
    // boundary (claims at or below the frontier change nothing).
    let (read_from, clock) = if covered { m.near } else { m.lookback };
    let reread_until = if covered { reread_until } else { None };
    Start {
        partition,
        read_from,
        count_from: m.boundary,
        clock,
        scope: Scope::Shared { reread_until },
        commit_floor: m.boundary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: u64) -> BatchOffsets {
        BatchOffsets::new(v).unwrap()
    }

    fn clock(secs: u32) -> PartitionClock {
        PartitionClock::at(Some(Secs::new(secs)))
    }

    /// Counting from 1 000, the nearest recorded clock at 900, the lookback at 400.
    const M: Marks = Marks {
        boundary: 1_000,
        near: (900, PartitionClock::from_parts(Some(Secs::new(4_900)), None)),
        lookback: (400, PartitionClock::from_parts(Some(Secs::new(3_000)), None)),
    };

    fn at(claimed: i64, exact_from: i64) -> Option<CacheFrontier> {
        Some(CacheFrontier { claimed, clock: Secs::new(0), exact_from })
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
    fn a_private_reader_reads_the_whole_lookback_from_its_recorded_clock() {
        let s = private_start(3, M, None);
        assert_eq!((s.read_from, s.count_from, s.clock), (400, 1_000, clock(3_000)));
        assert_eq!(s.scope, Scope::Private { resume: None });
    }

    #[test]
    fn a_cache_whose_frontier_reaches_the_boundary_needs_no_warm_up_but_the_nearest_clock() {
        let s = shared_start(0, M, at(999, 0));
        assert_eq!((s.read_from, s.clock, s.scope), (900, clock(4_900), Scope::Shared { reread_until: None }));
        let ahead = shared_start(0, M, at(1_733, 0));
        assert_eq!((ahead.read_from, ahead.scope), (900, Scope::Shared { reread_until: Some(1_733) }));
    }

    #[test]
    fn a_cache_behind_the_boundary_is_warmed_up_from_the_lookback() {
        for frontier in [at(700, 0), at(100, 0), None] {
            let s = shared_start(0, M, frontier);
            assert_eq!((s.read_from, s.count_from, s.clock), (400, 1_000, clock(3_000)), "{frontier:?}");
            assert_eq!(s.scope, Scope::Shared { reread_until: None });
        }
    }

    #[test]
    fn a_boundary_below_where_a_rebuilt_cache_is_exact_is_read_privately_until_the_cache_can_decide() {
        let s = shared_start(0, M, at(1_500, 1_200));
        let resume = Resume { claimed: 1_500, exact_from: 1_200 };
        assert_eq!(s, private_start(0, M, Some(resume)));
        assert_eq!(resume.shared_from(), 1_501);
        assert!(!resume.fills_cache(1_300));
        // A warm-up that stopped at 1 049 of the 1 100 it was rebuilding up to: the
        // private reader finishes it, then decides through the cache from 1 100.
        let unfinished = Resume { claimed: 1_049, exact_from: 1_100 };
        assert_eq!(unfinished.shared_from(), 1_100);
        assert!(unfinished.fills_cache(1_050) && unfinished.fills_cache(1_099) && !unfinished.fills_cache(1_049));
        let later = Marks { boundary: 1_200, ..M };
        assert!(matches!(shared_start(0, later, at(1_500, 1_200)).scope, Scope::Shared { .. }));
    }

    #[test]
    fn key_groups_merge_to_the_lowest_frontier_and_a_group_that_lost_the_partition_is_restarted() {
        let f = |claimed, exact_from| Some(CacheFrontier { claimed, clock: Secs::new(claimed as u32), exact_from });
        assert_eq!(merge_frontiers(&[None, None], M), (None, false), "never read");
        assert_eq!(merge_frontiers(&[f(700, 0)], M), (f(700, 0), false), "a single Redis");
        // A crash between the calls of one batch: one group is a batch ahead.
        assert_eq!(merge_frontiers(&[f(900, 0), f(700, 0), f(900, 0)], M), (f(700, 0), false));
        // A restart made one group exact only from a later boundary: the stricter wins.
        assert_eq!(merge_frontiers(&[f(900, 500), f(900, 0)], M), (f(900, 500), false));
        // One group lost its state: it counts as restarted at the lookback (400) and
        // exact from the boundary (1 000), so the member warms up from the lookback...
        let lost = merge_frontiers(&[f(1_200, 0), None], M);
        assert_eq!(lost, (Some(CacheFrontier { claimed: 399, clock: Secs::new(0), exact_from: 1_000 }), true));
        assert_eq!(shared_start(0, M, lost.0).read_from, 400);
        // ...unless another group is exact only from beyond the boundary: private.
        let stricter = merge_frontiers(&[f(1_200, 1_100), None], M).0;
        assert!(matches!(shared_start(0, M, stricter).scope, Scope::Private { .. }));
    }

    #[test]
    fn nothing_within_the_window_before_the_boundary_means_nothing_to_warm_up() {
        let fresh = PartitionClock::default();
        let fresh_topic = Marks { boundary: 0, near: (0, fresh), lookback: (0, fresh) };
        assert_eq!(shared_start(0, fresh_topic, None).read_from, 0);
        let quiet = Marks { lookback: (1_000, clock(4_990)), near: (1_000, clock(4_990)), ..M };
        assert_eq!(shared_start(0, quiet, None).read_from, 1_000);
    }
}
