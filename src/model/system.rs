//! The simulated system: ClickHouse (rows read through `FINAL`, pins, recorded clocks),
//! the group's committed offsets, the settings versions, the wall clock, and the
//! processes — live members and replays — built from the product's pure pieces
//! (`Aggregator`, `position`, `PartitionClock`, `PrivateScope`, `decide_shared` through
//! the cache mirror, `sweep_cutoff`, and the pipeline's own claim step `claims_of` and
//! sweep hold `hold`, so a change to either fails the model) and mirrors of the steps
//! that do I/O: `Stages::prepare`/`apply`/`fall_back`/`start_over`, `Planner::plan_starts`/
//! `fall_back`/`ensure_pins`, `planner::marks`, the `Claimer`, `Loop::run`/`start_over`/
//! `rewind`, the flusher (pins, clocks, day, hour and minute rows, then the commit) and
//! `replay`.
//!
//! Nothing here decides what *should* count: that is `oracle`'s job.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use super::log::Log;
use super::oracle;
use super::redis::{group_of, ClaimIn, Lost, Ns, Recovered, Redis, Reply, GROUPS};
use crate::aggregate::{Aggregator, BucketKey, Flush};
use crate::cache::sweeper::sweep_cutoff;
use crate::click::Minute;
use crate::dedup::{Checkpoint, Fingerprint, PartitionClock, Pin, PrivateScope, Secs, Sighting, Timeline, Verdict};
use crate::pipeline::{claims_of, hold, ItemAt};
use crate::position::BatchOffsets;
use crate::position::{self, Marks, Resume, Scope, Start};
use crate::sealing::Grain;
use crate::sink::{stored_version, Writer};

/// How often the simulated system took each path, over all cases (for
/// `scripts/model-nightly`: a path never taken is a path not tested).
pub mod coverage {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    macro_rules! counters {
        ($($name:ident: $what:literal,)*) => {
            $(pub static $name: AtomicUsize = AtomicUsize::new(0);)*
            pub fn report() -> String {
                let mut out = Vec::new();
                $(out.push(format!("{} {}", $name.load(Relaxed), $what));)*
                out.join(", ")
            }
        };
    }

    counters! {
        WAITS: "waits (rewound)",
        FALL_BACKS: "fall-backs to private state",
        RESUMED: "returns from private state to the cache",
        LOST_NAMESPACE: "losses found by the namespace",
        LOST_FRONTIER: "losses found by the frontier",
        START_OVERS: "start-overs",
        FENCED: "fenced flushes dropped",
        CONFIRMS: "jumps of clicks judged ahead confirmed",
        CROSS_DUPLICATES: "cross-partition duplicates decided",
        SWEEPS: "sweeps",
        SWEPT: "chains swept",
        REPLAY_PASSES: "replay passes",
        MID_FLUSH_CRASHES: "crashes inside a flush",
        ZOMBIE_FLUSHES: "flushes of partitions another member reads",
    }

    pub fn add(c: &AtomicUsize, n: usize) {
        c.fetch_add(n, Relaxed);
    }
}

use coverage::add;

/// `dedup.max_record_lag` (s).
pub const LAG: u32 = 20;
/// How many offsets of pins a reader loads at a time (`Stages::pins_window` at its floor).
const PINS_WINDOW: i64 = 100_000;

/// A settings version: its window and the offset of each partition it decides from.
#[derive(Debug, Clone)]
pub struct Version {
    pub window: Secs,
    pub from: Vec<i64>,
}

/// Per grain, partition, batch and bucket: (clicks, stored version, settings version).
pub type Rows = HashMap<(Grain, i32, i64, BucketKey), (u64, u64, usize)>;

/// Where readers start, with the recorded pins of what they read (loaded up to `.2`).
type Planned = Vec<(Start, BTreeMap<i64, Pin>, i64)>;

/// Everything but the processes.
pub struct World {
    pub log: Log,
    pub n: BatchOffsets,
    pub versions: Vec<Version>,
    pub redis: Redis,
    /// `ad_clicks_minute`: per grain (only minutes: flushes write no others), partition,
    /// batch and bucket, the kept row (clicks, stored version) and the settings version
    /// its writer decided under.
    pub rows: Rows,
    pub pins: BTreeMap<(i32, i64), Pin>,
    pub clocks: BTreeMap<(i32, i64), PartitionClock>,
    pub committed: Vec<Option<i64>>,
    /// The wall clock (s).
    pub wall: u32,
    /// The cross-partition clicks the defect `World::resets_to` names meets.
    pub exposed: BTreeSet<u32>,
    /// Per partition, the offsets group resets moved past that no member read since.
    pub skipped: BTreeMap<i32, BTreeSet<i64>>,
    /// What the model saw the product do that the oracle contradicts on the way
    /// (record times, recorded clocks), or that the model cannot go on from.
    pub violations: Vec<String>,
    /// The oracle's clock (and pending jump) before each offset of each partition.
    truth: Vec<Vec<(Option<u32>, Option<u32>)>>,
    next_pid: u64,
}

impl World {
    pub fn new(log: Log, n: BatchOffsets, window: Secs) -> World {
        let truth = log
            .parts
            .iter()
            .map(|records| {
                let ts: Vec<Option<u32>> = records.iter().map(|r| oracle::stamp(r.ts)).collect();
                oracle::clocks(&ts).into_iter().zip(oracle::pending(&ts)).collect()
            })
            .collect();
        let partitions = log.partitions();
        World {
            wall: super::log::T0,
            log,
            n,
            versions: vec![Version { window, from: vec![0; partitions] }],
            redis: Redis::new(),
            exposed: BTreeSet::new(),
            rows: HashMap::new(),
            pins: BTreeMap::new(),
            clocks: BTreeMap::new(),
            committed: vec![None; partitions],
            skipped: BTreeMap::new(),
            violations: Vec::new(),
            truth,
            next_pid: 0,
        }
    }

    /// The group's offsets move to the boundaries `to` (per partition): members will count
    /// offsets a reset forward had skipped, which the cache takes for decided (a warm-up,
    /// or a private re-read filling the cache, claimed them as counted chains without a
    /// cross-partition check) although nobody decided them: the cross-partition clicks
    /// with a copy there are held loosely. (`restart` no longer leaves such a partition
    /// ready before its warm-up — the test
    /// `a_warm_up_after_a_reset_forward_counts_a_copy_another_partition_counted` — but a
    /// warm chain still stands for a decision nobody made; see the summary in `model.rs`.)
    pub fn resets_to(&mut self, to: &[i64]) {
        for c in &self.log.cross {
            let read_again = |&(p, o): &(usize, usize)| {
                o as i64 >= to[p] && self.skipped.get(&(p as i32)).is_some_and(|s| s.contains(&(o as i64)))
            };
            if c.copies.iter().any(read_again) {
                self.exposed.insert(c.id);
            }
        }
    }

