//! The decision as pure functions, with no I/O: the partition's record clock, what the
//! Redis function `claim` does to one cache entry ([`decide_shared`], the same logic as
//! `claim.lua`), and the state a reader rebuilds from the log itself ([`PrivateScope`]).
//! `model.rs` holds both to the definition in `mod.rs` with a property test.
//!
//! Every decision that does not come from a pin is the definition's per-partition rule:
//! the cache keeps one chain of sightings per partition for each click, and only a
//! first sighting whose per-partition verdict is "counts" is checked against the other
//! partitions' chains — and if that turns it into a cross-partition duplicate, the
//! verdict is pinned. So a reader that rebuilt one partition's state from the log alone,
//! with the pins, decides exactly as the live member did.

use super::fingerprint::Fingerprint;
use std::collections::HashMap;

use super::clock::{Secs, Timeline};

/// What one sighting of a click ID comes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// No earlier sighting of the ID in this partition within the window: counts.
    First,
    /// The cache names this very record as the one that counted: a re-read; counts.
    Own,
    /// An earlier sighting in this partition lies within the window: does not count.
    Duplicate,
    /// A `Duplicate` in a chain whose start did not count (it was a copy of a click
    /// counted on another partition). Pinned like a cross-partition decision: a warm-up
    /// that starts after the chain's start, at this sighting, must rebuild the chain as
    /// one that did not count, or a copy still to be decided on another partition would
    /// be judged a duplicate of a click that never counted.
    UncountedDuplicate,
    /// First in its partition, but a copy on another partition counted within the window
    /// of it: does not count. Which copy wins depends on the order the partitions were
    /// read in, so the decision is pinned in ClickHouse and every re-read applies it.
    CrossDuplicate,
    /// A re-read the cache cannot decide (it lost the entry, or it is more than a window
    /// ahead of this reader): the partition is decided from a rebuild of the log instead.
    Undecidable,
    /// A fresh sighting whose verdict depends on other partitions' sightings while some
    /// other partition's state is still being rebuilt from the log: decided later.
    Wait,
}

impl Verdict {
    pub fn counts(self) -> bool {
        matches!(self, Verdict::First | Verdict::Own)
    }

    /// The pin a live member records for this verdict, if any.
    pub fn pin(self) -> Option<Pin> {
        match self {
            Verdict::CrossDuplicate => Some(Pin::CrossDuplicate),
            Verdict::UncountedDuplicate => Some(Pin::Uncounted),
            _ => None,
        }
    }

    /// The byte `claim.lua` answers with.
    pub fn from_code(code: u8) -> Option<Verdict> {
        Some(match code {
            b'F' => Verdict::First,
            b'O' => Verdict::Own,
            b'D' => Verdict::Duplicate,
            b'd' => Verdict::UncountedDuplicate,
            b'X' => Verdict::CrossDuplicate,
            b'U' => Verdict::Undecidable,
            b'W' => Verdict::Wait,
            _ => return None,
        })
    }
}

/// A cross-partition decision recorded durably (table `clickagg_pins`), so that every
/// re-read makes it again whatever order it reads the partitions in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pin {
    CrossDuplicate = 1,
    /// A later sighting of a chain that did not count ([`Verdict::UncountedDuplicate`]).
    Uncounted = 2,
}

impl Pin {
    pub fn from_code(code: u8) -> Option<Pin> {
        match code {
            1 => Some(Pin::CrossDuplicate),
            2 => Some(Pin::Uncounted),
            _ => None,
        }
    }

    pub fn verdict(self) -> Verdict {
        match self {
            Pin::CrossDuplicate => Verdict::CrossDuplicate,
            Pin::Uncounted => Verdict::UncountedDuplicate,
        }
    }
}

/// What the cache knows of one click ID in one partition: a chain of sightings, each
/// within the window of the one before, which started at offset `first` and last saw the
/// click at record time `last_seen` — or one sighting judged ahead of its partition's
/// clock (`ahead`). A cache entry holds the items of every partition that sighted the
/// click (usually one chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    pub partition: i32,
    pub first: i64,
    /// What the sighting at `first` was.
    pub start: Start,
    /// The click counted in this partition: the chain's start counted, or the sighting it
    /// continues did. A later sighting is a [`Verdict::Duplicate`] of a counted chain and
    /// a [`Verdict::UncountedDuplicate`] of one that is not.
    pub counted: bool,
    pub last_seen: Secs,
    /// `Some(reach)` for a sighting judged at its own timestamp, more than an hour ahead
    /// of its partition's clock (guide, "What counts"): `first` is that sighting and
    /// `last_seen` its record time; it matters to later sightings only while the
    /// partition's clock stays within the window of `reach` — the clock it was read at,
    /// or the one the next record moved the clock to when it confirmed the jump (0: read
    /// while its partition had no clock, see [`Chain::kept_by_sweep`]). So one record
    /// stamped in the year 2100 is forgotten a window later, like any other, and hides
    /// none of the sightings before it.
    pub ahead: Option<Secs>,
}

/// What the first sighting of a chain was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// It counted.
    Counted,
    /// A copy of a click counted on another partition (or pinned as not counted).
    Cross,
    /// A duplicate: the chain continues a sighting judged ahead.
    Duplicate,
}

