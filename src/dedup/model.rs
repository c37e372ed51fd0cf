//! The property test of the definition (README, "What counts"): a model of the whole
//! system — the log, the shared cache (`decide_shared`, applied as `claim.lua` applies
//! it, in key groups as on a Redis Cluster: one call per group and poll batch, with the
//! batch's marks), private scopes, ClickHouse (rows read through FINAL, and pins) and
//! the group's committed offsets — driven through any interleaving of live members that
//! flush or crash (also between the group calls of one batch), cache wipes (all of it,
//! or one key group: a Redis node that lost its data), group resets to any offset and
//! replays of any range, with the same planning (`position`) and fall-back rules as the
//! pipeline. Whatever happened, the rows in the table must give the counts the
//! definition gives for the log, with the cross-partition decisions the members
//! recorded.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::{decide_shared, Chain, ClaimMode, Frontier, PartitionClock, Pin, PrivateScope, Secs, Sighting, Verdict};
use crate::aggregate::{Aggregator, BatchOffsets, BucketKey, Flush};
use crate::click::Minute;
use crate::position::{self, CacheFrontier, Marks, Scope, Start};
use crate::sink::{stored_version, Writer};

const W: Secs = 10;
const PARTITIONS: i32 = 2;
/// Key groups of the cache; a click's entry lives in one (`SharedCache::group_of`).
const GROUPS: usize = 2;

fn group_of(click: u8) -> usize {
    usize::from(click) % GROUPS
}

/// One record: its timestamp (s) and, for a valid click, its click ID and ad.
#[derive(Debug, Clone, Copy)]
struct Rec {
    ts: Secs,
    click: Option<(u8, u8)>,
}

fn bucket(rec: &Rec, ad: u8) -> BucketKey {
    BucketKey { ad_id: u64::from(ad), minute: Minute::from_epoch_seconds(rec.ts - rec.ts % 60) }
}

/// One key group of the cache (a hash tag: on a Redis Cluster, one slot).
#[derive(Default)]
struct Group {
    entries: HashMap<u8, Vec<Chain>>,
    /// Per partition: the highest offset claimed through this group, its record time,
    /// and where re-reads are exact from.
    frontier: HashMap<i32, (i64, Secs, i64)>,
    cached_pins: HashMap<(i32, i64), Pin>,
}

impl Group {
    /// `claim.lua`'s `claim`: the claims of one poll batch that fall in this group, in
    /// order, then the batch's marks.
    fn call(&mut self, claims: &[(u8, Sighting, ClaimMode)], marks: &BTreeMap<i32, (i64, Secs)>) -> Vec<Verdict> {
        let mut out = Vec::with_capacity(claims.len());
        for &(click, s, mode) in claims {
            let f = self.frontier.get(&s.partition).map(|&(claimed, _, exact_from)| Frontier { claimed, exact_from });
            let reread = f.is_some_and(|f| s.offset <= f.claimed);
            let cached = reread && self.cached_pins.contains_key(&(s.partition, s.offset));
            let v = decide_shared(self.entries.entry(click).or_default(), s, f, mode, cached, true, W);
            if let (None, Some(new_pin), false) = (mode.pin, v.pin(), reread) {
                self.cached_pins.insert((s.partition, s.offset), new_pin);
            }
            if !reread {
                self.frontier.insert(s.partition, (s.offset, s.clock, f.map_or(0, |f| f.exact_from)));
            }
            out.push(v);
        }
        for (&p, &(o, clock)) in marks {
            let now = self.frontier.get(&p).copied();
            if now.is_none_or(|(claimed, _, _)| o > claimed) {
                self.frontier.insert(p, (o, clock, now.map_or(0, |(_, _, exact_from)| exact_from)));
            }
        }
        out
    }

    /// `claim.lua`'s `restart`.
    fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) {
        if self.frontier.get(&partition).is_none_or(|&(claimed, _, _)| claimed < lookback - 1) {
            self.frontier.insert(partition, (lookback - 1, 0, boundary));
        }
    }
}

/// Redis, ClickHouse and the group's offsets.
struct World {
    groups: Vec<Group>,
    rows: HashMap<(i32, i64, BucketKey), (u64, u64)>,
    pins: HashMap<(i32, i64), Pin>,
    committed: HashMap<i32, i64>,
}