    pub fn partitions(&self) -> i32 {
        self.log.partitions() as i32
    }

    fn len(&self, p: i32) -> i64 {
        self.log.len(p as usize)
    }

    fn pid(&mut self) -> u64 {
        self.next_pid += 1;
        self.next_pid
    }

    /// The settings version deciding offset `o` of `p` (`RulesHistory::at`).
    pub fn version_at(&self, p: usize, o: usize) -> usize {
        (0..self.versions.len()).rev().find(|&v| v == 0 || self.versions[v].from[p] <= o as i64).unwrap_or(0)
    }

    pub fn latest(&self) -> usize {
        self.versions.len() - 1
    }

    fn latest_from(&self, p: i32) -> i64 {
        let v = self.latest();
        if v == 0 {
            0
        } else {
            self.versions[v].from[p as usize]
        }
    }

    /// `position::boundary` on a log that starts at 0.
    pub fn boundary(&self, p: i32, requested: Option<i64>) -> i64 {
        position::boundary(self.n, 0, self.len(p), requested)
    }

    /// `planner::lagging_clock` from the recorded clocks and the group's commits.
    fn lagging_clock(&self) -> Option<Secs> {
        let mut need: Option<Secs> = None;
        for q in 0..self.partitions() {
            let b = self.boundary(q, self.committed[q as usize]);
            if b >= self.len(q) {
                continue;
            }
            match self.marks(q, b, Secs::ZERO, None).near.1.get() {
                Some(c) => need = Some(need.map_or(c, |n| n.min(c))),
                None => return Some(Secs::ZERO),
            }
        }
        need
    }

    /// `planner::marks` from the recorded clocks.
    fn marks(&self, p: i32, boundary: i64, window: Secs, need: Option<Secs>) -> Marks {
        let log_start = (0, PartitionClock::default());
        let recorded = |to: i64, below: Option<Secs>| {
            self.clocks
                .range((p, 0)..=(p, to))
                .rev()
                .find(|(_, c)| match below {
                    // `near`: a reader starting there knows every click whose jump is
                    // still to be confirmed.
                    None => c.pending().is_none(),
                    Some(b) => c.get().is_none_or(|t| t < b) && c.pending().is_none_or(|t| t < b),
                })
                .map(|(&(_, b), &c)| (b, c))
        };
        let near = recorded(boundary, None).unwrap_or(log_start);
        let lookback = match near.1.get() {
            None => log_start,
            Some(c) => recorded(near.0, Some(need.map_or(c, |n| n.min(c)).saturating_sub(window))).unwrap_or(log_start),
        };
        let lookback = if lookback.0 > near.0 { near } else { lookback };
        Marks { boundary, near, lookback }
    }

    /// The recorded cross-partition decisions of `p` in `[from, to]`: durable ones, and
    /// with `cache`, those still only in that namespace (`pipeline::load_pins`).
    fn load_pins(&self, p: i32, from: i64, to: i64, cache: Option<Ns>) -> BTreeMap<i64, Pin> {
        let mut out: BTreeMap<i64, Pin> =
            self.pins.range((p, from)..=(p, to)).map(|(&(_, o), &pin)| (o, pin)).collect();
        if let Some(ns) = cache {
            out.extend(self.redis.cached_pins(ns, p, from).into_iter().filter(|&(o, _)| o <= to));
        }
        out
    }

    /// The flusher's writes of one job, in its order: pins, clocks, then the minute rows
    /// (hours and days are sealed from them later, not written by a flush); `stages` of
    /// them (3: all).
    fn write(&mut self, job: &Job, writer: Writer, settings: usize, stages: usize) {
        if stages >= 1 {
            for pin in &job.flush.pins {
                self.pins.insert((pin.partition, pin.offset), pin.pin);
            }
        }
        if stages >= 2 {
            for cp in &job.clocks {
                self.record_clock(*cp);
            }
        }
        if stages < 3 {
            return;
        }
        for r in &job.flush.rows {
            let version = stored_version(r.version, writer);
            let slot = self
                .rows
                .entry((Grain::Minute, r.partition, r.batch_start, r.key))
                .or_insert((r.clicks, version, settings));
            if version >= slot.1 {
                *slot = (r.clicks, version, settings);
            }
        }
    }

    fn record_clock(&mut self, cp: Checkpoint) {
        let (clock, pending) = self.truth[cp.partition as usize][cp.boundary as usize];
        if (cp.clock.get().map(Secs::get), cp.clock.pending().map(Secs::get)) != (clock, pending) {
            self.violations.push(format!(
                "recorded clock of partition {} at {}: {:?}, but the log's clock there is {clock:?} (pending {pending:?})",
                cp.partition, cp.boundary, cp.clock
            ));
        }
        if let Some(before) = self.clocks.insert((cp.partition, cp.boundary), cp.clock) {
            if before != cp.clock {
                self.violations.push(format!("two readers recorded different clocks at {cp:?}: {before:?}"));
            }
        }
    }

    fn check_time(&mut self, p: i32, o: i64, clock: Secs) {
        let truth = self.log.times[p as usize][o as usize];
        if clock != Secs::new(truth) {
            self.violations
                .push(format!("offset {o} of partition {p} read at record time {clock}, the log's is {truth}"));
        }
    }

    /// Per bucket `(ad, start of the minute/hour/day)`, the billing count through `FINAL`.
    pub fn billing(&self, grain: Grain) -> BTreeMap<(u8, u32), u64> {
        self.billing_but(grain, |_, _, _| false)
    }

    /// The billing count without the rows `skip(partition, batch start, settings version
    /// of its writer)` names.
    pub fn billing_but(&self, grain: Grain, skip: impl Fn(i32, i64, usize) -> bool) -> BTreeMap<(u8, u32), u64> {
        let mut out: BTreeMap<(u8, u32), u64> = BTreeMap::new();
        for ((g, p, b, k), (clicks, _, settings)) in &self.rows {
            if *g == grain && !skip(*p, *b, *settings) {
                *out.entry((k.ad_id as u8, k.minute.epoch_seconds())).or_default() += clicks;
            }
        }
        out.retain(|_, c| *c > 0);
        out
    }
}

/// One flush on its way to ClickHouse (`flusher::Job`).
#[derive(Debug, Clone, Default)]
pub struct Job {
    pub flush: Flush,
    pub clocks: Vec<Checkpoint>,
}

