//! The stages of one reader, in pipeline order, and what they do to a poll batch — pure
//! and synchronous: no I/O, no waiting (the `planner` does the look-ups a start or a
//! fall-back needs, and hands the results in):
//!
//! ```text
//! poll batch ─► decode/validate ─► dedup (one Redis call) ─► aggregate ─► cut a flush
//!     └─ rejected records ─► their dead letters go with the next flush
//! flusher task: dead letters acked ─► pins, rows durable (ClickHouse) ─► commit offsets
//! ```
//!
//! [`Stages`] holds the state of the stages up to the cut; a poll batch goes through it
//! in two steps, [`Stages::prepare`] (clocks, fingerprints, private decisions, the
//! claims for Redis) and [`Stages::apply`] (the verdicts, the aggregator), so that one
//! batch's claims can be in flight against Redis while the next is decoded. The
//! `flusher` makes the cuts durable and commits. `member` drives them from the
//! consumer-group loop and `replay` from a directly assigned reader.
//!
//! Error classes: a rejected record is routed to the dead-letter topic and counted; a
//! transient Redis, ClickHouse or Kafka failure is retried with backoff while nothing
//! is committed; a fatal one (bad credentials, a missing table, a batch-size mismatch)
//! stops the member with a message saying what to fix.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::CommitMode;
use tracing::{info, warn};

use crate::aggregate::{Aggregator, BucketKey, Flush};
use crate::click::Click;
use crate::config::Settings;
use crate::dedup::{
    Checkpoint, Claim, ClaimBatch, ClaimMode, Fingerprint, Pin, PrivateScope, ReaderClaim, ReaderMark, Secs, Sighting,
    Timeline, Verdict,
};
use crate::position::{BatchOffsets, Scope, Start};
use crate::record::Record;
use crate::status::StatusBoard;
use crate::telemetry::{self as t, RateLimiter};

/// One flush on its way to ClickHouse (the `flusher` writes it, then commits).
pub struct Job {
    pub flush: Flush,
    /// Partition clocks at the batch boundaries crossed since the last cut: written
    /// before the commits that pass them.
    pub clocks: Vec<Checkpoint>,
    /// Rejected records read before this flush was cut: acknowledged before its commit.
    pub dead_letters: Vec<Record>,
    /// Counted clicks by record timestamp: how fresh the counts are once durable.
    pub freshness: t::ClicksByTenth,
    /// Minute buckets this flush carries, for the member's unflushed count.
    pub buckets: usize,
    /// `Sync` for revokes and shutdown: the commit must be done when the drain ends.
    pub commit_mode: CommitMode,
    /// Commits sent before, sent again with this job's ([`Stages::commit_latest_again`]).
    /// They flush nothing, so they do not count as flushes in the metrics and status.
    pub again: BTreeMap<i32, i64>,
}

/// The wall clock in whole epoch seconds, as [`hold`] and the record-lag gauge take it.
pub fn wall_secs() -> u64 {
    chrono::Utc::now().timestamp().max(0) as u64
}

/// A reader's hold at record time `clock`: `Some(clock)` while it lags the wall clock
/// (`now`, epoch seconds) by more than half of `dedup.max_record_lag` with records still
/// to read (`behind`): the sweeper keeps what it still needs. The property model's
/// members call it too.
pub fn hold(clock: Secs, behind: bool, max_record_lag: Duration, now: u64) -> Option<Secs> {
    let lagging = now.saturating_sub(u64::from(clock)) > max_record_lag.as_secs() / 2;
    (lagging && behind).then_some(clock)
}

/// One record as its reader's dedup state sees it ([`claims_of`]).
#[derive(Debug, Clone, Copy)]
pub struct ItemAt {
    /// Its partition, offset, record time and the partition's clock just after it.
    pub sighting: Sighting,
    /// Before the reader's first counted offset: it only rebuilds dedup state.
    pub warm: bool,
    /// The pin recorded for it, if any.
    pub pin: Option<Pin>,
    /// The click judged ahead whose jump it confirms (offset, fingerprint).
    pub confirms: Option<(i64, u128)>,
    /// Its click's fingerprint; `None` when it is not a valid click.
    pub fingerprint: Option<Fingerprint>,
}

/// What one record asks of the dedup state, in order: the confirmation of the jump it
/// confirms, then its own sighting.
#[derive(Debug, Default)]
pub struct ItemClaims {
    /// The confirmation to claim from the cache before the record's own sighting.
    pub confirm: Option<Claim>,
    /// The record's own sighting to claim from the cache.
    pub own: Option<Claim>,
    /// `own`'s verdict decides the record (a reader through the cache); otherwise the
    /// claim only finishes a warm-up of the cache that a private reader decides past.
    pub own_decides: bool,
    /// The verdict a private reader decided from its own state.
    pub verdict: Option<Verdict>,
    /// The reader went back to the cache at this record.
    pub resumed: bool,
}