impl Chain {
    /// The verdict of a later sighting of this chain.
    fn duplicate(&self) -> Verdict {
        if self.counted {
            Verdict::Duplicate
        } else {
            Verdict::UncountedDuplicate
        }
    }

    /// Until when, in the partition's record time, a later sighting can match it: the
    /// sweeper deletes it once that lies far enough behind.
    pub fn reach(&self) -> Secs {
        self.ahead.unwrap_or(self.last_seen)
    }

    /// Whether the sweeper keeps it at `cutoff`, given the record time at its partition's
    /// frontier in the cache (`None`: no frontier). A sighting judged ahead of no clock
    /// (its partition's first timestamped records; reach 0) is confirmed — its reach moved
    /// to the clock the next record starts — only by a record still to come while the
    /// partition has no clock, which the sweeper cannot see coming: it stays until then
    /// (`claim.lua`'s `sweep` keeps it alike).
    pub fn kept_by_sweep(&self, cutoff: Secs, frontier_clock: Option<Secs>) -> bool {
        self.reach() >= cutoff || (self.ahead == Some(Secs::ZERO) && frontier_clock.is_none_or(|c| c == Secs::ZERO))
    }

    /// The verdict of its first sighting, read again.
    fn start_again(&self, mode: ClaimMode, cached_pin: bool) -> Verdict {
        match (mode.pin, self.start) {
            (Some(pin), _) => pin.verdict(),
            (None, Start::Counted) => Verdict::Own,
            (None, Start::Duplicate) => self.duplicate(),
            // Claimed again before its pin was durable (a retry, a crash between the
            // calls of one batch): the cache kept the decision.
            (None, Start::Cross) if cached_pin => Verdict::CrossDuplicate,
            (None, Start::Cross) => Verdict::Undecidable,
        }
    }

    /// Whether a fresh sighting `s` lies within the window after it (`s.clock − W ≤
    /// last_seen ≤ s.clock`) while the partition's clock is within the window of its
    /// reach. For a chain the second holds whenever the first does.
    fn matches(&self, s: Sighting, window: Secs) -> bool {
        match self.ahead {
            None => s.clock.saturating_sub(self.last_seen) <= window,
            Some(reach) => {
                self.last_seen <= s.clock && s.clock - self.last_seen <= window && s.now.saturating_sub(window) <= reach
            }
        }
    }
}

/// One sighting of a click ID: where it is, its record time `clock`, and its partition's
/// clock just after it, `now` — below `clock` for a record judged ahead of the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sighting {
    pub partition: i32,
    pub offset: i64,
    pub clock: Secs,
    pub now: Secs,
}

impl Sighting {
    /// A sighting on its partition's clock.
    pub fn at(partition: i32, offset: i64, clock: Secs) -> Sighting {
        Sighting { partition, offset, clock, now: clock }
    }

    /// Judged at its own timestamp, more than an hour ahead of its partition's clock.
    pub fn is_ahead(&self) -> bool {
        self.clock > self.now
    }
}

/// What the cache knows of a partition's reads: the highest offset claimed, and the
/// first offset from which its entries are exact for re-reads. After a warm-up that
/// rebuilt lost state from the lookback, the entries are exact only from the boundary
/// that warm-up counted from: they may lack sightings before the lookback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frontier {
    pub claimed: i64,
    pub exact_from: i64,
}

/// How a claim is made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimMode {
    /// The decision recorded at the first read of this sighting, applied as it was.
    pub pin: Option<Pin>,
    /// A warm-up sighting (not counted now). It was decided within its partition at its
    /// first read unless pinned, so no cross-partition check is made for it.
    pub warm: bool,
    /// Not a sighting: the record after the sighting judged ahead at this offset
    /// confirmed its jump, so that sighting reaches from the clock `now` on. Its verdict
    /// is not used.
    pub confirm: bool,
}