/// One partition being read (`pipeline::Reader`).
#[derive(Debug)]
struct Reader {
    generation: u64,
    count_from: i64,
    clock: Timeline,
    /// `pipeline::Reader::decided_clock`.
    decided_clock: Secs,
    /// `pipeline::Reader::decided`: the last offset applied.
    decided: i64,
    scope: Scope,
    pins: BTreeMap<i64, Pin>,
    pins_until: i64,
    last: i64,
    /// `pipeline::Reader::commit_floor`: commits go out only past it.
    commit_floor: i64,
}

impl Reader {
    fn new(start: Start, pins: BTreeMap<i64, Pin>, pins_until: i64, generation: u64) -> Reader {
        Reader {
            generation,
            count_from: start.count_from,
            clock: Timeline::new(start.clock),
            decided_clock: start.clock.now(),
            decided: start.read_from - 1,
            scope: start.scope,
            pins,
            pins_until,
            last: start.read_from - 1,
            commit_floor: start.commit_floor,
        }
    }
}

struct Item {
    p: i32,
    offset: i64,
    click: Option<oracle::ClickOf>,
    generation: u64,
    clock: Secs,
    now: Secs,
    clock_before: Timeline,
    confirms: Option<(i64, u128)>,
    warm: bool,
    verdict: Option<Verdict>,
}

/// A poll batch between `prepare` and `apply`.
#[derive(Default)]
struct Prepared {
    items: Vec<Item>,
    claims: Vec<ClaimIn>,
    generations: Vec<u64>,
    claimed: Vec<Option<usize>>,
    /// `ClaimBatch::marks`: per partition read through the cache, its last record read.
    marks: Vec<(Sighting, u64)>,
}

/// What `apply` asks of the loop.
#[derive(Default)]
struct Applied {
    fall_backs: Vec<i32>,
    rewinds: BTreeMap<i32, i64>,
}

/// `pipeline::Stages`: the state up to the cut of a flush (a member's or a replay's).
struct Stages {
    window: Secs,
    agg: Aggregator,
    readers: BTreeMap<i32, Reader>,
    generation: u64,
    private: PrivateScope,
    carried: Flush,
    clocks: Vec<Checkpoint>,
    /// A replay's `GroupProgress::final_below`.
    final_below: BTreeMap<i32, i64>,
}

fn bucket(c: &oracle::ClickOf) -> BucketKey {
    BucketKey { ad_id: u64::from(c.ad), minute: Minute::from_epoch_seconds(c.minute) }
}

impl Stages {
    fn new(n: BatchOffsets, window: Secs) -> Stages {
        Stages {
            window,
            agg: Aggregator::new(n),
            readers: BTreeMap::new(),
            generation: 0,
            private: PrivateScope::new(window),
            carried: Flush::default(),
            clocks: Vec::new(),
            final_below: BTreeMap::new(),
        }
    }

    /// `Stages::assign`.
    fn assign(&mut self, starts: Planned) {
        for (start, pins, until) in starts {
            let p = start.partition;
            self.agg.forget(p);
            self.private.forget(p);
            self.generation += 1;
            self.readers.insert(p, Reader::new(start, pins, until, self.generation));
        }
    }

    /// `Stages::ensure_pins` for records about to be prepared.
    fn ensure_pins(&mut self, w: &World, records: &[(i32, i64)], cache: Option<Ns>) {
        let mut needed: BTreeMap<i32, i64> = BTreeMap::new();
        for &(p, o) in records {
            if let Some(r) = self.readers.get(&p) {
                if o > r.pins_until && o > r.last {
                    let at = needed.entry(p).or_insert(o);
                    *at = (*at).max(o);
                }
            }
        }
        let mut loads: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
        for (p, beyond) in needed {
            let from = self.readers[&p].pins_until + 1;
            loads.insert(p, (from, beyond.max(from + PINS_WINDOW - 1)));
        }
        // `Planner::ensure_pins` of a replay: asks for the group's committed offsets
        // where it loads pins or reads past where they stood at its last load.
        let mut committed = BTreeMap::new();
        if cache.is_none() {
            let mut reads: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
            for &(p, o) in records {
                if self.readers.contains_key(&p) {
                    let at = reads.entry(p).or_insert((o, o));
                    *at = (at.0.min(o), at.1.max(o));
                }
            }
            for (&p, &(lo, hi)) in &reads {
                let fb = self.final_below.get(&p).copied();
                if loads.contains_key(&p) || fb.is_some_and(|fb| hi >= fb) {
                    let now = w.committed[p as usize].unwrap_or(0);
                    committed.insert(p, now);
                    if fb.is_some_and(|fb| now > fb) && !loads.contains_key(&p) {
                        loads.insert(p, (lo, self.readers[&p].pins_until));
                    }
                }
            }
        }
        for (p, (from, to)) in loads {
            let r = self.readers.get_mut(&p).expect("checked");
            r.pins.extend(w.load_pins(p, from, to, cache));
            r.pins_until = to;
            if let Some(&now) = committed.get(&p) {
                self.final_below.insert(p, now);
            }
        }
    }

    /// `Stages::prepare`: clocks, private decisions, the claims for the cache.
    fn prepare(&mut self, w: &mut World, records: &[(i32, i64)]) -> Prepared {
        let n = self.agg.batch_offsets();
        let mut items = Vec::new();
        for &(p, o) in records {
            let Some(reader) = self.readers.get_mut(&p) else { continue };
            if o <= reader.last {
                continue;
            }
            let b = n.start_of(o);
            if b > reader.last + 1 {
                self.clocks.push(Checkpoint { partition: p, boundary: b, clock: reader.clock.clock });
            }
            reader.last = o;
            let rec = w.log.parts[p as usize][o as usize];
            let clock_before = reader.clock;
            let read = reader.clock.read(
                o,
                rec.ts.map(|t| i64::try_from(t).map_or(i64::MAX, |t| t.saturating_mul(1000))),
                rec.click.map(|c| u128::from(c.id)),
            );
            let clock = read.time;
            if n.start_of(o + 1) == o + 1 {
                self.clocks.push(Checkpoint { partition: p, boundary: o + 1, clock: reader.clock.clock });
            }
            w.check_time(p, o, clock);
            let warm = o < reader.count_from;
            items.push(Item {
                p,
                offset: o,
                click: rec.click,
                generation: reader.generation,
                clock,
                now: read.now,
                clock_before,
                confirms: read.confirms,
                warm,
                verdict: None,
            });
        }
        let (mut claims, mut generations, mut claimed) = (Vec::new(), Vec::new(), Vec::new());
        for (idx, i) in items.iter_mut().enumerate() {
            let (p, o) = (i.p, i.offset);
            let reader = self.readers.get_mut(&p).expect("items come from readers");
            if i.confirms.is_some() {
                add(&coverage::CONFIRMS, 1);
            }
            // The product's own step (`Stages::claim` calls it too).
            let at = ItemAt {
                sighting: Sighting { partition: p, offset: o, clock: i.clock, now: i.now },
                warm: i.warm,
                pin: i.click.and_then(|_| reader.pins.get(&o).copied()),
                confirms: i.confirms,
                fingerprint: i.click.map(|c| Fingerprint(u128::from(c.id))),
            };
            let asks = claims_of(&mut reader.scope, &mut self.private, at);
            if asks.resumed {
                add(&coverage::RESUMED, 1);
            }
            i.verdict = asks.verdict;
            for (claim, decides) in
                asks.confirm.map(|c| (c, false)).into_iter().chain(asks.own.map(|c| (c, asks.own_decides)))
            {
                claims.push(ClaimIn { id: claim.fingerprint.0 as u32, sighting: claim.sighting, mode: claim.mode });
                claimed.push(decides.then_some(idx));
                generations.push(i.generation);
            }
        }
        let mut last: BTreeMap<i32, (Sighting, u64)> = BTreeMap::new();
        for i in &items {
            if matches!(self.readers.get(&i.p).map(|r| r.scope), Some(Scope::Shared { .. })) {
                let sighting = Sighting { partition: i.p, offset: i.offset, clock: i.clock, now: i.now };
                last.insert(i.p, (sighting, i.generation));
            }
        }
        let marks = last.into_values().collect();
        Prepared { items, claims, generations, claimed, marks }
    }