/// What one record asks of its reader's dedup state: decided here by a private reader
/// (`private`, while `scope` is private), claimed from the shared cache otherwise, and
/// claimed as well where a private reader finishes a warm-up of the cache. The one
/// statement of this step: `Stages::claim` and the property model's member both call it.
pub fn claims_of(scope: &mut Scope, private: &mut PrivateScope, at: ItemAt) -> ItemClaims {
    let Sighting { partition: p, offset: o, .. } = at.sighting;
    let mut asks = ItemClaims::default();
    if let Some((ahead, fp)) = at.confirms {
        // Before this record's own claim: a retry of that click in it is judged
        // against the confirmed reach.
        let decided_here = matches!(*scope, Scope::Private { resume } if resume.is_none_or(|r| o < r.shared_from()));
        if decided_here {
            private.confirm(p, fp, ahead, at.sighting.now);
        }
        let fills = matches!(*scope, Scope::Private { resume: Some(r) } if r.fills_cache(o));
        if !decided_here || fills {
            let sighting = Sighting { offset: ahead, ..at.sighting };
            let mode = ClaimMode { confirm: true, ..ClaimMode::default() };
            asks.confirm = Some(Claim { fingerprint: Fingerprint(fp), sighting, mode });
        }
    }
    let Some(fingerprint) = at.fingerprint else { return asks };
    let pin = at.pin;
    if let Scope::Private { resume } = *scope {
        if resume.is_some_and(|r| o >= r.shared_from()) {
            // The cache holds everything before this offset again: back to it.
            *scope = Scope::Shared { reread_until: None };
            private.forget(p);
            asks.resumed = true;
        } else {
            asks.verdict = Some(private.sight_at(fingerprint.0, at.sighting, if at.warm { None } else { pin }));
            if resume.is_some_and(|r| r.fills_cache(o)) {
                // The cache's last warm-up did not get this far: finish it.
                let mode = ClaimMode { pin, warm: true, confirm: false };
                asks.own = Some(Claim { fingerprint, sighting: at.sighting, mode });
            }
            return asks;
        }
    }
    let mode = ClaimMode { pin, warm: at.warm, confirm: false };
    asks.own = Some(Claim { fingerprint, sighting: at.sighting, mode });
    asks.own_decides = true;
    asks
}

/// What a poll batch did, for metrics and for `replay`'s summary.
#[derive(Debug, Default, Clone, Copy)]
pub struct BatchStats {
    /// Records read from the first counted offset on.
    pub records: u64,
    pub counted: u64,
    pub redelivered: u64,
    /// Duplicates within a partition and copies on other partitions.
    pub duplicates: u64,
    /// Of the duplicates, copies of a click counted on another partition.
    pub cross_partition: u64,
    pub invalid: u64,
    /// Records read before the first counted offset, to rebuild dedup state.
    pub warmup: u64,
}

impl BatchStats {
    /// Counts a click's verdict among the redeliveries and duplicates.
    fn add_verdict(&mut self, v: Verdict) {
        match v {
            Verdict::Own => self.redelivered += 1,
            Verdict::Duplicate | Verdict::UncountedDuplicate => self.duplicates += 1,
            Verdict::CrossDuplicate => {
                self.duplicates += 1;
                self.cross_partition += 1;
            }
            _ => {}
        }
    }

    pub fn add(&mut self, o: &BatchStats) {
        self.records += o.records;
        self.counted += o.counted;
        self.redelivered += o.redelivered;
        self.duplicates += o.duplicates;
        self.cross_partition += o.cross_partition;
        self.invalid += o.invalid;
        self.warmup += o.warmup;
    }
}

/// The state of the stages up to the cut of a flush. Owned by the loop, reached by
/// rebalance callbacks.
pub struct Stages {
    pub agg: Aggregator,
    max_record_lag: Duration,
    /// The partitions being read, with where each started and how it decides. Records
    /// of other partitions (fetched before a revoke) are dropped.
    readers: HashMap<i32, Reader>,
    /// Bumped for every new reader: a prepared poll batch whose reader was replaced
    /// meanwhile (revoked, reassigned, fallen back) is not applied.
    generation: u64,
    /// The state of readers that rebuilt it from the log (`Scope::Private`).
    private: PrivateScope,
    dead_letters: bool,
    /// Rejected records since the last cut: their dead letters go with the next flush.
    rejected: Vec<Record>,
    /// Counted clicks by record timestamp since the last cut.
    freshness: t::ClicksByTenth,
    /// Cuts of partitions that fell back to private state, written with the next flush.
    carried: Flush,
    /// The next cut sends each partition's latest commit again ([`Stages::commit_latest_again`]).
    repeat_commits: bool,
    /// Partition clocks at the batch boundaries crossed since the last cut: written
    /// with the next flush, before its commits (`clickagg_clocks`).
    clocks: Vec<Checkpoint>,
    pub totals: BatchStats,
    /// Where the readers are, for `/status.json`.
    status: Arc<StatusBoard>,
    log_limit: RateLimiter,
    /// Every record applied, with its verdict, while a caller traces (`explain --records`).
    trace: Option<Vec<Traced>>,
}

/// One record as the stages decided it: what `explain --records` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traced {
    pub partition: i32,
    pub offset: i64,
    /// Read only to rebuild dedup state before the counted range.
    pub warm: bool,
    /// The click, `None` for a rejected record.
    pub click: Option<Click<Fingerprint>>,
    pub verdict: Option<Verdict>,
}