/// What `claim.lua` does with one sighting: the verdict, after updating `entry` (the
/// chains of the click). A sighting at or below the partition's frontier is a re-read,
/// which never changes the entry. (`claim.lua` also keeps new cross-partition verdicts
/// until their pins are durable, and moves the frontier.) `cached_pin`: the cache still
/// holds the cross-partition verdict an earlier claim of this very sighting made (its
/// sorted set `x:<partition>`), so claiming it again answers the same. `others_ready`:
/// every other partition's state holds what its reader relies on; while one is being
/// rebuilt, a sighting that would check the other partitions waits, changing nothing.
pub fn decide_shared(
    entry: &mut Vec<Chain>,
    s: Sighting,
    frontier: Option<Frontier>,
    mode: ClaimMode,
    cached_pin: bool,
    others_ready: bool,
    window: Secs,
) -> Verdict {
    let p = s.partition;
    if mode.confirm {
        if let Some(c) = entry.iter_mut().find(|c| c.partition == p && c.ahead.is_some() && c.first == s.offset) {
            c.ahead = c.ahead.map(|reach| reach.max(s.now));
        }
        return Verdict::First;
    }
    let reread = frontier.is_some_and(|f| s.offset <= f.claimed);
    let mine = entry.iter().position(|c| c.partition == p && c.ahead.is_none());
    if reread {
        if frontier.is_some_and(|f| s.offset < f.exact_from) {
            return Verdict::Undecidable;
        }
        if let Some(ahead) = entry.iter().find(|c| c.partition == p && c.ahead.is_some() && c.first == s.offset) {
            return ahead.start_again(mode, cached_pin);
        }
        let Some(chain) = mine.map(|i| entry[i]) else { return Verdict::Undecidable };
        return match mode.pin {
            Some(pin) => pin.verdict(),
            None if s.offset == chain.first => chain.start_again(mode, cached_pin),
            // A later sighting of the chain: it did not count.
            None if s.offset > chain.first => chain.duplicate(),
            None if cached_pin => Verdict::CrossDuplicate,
            // A sighting from before the chain (more than a window before it): the cache
            // cannot say.
            None => Verdict::Undecidable,
        };
    }
    let in_chain = mine.filter(|&i| entry[i].matches(s, window));
    // Of this partition's sightings judged ahead, the ones within the window before it
    // (the counted kind wins: the click counted in this partition).
    let of_ahead = entry
        .iter()
        .filter(|c| c.partition == p && c.ahead.is_some() && c.matches(s, window))
        .map(|c| c.counted)
        .reduce(|a, b| a || b);
    if in_chain.is_some() || of_ahead.is_some() {
        let counted = in_chain.is_some_and(|i| entry[i].counted) || of_ahead == Some(true);
        let item =
            Chain { partition: p, first: s.offset, start: Start::Duplicate, counted, last_seen: s.clock, ahead: None };
        match in_chain {
            _ if s.is_ahead() => entry.push(Chain { ahead: Some(s.now), ..item }),
            Some(i) => entry[i].last_seen = entry[i].last_seen.max(s.clock),
            // It continues a sighting judged ahead: a chain of its own from here.
            None => match mine {
                Some(i) => entry[i] = item,
                None => entry.push(item),
            },
        }
        let verdict = if counted { Verdict::Duplicate } else { Verdict::UncountedDuplicate };
        return mode.pin.map_or(verdict, Pin::verdict);
    }
    let cross = match mode.pin {
        Some(_) => true,
        None if mode.warm => false,
        None if !others_ready => return Verdict::Wait,
        None => entry.iter().any(|c| c.partition != p && c.counted && s.clock.abs_diff(c.last_seen) <= window),
    };
    let start = if cross { Start::Cross } else { Start::Counted };
    let item = Chain { partition: p, first: s.offset, start, counted: !cross, last_seen: s.clock, ahead: None };
    match mine {
        _ if s.is_ahead() => entry.push(Chain { ahead: Some(s.now), ..item }),
        Some(i) => entry[i] = item,
        None => entry.push(item),
    }
    match mode.pin {
        // A warm-up (or a re-read) starting inside a chain that did not count.
        Some(pin) => pin.verdict(),
        None if cross => Verdict::CrossDuplicate,
        None => Verdict::First,
    }
}

/// The dedup state a reader rebuilt from the log (replay, reconcile, a member that
/// cannot trust the cache): per partition, the record time of each click ID's latest
/// sighting on the clock, and the sightings judged ahead of it. Cross-partition
/// decisions come from the recorded pins, never from order.
#[derive(Debug)]
pub struct PrivateScope {
    window: Secs,
    partitions: HashMap<i32, PartitionSightings>,
}

#[derive(Debug, Default)]
struct PartitionSightings {
    last_seen: HashMap<u128, Secs>,
    /// Sightings judged ahead of the clock (rare): per click ID, (offset, record time,
    /// reach) as in [`Chain::ahead`].
    ahead: HashMap<u128, Vec<(i64, Secs, Secs)>>,
    /// The clock at the last collection of sightings older than the window.
    collected_at: Secs,
}

impl PrivateScope {
    pub fn new(window: Secs) -> PrivateScope {
        PrivateScope { window, partitions: HashMap::new() }
    }

    /// Decides one sighting of `fingerprint` on its partition's clock; `pin` is the
    /// recorded cross-partition decision for it, if any. Warm-up reads use the same call
    /// and ignore the verdict.
    pub fn sight(&mut self, partition: i32, fingerprint: u128, clock: Secs, pin: Option<Pin>) -> Verdict {
        self.sight_at(fingerprint, Sighting::at(partition, 0, clock), pin)
    }