impl Default for World {
    fn default() -> World {
        World {
            groups: (0..GROUPS).map(|_| Group::default()).collect(),
            rows: HashMap::new(),
            pins: HashMap::new(),
            committed: HashMap::new(),
        }
    }
}

impl World {
    /// `SharedCache::frontiers`: what every group says of `partition`, merged for a
    /// reader counting from `m.boundary`.
    fn frontier(&self, partition: i32, m: Marks) -> Option<CacheFrontier> {
        let per_group: Vec<Option<CacheFrontier>> = self
            .groups
            .iter()
            .map(|g| {
                g.frontier.get(&partition).map(|&(claimed, clock, exact_from)| CacheFrontier {
                    claimed,
                    clock,
                    exact_from,
                })
            })
            .collect();
        position::merge_frontiers(&per_group, m).0
    }

    /// A durable flush: pins, then rows (`ReplacingMergeTree`: the highest stored version
    /// wins, the later insert on a tie), then the commits and the trimming of cached pins.
    fn apply(&mut self, flush: &Flush, member: bool) {
        for p in &flush.pins {
            self.pins.insert((p.partition, p.offset), p.pin);
        }
        let writer = if member { Writer::Member } else { Writer::Replay };
        for r in &flush.rows {
            let version = stored_version(r.version, writer);
            let slot = self.rows.entry((r.partition, r.batch_start, r.key)).or_insert((r.clicks, version));
            if version >= slot.1 {
                *slot = (r.clicks, version);
            }
        }
        let commit = member;
        if commit {
            for (&p, &c) in &flush.commits {
                self.committed.insert(p, c);
                for g in &mut self.groups {
                    g.cached_pins.retain(|&(xp, o), _| xp != p || o >= c);
                }
            }
        }
    }

    fn recorded_pins(&self, partition: i32, from: i64, with_cache: bool) -> BTreeMap<i64, Pin> {
        let mut out: BTreeMap<i64, Pin> = BTreeMap::new();
        let cached = self.groups.iter().flat_map(|g| g.cached_pins.iter()).filter(|_| with_cache);
        for (&(p, o), &pin) in self.pins.iter().chain(cached) {
            if p == partition && o >= from {
                out.insert(o, pin);
            }
        }
        out
    }

    fn billing(&self) -> BTreeMap<BucketKey, u64> {
        let mut out = BTreeMap::new();
        for ((_, _, k), (clicks, _)) in &self.rows {
            *out.entry(*k).or_default() += clicks;
        }
        out.retain(|_, c: &mut u64| *c > 0);
        out
    }
}

/// The clock just before `offset`: what `clickagg_clocks` records at a boundary.
fn clock_before(log: &[Rec], offset: i64) -> PartitionClock {
    let mut clock = PartitionClock::default();
    for r in &log[..offset as usize] {
        clock.tick(Some(i64::from(r.ts) * 1000));
    }
    clock
}

/// What the recorded clocks give a reader counting from `boundary` (`planner::marks`):
/// the clock there, and the latest boundary whose clock lies more than a window before.
fn marks(log: &[Rec], n: BatchOffsets, boundary: i64) -> Marks {
    let near = (boundary, clock_before(log, boundary));
    let lookback = match near.1.get() {
        None => (0, PartitionClock::default()),
        Some(c) => (0..=boundary)
            .rev()
            .filter(|&b| n.start_of(b) == b)
            .map(|b| (b, clock_before(log, b)))
            .find(|(_, clock)| clock.get().is_none_or(|t| t < c.saturating_sub(W)))
            .unwrap_or((0, PartitionClock::default())),
    };
    Marks { boundary, near, lookback }
}

struct Reader {
    start: Start,
    clock: PartitionClock,
    next: i64,
    pins: BTreeMap<i64, Pin>,
}

impl Reader {
    fn new(start: Start, pins: BTreeMap<i64, Pin>) -> Reader {
        Reader { start, clock: start.clock, next: start.read_from, pins }
    }
}

/// One reader process: a live member (shared cache, commits) or a replay (private).
struct Process<'a> {
    log: &'a [Vec<Rec>],
    agg: Aggregator,
    private: PrivateScope,
    readers: HashMap<i32, Reader>,
    /// Cuts of partitions that fell back to private state, flushed with the next flush.
    pending: Flush,
}