    /// `Stages::apply`: the verdicts, then the aggregator.
    fn apply(&mut self, prepared: Prepared, verdicts: Vec<Verdict>) -> Applied {
        let Prepared { mut items, claimed, .. } = prepared;
        let mut distrusted: BTreeMap<i32, u64> = BTreeMap::new();
        let mut waits: BTreeMap<i32, (i64, Timeline, u64)> = BTreeMap::new();
        for (idx, v) in claimed.into_iter().zip(verdicts) {
            let Some(idx) = idx else { continue };
            items[idx].verdict = Some(v);
            let item = &items[idx];
            if v == Verdict::Undecidable && !item.warm {
                distrusted.entry(item.p).or_insert(item.generation);
            }
            if v == Verdict::Wait {
                waits.entry(item.p).or_insert((item.offset, item.clock_before, item.generation));
            }
        }
        let current =
            |readers: &BTreeMap<i32, Reader>, p: &i32, g: u64| readers.get(p).is_some_and(|r| r.generation == g);
        distrusted.retain(|p, g| current(&self.readers, p, *g));
        waits.retain(|p, (_, _, g)| !distrusted.contains_key(p) && current(&self.readers, p, *g));
        let mut applied: BTreeMap<i32, i64> = BTreeMap::new();
        for i in items {
            let current = current(&self.readers, &i.p, i.generation);
            let waiting = waits.get(&i.p).is_some_and(|&(from, _, _)| i.offset >= from);
            if !current || distrusted.contains_key(&i.p) || waiting {
                continue;
            }
            applied.insert(i.p, i.offset);
            if let Some(r) = self.readers.get_mut(&i.p) {
                r.decided_clock = i.now;
                r.decided = i.offset;
            }
            if i.warm {
                continue;
            }
            let (counted, pin) = match (i.click, i.verdict) {
                (Some(c), Some(v)) => (v.counts().then(|| bucket(&c)), v.pin().map(|pin| (pin, bucket(&c)))),
                _ => (None, None),
            };
            self.agg.observe(i.p, i.offset, counted, pin);
        }
        for (p, offset) in applied {
            if let Some(r) = self.readers.get_mut(&p) {
                r.pins = r.pins.split_off(&(offset + 1));
            }
        }
        let mut rewinds = BTreeMap::new();
        for (p, (from, clock_before, _)) in waits {
            self.generation += 1;
            let r = self.readers.get_mut(&p).expect("checked current");
            r.last = from - 1;
            r.clock = clock_before;
            r.generation = self.generation;
            rewinds.insert(p, from);
        }
        Applied { fall_backs: distrusted.into_keys().collect(), rewinds }
    }

    /// `Stages::cut`.
    fn cut(&mut self) -> Job {
        let flush = self.agg.take_flush();
        self.job(flush)
    }

    /// `Stages::job`: the carried cuts with `flush`, commits only past each reader's floor.
    fn job(&mut self, flush: Flush) -> Job {
        let mut all = std::mem::take(&mut self.carried);
        all.merge(flush);
        all.commits.retain(|p, c| match self.readers.get_mut(p) {
            Some(reader) if *c > reader.commit_floor => {
                reader.commit_floor = *c;
                true
            }
            Some(_) => false,
            None => true,
        });
        Job { flush: all, clocks: std::mem::take(&mut self.clocks) }
    }
}

/// Whether a process is still running after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Alive,
    Dead,
}

/// A live member: its stages, its claim task, its flusher and its consumer's positions.
pub struct Member {
    pub pid: u64,
    ns: Ns,
    /// The claim task's handle: the frontier its claims reached, acknowledged, per
    /// partition, in the namespace named.
    acked: (Ns, BTreeMap<(usize, i32), i64>),
    st: Stages,
    /// The claim task's partitions whose reader generation had to wait.
    waiting: HashMap<i32, u64>,
    /// The claimer's `sent_marks`: per partition, the reader generation and mark of the
    /// last batch sent.
    sent_marks: HashMap<i32, (u64, i64)>,
    /// The flusher: handed-over jobs with the fence they were handed over under.
    queue: VecDeque<(Job, u64)>,
    fence: u64,
    /// The partitions whose commits the flusher sends.
    owned: BTreeSet<i32>,
    /// Where the consumer fetches each partition next.
    position: BTreeMap<i32, i64>,
    /// The holds last given to the sweeper.
    holds: BTreeMap<i32, Option<Secs>>,
    /// Whether the broker takes its commits (a zombie's are refused once it is fenced).
    pub commits_taken: bool,
}