    /// Decides one sighting `s` of `fingerprint` — on the clock, or judged ahead of it
    /// (`s.now < s.clock`). Only the clock says which sightings no later record can be
    /// within the window of: a record time judged ahead says nothing of the records after
    /// it.
    pub fn sight_at(&mut self, fingerprint: u128, s: Sighting, pin: Option<Pin>) -> Verdict {
        let window = self.window;
        let now = s.now;
        let state = self.partitions.entry(s.partition).or_default();
        if now.saturating_sub(state.collected_at) > window {
            // Sightings older than a window before the clock can never matter again: the
            // clock only grows.
            state.last_seen.retain(|_, seen| now.saturating_sub(*seen) <= window);
            state.ahead.retain(|_, v| {
                v.retain(|&(_, _, reach)| now.saturating_sub(reach) <= window);
                !v.is_empty()
            });
            state.collected_at = now;
        }
        let duplicate = state.last_seen.get(&fingerprint).is_some_and(|&seen| s.clock.saturating_sub(seen) <= window)
            || state.ahead.get(&fingerprint).is_some_and(|v| {
                v.iter().any(|&(_, seen, reach)| {
                    seen <= s.clock && s.clock - seen <= window && now.saturating_sub(window) <= reach
                })
            });
        if s.is_ahead() {
            state.ahead.entry(fingerprint).or_default().push((s.offset, s.clock, now));
        } else {
            let seen = state.last_seen.entry(fingerprint).or_insert(s.clock);
            *seen = (*seen).max(s.clock);
        }
        match pin {
            Some(pin) => pin.verdict(),
            None if duplicate => Verdict::Duplicate,
            None => Verdict::First,
        }
    }

    /// The record after the sighting of `fingerprint` judged ahead at `offset` confirmed
    /// its jump: it reaches from the clock `now` on ([`ClaimMode::confirm`]).
    pub fn confirm(&mut self, partition: i32, fingerprint: u128, offset: i64, now: Secs) {
        let Some(state) = self.partitions.get_mut(&partition) else { return };
        for sighting in state.ahead.get_mut(&fingerprint).into_iter().flatten() {
            if sighting.0 == offset {
                sighting.2 = sighting.2.max(now);
            }
        }
    }

    /// Forgets a partition (its reader starts over).
    pub fn forget(&mut self, partition: i32) {
        self.partitions.remove(&partition);
    }

    /// Sightings held, for metrics and tests.
    pub fn len(&self) -> usize {
        self.partitions.values().map(|p| p.last_seen.len() + p.ahead.values().map(Vec::len).sum::<usize>()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The definition itself, applied to a whole partition log (no cache, no pins): which
/// offsets count. A record is `(offset, record timestamp ms, Some(click fingerprint))`
/// for a valid click or `None` for a rejected one. Used as the reference in tests.
pub fn counted_offsets(log: &[(i64, Option<i64>, Option<u128>)], window: Secs) -> Vec<i64> {
    let mut timeline = Timeline::default();
    let mut scope = PrivateScope::new(window);
    let mut out = Vec::new();
    for &(offset, ts, click) in log {
        let read = timeline.read(offset, ts, click);
        let s = Sighting { partition: 0, offset, clock: read.time, now: read.now };
        if let Some((o, fp)) = read.confirms {
            scope.confirm(0, fp, o, s.now);
        }
        if let Some(fp) = click {
            if scope.sight_at(fp, s, None).counts() {
                out.push(offset);
            }
        }
    }
    out
}

/// One click to claim: its fingerprint, where it was sighted, and how (`ClaimMode`).
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub fingerprint: Fingerprint,
    pub sighting: Sighting,
    pub mode: ClaimMode,
}

/// A claim of a poll batch, with the generation of the reader it came from (a reader
/// rewound after a wait gets a new one; the claims of the one before are held back).
#[derive(Debug, Clone, Copy)]
pub struct ReaderClaim {
    pub claim: Claim,
    pub generation: u64,
}

/// The last record of a poll batch in a partition read through the cache (a click or
/// not), with its reader's generation: the batch's mark reaches it, so that a warm-up
/// ending on records that are not clicks still reaches its boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderMark {
    pub last: Sighting,
    pub generation: u64,
}

/// One poll batch's claims, in record order, and its marks.
#[derive(Debug, Clone, Default)]
pub struct ClaimBatch {
    pub claims: Vec<ReaderClaim>,
    /// One per partition read through the cache.
    pub marks: Vec<ReaderMark>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Secs = Secs::new(60);

    fn at(partition: i32, offset: i64, clock: u32) -> Sighting {
        Sighting::at(partition, offset, Secs::new(clock))
    }

    fn chain(partition: i32, first: i64, counted: bool, last_seen: u32) -> Chain {
        let start = if counted { Start::Counted } else { Start::Cross };
        Chain { partition, first, start, counted, last_seen: Secs::new(last_seen), ahead: None }
    }

    fn live() -> ClaimMode {
        ClaimMode::default()
    }

    fn upto(claimed: i64) -> Option<Frontier> {
        Some(Frontier { claimed, exact_from: 0 })
    }

    #[test]
    fn a_sighting_within_the_window_of_the_latest_one_is_a_duplicate_even_if_that_one_did_not_count() {
        // 0 counts; 50 is 50 s after it; 100 is 50 s after the sighting at 50, which
        // did not count either: a click seen again and again within the window never
        // counts twice. 200 comes 100 s after the last sighting: a new click.
        let fp = Some(7u128);
        let log = [(0, Some(0), fp), (1, Some(50_000), fp), (2, Some(100_000), fp), (3, Some(200_000), fp)];
        assert_eq!(counted_offsets(&log, W), vec![0, 3]);
    }