/// One partition being read (see `position`).
#[derive(Debug)]
struct Reader {
    generation: u64,
    /// The first offset counted; records before it only rebuild dedup state.
    count_from: i64,
    clock: Timeline,
    scope: Scope,
    /// Recorded cross-partition decisions for the offsets this reader reads next, loaded
    /// a window at a time (`Planner::ensure_pins`) and dropped once read, so a replay of
    /// a month holds no more than a window of them.
    pins: RecordedPins,
    /// The last offset taken in: anything at or below it is a stale fetch.
    last: i64,
    /// The partition clock after the last record applied (its claim decided): what the
    /// sweeper must keep a window before (`Stages::holds`).
    decided_clock: Secs,
    /// The last offset applied (its claim decided): a reader is behind its log end, and
    /// holds, until this one is the last — not `last`, taken in before its claim went out.
    decided: i64,
    /// Commits of this partition go out only past it (`Start::commit_floor`), which
    /// rises with every commit cut.
    commit_floor: i64,
    /// The latest commit cut for this partition ([`Stages::commit_latest_again`]).
    last_cut: Option<i64>,
}

impl Reader {
    /// The clock checkpoints of `offset`, which comes right after `self.last`: the
    /// boundary it crosses (unless the record before it ended a batch, which recorded
    /// the boundary already), with the clock before it; then, once `offset` is ticked,
    /// the boundary after it if it ends a batch.
    fn crossing(&self, n: BatchOffsets, partition: i32, offset: i64) -> Option<Checkpoint> {
        let b = n.start_of(offset);
        (b > self.last + 1).then_some(Checkpoint { partition, boundary: b, clock: self.clock.clock })
    }

    fn batch_end(&self, n: BatchOffsets, partition: i32, offset: i64) -> Option<Checkpoint> {
        let next = offset + 1;
        (n.start_of(next) == next).then_some(Checkpoint { partition, boundary: next, clock: self.clock.clock })
    }
}

/// The recorded cross-partition decisions of a reader's next offsets: every one at or
/// below `until` is in `pins`.
#[derive(Debug, Clone, Default)]
pub struct RecordedPins {
    pub pins: BTreeMap<i64, Pin>,
    pub until: i64,
}

impl RecordedPins {
    /// Nothing loaded yet for a reader starting at `from`.
    pub fn before(from: i64) -> RecordedPins {
        RecordedPins { pins: BTreeMap::new(), until: from - 1 }
    }

    fn get(&self, offset: i64) -> Option<Pin> {
        self.pins.get(&offset).copied()
    }
}

/// Why a member re-reads a partition privately: a re-read the cache could not decide
/// (a sighting older than the chain the cache keeps, or one swept since). Lagging far
/// behind is not a reason: the sweeper keeps what a lagging reader holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    Undecidable,
}

impl Distrust {
    pub fn as_str(self) -> &'static str {
        match self {
            Distrust::Undecidable => "undecidable",
        }
    }
}

pub struct StagesConfig {
    pub batch_offsets: BatchOffsets,
    pub window: Secs,
    pub max_record_lag: Duration,
    pub dead_letters: bool,
}

impl StagesConfig {
    pub fn from_settings(s: &Settings) -> StagesConfig {
        StagesConfig {
            batch_offsets: s.batch_offsets(),
            window: s.rules().window(),
            max_record_lag: s.dedup.max_record_lag,
            dead_letters: s.dead_letter.enabled,
        }
    }
}

/// One record of a poll batch on its way through the stages.
struct Item {
    record: Record,
    generation: u64,
    /// Its record time.
    clock: Secs,
    /// Its partition's clock just after it (below `clock` when it is judged ahead).
    now: Secs,
    /// Its partition's clock just before it: where a reader rewound to it starts.
    clock_before: Timeline,
    /// The click judged ahead whose jump this record confirmed (offset, fingerprint).
    confirms: Option<(i64, u128)>,
    /// Before the reader's first counted offset: it only rebuilds dedup state.
    warm: bool,
    fingerprint: Option<Fingerprint>,
    /// Its claim's place among the poll batch's claims, whose verdict decides it (`None`:
    /// not a click, or decided by a private reader).
    claim: Option<usize>,
    verdict: Option<Verdict>,
}

/// The first sighting of a poll batch in a partition that must wait while other
/// partitions' state is rebuilt: its reader is rewound to just before it.
struct Wait {
    from: i64,
    /// The partition's clock just before it: where the rewound reader starts.
    clock_before: Timeline,
    /// The generation of the reader that read it.
    generation: u64,
}

/// What applying a poll batch asks of the loop: partitions to re-read privately (the
/// cache could not decide a re-read), and partitions to read again from an offset (a
/// sighting had to wait while other partitions' state is rebuilt): seek them there.
#[derive(Debug, Default)]
pub struct Applied {
    pub fall_backs: BTreeMap<i32, Distrust>,
    pub rewinds: BTreeMap<i32, i64>,
}

/// A poll batch between [`Stages::prepare`] and [`Stages::apply`].
pub struct Prepared {
    items: Vec<Item>,
    /// The claims for the shared cache, in record order (an item names its own,
    /// [`Item::claim`]), and the marks.
    claims: ClaimBatch,
}