impl Member {
    /// `Member::run` up to its first assignment: opens the cache's namespace, then is
    /// assigned `partitions`. `None` when it cannot start (its plan cannot be made).
    pub fn join(w: &mut World, partitions: &[i32]) -> Option<Member> {
        let tag = w.latest();
        let Recovered::Ns(ns) = w.redis.open(tag) else { return None };
        let pid = w.pid();
        let mut m = Member {
            pid,
            ns,
            acked: (ns, BTreeMap::new()),
            st: Stages::new(w.n, w.versions[tag].window),
            waiting: HashMap::new(),
            sent_marks: HashMap::new(),
            queue: VecDeque::new(),
            fence: 0,
            owned: BTreeSet::new(),
            position: BTreeMap::new(),
            holds: BTreeMap::new(),
            commits_taken: true,
        };
        match m.plan(w, partitions) {
            Ok(starts) => {
                m.assign(starts);
                m.owned.extend(partitions);
                // The loop gives the holds of its first assignment at once; the sweeper's
                // first walk waits for them.
                m.give_holds(w);
                Some(m)
            }
            // `GroupContext::plan` retries this forever: the member never reads.
            Err(_) => {
                w.violations.push(format!("member {pid} cannot plan its assignment {partitions:?}"));
                None
            }
        }
    }

    pub fn owns(&self, p: i32) -> bool {
        self.st.readers.contains_key(&p)
    }

    pub fn partitions(&self) -> Vec<i32> {
        self.st.readers.keys().copied().collect()
    }

    /// Its readers and what the cache says of their partitions, for a failure message.
    pub fn describe(&self, w: &World) -> String {
        let mut out = format!("member {} in {:?}:", self.pid, self.ns);
        for (&p, r) in &self.st.readers {
            out += &format!(
                "\n  partition {p}: last {} count_from {} scope {:?} position {:?} frontiers {:?} waiting {:?}",
                r.last,
                r.count_from,
                r.scope,
                self.position.get(&p),
                w.redis.frontiers(self.ns, p),
                self.waiting.get(&p)
            );
        }
        out
    }

    /// Whether every partition it reads is read to the end of the log.
    pub fn caught_up(&self, w: &World) -> bool {
        self.st.readers.iter().all(|(&p, r)| r.last + 1 >= w.len(p))
    }

    /// `Planner::plan_starts`.
    fn plan(&mut self, w: &mut World, partitions: &[i32]) -> Result<Planned, Lost> {
        let mut starts = Vec::new();
        let need = w.lagging_clock();
        for &p in partitions {
            let m = w.marks(p, w.boundary(p, w.committed[p as usize]), self.st.window, need);
            assert!(m.boundary >= w.latest_from(p), "model: a member would count from before its settings");
            let (frontier, _) = position::merge_frontiers(&w.redis.frontiers(self.ns, p), m);
            let mut start = position::shared_start(p, m, frontier);
            let committed = w.committed[p as usize].unwrap_or(0).min(w.len(p));
            start.commit_floor = committed.max(start.count_from);
            let behind = frontier.is_none_or(|f| f.claimed + 1 < m.boundary);
            if matches!(start.scope, Scope::Shared { .. }) && behind {
                w.redis.restart(self.ns, p, m.lookback.0, m.boundary)?;
            }
            let until = start.read_from + PINS_WINDOW - 1;
            starts.push((start, w.load_pins(p, start.read_from, until, Some(self.ns)), until));
        }
        Ok(starts)
    }

    fn assign(&mut self, starts: Planned) {
        for (start, _, _) in &starts {
            self.position.insert(start.partition, start.read_from);
        }
        self.st.assign(starts);
    }

    /// `Loop::give_holds` (`Stages::holds`): per partition read, its record time while it
    /// lags the wall clock by more than half of `max_record_lag` and its last record
    /// applied is behind the log end.
    pub fn give_holds(&mut self, w: &mut World) {
        let holds: BTreeMap<i32, Option<Secs>> = self
            .st
            .readers
            .iter()
            .map(|(&p, r)| {
                let behind = r.decided + 1 < w.len(p);
                (p, hold(r.decided_clock, behind, Duration::from_secs(LAG.into()), w.wall.into()))
            })
            .collect();
        if holds != self.holds && !holds.is_empty() {
            w.redis.set_holds(self.ns, &holds);
            self.holds = holds;
        }
    }

    /// The consumer's next `k` records of `p`.
    fn fetch(&mut self, w: &World, p: i32, k: usize) -> Vec<(i32, i64)> {
        let Some(at) = self.position.get_mut(&p) else { return Vec::new() };
        let from = *at;
        let to = (from + k as i64).min(w.len(p));
        *at = to.max(from);
        (from..to).map(|o| (p, o)).collect()
    }