    #[test]
    fn the_window_is_inclusive_and_measured_on_the_partition_clock() {
        let fp = Some(1u128);
        assert_eq!(counted_offsets(&[(0, Some(0), fp), (1, Some(60_000), fp)], W), vec![0]);
        assert_eq!(counted_offsets(&[(0, Some(0), fp), (1, Some(61_000), fp)], W), vec![0, 1]);
        // A record stamped far in the past is judged at the partition's clock (120 s),
        // not at its own timestamp: the sighting at 0 is more than a window behind it.
        let log = [(0, Some(0), fp), (1, Some(120_000), None), (2, Some(1_000), fp)];
        assert_eq!(counted_offsets(&log, W), vec![0, 2]);
    }

    // Issue 35, defect 2: a junk first record stamped in 2100 started the partition's clock
    // there, so every later record was judged at 2100: every repeat of a click ID a
    // duplicate for ever, and (`decide_shared`'s cross check) no copy on another
    // partition within the window of any of them.
    #[test]
    fn a_first_record_stamped_far_ahead_leaves_the_window_to_ordinary_traffic() {
        let (x, y) = (Some(7u128), Some(8u128));
        let t = 1_000_000_000i64;
        let log =
            [(0, Some(4_102_444_800_000), None), (1, Some(t), x), (2, Some(t + 1_000), y), (3, Some(t + 61_000), x)];
        assert_eq!(counted_offsets(&log, W), vec![1, 2, 3], "a repeat 61 s later is a new click");
        // A first record that is a valid click stamped in 2100: judged there, it hides
        // nothing of ordinary traffic after it.
        let log = [(0, Some(4_102_444_800_000), x), (1, Some(t), x), (2, Some(t + 1_000), x), (3, Some(t + 62_000), x)];
        assert_eq!(counted_offsets(&log, W), vec![0, 1, 3]);
        // An ordinary first click and its retry: a duplicate, as ever.
        let log = [(0, Some(t), x), (1, Some(t + 1_000), x), (2, Some(t - 1_000), x)];
        assert_eq!(counted_offsets(&log, W), vec![0]);
    }

    // Issue 35, defect 5: two records stamped past 2106 (clamped to its last second)
    // moved the clock there for good: every later repeat a duplicate, every chain's reach
    // past every sweep's cutoff, no copy on another partition within the window.
    #[test]
    fn records_stamped_past_2106_judge_nothing_at_2106() {
        let (x, y) = (Some(7u128), Some(8u128));
        let t = 1_000_000_000i64;
        let (y2200, y2300) = (Some(7_258_118_400_000), Some(10_413_792_000_000));
        let log = [
            (0, Some(t), y),
            (1, Some(t), x),
            (2, y2200, None),
            (3, y2300, None),
            (4, Some(t + 1_000), x),
            (5, Some(t + 200_000), x),
            (6, Some(t + 201_000), y),
        ];
        assert_eq!(counted_offsets(&log, W), vec![0, 1, 5, 6]);
        // A copy on another partition is judged within the window of this one's.
        let mut e = Vec::new();
        let mut line = Timeline::new(crate::dedup::PartitionClock::at(Some(Secs::new(1_000_000))));
        for (o, ts) in [(0, y2200), (1, y2300)] {
            line.read(o, ts, None);
        }
        let read = line.read(2, Some(t + 1_000), x);
        let s = Sighting { partition: 0, offset: 2, clock: read.time, now: read.now };
        assert_eq!(decide_shared(&mut e, s, None, live(), false, true, W), Verdict::First);
        assert_eq!(e[0].reach(), Secs::new(1_000_001), "swept a window after the clock passes it");
        assert_eq!(decide_shared(&mut e, at(1, 0, 1_000_002), None, live(), false, true, W), Verdict::CrossDuplicate);
    }

    #[test]
    fn fresh_sightings_follow_the_sliding_window_of_their_partition() {
        let mut e = vec![chain(0, 10, true, 100)];
        assert_eq!(decide_shared(&mut e, at(0, 30, 150), upto(20), live(), false, true, W), Verdict::Duplicate);
        assert_eq!(e, vec![chain(0, 10, true, 150)], "the window slides with every sighting");
        assert_eq!(decide_shared(&mut e, at(0, 31, 211), upto(30), live(), false, true, W), Verdict::First);
        assert_eq!(e, vec![chain(0, 31, true, 211)], "a new chain");
        let mut none = Vec::new();
        assert_eq!(
            decide_shared(&mut none, at(0, 0, 0), None, live(), false, true, W),
            Verdict::First,
            "nothing read yet"
        );
    }

    #[test]
    fn the_owner_read_again_counts_and_a_later_sighting_read_again_does_not() {
        let mut e = vec![chain(0, 10, true, 100)];
        assert_eq!(decide_shared(&mut e, at(0, 10, 100), upto(20), live(), false, true, W), Verdict::Own);
        assert_eq!(decide_shared(&mut e, at(0, 15, 120), upto(20), live(), false, true, W), Verdict::Duplicate);
        // Before the chain: a window separates it from the chain, and nothing more is known.
        assert_eq!(decide_shared(&mut e, at(0, 5, 30), upto(20), live(), false, true, W), Verdict::Undecidable);
        // A re-read that finds no chain cannot tell a lost entry from a click never seen.
        assert_eq!(
            decide_shared(&mut Vec::new(), at(0, 5, 30), upto(20), live(), false, true, W),
            Verdict::Undecidable
        );
        assert_eq!(e, vec![chain(0, 10, true, 100)], "re-reads change nothing");
        // Below where a rebuilt cache is exact from: it may lack sightings before.
        let rebuilt = Some(Frontier { claimed: 20, exact_from: 12 });
        assert_eq!(decide_shared(&mut e, at(0, 10, 100), rebuilt, live(), false, true, W), Verdict::Undecidable);
        // From that offset on it is exact: the boundary itself is decided.
        let from_the_chain = Some(Frontier { claimed: 20, exact_from: 10 });
        assert_eq!(decide_shared(&mut e, at(0, 10, 100), from_the_chain, live(), false, true, W), Verdict::Own);
    }