impl Prepared {
    /// A batch of nothing: handed to the claimer, it asks the cache whether it still holds
    /// what this member relies on (an idle member's check).
    pub fn empty() -> Prepared {
        Prepared { items: Vec::new(), claims: ClaimBatch::default() }
    }

    /// Takes the claims to hand to the `Claimer` (the verdicts come back in this order),
    /// with the generation of the reader each came from.
    pub fn take_claims(&mut self) -> ClaimBatch {
        std::mem::take(&mut self.claims)
    }

    /// Records in this batch (the ones its reader had not seen yet).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Stages {
    pub fn new(cfg: StagesConfig, status: Arc<StatusBoard>) -> Stages {
        Stages {
            agg: Aggregator::new(cfg.batch_offsets),
            max_record_lag: cfg.max_record_lag,
            readers: HashMap::new(),
            generation: 0,
            private: PrivateScope::new(cfg.window),
            dead_letters: cfg.dead_letters,
            rejected: Vec::new(),
            freshness: BTreeMap::new(),
            carried: Flush::default(),
            repeat_commits: false,
            clocks: Vec::new(),
            totals: BatchStats::default(),
            status,
            log_limit: RateLimiter::new(Duration::from_secs(5)),
            trace: None,
        }
    }

    /// From now on, keeps every record applied with its verdict, for [`Stages::take_trace`].
    pub fn trace_records(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The records applied since the last call (while tracing), in the order applied.
    pub fn take_trace(&mut self) -> Vec<Traced> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The partitions being read.
    pub fn partitions(&self) -> impl Iterator<Item = i32> + '_ {
        self.readers.keys().copied()
    }

    /// Partitions become ours, starting as planned: any state left from an earlier
    /// ownership is stale, so it is dropped.
    pub fn assign(&mut self, starts: Vec<(Start, RecordedPins)>) {
        for (start, pins) in starts {
            let p = start.partition;
            self.agg.forget(p);
            self.private.forget(p);
            if start.read_from < start.count_from {
                info!(
                    partition = p,
                    from = start.read_from,
                    to = start.count_from,
                    "warming up dedup state from the log"
                );
            }
            self.generation += 1;
            self.status.reading(&start);
            self.readers.insert(p, Reader::new(start, pins, self.generation));
        }
        self.publish_assignment();
    }

    /// Partitions stop being ours: the cut of their state (to flush and commit before
    /// they are released), unless the assignment was lost (another member may own them
    /// already: nothing is written for them).
    pub fn revoke(&mut self, partitions: &[i32], lost: bool) -> Option<Job> {
        let job = if lost {
            None
        } else {
            let cut = self.agg.take_partitions(partitions);
            Some(self.job(cut, CommitMode::Sync))
        };
        for &p in partitions {
            self.agg.forget(p);
            self.private.forget(p);
            self.readers.remove(&p);
        }
        self.status.revoked(partitions);
        self.publish_assignment();
        job
    }