    /// `SharedCache::claim`: one call per key group (all sent; `groups` limits which
    /// reach Redis, for a member killed mid-pipeline), the marks, what was acknowledged.
    fn shared_claim(
        &mut self,
        w: &mut World,
        claims: &[ClaimIn],
        reached: &[Sighting],
        prev: &BTreeMap<i32, i64>,
        groups: u8,
    ) -> Result<Vec<Verdict>, Lost> {
        let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); GROUPS];
        let mut marks: BTreeMap<i32, (i64, Secs)> = BTreeMap::new();
        for (i, c) in claims.iter().enumerate() {
            by_group[group_of(c.id)].push(i);
        }
        for s in claims.iter().map(|c| c.sighting).chain(reached.iter().copied()) {
            let mark = marks.entry(s.partition).or_insert((s.offset, s.now));
            if s.offset >= mark.0 {
                *mark = (s.offset, s.now);
            }
        }
        if self.acked.0 != self.ns {
            self.acked = (self.ns, BTreeMap::new());
        }
        // Per group, what was acknowledged there; and, for a partition read through the
        // cache with nothing acknowledged yet, that its frontier exists (-1: the restart
        // that planned its reader wrote it).
        let expect: Vec<BTreeMap<i32, i64>> = (0..GROUPS)
            .map(|g| {
                let mut e: BTreeMap<i32, i64> = self
                    .acked
                    .1
                    .iter()
                    .filter(|(&(h, p), _)| h == g && (marks.is_empty() || marks.contains_key(&p)))
                    .map(|(&(_, p), &o)| (p, o))
                    .collect();
                for s in reached {
                    e.entry(s.partition).or_insert(-1);
                }
                e
            })
            .collect();
        // Every group's call is sent (a pipeline); the first lost answer, in group order,
        // is the batch's.
        let mut replies: Vec<Option<Reply>> = Vec::new();
        for (g, members) in by_group.iter().enumerate() {
            if groups & (1 << g) == 0 {
                replies.push(None);
                continue;
            }
            let calls: Vec<ClaimIn> = members.iter().map(|&i| claims[i]).collect();
            let window = self.st.window;
            let (expect, total) = (&expect[g], w.partitions());
            replies.push(Some(w.redis.claim(self.pid, g, self.ns, window, &calls, &marks, expect, prev, total)));
        }
        let mut verdicts = vec![Verdict::Undecidable; claims.len()];
        let answered: Vec<bool> = replies.iter().map(Option::is_some).collect();
        let mut refused: BTreeSet<(usize, i32)> = BTreeSet::new();
        for (g, (members, reply)) in by_group.iter().zip(replies).enumerate() {
            match reply {
                None => {}
                Some(Reply::Lost(l)) => return Err(l),
                Some(Reply::Ok(codes, not_applied)) => {
                    refused.extend(not_applied.into_iter().map(|p| (g, p)));
                    add(&coverage::CROSS_DUPLICATES, codes.iter().filter(|&&v| v == Verdict::CrossDuplicate).count());
                    for (&i, v) in members.iter().zip(codes) {
                        verdicts[i] = v;
                    }
                }
            }
        }
        // `SharedCache::claim`: per group, the mark, or where a sighting of the partition
        // waited there, just before the first claim that waited.
        for (g, members) in by_group.iter().enumerate() {
            if !answered[g] {
                continue;
            }
            let waited: BTreeSet<i32> = members
                .iter()
                .filter(|&&i| verdicts[i] == Verdict::Wait)
                .map(|&i| claims[i].sighting.partition)
                .collect();
            for (&p, &(o, _)) in marks.iter().filter(|(p, _)| !refused.contains(&(g, **p))) {
                let reached = if waited.contains(&p) {
                    members
                        .iter()
                        .filter(|&&i| claims[i].sighting.partition == p && verdicts[i] == Verdict::Wait)
                        .map(|&i| o.min(claims[i].sighting.offset - 1))
                        .min()
                        .filter(|&r| r >= 0)
                } else {
                    Some(o)
                };
                if let Some(o) = reached {
                    let seen = self.acked.1.entry((g, p)).or_insert(o);
                    *seen = (*seen).max(o);
                }
            }
        }
        Ok(verdicts)
    }

    /// The `Claimer` sending one batch (`Task::send`): claims of a reader generation that
    /// had to wait are not sent; each partition's `prev` is the mark of the last batch
    /// sent by the same reader generation. Redis runs the calls at once (in the order
    /// sent); their answers are taken in order by [`Member::claimer_answer`], after every
    /// batch in flight was sent — as the claimer does with `claims_in_flight` batches.
    fn claimer_send(&mut self, w: &mut World, prepared: &Prepared) -> (Vec<usize>, Result<Vec<Verdict>, Lost>) {
        let (claims, generations, marks) = (&prepared.claims, &prepared.generations, &prepared.marks);
        let stale = |i: usize| self.waiting.get(&claims[i].sighting.partition).is_some_and(|&g| generations[i] <= g);
        let (sent, _held): (Vec<usize>, Vec<usize>) = (0..claims.len()).partition(|&i| !stale(i));
        for &i in &sent {
            self.waiting.remove(&claims[i].sighting.partition);
        }
        let marks: Vec<(Sighting, u64)> =
            marks.iter().filter(|(s, g)| self.waiting.get(&s.partition).is_none_or(|w| g > w)).copied().collect();
        let prev: BTreeMap<i32, i64> = marks
            .iter()
            .filter_map(|(s, g)| match self.sent_marks.get(&s.partition) {
                Some(&(sent_g, o)) if sent_g == *g => Some((s.partition, o)),
                _ => None,
            })
            .collect();
        let reached: Vec<Sighting> = marks.iter().map(|&(s, _)| s).collect();
        let to_send: Vec<ClaimIn> = sent.iter().map(|&i| claims[i]).collect();
        for (s, g) in &marks {
            let mark = to_send
                .iter()
                .map(|c| c.sighting)
                .chain(reached.iter().copied())
                .filter(|x| x.partition == s.partition)
                .map(|x| x.offset)
                .max();
            if let Some(o) = mark {
                self.sent_marks.insert(s.partition, (*g, o));
            }
        }
        let v = self.shared_claim(w, &to_send, &reached, &prev, u8::MAX);
        if std::env::var_os("MODEL_TRACE").is_some() {
            for (c, v) in to_send.iter().zip(v.iter().flatten()) {
                eprintln!("    member {} claims {c:?}: {v:?}", self.pid);
            }
        }
        (sent, v)
    }

    /// The `Claimer` taking one batch's answer, in order.
    fn claimer_answer(
        &mut self,
        prepared: &Prepared,
        sent: Vec<usize>,
        answer: Result<Vec<Verdict>, Lost>,
    ) -> Result<Vec<Verdict>, Lost> {
        let (claims, generations) = (&prepared.claims, &prepared.generations);
        let v = answer?;
        let mut all = vec![Verdict::Wait; claims.len()];
        for (&i, verdict) in sent.iter().zip(v) {
            if verdict == Verdict::Wait {
                let g = self.waiting.entry(claims[i].sighting.partition).or_insert(generations[i]);
                *g = (*g).max(generations[i]);
            }
            all[i] = verdict;
        }
        Ok(all)
    }

    /// `Loop::run` for poll batches of `(partition, records)`: all prepared (in flight
    /// together, at most two), claimed in order, applied in order; a loss starts every
    /// partition over once the batches in flight are answered.
    pub fn read(&mut self, w: &mut World, batches: &[(i32, usize)]) -> Fate {
        self.read_between(w, batches, |_| {})
    }

    /// [`read`](Self::read), with `between` run once the batches are taken in and before
    /// their claims reach Redis: the loop gives its holds on its tick meanwhile (as the
    /// real one does while poll batches are in flight), then `between` (a sweeper's walk).
    pub fn read_between(&mut self, w: &mut World, batches: &[(i32, usize)], between: impl FnOnce(&mut World)) -> Fate {
        self.give_holds(w);
        let mut in_flight = Vec::new();
        for &(p, k) in batches {
            let records = self.fetch(w, p, k);
            self.st.ensure_pins(w, &records, Some(self.ns));
            in_flight.push(self.st.prepare(w, &records));
        }
        self.give_holds(w);
        between(w);
        let mut lost: Option<Lost> = None;
        let sends: Vec<_> = in_flight.iter().map(|prepared| self.claimer_send(w, prepared)).collect();
        let mut answers = Vec::new();
        for (prepared, (sent, answer)) in in_flight.iter().zip(sends) {
            answers.push(self.claimer_answer(prepared, sent, answer));
        }
        for (prepared, answer) in in_flight.into_iter().zip(answers) {
            match answer {
                Ok(verdicts) if lost.is_none() => {
                    if self.apply(w, prepared, verdicts) == Fate::Dead {
                        return Fate::Dead;
                    }
                }
                Ok(_) => {}
                Err(l) => {
                    lost.get_or_insert(l);
                }
            }
        }
        match lost {
            Some(l) => self.start_over(w, l),
            None => Fate::Alive,
        }
    }

    /// The idle member's check on a flush tick: an empty claim.
    pub fn idle(&mut self, w: &mut World) -> Fate {
        let idle = Prepared::default();
        let (sent, answer) = self.claimer_send(w, &idle);
        match self.claimer_answer(&idle, sent, answer) {
            Ok(_) => Fate::Alive,
            Err(l) => self.start_over(w, l),
        }
    }

    /// A poll batch whose claims reach only the key groups in `groups`, then a kill.
    pub fn torn(&mut self, w: &mut World, p: i32, k: usize, groups: u8) {
        self.give_holds(w);
        let records = self.fetch(w, p, k);
        self.st.ensure_pins(w, &records, Some(self.ns));
        let prepared = self.st.prepare(w, &records);
        let reached: Vec<Sighting> = prepared.marks.iter().map(|&(s, _)| s).collect();
        let _ = self.shared_claim(w, &prepared.claims, &reached, &BTreeMap::new(), groups);
    }

    /// `Loop::apply`: the verdicts, fall-backs to private state, rewinds.
    fn apply(&mut self, w: &mut World, prepared: Prepared, verdicts: Vec<Verdict>) -> Fate {
        let applied = self.st.apply(prepared, verdicts);
        add(&coverage::FALL_BACKS, applied.fall_backs.len());
        for p in applied.fall_backs {
            if self.fall_back(w, p).is_err() {
                // `Planner::fall_back` answers lost: the error ends the member.
                return Fate::Dead;
            }
        }
        add(&coverage::WAITS, applied.rewinds.len());
        for (p, from) in applied.rewinds {
            self.position.insert(p, from);
        }
        Fate::Alive
    }

    /// `Planner::fall_back` with `Stages::fall_back`.
    fn fall_back(&mut self, w: &mut World, p: i32) -> Result<(), ()> {
        let Some(reader) = self.st.readers.get(&p) else { return Ok(()) };
        let (count_from, floor) = (reader.count_from, reader.commit_floor);
        let from = self.st.agg.open_batch_start(p).unwrap_or(count_from);
        let cut = self.st.agg.take_partitions(&[p]);
        self.st.carried.merge(cut);
        let m = w.marks(p, w.boundary(p, Some(from)), self.st.window, None);
        let (frontier, _) = position::merge_frontiers(&w.redis.frontiers(self.ns, p), m);
        let f = frontier.ok_or(())?;
        let resume = Resume { claimed: f.claimed, exact_from: f.exact_from };
        let start = position::private_start(p, m, Some(resume));
        let until = start.read_from + PINS_WINDOW - 1;
        let pins = w.load_pins(p, start.read_from, until, Some(self.ns));
        self.st.private.forget(p);
        self.st.generation += 1;
        let mut reader = Reader::new(start, pins, until, self.st.generation);
        reader.commit_floor = reader.commit_floor.max(floor);
        self.st.readers.insert(p, reader);
        self.position.insert(p, start.read_from);
        Ok(())
    }

    /// `Loop::start_over` and `Stages::start_over`: fence the flusher, move to a new
    /// namespace (or the one another member moved to), plan every partition again.
    fn start_over(&mut self, w: &mut World, mut lost: Lost) -> Fate {
        add(if lost.frontier { &coverage::LOST_FRONTIER } else { &coverage::LOST_NAMESPACE }, 1);
        add(&coverage::START_OVERS, 1);
        self.fence += 1;
        // `Flusher::settle`: the fenced flushes are dropped before the partitions are
        // planned again.
        while self.has_queued() {
            if self.flush_one(w, None) == Fate::Dead {
                return Fate::Dead;
            }
        }
        for _ in 0..4 {
            match w.redis.recover(self.ns, &lost) {
                Recovered::Fatal => return Fate::Dead,
                Recovered::Ns(ns) => self.ns = ns,
            }
            let partitions = self.partitions();
            self.st.carried = Flush::default();
            match self.plan(w, &partitions) {
                Ok(starts) => {
                    self.assign(starts);
                    self.owned = partitions.into_iter().collect();
                    // The holds given in the old namespace are not in the new one: given
                    // again at once.
                    self.holds.clear();
                    self.give_holds(w);
                    return Fate::Alive;
                }
                Err(again) => lost = again,
            }
        }
        w.violations.push(format!("member {} could not start over", self.pid));
        Fate::Dead
    }

    /// Cuts a flush and hands it to the flusher.
    pub fn cut(&mut self) {
        let job = self.st.cut();
        if !(job.flush.is_empty() && job.clocks.is_empty()) {
            self.queue.push_back((job, self.fence));
        }
    }

    pub fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// The flusher writes its oldest job and commits what it allows; with `crash_after`,
    /// the member dies after that many of the writes (pins, clocks, day, hour, minute).
    pub fn flush_one(&mut self, w: &mut World, crash_after: Option<usize>) -> Fate {
        let Some((job, fence)) = self.queue.pop_front() else { return Fate::Alive };
        // `flusher::write`: a job decided in a cache lost since (fenced, or its
        // namespace no longer held) is dropped unwritten.
        if fence != self.fence || !w.redis.holds_ns(self.ns) {
            add(&coverage::FENCED, 1);
            return Fate::Alive;
        }
        if let Some(stages) = crash_after {
            add(&coverage::MID_FLUSH_CRASHES, 1);
            w.write(&job, Writer::Member, self.ns.tag, stages);
            return Fate::Dead;
        }
        w.write(&job, Writer::Member, self.ns.tag, 3);
        let commits: BTreeMap<i32, i64> =
            job.flush.commits.iter().filter(|(p, _)| self.owned.contains(p)).map(|(&p, &o)| (p, o)).collect();
        if commits.is_empty() {
            return Fate::Alive;
        }
        if self.commits_taken {
            for (&p, &c) in &commits {
                w.committed[p as usize] = Some(c);
            }
        }
        if !job.flush.pins.is_empty() {
            w.redis.trim_cached_pins(self.ns, &commits);
        }
        Fate::Alive
    }

    /// A drain: cut, then everything handed over is written and committed.
    pub fn drain(&mut self, w: &mut World) {
        self.cut();
        while self.has_queued() {
            self.flush_one(w, None);
        }
    }

    /// Partitions taken away: cut and drained first (`lost`: dropped, nothing more is
    /// committed for them).
    pub fn revoke(&mut self, w: &mut World, partitions: &[i32], lost: bool) {
        let partitions: Vec<i32> = partitions.iter().copied().filter(|&p| self.owns(p)).collect();
        if partitions.is_empty() {
            return;
        }
        if lost {
            self.owned.retain(|p| !partitions.contains(p));
        } else {
            let cut = self.st.agg.take_partitions(&partitions);
            let job = self.st.job(cut);
            self.queue.push_back((job, self.fence));
            while self.has_queued() {
                self.flush_one(w, None);
            }
        }
        for &p in &partitions {
            self.st.agg.forget(p);
            self.st.private.forget(p);
            self.st.readers.remove(&p);
            self.position.remove(&p);
        }
        self.owned = self.st.readers.keys().copied().collect();
    }

    /// Whether this member's claim task would find that key group `g` lost writes if the
    /// group's frontiers went back from `now` to `then`: every partition the lost writes
    /// moved is one whose frontier it saw acknowledged past where `then` leaves it.
    pub fn would_notice(&self, g: usize, then: &super::redis::Group, now: &super::redis::Group) -> bool {
        let frontier = |g: &super::redis::Group| g.spaces.get(&self.ns).map(|s| s.frontier.clone()).unwrap_or_default();
        let (before, after) = (frontier(then), frontier(now));
        after.iter().all(|(p, &(next, _, _))| {
            before.get(p).is_some_and(|&(was, _, _)| was == next)
                || (self.acked.0 == self.ns
                    && self
                        .acked
                        .1
                        .get(&(g, *p))
                        .is_some_and(|&seen| before.get(p).is_none_or(|&(was, _, _)| was - 1 < seen)))
        })
    }

    /// One walk of this member's sweeper at the current wall clock.
    pub fn sweep(&self, w: &mut World) {
        self.sweeper()(w);
    }

    /// One walk of this member's sweeper while its readers are at their log ends (the
    /// records after them not produced yet), so that none of them holds anything: what
    /// the model's fixed log cannot show otherwise (a reader with records left to read
    /// is behind, `give_holds`).
    pub fn sweep_at_log_end(&self, w: &mut World) {
        let window = Duration::from_secs(u64::from(self.st.window));
        let cutoff = sweep_cutoff(i64::from(w.wall), window, Duration::from_secs(u64::from(LAG)), None);
        add(&coverage::SWEEPS, 1);
        add(&coverage::SWEPT, w.redis.sweep(self.ns, cutoff));
    }

    /// This member's sweeper, to walk while another member's step is under way.
    pub fn sweeper(&self) -> impl FnOnce(&mut World) {
        let (ns, window) = (self.ns, Duration::from_secs(u64::from(self.st.window)));
        move |w: &mut World| {
            let held = w.redis.lowest_hold(ns);
            let cutoff = sweep_cutoff(i64::from(w.wall), window, Duration::from_secs(u64::from(LAG)), held);
            add(&coverage::SWEEPS, 1);
            add(&coverage::SWEPT, w.redis.sweep(ns, cutoff));
        }
    }
}