    #[test]
    fn a_forgotten_partition_starts_from_nothing_and_the_others_keep_theirs() {
        let mut scope = PrivateScope::new(W);
        assert!(scope.is_empty());
        assert_eq!(scope.sight(0, 7, Secs::new(100), None), Verdict::First);
        assert_eq!(scope.sight(1, 7, Secs::new(100), None), Verdict::First);
        assert!(!scope.is_empty());
        assert_eq!(scope.len(), 2);
        scope.forget(0);
        assert_eq!(scope.len(), 1);
        // Read again from an earlier offset: the click is first again in partition 0,
        // and partition 1 still holds its sighting.
        assert_eq!(scope.sight(0, 7, Secs::new(90), None), Verdict::First);
        assert_eq!(scope.sight(1, 7, Secs::new(101), None), Verdict::Duplicate);
    }

    #[test]
    fn the_codes_redis_and_clickhouse_carry_read_back_as_the_verdicts_and_pins_they_stand_for() {
        let verdicts = [
            (b'F', Verdict::First),
            (b'O', Verdict::Own),
            (b'D', Verdict::Duplicate),
            (b'd', Verdict::UncountedDuplicate),
            (b'X', Verdict::CrossDuplicate),
            (b'U', Verdict::Undecidable),
            (b'W', Verdict::Wait),
        ];
        for (code, verdict) in verdicts {
            assert_eq!(Verdict::from_code(code), Some(verdict), "{}", code as char);
        }
        assert_eq!(Verdict::from_code(b'?'), None);
        for pin in [Pin::CrossDuplicate, Pin::Uncounted] {
            assert_eq!(Pin::from_code(pin as u8), Some(pin));
            assert_eq!(pin.verdict().pin(), Some(pin), "a pinned verdict records its pin again");
        }
        assert_eq!((Pin::from_code(0), Pin::from_code(3)), (None, None));
    }