    fn publish_assignment(&self) {
        metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.readers.len() as f64);
    }

    /// The first step of a poll batch: clocks, fingerprints, the decisions of readers
    /// with private state, and the claims for the shared cache. Records of partitions
    /// not ours, and stale ones (at or below what was already taken in, fetched before a
    /// seek), are dropped.
    pub fn prepare(&mut self, records: Vec<Record>) -> Prepared {
        let mut items = self.take_in(records);
        self.status.read_up_to(self.readers.iter().map(|(&p, r)| (p, r.last)));
        self.record_lag(&items);
        let mut claims = Vec::new();
        for i in items.iter_mut() {
            self.claim(i, &mut claims);
        }
        let marks = self.marks(&items);
        Prepared { items, claims: ClaimBatch { claims, marks } }
    }

    /// Takes a poll batch's records into their readers: each record's place on its
    /// partition's clock, and the clock checkpoints at the batch boundaries it crosses.
    fn take_in(&mut self, records: Vec<Record>) -> Vec<Item> {
        let n = self.agg.batch_offsets();
        let mut items = Vec::with_capacity(records.len());
        for r in records {
            let p = r.partition;
            let Some(reader) = self.readers.get_mut(&p) else { continue };
            if r.offset <= reader.last {
                continue;
            }
            self.clocks.extend(reader.crossing(n, p, r.offset));
            reader.last = r.offset;
            let clock_before = reader.clock;
            let fingerprint = r.outcome.as_ref().ok().map(|c| c.click_id);
            let read = reader.clock.read(r.offset, r.timestamp_ms, fingerprint.map(|f| f.0));
            self.clocks.extend(reader.batch_end(n, p, r.offset));
            let warm = r.offset < reader.count_from;
            let generation = reader.generation;
            items.push(Item {
                record: r,
                generation,
                clock: read.time,
                now: read.now,
                clock_before,
                confirms: read.confirms,
                warm,
                fingerprint,
                claim: None,
                verdict: None,
            });
        }
        items
    }

    /// What an item of a poll batch asks of the dedup state ([`claims_of`]), its claims
    /// pushed to `claims` in record order.
    fn claim(&mut self, i: &mut Item, claims: &mut Vec<ReaderClaim>) {
        let p = i.record.partition;
        let o = i.record.offset;
        let reader = self.readers.get_mut(&p).expect("items come from readers");
        let at = ItemAt {
            sighting: Sighting { partition: p, offset: o, clock: i.clock, now: i.now },
            warm: i.warm,
            pin: i.fingerprint.and_then(|_| reader.pins.get(o)),
            confirms: i.confirms,
            fingerprint: i.fingerprint,
        };
        let asks = claims_of(&mut reader.scope, &mut self.private, at);
        if asks.resumed {
            info!(partition = p, offset = o, "deciding through the dedup cache again");
        }
        let generation = i.generation;
        claims.extend(asks.confirm.into_iter().map(|claim| ReaderClaim { claim, generation }));
        i.verdict = asks.verdict;
        if let Some(claim) = asks.own {
            claims.push(ReaderClaim { claim, generation });
            if asks.own_decides {
                i.claim = Some(claims.len() - 1);
            }
        }
    }

    /// The last record of each partition read through the cache, click or not.
    fn marks(&self, items: &[Item]) -> Vec<ReaderMark> {
        let mut last: BTreeMap<i32, ReaderMark> = BTreeMap::new();
        for i in items {
            let p = i.record.partition;
            if matches!(self.readers.get(&p).map(|r| r.scope), Some(Scope::Shared { .. })) {
                let sighting = Sighting { partition: p, offset: i.record.offset, clock: i.clock, now: i.now };
                last.insert(p, ReaderMark { last: sighting, generation: i.generation });
            }
        }
        last.into_values().collect()
    }

    /// Records how far each partition's first counted record lags the wall clock.
    fn record_lag(&self, items: &[Item]) {
        let now = wall_secs();
        let mut seen = BTreeSet::new();
        for i in items.iter().filter(|i| !i.warm) {
            let p = i.record.partition;
            if seen.insert(p) {
                let lag = now.saturating_sub(u64::from(i.clock));
                metrics::gauge!(t::RECORD_LAG, "partition" => p.to_string()).set(lag as f64);
            }
        }
    }

    /// The holds the sweeper must respect: per partition read, its record time while it
    /// lags the wall clock by more than half of `dedup.max_record_lag` and is behind the
    /// log end (`behind`), `None` otherwise. A partition caught up with its log releases
    /// its hold however old its last record is: its next records are new traffic.
    ///
    /// The record time is the clock after the last record *applied*, not the last one
    /// read: the claims of the poll batches in flight (and of a reader rewound to a
    /// sighting that waited) are still to be decided, and on a backlog two poll batches
    /// can span more than a window of record time. For the same reason a reader is
    /// behind until its last *applied* offset is the log end's: one that has taken in
    /// the last record while its claims were still on their way released its hold, and
    /// another member's sweeper deleted the old sightings those claims then missed
    /// (copies on other partitions counted twice).
    pub fn holds(&self, behind: impl Fn(i32, i64) -> bool) -> BTreeMap<i32, Option<Secs>> {
        let now = wall_secs();
        self.readers
            .iter()
            .map(|(&p, r)| (p, hold(r.decided_clock, behind(p, r.decided), self.max_record_lag, now)))
            .collect()
    }

    /// The second step of a poll batch: the shared cache's verdicts (in the order of
    /// the claims), then the aggregator. Returns the partitions that stop trusting the
    /// cache; the caller falls them back to private state (`Planner::fall_back`).
    pub fn apply(&mut self, prepared: Prepared, verdicts: Vec<Verdict>) -> Applied {
        let Prepared { mut items, .. } = prepared;
        let (fall_backs, waits) = self.take_verdicts(&mut items, &verdicts);
        let mut applied: BTreeMap<i32, i64> = BTreeMap::new();
        let mut stats = BatchStats::default();
        for i in items {
            let p = i.record.partition;
            let current = self.readers.get(&p).is_some_and(|r| r.generation == i.generation);
            let waiting = waits.get(&p).is_some_and(|w| i.record.offset >= w.from);
            if !current || fall_backs.contains_key(&p) || waiting {
                continue;
            }
            applied.insert(p, i.record.offset);
            self.apply_item(i, &mut stats);
        }
        self.publish(&stats);
        for (p, offset) in applied {
            if let Some(reader) = self.readers.get_mut(&p) {
                // Read past: a re-read starts a new reader, which loads its own.
                reader.pins.pins = reader.pins.pins.split_off(&(offset + 1));
            }
        }
        let rewinds = self.rewind(waits);
        Applied { fall_backs, rewinds }
    }

    /// Gives each item of a poll batch its claim's verdict. Returns, of the readers not
    /// replaced since the batch was prepared, the partitions whose re-read the cache
    /// could not decide, and per partition the first sighting that must wait.
    fn take_verdicts(
        &self,
        items: &mut [Item],
        verdicts: &[Verdict],
    ) -> (BTreeMap<i32, Distrust>, BTreeMap<i32, Wait>) {
        let mut distrusted: BTreeMap<i32, (Distrust, u64)> = BTreeMap::new();
        let mut waits: BTreeMap<i32, Wait> = BTreeMap::new();
        for item in items.iter_mut() {
            let Some(&v) = item.claim.and_then(|k| verdicts.get(k)) else { continue };
            item.verdict = Some(v);
            let p = item.record.partition;
            if v == Verdict::Undecidable && !item.warm {
                distrusted.entry(p).or_insert((Distrust::Undecidable, item.generation));
            }
            if v == Verdict::Wait {
                let wait =
                    Wait { from: item.record.offset, clock_before: item.clock_before, generation: item.generation };
                waits.entry(p).or_insert(wait);
            }
        }
        // A reader replaced since this batch was prepared has nothing to fall back or rewind.
        let current = |p: &i32, generation: u64| self.readers.get(p).is_some_and(|r| r.generation == generation);
        let distrusted: BTreeMap<i32, Distrust> =
            distrusted.into_iter().filter(|(p, (_, g))| current(p, *g)).map(|(p, (why, _))| (p, why)).collect();
        waits.retain(|p, w| !distrusted.contains_key(p) && current(p, w.generation));
        (distrusted, waits)
    }

    /// One decided record of a current reader: its reader's progress, the trace, and
    /// then the aggregator (a counted click, a pin) or the dead letters (a rejected one).
    fn apply_item(&mut self, i: Item, stats: &mut BatchStats) {
        let p = i.record.partition;
        if let Some(reader) = self.readers.get_mut(&p) {
            reader.decided_clock = i.now;
            reader.decided = i.record.offset;
        }
        if let Some(trace) = &mut self.trace {
            let click = i.record.outcome.as_ref().ok().cloned();
            trace.push(Traced { partition: p, offset: i.record.offset, warm: i.warm, click, verdict: i.verdict });
        }
        if i.warm {
            stats.warmup += 1;
            return;
        }
        stats.records += 1;
        let (counted, pin) = match (&i.record.outcome, i.verdict) {
            (Ok(click), Some(v)) => {
                stats.add_verdict(v);
                let bucket = BucketKey { ad_id: click.ad_id, minute: click.minute };
                // Recorded again on re-reads too: a pin applied from the cache may not
                // be durable yet, and the trim after this flush's commit drops it there.
                (v.counts().then_some(bucket), v.pin().map(|p| (p, bucket)))
            }
            _ => (None, None),
        };
        if counted.is_some() {
            stats.counted += 1;
            if let Some(tenth) = i.record.timestamp_ms.and_then(t::tenth_of_millis) {
                *self.freshness.entry(tenth).or_default() += 1;
            }
        }
        self.agg.observe(p, i.record.offset, counted, pin);
        if let Err(rejected) = &i.record.outcome {
            stats.invalid += 1;
            let reason = rejected.rejection.reason.as_str();
            metrics::counter!(t::INVALID_RECORDS, "reason" => reason).increment(1);
            if let Some(suppressed) = self.log_limit.allow(reason, Instant::now()) {
                warn!(
                    partition = p,
                    offset = i.record.offset,
                    reason,
                    detail = %rejected.rejection.detail,
                    suppressed_since_last = suppressed,
                    "rejected record"
                );
            }
            if self.dead_letters {
                self.rejected.push(i.record);
            }
        }
    }

    /// A poll batch's counts, to the metrics and the totals.
    fn publish(&mut self, stats: &BatchStats) {
        metrics::counter!(t::RECORDS_CONSUMED).increment(stats.records);
        metrics::counter!(t::WARMUP_RECORDS).increment(stats.warmup);
        metrics::counter!(t::CLICKS_COUNTED).increment(stats.counted);
        metrics::counter!(t::REDELIVERIES).increment(stats.redelivered);
        metrics::counter!(t::DUPLICATES_DROPPED).increment(stats.duplicates);
        metrics::counter!(t::CROSS_PARTITION_DUPLICATES).increment(stats.cross_partition);
        metrics::gauge!(t::BUCKETS_HELD).set(self.unflushed_buckets() as f64);
        self.totals.add(stats);
    }

    /// A sighting that waits for other partitions' state to be rebuilt is read again,
    /// with everything after it in its partition: the reader goes back to just before it
    /// (a new generation, so that batches already prepared past it are dropped). Returns
    /// where each partition is to be read again from.
    fn rewind(&mut self, waits: BTreeMap<i32, Wait>) -> BTreeMap<i32, i64> {
        let mut rewinds = BTreeMap::new();
        for (p, wait) in waits {
            self.generation += 1;
            let reader = self.readers.get_mut(&p).expect("checked current");
            reader.last = wait.from - 1;
            reader.clock = wait.clock_before;
            reader.generation = self.generation;
            metrics::counter!(t::DEDUP_WAITS).increment(1);
            rewinds.insert(p, wait.from);
        }
        rewinds
    }

    /// Per reader that `records` take past the recorded pins it holds, the offsets whose
    /// pins it needs next: `[from, beyond]`.
    pub fn pins_needed(&self, records: &[Record]) -> BTreeMap<i32, (i64, i64)> {
        let mut needed: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
        for r in records {
            let Some(reader) = self.readers.get(&r.partition) else { continue };
            if r.offset > reader.pins.until && r.offset > reader.last {
                let at = needed.entry(r.partition).or_insert((reader.pins.until + 1, r.offset));
                at.1 = at.1.max(r.offset);
            }
        }
        needed
    }

    /// The last offset of `partition` whose recorded pins are loaded (`None`: not read).
    pub fn pins_until(&self, partition: i32) -> Option<i64> {
        self.readers.get(&partition).map(|r| r.pins.until)
    }

    /// Recorded pins of `partition` loaded for every offset up to `until`.
    pub fn add_pins(&mut self, partition: i32, pins: BTreeMap<i64, Pin>, until: i64) {
        if let Some(reader) = self.readers.get_mut(&partition) {
            reader.pins.pins.extend(pins);
            reader.pins.until = until;
        }
    }

    /// Where a fall-back of `partition` counts from: the start of its open batch, or
    /// where its reader counts from when nothing of it is held (`None`: not ours).
    pub fn fall_back_from(&self, partition: i32) -> Option<i64> {
        let reader = self.readers.get(&partition)?;
        Some(self.agg.open_batch_start(partition).unwrap_or(reader.count_from))
    }

    /// Stops deciding `partition` from the shared cache: its state so far (decided
    /// correctly) goes with the next flush, and it is read again from `start`, a private
    /// start planned from [`fall_back_from`](Self::fall_back_from) up to where the cache
    /// can decide again.
    pub fn fall_back(&mut self, start: Start, pins: RecordedPins, why: Distrust) {
        let partition = start.partition;
        let cut = self.agg.take_partitions(&[partition]);
        self.carried.merge(cut);
        warn!(
            partition,
            reason = why.as_str(),
            count_from = start.count_from,
            read_from = start.read_from,
            "the dedup cache cannot decide this partition's re-read; rebuilding its state from the log up to where it can"
        );
        metrics::counter!(t::DEDUP_REBUILDS, "reason" => why.as_str()).increment(1);
        self.private.forget(partition);
        self.generation += 1;
        self.status.reading(&start);
        let floor = self.readers.get(&partition).map_or(start.commit_floor, |r| r.commit_floor);
        let mut reader = Reader::new(start, pins, self.generation);
        reader.commit_floor = reader.commit_floor.max(floor);
        self.readers.insert(partition, reader);
    }

    /// After the cache was lost (and renewed): every partition starts over from `starts`
    /// as if just assigned. Cuts carried from fall-backs are dropped like the flushes
    /// the flusher fenced: decided before the loss, they are read and decided again.
    pub fn start_over(&mut self, starts: Vec<(Start, RecordedPins)>) {
        self.carried = Flush::default();
        metrics::counter!(t::DEDUP_REBUILDS, "reason" => "lost").increment(starts.len() as u64);
        self.assign(starts);
    }

    /// Cuts a flush of everything changed since the last cut: the rows, the dead
    /// letters to acknowledge before its commits, the freshness of its clicks.
    pub fn cut(&mut self, commit_mode: CommitMode) -> Job {
        let flush = self.agg.take_flush();
        self.job(flush, commit_mode)
    }

    /// Like [`cut`](Self::cut) for the complete batches only (`replay --supersede`):
    /// those a later offset closed, and the open batch of every partition of `finished`
    /// (read to the end of its range). Nothing of a batch read part-way.
    pub fn cut_complete_batches(&mut self, finished: impl IntoIterator<Item = i32>, commit_mode: CommitMode) -> Job {
        for p in finished {
            self.agg.finish(p);
        }
        let flush = self.agg.take_complete_batches();
        self.job(flush, commit_mode)
    }

    /// Has the next cut send each partition's latest commit again, unless it cuts a later
    /// one: an asynchronous commit the broker refused during a rebalance is not reported
    /// back, and a partition with nothing more to read would otherwise keep the group's
    /// offset behind what is durable until its next record, however long that is.
    pub fn commit_latest_again(&mut self) {
        self.repeat_commits = true;
    }

    fn job(&mut self, flush: Flush, commit_mode: CommitMode) -> Job {
        let mut all = std::mem::take(&mut self.carried);
        all.merge(flush);
        // A reader re-reading the open batch below the group's position (after a restart
        // or a rebalance) does not commit until it is past it: the commits it would send
        // meanwhile are behind it, and would show lag tools the group moving back.
        all.commits.retain(|p, c| match self.readers.get_mut(p) {
            Some(reader) if *c > reader.commit_floor => {
                reader.commit_floor = *c;
                reader.last_cut = Some(*c);
                true
            }
            Some(_) => false,
            None => true,
        });
        let again = match std::mem::take(&mut self.repeat_commits) {
            true => self
                .readers
                .iter()
                .filter(|(p, _)| !all.commits.contains_key(p))
                .filter_map(|(&p, r)| r.last_cut.map(|o| (p, o)))
                .collect(),
            false => BTreeMap::new(),
        };
        let buckets = all.rows.len();
        Job {
            flush: all,
            clocks: std::mem::take(&mut self.clocks),
            dead_letters: std::mem::take(&mut self.rejected),
            freshness: std::mem::take(&mut self.freshness),
            buckets,
            commit_mode,
            again,
        }
    }

    /// The partitions the aggregator holds state of.
    pub fn counted_partitions(&self) -> Vec<i32> {
        self.agg.partitions().collect()
    }

    /// Minute buckets held in the aggregator.
    pub fn unflushed_buckets(&self) -> usize {
        self.agg.buckets_held()
    }
}