/// `clickagg replay`: one pass per settings version, each reading its ranges through
/// private stages and writing rows as a replay.
pub struct Replay {
    passes: VecDeque<PassPlan>,
    pass: Option<Pass>,
}

/// One settings version's share of a replay: its index, window and ranges.
struct PassPlan {
    version: usize,
    window: Secs,
    ranges: BTreeMap<i32, (i64, i64)>,
}

/// The pass being read: its stages, and per partition the next offset and the end.
struct Pass {
    version: usize,
    st: Stages,
    position: BTreeMap<i32, i64>,
    ends: BTreeMap<i32, i64>,
}

impl Replay {
    /// A replay counting each partition of `from` from the boundary at or below its
    /// offset to the log end, under the settings recorded for each range.
    pub fn new(w: &World, from: &BTreeMap<i32, i64>) -> Replay {
        let counted: BTreeMap<i32, (i64, i64)> =
            from.iter().map(|(&p, &o)| (p, (w.boundary(p, Some(o.min(w.len(p)))), w.len(p)))).collect();
        let from_of = |v: usize, p: i32| if v == 0 { 0 } else { w.versions[v].from[p as usize] };
        let mut passes = VecDeque::new();
        for version in 0..w.versions.len() {
            let mut ranges = BTreeMap::new();
            for (&p, &(start, end)) in &counted {
                let lo = start.max(from_of(version, p));
                let hi = end.min(if version + 1 < w.versions.len() { from_of(version + 1, p) } else { i64::MAX });
                if lo < hi {
                    ranges.insert(p, (lo, hi));
                }
            }
            if !ranges.is_empty() {
                passes.push_back(PassPlan { version, window: w.versions[version].window, ranges });
            }
        }
        Replay { passes, pass: None }
    }