    #[test]
    fn a_copy_on_another_partition_is_a_duplicate_only_within_the_window_of_a_counted_chain() {
        let mut e = vec![chain(1, 4, true, 1_000)];
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), None, live(), false, true, W), Verdict::CrossDuplicate);
        assert_eq!(e[1], chain(0, 7, false, 1_040), "its own partition's chain starts, uncounted");
        // A retry of it: a duplicate in a chain that did not count, pinned as such.
        assert_eq!(
            decide_shared(&mut e, at(0, 8, 1_090), upto(7), live(), false, true, W),
            Verdict::UncountedDuplicate,
            "within its chain"
        );
        assert_eq!(Verdict::UncountedDuplicate.pin(), Some(Pin::Uncounted));
        assert!(!Verdict::UncountedDuplicate.counts());
        // Re-read, it answers the same, pin or no pin.
        assert_eq!(
            decide_shared(&mut e, at(0, 8, 1_090), upto(8), live(), false, true, W),
            Verdict::UncountedDuplicate
        );
        // A warm-up that starts at that retry (the copy before its lookback) rebuilds the
        // chain as one that did not count: a copy on partition 1 then counts.
        let mut rebuilt = Vec::new();
        let warm = ClaimMode { pin: Some(Pin::Uncounted), warm: true, ..ClaimMode::default() };
        assert_eq!(
            decide_shared(&mut rebuilt, at(0, 8, 1_090), None, warm, false, true, W),
            Verdict::UncountedDuplicate
        );
        assert_eq!(rebuilt, vec![chain(0, 8, false, 1_090)]);
        assert_eq!(decide_shared(&mut rebuilt, at(1, 4, 1_091), None, live(), false, true, W), Verdict::First);
        let mut far = vec![chain(1, 4, true, 1_000)];
        assert_eq!(decide_shared(&mut far, at(0, 7, 1_061), None, live(), false, true, W), Verdict::First);
        let mut uncounted = vec![chain(1, 4, false, 1_000)];
        assert_eq!(
            decide_shared(&mut uncounted, at(0, 7, 1_010), None, live(), false, true, W),
            Verdict::First,
            "a copy of a copy"
        );
        let mut warm = vec![chain(1, 4, true, 1_000)];
        let warm_mode = ClaimMode { warm: true, pin: None, ..ClaimMode::default() };
        assert_eq!(
            decide_shared(&mut warm, at(0, 7, 1_010), None, warm_mode, false, true, W),
            Verdict::First,
            "no cross check"
        );
    }

    #[test]
    fn a_fresh_sighting_waits_while_another_partition_is_rebuilt_unless_its_own_partition_decides_it() {
        let mut e = vec![chain(1, 4, true, 1_000)];
        let before = e.clone();
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), None, live(), false, false, W), Verdict::Wait);
        assert_eq!(e, before, "a wait changes nothing");
        let mut own = vec![chain(0, 3, true, 1_000)];
        assert_eq!(decide_shared(&mut own, at(0, 7, 1_040), upto(3), live(), false, false, W), Verdict::Duplicate);
        let warm = ClaimMode { warm: true, pin: None, ..ClaimMode::default() };
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), None, warm, false, false, W), Verdict::First);
        let mut fresh = Vec::new();
        assert_eq!(decide_shared(&mut fresh, at(0, 9, 1_200), None, live(), false, false, W), Verdict::Wait);
        assert_eq!(decide_shared(&mut fresh, at(0, 9, 1_200), None, live(), false, true, W), Verdict::First);
    }

    #[test]
    fn a_recorded_pin_is_applied_with_its_effect_and_read_again_without() {
        let pinned = ClaimMode { pin: Some(Pin::CrossDuplicate), warm: false, ..ClaimMode::default() };
        let mut e = Vec::new();
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), None, pinned, false, true, W), Verdict::CrossDuplicate);
        assert_eq!(e, vec![chain(0, 7, false, 1_040)]);
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), upto(7), pinned, false, true, W), Verdict::CrossDuplicate);
        assert_eq!(
            decide_shared(&mut e, at(0, 7, 1_040), upto(7), live(), false, true, W),
            Verdict::Undecidable,
            "pin lost"
        );
    }

    #[test]
    fn a_cross_partition_verdict_claimed_again_before_it_is_durable_comes_from_the_cache() {
        // The first claim made the verdict; a retry of the same claims (its answer was
        // lost, or another group's call of the batch failed) finds it in the cache.
        let mut e = vec![chain(1, 4, true, 1_000)];
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), None, live(), false, true, W), Verdict::CrossDuplicate);
        let before = e.clone();
        assert_eq!(decide_shared(&mut e, at(0, 7, 1_040), upto(7), live(), true, true, W), Verdict::CrossDuplicate);
        assert_eq!(e, before, "claiming again changes nothing");
        // The cached verdict never overrides what the chain itself says.
        let mut counted = vec![chain(0, 7, true, 1_040)];
        assert_eq!(decide_shared(&mut counted, at(0, 7, 1_040), upto(9), live(), true, true, W), Verdict::Own);
        assert_eq!(decide_shared(&mut counted, at(0, 8, 1_041), upto(9), live(), true, true, W), Verdict::Duplicate);
    }

    #[test]
    fn a_private_scope_follows_pins_and_forgets_what_is_out_of_the_window() {
        let mut s = PrivateScope::new(W);
        assert_eq!(s.sight(0, 1, Secs::new(0), None), Verdict::First);
        assert_eq!(s.sight(0, 1, Secs::new(30), None), Verdict::Duplicate);
        assert_eq!(s.sight(1, 1, Secs::new(30), None), Verdict::First, "partitions are separate without a pin");
        assert_eq!(s.sight(2, 1, Secs::new(30), Some(Pin::CrossDuplicate)), Verdict::CrossDuplicate);
        assert_eq!(s.sight(2, 1, Secs::new(40), None), Verdict::Duplicate, "a pinned sighting is still a sighting");
        assert_eq!(s.sight(0, 2, Secs::new(200), None), Verdict::First);
        assert_eq!(s.len(), 3, "partition 0 dropped click 1, last seen 170 s ago");
    }

    #[test]
    fn a_sighting_judged_ahead_is_an_item_of_its_own_that_hides_nothing_and_is_forgotten_a_window_later() {
        let far = 4_102_444_800;
        let ahead =
            |offset, clock, now| Sighting { partition: 0, offset, clock: Secs::new(clock), now: Secs::new(now) };
        let mut e = vec![chain(0, 10, true, 100)];
        // Judged at 2100: nothing within the window before it, so it counts.
        assert_eq!(decide_shared(&mut e, ahead(11, far, 101), upto(10), live(), false, true, W), Verdict::First);
        assert_eq!(e[0], chain(0, 10, true, 100), "the chain keeps its own time");
        // A retry on the clock, right after: a duplicate of the chain, not of 2100.
        assert_eq!(decide_shared(&mut e, at(0, 12, 120), upto(11), live(), false, true, W), Verdict::Duplicate);
        // Re-read, the item judged ahead is its own owner.
        assert_eq!(decide_shared(&mut e, ahead(11, far, 101), upto(12), live(), false, true, W), Verdict::Own);
        // Another sighting at 2100 within the window of the first's reach: a duplicate.
        assert_eq!(
            decide_shared(&mut e, ahead(13, far + 5, 130), upto(12), live(), false, true, W),
            Verdict::Duplicate
        );
        // A window of clock past its reach (101 and 130), it matters no more.
        assert_eq!(decide_shared(&mut e, ahead(14, far + 6, 200), upto(13), live(), false, true, W), Verdict::First);
        assert_eq!(
            e.iter().filter(|c| c.ahead.is_some()).count(),
            3,
            "each sighting judged ahead is kept (the sweeper collects them)"
        );
    }

    #[test]
    fn a_first_click_judged_ahead_of_no_clock_is_kept_by_the_sweeper_until_the_partition_has_one() {
        let first = Chain { ahead: Some(Secs::new(0)), ..chain(0, 0, true, 1_000) };
        assert!(
            first.kept_by_sweep(Secs::new(500), Some(Secs::new(0))),
            "no clock yet: the next record may confirm it"
        );
        assert!(first.kept_by_sweep(Secs::new(500), None));
        assert!(
            !first.kept_by_sweep(Secs::new(500), Some(Secs::new(1_001))),
            "the clock started without it: it is dead"
        );
        let confirmed = Chain { ahead: Some(Secs::new(1_001)), ..first };
        assert!(
            confirmed.kept_by_sweep(Secs::new(1_001), Some(Secs::new(1_001)))
                && !confirmed.kept_by_sweep(Secs::new(1_002), Some(Secs::new(0)))
        );
        assert!(
            !chain(0, 0, true, 1_000).kept_by_sweep(Secs::new(1_001), Some(Secs::new(0))),
            "a chain goes by its reach"
        );
    }

    // Issue 35, defect 4: the sweeper keeps a chain that continues a sighting judged ahead
    // (its start a duplicate) by its latest sighting, like any chain: every sighting
    // extends the window, and the sweeper collects an item `window + max_record_lag`
    // after its last one. `claim.lua` kept it by the reach stored at its first sighting,
    // so a click retried longer than that counted again after a sweep.
    #[test]
    fn a_chain_that_continues_a_sighting_judged_ahead_is_swept_by_its_latest_sighting() {
        let t = 10_000;
        let first = Sighting { partition: 0, offset: 0, clock: Secs::new(t), now: Secs::new(0) };
        let mut e = Vec::new();
        assert_eq!(decide_shared(&mut e, first, None, live(), false, true, W), Verdict::First);
        let confirm = ClaimMode { confirm: true, ..ClaimMode::default() };
        decide_shared(&mut e, Sighting { now: Secs::new(t), ..first }, upto(0), confirm, false, true, W);
        // Retries every 15 s (W = 60) for three minutes: the first continues the sighting
        // judged ahead in a chain of its own, the others extend that chain.
        for i in 0..12 {
            let retry = at(0, 1 + i64::from(i), t + 5 + 15 * i);
            assert_eq!(decide_shared(&mut e, retry, upto(i64::from(i)), live(), false, true, W), Verdict::Duplicate);
        }
        let chain = e.iter().find(|c| c.ahead.is_none()).copied().expect("a chain");
        assert_eq!((chain.start, chain.first, chain.last_seen), (Start::Duplicate, 1, Secs::new(t + 170)));
        assert_eq!(chain.reach(), Secs::new(t + 170), "its latest sighting, not its first (t + 5)");
        assert!(
            chain.kept_by_sweep(Secs::new(t + 6), Some(Secs::new(t + 170)))
                && chain.kept_by_sweep(Secs::new(t + 170), Some(Secs::new(t + 170)))
        );
        assert!(!chain.kept_by_sweep(Secs::new(t + 171), Some(Secs::new(t + 170))));
        // So the retry 15 s after the last is a duplicate after any sweep a live member's
        // sweeper makes meanwhile (cutoff at most its time less W + max_record_lag).
        e.retain(|c| c.kept_by_sweep(Secs::new(t + 185) - W, Some(Secs::new(t + 170))));
        assert_eq!(decide_shared(&mut e, at(0, 13, t + 185), upto(12), live(), false, true, W), Verdict::Duplicate);
    }

    #[test]
    fn a_confirmed_jump_reaches_from_the_clock_it_moved_to() {
        let t = 10_000;
        let mut e = Vec::new();
        // The first record after a quiet stretch, judged at its own time t (clock 100).
        let first = Sighting { partition: 0, offset: 5, clock: Secs::new(t), now: Secs::new(100) };
        assert_eq!(decide_shared(&mut e, first, None, live(), false, true, W), Verdict::First);
        // Unconfirmed, a retry once the clock is at t would not find it within the window
        // of its reach (100)...
        let retry = at(0, 7, t + 1);
        assert_eq!(decide_shared(&mut e.clone(), retry, upto(6), live(), false, true, W), Verdict::First);
        // ...but the next record confirmed the jump: it reaches from t on.
        let confirm = ClaimMode { confirm: true, ..ClaimMode::default() };
        decide_shared(&mut e, Sighting { now: Secs::new(t), ..first }, upto(6), confirm, false, true, W);
        assert_eq!(e[0].ahead, Some(Secs::new(t)));
        assert_eq!(decide_shared(&mut e, retry, upto(6), live(), false, true, W), Verdict::Duplicate);
        let mut scope = PrivateScope::new(W);
        assert_eq!(scope.sight_at(1, first, None), Verdict::First);
        scope.confirm(0, 1, 5, Secs::new(t));
        assert_eq!(scope.sight_at(1, retry, None), Verdict::Duplicate, "a private reader decides alike");
    }
}