impl Reader {
    fn new(start: Start, pins: RecordedPins, generation: u64) -> Reader {
        Reader {
            generation,
            count_from: start.count_from,
            clock: Timeline::new(start.clock),
            decided_clock: start.clock.now(),
            decided: start.read_from - 1,
            scope: start.scope,
            pins,
            last: start.read_from - 1,
            commit_floor: start.commit_floor,
            last_cut: None,
        }
    }
}

/// Stages and records for unit tests here and in `replay`.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::position::{BatchOffsets, Start};

    const T0: u32 = 1_800_000_000;

    /// One new click of ad 1 in the same minute at every offset of `offsets`.
    pub fn clicks(partition: i32, offsets: std::ops::Range<i64>) -> Vec<Record> {
        offsets
            .map(|offset| Record {
                partition,
                offset,
                timestamp_ms: Some(i64::from(T0) * 1000),
                outcome: Ok(Click {
                    click_id: Fingerprint(((partition as u128) << 64) | offset as u128),
                    ad_id: 1,
                    ts_ms: i64::from(T0) * 1000,
                    minute: crate::click::Minute::from_epoch_seconds(T0),
                }),
            })
            .collect()
    }

    /// Stages reading partitions 0 and 1 privately from offset 0, in batches of 10.
    pub fn reading() -> Stages {
        let cfg = StagesConfig {
            batch_offsets: BatchOffsets::new(10).unwrap(),
            window: Secs::new(86_400),
            max_record_lag: Duration::from_secs(3600),
            dead_letters: false,
        };
        let mut stages = Stages::new(cfg, Default::default());
        let start = |partition| Start {
            partition,
            read_from: 0,
            count_from: 0,
            clock: crate::dedup::PartitionClock::at(None),
            scope: Scope::Private { resume: None },
            commit_floor: 0,
        };
        stages.assign(vec![(start(0), RecordedPins::before(0)), (start(1), RecordedPins::before(0))]);
        stages
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{clicks, reading};
    use super::*;

    fn read(stages: &mut Stages, records: Vec<Record>) {
        let prepared = stages.prepare(records);
        stages.apply(prepared, Vec::new());
    }

    // Found in a CI rehearsal (`cache_trust`, a member frozen past its session): a
    // member's last commits were refused during a rebalance that left it its
    // partitions (librdkafka logged COMMITFAIL; the consumer reports nothing back); with
    // nothing more to read it never committed again, and the group's offsets stayed
    // 2 500 records behind what was durable for as long as it ran.
    #[test]
    fn the_latest_commits_go_again_with_the_next_cut_unless_a_later_one_passed_them() {
        let mut stages = reading();
        stages.commit_latest_again();
        assert!(stages.cut(CommitMode::Async).again.is_empty(), "nothing cut yet, nothing to send again");
        read(&mut stages, clicks(0, 0..5).into_iter().chain(clicks(1, 0..7)).collect());
        let job = stages.cut(CommitMode::Async);
        assert_eq!(job.flush.commits, BTreeMap::from([(0, 5), (1, 7)]));
        assert!(stages.cut(CommitMode::Async).flush.commits.is_empty(), "nothing new read: nothing to commit");
        // Sent again; partition 1 reads on meanwhile, so its next commit passes the old one.
        stages.commit_latest_again();
        read(&mut stages, clicks(1, 7..9));
        let job = stages.cut(CommitMode::Async);
        assert_eq!((job.flush.commits, job.again), (BTreeMap::from([(1, 9)]), BTreeMap::from([(0, 5)])));
        assert!(stages.cut(CommitMode::Async).again.is_empty(), "sent again once, not on every cut");
        read(&mut stages, clicks(0, 5..6));
        assert_eq!(stages.cut(CommitMode::Async).flush.commits, BTreeMap::from([(0, 6)]));
        stages.commit_latest_again();
        assert_eq!(stages.cut(CommitMode::Async).again, BTreeMap::from([(0, 6), (1, 9)]), "each partition's latest");
    }

    const NOW: u64 = 1_800_000_000;

    fn secs_ago(ago: u64) -> Secs {
        Secs::new(u32::try_from(NOW - ago).expect("a time before 2106"))
    }

    #[test]
    fn a_reader_holds_the_sweep_only_while_it_lags_by_more_than_half_the_lag_and_has_records_to_read() {
        let lag = Duration::from_secs(600);
        let hold = |clock, behind| hold(clock, behind, lag, NOW);
        let far_behind = secs_ago(3_600);
        assert_eq!(hold(far_behind, true), Some(far_behind), "lagging, with records to read");
        assert_eq!(hold(far_behind, false), None, "lagging, but at the end of its partition");
        assert_eq!(hold(secs_ago(60), true), None, "within half the lag of the wall clock");
        assert_eq!(hold(secs_ago(300), true), None, "exactly half the lag");
        let past_half = secs_ago(301);
        assert_eq!(hold(past_half, true), Some(past_half), "past half the lag");
    }
}