    /// Reads up to `k` records of one of the current pass's partitions (`p` picks which);
    /// `false` once the replay is done.
    pub fn read(&mut self, w: &mut World, p: u8, k: usize) -> bool {
        if self.pass.is_none() {
            let Some(plan) = self.passes.pop_front() else { return false };
            add(&coverage::REPLAY_PASSES, 1);
            let mut st = Stages::new(w.n, plan.window);
            let mut starts = Vec::new();
            let (mut position, mut ends) = (BTreeMap::new(), BTreeMap::new());
            for (&q, &(lo, hi)) in &plan.ranges {
                let start = position::private_start(q, w.marks(q, lo, plan.window, None), None);
                position.insert(q, start.read_from);
                ends.insert(q, hi);
                starts.push((start, BTreeMap::new(), start.read_from - 1));
            }
            st.assign(starts);
            self.pass = Some(Pass { version: plan.version, st, position, ends });
        }
        let pass = self.pass.as_mut().expect("just planned");
        let open: Vec<i32> = pass.position.iter().filter(|(q, &at)| at < pass.ends[q]).map(|(&q, _)| q).collect();
        if open.is_empty() {
            let job = pass.st.cut();
            w.write(&job, Writer::Replay, pass.version, 3);
            self.pass = None;
            return !self.passes.is_empty();
        }
        let q = open[usize::from(p) % open.len()];
        let at = pass.position[&q];
        let to = (at + k.max(1) as i64).min(pass.ends[&q]);
        pass.position.insert(q, to);
        let records: Vec<(i32, i64)> = (at..to).map(|o| (q, o)).collect();
        pass.st.ensure_pins(w, &records, None);
        let prepared = pass.st.prepare(w, &records);
        pass.st.apply(prepared, Vec::new());
        // A replay flushes once per interval; any schedule of cuts is one the model may
        // take, and a cut per step is the one that writes the most partial batches.
        {
            let job = pass.st.cut();
            w.write(&job, Writer::Replay, pass.version, 3);
        }
        true
    }

    pub fn run_to_end(&mut self, w: &mut World) {
        let mut p = 0u8;
        while self.read(w, p, 5) {
            p = p.wrapping_add(1);
        }
    }
}