impl<'a> Process<'a> {
    fn new(log: &'a [Vec<Rec>], n: BatchOffsets) -> Process<'a> {
        Process {
            log,
            agg: Aggregator::new(n),
            private: PrivateScope::new(W),
            readers: HashMap::new(),
            pending: Flush::default(),
        }
    }

    /// A live member assigned every partition (`Stages::plan_shared_starts`).
    fn member(world: &mut World, log: &'a [Vec<Rec>], n: BatchOffsets) -> Process<'a> {
        let mut process = Process::new(log, n);
        for p in 0..PARTITIONS {
            let len = log[p as usize].len() as i64;
            let boundary = position::boundary(n, 0, len, world.committed.get(&p).copied());
            let m = marks(&log[p as usize], n, boundary);
            let frontier = world.frontier(p, m);
            let start = position::shared_start(p, m, frontier);
            if matches!(start.scope, Scope::Shared { .. }) && frontier.is_none_or(|f| f.claimed + 1 < m.boundary) {
                for g in &mut world.groups {
                    g.restart(p, m.lookback.0, m.boundary);
                }
            }
            process.readers.insert(p, Reader::new(start, world.recorded_pins(p, start.read_from, true)));
        }
        process
    }

    /// A replay counting from the boundaries at or below `from`.
    fn replay(world: &World, log: &'a [Vec<Rec>], n: BatchOffsets, from: &[i64]) -> Process<'a> {
        let mut process = Process::new(log, n);
        for p in 0..PARTITIONS {
            let len = log[p as usize].len() as i64;
            let boundary = position::boundary(n, 0, len, Some(from[p as usize].min(len)));
            let start = position::private_start(p, marks(&log[p as usize], n, boundary), None);
            process.readers.insert(p, Reader::new(start, world.recorded_pins(p, start.count_from, false)));
        }
        process
    }

    /// Reads a poll batch of up to `k` records of `p` (`Stages::prepare`, the `Claimer`,
    /// `Stages::apply`). Its claims go to the cache one key group at a time; with
    /// `crash_after` set, only the groups in that bit set get theirs before the process
    /// dies (`false`: nothing of the batch is applied, the process is gone).
    fn read(&mut self, world: &mut World, p: i32, k: usize, crash_after: Option<u8>) -> bool {
        struct Item {
            offset: i64,
            rec: Rec,
            clock: Secs,
            warm: bool,
            verdict: Option<Verdict>,
        }
        let reader = self.readers.get_mut(&p).expect("assigned");
        let log = &self.log[p as usize];
        let mut items = Vec::new();
        while items.len() < k {
            let Some(&rec) = log.get(reader.next as usize) else { break };
            let offset = reader.next;
            reader.next += 1;
            let clock = reader.clock.tick(Some(i64::from(rec.ts) * 1000));
            items.push(Item { offset, rec, clock, warm: offset < reader.start.count_from, verdict: None });
        }
        // Decisions: private ones at once, shared ones per key group with the marks.
        type GroupClaims = Vec<(usize, (u8, Sighting, ClaimMode))>;
        let mut claims: Vec<GroupClaims> = (0..GROUPS).map(|_| Vec::new()).collect();
        let mut marks: BTreeMap<i32, (i64, Secs)> = BTreeMap::new();
        for (i, item) in items.iter_mut().enumerate() {
            let Some((click, _)) = item.rec.click else { continue };
            let recorded = reader.pins.get(&item.offset).copied();
            match reader.start.scope {
                Scope::Private { .. } => {
                    let pin = recorded.filter(|_| !item.warm);
                    item.verdict = Some(self.private.sight(p, u128::from(click), item.clock, pin));
                }
                Scope::Shared { .. } => {
                    let s = Sighting { partition: p, offset: item.offset, clock: item.clock };
                    claims[group_of(click)].push((i, (click, s, ClaimMode { pin: recorded, warm: item.warm })));
                    marks.insert(p, (item.offset, item.clock));
                }
            }
        }
        if !marks.is_empty() {
            for (g, group_claims) in claims.iter().enumerate() {
                if crash_after.is_some_and(|applied| applied & (1 << g) == 0) {
                    continue;
                }
                let calls: Vec<_> = group_claims.iter().map(|&(_, c)| c).collect();
                let verdicts = world.groups[g].call(&calls, &marks);
                for (&(i, _), v) in group_claims.iter().zip(verdicts) {
                    items[i].verdict = Some(v);
                }
            }
        }
        if crash_after.is_some() {
            return false;
        }
        if items.iter().any(|i| !i.warm && i.verdict == Some(Verdict::Undecidable)) {
            // Nothing of this batch is taken in: the partition starts over privately.
            self.fall_back(world, p);
            return true;
        }
        for item in items {
            if item.warm {
                continue;
            }
            let Some((_, ad)) = item.rec.click else {
                self.agg.observe(p, item.offset, None, None);
                continue;
            };
            let verdict = item.verdict.expect("decided");
            let counted = verdict.counts().then(|| bucket(&item.rec, ad));
            // Pins are recorded again on re-reads: one applied from the cache may not be
            // durable yet, and the trim after this flush's commit drops it there.
            self.agg.observe(p, item.offset, counted, verdict.pin().map(|pin| (pin, bucket(&item.rec, ad))));
        }
        true
    }

    /// `Stages::fall_back_to_private`.
    fn fall_back(&mut self, world: &World, p: i32) {
        let reader = &self.readers[&p];
        let cut = self.agg.take_partitions(&[p]);
        let from = cut.commits.get(&p).copied().unwrap_or(reader.start.count_from);
        self.pending.merge(cut);
        let n = self.agg.batch_offsets();
        let start = position::private_start(p, marks(&self.log[p as usize], n, from), None);
        self.private.forget(p);
        self.readers.insert(p, Reader::new(start, world.recorded_pins(p, start.count_from, true)));
    }

    fn read_to_end(&mut self, world: &mut World) {
        for p in 0..PARTITIONS {
            // Several passes: a fall-back starts the partition over.
            while self.readers[&p].next < self.log[p as usize].len() as i64 {
                self.read(world, p, 7, None);
            }
        }
    }

    fn flush(&mut self, world: &mut World, commit: bool) {
        let mut f = std::mem::take(&mut self.pending);
        f.merge(self.agg.take_flush());
        world.apply(&f, commit);
    }
}

/// The definition applied to the log, with the recorded pins.
fn expected(log: &[Vec<Rec>], pins: &HashMap<(i32, i64), Pin>) -> BTreeMap<BucketKey, u64> {
    let mut out = BTreeMap::new();
    for (p, records) in log.iter().enumerate() {
        let p = p as i32;
        let mut clock = PartitionClock::default();
        let mut scope = PrivateScope::new(W);
        for (o, rec) in records.iter().enumerate() {
            let now = clock.tick(Some(i64::from(rec.ts) * 1000));
            let Some((click, ad)) = rec.click else { continue };
            if scope.sight(p, u128::from(click), now, pins.get(&(p, o as i64)).copied()).counts() {
                *out.entry(bucket(rec, ad)).or_default() += 1;
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Op {
    /// A member reads (partition, records, flush afterwards) steps, then crashes; with
    /// the last value set, while the claims of one more poll batch (partition, records)
    /// reached only the key groups in that bit set.
    Crash(Vec<(i32, usize, bool)>, Option<(i32, usize, u8)>),
    /// The cache loses everything (a flushed Redis, expired keys).
    Wipe,
    /// One key group loses everything (a Redis Cluster node that lost its data).
    WipeGroup(usize),
    /// The group's offsets are moved back, per partition, to a fraction of its length.
    Reset(Vec<f64>),
    /// A replay from a fraction of each partition's length.
    Replay(Vec<f64>),
}

fn logs() -> impl Strategy<Value = Vec<Vec<Rec>>> {
    let record = (0u32..4, prop::bool::weighted(0.1), prop::option::weighted(0.85, (0u8..12, 0u8..3)));
    prop::collection::vec(prop::collection::vec(record, 0..60), PARTITIONS as usize).prop_map(|parts| {
        parts
            .into_iter()
            .map(|records| {
                let mut ts: Secs = 1_000;
                records
                    .into_iter()
                    .map(|(dt, back, click)| {
                        // Mostly forward, sometimes a producer clock a few seconds behind.
                        ts = if back { ts.saturating_sub(dt * 2) } else { ts + dt };
                        Rec { ts, click }
                    })
                    .collect()
            })
            .collect()
    })
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let fractions = || prop::collection::vec(0.0f64..1.0, PARTITIONS as usize);
    let steps = prop::collection::vec((0..PARTITIONS, 1usize..25, any::<bool>()), 0..8);
    let torn = prop::option::weighted(0.3, (0..PARTITIONS, 1usize..25, 0u8..(1 << GROUPS)));
    let op = prop_oneof![
        4 => (steps, torn).prop_map(|(steps, torn)| Op::Crash(steps, torn)),
        1 => Just(Op::Wipe),
        1 => (0..GROUPS).prop_map(Op::WipeGroup),
        1 => fractions().prop_map(Op::Reset),
        1 => fractions().prop_map(Op::Replay),
    ];
    prop::collection::vec(op, 0..8)
}

fn at(fractions: &[f64], log: &[Vec<Rec>]) -> Vec<i64> {
    fractions.iter().zip(log).map(|(f, records)| (f * records.len() as f64) as i64).collect()
}

proptest! {
    // PROPTEST_CASES raises the count for a longer hunt (512 by default: about a second).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn any_interleaving_of_crashes_resets_wipes_and_replays_gives_the_rows_the_definition_gives(
        log in logs(),
        n in 1u64..12,
        ops in ops(),
    ) {
        let n = BatchOffsets::new(n).unwrap();
        let mut world = World::default();
        for op in &ops {
            match op {
                Op::Crash(steps, torn) => {
                    let mut member = Process::member(&mut world, &log, n);
                    for &(p, k, flush) in steps {
                        member.read(&mut world, p, k, None);
                        if flush {
                            member.flush(&mut world, true);
                        }
                    }
                    if let Some((p, k, applied)) = *torn {
                        member.read(&mut world, p, k, Some(applied));
                    }
                }
                Op::Wipe => {
                    for g in &mut world.groups {
                        *g = Group::default();
                    }
                }
                Op::WipeGroup(g) => world.groups[*g] = Group::default(),
                Op::Reset(f) => {
                    // Back only: a reset forward skips records on purpose, and nothing
                    // counts them until a replay reads them.
                    for (p, o) in at(f, &log).into_iter().enumerate() {
                        let now = world.committed.get(&(p as i32)).copied().unwrap_or(0);
                        world.committed.insert(p as i32, o.min(now));
                    }
                }
                Op::Replay(f) => {
                    let mut replay = Process::replay(&world, &log, n, &at(f, &log));
                    replay.read_to_end(&mut world);
                    replay.flush(&mut world, false);
                }
            }
        }
        let mut last = Process::member(&mut world, &log, n);
        last.read_to_end(&mut world);
        last.flush(&mut world, true);
        prop_assert_eq!(world.billing(), expected(&log, &world.pins));
    }
}

#[test]
fn without_copies_on_other_partitions_the_counts_are_the_definition_alone() {
    // One partition: nothing is pinned, and a crash, a wipe and a replay change nothing.
    let recs = |v: &[(Secs, u8)]| v.iter().map(|&(ts, c)| Rec { ts, click: Some((c, 0)) }).collect::<Vec<_>>();
    let log = vec![recs(&[(0, 1), (5, 1), (12, 1), (30, 1), (31, 2)]), vec![]];
    let n = BatchOffsets::new(2).unwrap();
    let mut world = World::default();
    let mut member = Process::member(&mut world, &log, n);
    member.read(&mut world, 0, 3, None);
    member.flush(&mut world, true);
    for g in &mut world.groups {
        *g = Group::default();
    }
    let mut replay = Process::replay(&world, &log, n, &[1, 0]);
    replay.read_to_end(&mut world);
    replay.flush(&mut world, false);
    let mut last = Process::member(&mut world, &log, n);
    last.read_to_end(&mut world);
    last.flush(&mut world, true);
    // 0 counts; 5 and 12 are within 10 s of the sighting before them; 30 counts; 31 is another click.
    let minute = |ad| BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(0) };
    assert_eq!(world.billing(), BTreeMap::from([(minute(0), 3)]));
    assert!(world.pins.is_empty());
}
