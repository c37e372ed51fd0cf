//! The property test of the definition (README, "What counts"): a model of the whole
//! system — the log, the shared cache (`decide_shared`, applied as `claim.lua` applies
//! it), private scopes, ClickHouse (rows read through FINAL, and pins) and the group's
//! committed offsets — driven through any interleaving of live members that flush or
//! crash, cache wipes, group resets to any offset and replays of any range, with the
//! same planning (`position`) and fall-back rules as the pipeline. Whatever happened,
//! the rows in the table must give the counts the definition gives for the log, with
//! the cross-partition decisions the members recorded.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::{decide_shared, Chain, ClaimMode, Frontier, PartitionClock, Pin, PrivateScope, Secs, Sighting, Verdict};
use crate::aggregate::{Aggregator, BatchOffsets, BucketKey, Flush, Grain};
use crate::click::Minute;
use crate::position::{self, CacheFrontier, Marks, Scope, Start};
use crate::sink::{stored_version, Writer};

const W: Secs = 10;
const PARTITIONS: i32 = 2;

/// One record: its timestamp (s) and, for a valid click, its click ID and ad.
#[derive(Debug, Clone, Copy)]
struct Rec {
    ts: Secs,
    click: Option<(u8, u8)>,
}

fn bucket(rec: &Rec, ad: u8) -> BucketKey {
    BucketKey { ad_id: u64::from(ad), minute: Minute::from_epoch_seconds(rec.ts - rec.ts % 60) }
}

/// Redis, ClickHouse and the group's offsets.
#[derive(Default)]
struct World {
    entries: HashMap<u8, Vec<Chain>>,
    /// Per partition: the highest offset claimed, its record time, and where re-reads
    /// are exact from.
    frontier: HashMap<i32, (i64, Secs, i64)>,
    cached_pins: HashMap<(i32, i64), Pin>,
    rows: HashMap<(Grain, i32, i64, BucketKey), (u64, u64)>,
    pins: HashMap<(i32, i64), Pin>,
    committed: HashMap<i32, i64>,
}

impl World {
    /// `claim.lua` for one claim.
    fn claim(&mut self, click: u8, s: Sighting, mode: ClaimMode) -> Verdict {
        let f = self.frontier.get(&s.partition).map(|&(claimed, _, exact_from)| Frontier { claimed, exact_from });
        let v = decide_shared(self.entries.entry(click).or_default(), s, f, mode, W);
        let reread = f.is_some_and(|f| s.offset <= f.claimed);
        if let (None, Some(new_pin), false) = (mode.pin, v.pin(), reread) {
            self.cached_pins.insert((s.partition, s.offset), new_pin);
        }
        if !reread {
            self.frontier.insert(s.partition, (s.offset, s.clock, f.map_or(0, |f| f.exact_from)));
        }
        v
    }

    /// `claim.lua`'s `restart`.
    fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) {
        if self.frontier.get(&partition).is_none_or(|&(claimed, _, _)| claimed < lookback - 1) {
            self.frontier.insert(partition, (lookback - 1, 0, boundary));
        }
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
            let slot = self.rows.entry((r.grain, r.partition, r.batch_start, r.key)).or_insert((r.clicks, version));
            if version >= slot.1 {
                *slot = (r.clicks, version);
            }
        }
        let commit = member;
        if commit {
            for (&p, &c) in &flush.commits {
                self.committed.insert(p, c);
                self.cached_pins.retain(|&(xp, o), _| xp != p || o >= c);
            }
        }
    }

    fn recorded_pins(&self, partition: i32, from: i64, with_cache: bool) -> BTreeMap<i64, Pin> {
        let mut out: BTreeMap<i64, Pin> = BTreeMap::new();
        let cached = self.cached_pins.iter().filter(|_| with_cache);
        for (&(p, o), &pin) in self.pins.iter().chain(cached) {
            if p == partition && o >= from {
                out.insert(o, pin);
            }
        }
        out
    }

    fn billing(&self, grain: Grain) -> BTreeMap<BucketKey, u64> {
        let mut out = BTreeMap::new();
        for ((g, _, _, k), (clicks, _)) in &self.rows {
            if *g == grain {
                *out.entry(*k).or_default() += clicks;
            }
        }
        out.retain(|_, c: &mut u64| *c > 0);
        out
    }
}

/// What the broker answers for a reader counting from `boundary` (`source::marks_at`).
fn marks(log: &[Rec], boundary: i64) -> Marks {
    let clock_before = log[..boundary as usize].iter().map(|r| r.ts).max();
    let lookback = match clock_before {
        None => boundary,
        Some(c) => log.iter().position(|r| r.ts >= c.saturating_sub(W)).map_or(boundary, |o| (o as i64).min(boundary)),
    };
    Marks { boundary, clock_before, lookback }
}

struct Reader {
    start: Start,
    clock: PartitionClock,
    next: i64,
    pins: BTreeMap<i64, Pin>,
}

impl Reader {
    fn new(start: Start, pins: BTreeMap<i64, Pin>) -> Reader {
        Reader { start, clock: PartitionClock::at(start.clock), next: start.read_from, pins }
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
            let m = marks(&log[p as usize], boundary);
            let frontier = world.frontier.get(&p).map(|&(claimed, clock, exact_from)| CacheFrontier {
                claimed,
                clock,
                exact_from,
            });
            let start = position::shared_start(p, m, frontier);
            if start.read_from == m.lookback && m.lookback < m.boundary {
                world.restart(p, m.lookback, m.boundary);
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
            let start = position::private_start(p, marks(&log[p as usize], boundary));
            process.readers.insert(p, Reader::new(start, world.recorded_pins(p, start.count_from, false)));
        }
        process
    }

    /// Reads up to `k` records of `p` (`Stages::process`).
    fn read(&mut self, world: &mut World, p: i32, k: usize) {
        for _ in 0..k {
            let reader = self.readers.get_mut(&p).expect("assigned");
            let log = &self.log[p as usize];
            let Some(&rec) = log.get(reader.next as usize) else { return };
            let o = reader.next;
            reader.next += 1;
            let clock = reader.clock.tick(Some(i64::from(rec.ts) * 1000));
            let warm = o < reader.start.count_from;
            let Some((click, ad)) = rec.click else {
                if !warm {
                    self.agg.observe(p, o, None, None);
                }
                continue;
            };
            let recorded = reader.pins.get(&o).copied();
            let verdict = match reader.start.scope {
                Scope::Private => self.private.sight(p, u128::from(click), clock, recorded.filter(|_| !warm)),
                Scope::Shared { .. } => {
                    world.claim(click, Sighting { partition: p, offset: o, clock }, ClaimMode { pin: recorded, warm })
                }
            };
            if warm {
                continue;
            }
            if verdict == Verdict::Undecidable {
                self.fall_back(world, p);
                continue;
            }
            let counted = verdict.counts().then(|| bucket(&rec, ad));
            // Pins are recorded again on re-reads: one applied from the cache may not be
            // durable yet, and the trim after this flush's commit drops it there.
            self.agg.observe(p, o, counted, verdict.pin().map(|pin| (pin, bucket(&rec, ad))));
        }
    }

    /// `Stages::fall_back_to_private`.
    fn fall_back(&mut self, world: &World, p: i32) {
        let reader = &self.readers[&p];
        let cut = self.agg.take_partitions(&[p]);
        let from = cut.commits.get(&p).copied().unwrap_or(reader.start.count_from);
        self.pending.merge(cut);
        let start = position::private_start(p, marks(&self.log[p as usize], from));
        self.private.forget(p);
        self.readers.insert(p, Reader::new(start, world.recorded_pins(p, start.count_from, true)));
    }

    fn read_to_end(&mut self, world: &mut World) {
        for p in 0..PARTITIONS {
            // Several passes: a fall-back starts the partition over.
            while self.readers[&p].next < self.log[p as usize].len() as i64 {
                self.read(world, p, usize::MAX);
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
    /// A member reads (partition, records, flush afterwards) steps, then crashes.
    Crash(Vec<(i32, usize, bool)>),
    /// The cache loses everything (a flushed Redis, expired keys).
    Wipe,
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
    let op = prop_oneof![
        4 => prop::collection::vec((0..PARTITIONS, 1usize..25, any::<bool>()), 0..8).prop_map(Op::Crash),
        1 => Just(Op::Wipe),
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
                Op::Crash(steps) => {
                    let mut member = Process::member(&mut world, &log, n);
                    for &(p, k, flush) in steps {
                        member.read(&mut world, p, k);
                        if flush {
                            member.flush(&mut world, true);
                        }
                    }
                }
                Op::Wipe => {
                    world.entries.clear();
                    world.frontier.clear();
                    world.cached_pins.clear();
                }
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
        let minutes = world.billing(Grain::Minute);
        prop_assert_eq!(&minutes, &expected(&log, &world.pins));
        // The hourly and daily roll-ups, written by the same readers, agree with them.
        for grain in [Grain::Hour, Grain::Day] {
            let mut rolled = BTreeMap::new();
            for (k, c) in &minutes {
                *rolled.entry(BucketKey { ad_id: k.ad_id, minute: grain.truncate(k.minute) }).or_default() += c;
            }
            prop_assert_eq!(world.billing(grain), rolled);
        }
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
    member.read(&mut world, 0, 3);
    member.flush(&mut world, true);
    world.entries.clear();
    world.frontier.clear();
    let mut replay = Process::replay(&world, &log, n, &[1, 0]);
    replay.read_to_end(&mut world);
    replay.flush(&mut world, false);
    let mut last = Process::member(&mut world, &log, n);
    last.read_to_end(&mut world);
    last.flush(&mut world, true);
    // 0 counts; 5 and 12 are within 10 s of the sighting before them; 30 counts; 31 is another click.
    let minute = |ad| BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(0) };
    assert_eq!(world.billing(Grain::Minute), BTreeMap::from([(minute(0), 3)]));
    assert!(world.pins.is_empty());
}
