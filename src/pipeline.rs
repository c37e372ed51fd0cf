//! The stages of one member, in pipeline order, and what they do to a poll batch:
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

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::aggregate::{Aggregator, BatchOffsets, BucketKey, Flush};
use crate::config::Settings;
use crate::dedup::{
    Checkpoint, Claim, ClaimBatch, ClaimMode, DedupError, Fingerprint, PartitionClock, Pin, PrivateScope, Secs,
    SharedCache, Sighting, Verdict,
};
use crate::flusher::Job;
use crate::health::Health;
use crate::planner;
use crate::position::{self, Scope, Start};
use crate::retry::{self, Retry, Stopped};
use crate::sink::{Sink, SinkError};
use crate::source::{self, Record};
use crate::telemetry::{self as t, RateLimiter};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("Kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Dedup(#[from] DedupError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("{0}")]
    Fatal(String),
    /// Shut down (SIGTERM/SIGINT) while a step was still waiting to succeed.
    #[error("shut down before {0} succeeded")]
    ShutDown(String),
}

impl crate::retry::Retryable for PipelineError {
    fn is_fatal(&self) -> bool {
        PipelineError::is_fatal(self)
    }
}

impl PipelineError {
    /// Whether retrying cannot help (the member stops with the message).
    pub fn is_fatal(&self) -> bool {
        match self {
            PipelineError::Dedup(e) => e.is_fatal(),
            PipelineError::Sink(e) => e.is_fatal(),
            PipelineError::Kafka(e) => source::is_fatal_kafka(e.rdkafka_error_code()),
            PipelineError::Config(_) | PipelineError::Fatal(_) | PipelineError::ShutDown(_) => true,
        }
    }
}

/// How a member ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Everything read was flushed and committed.
    Drained,
    /// The drain timeout passed first; nothing unflushed was committed, and the next
    /// owner re-reads the open batches.
    DrainTimedOut,
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
    topic: String,
    pub agg: Aggregator,
    /// For planning starts, restarts and the cached pins (claims go through a `Claimer`).
    /// `None` for a replay, which never touches Redis.
    cache: Option<SharedCache>,
    rules: Option<crate::sink::RulesHistory>,
    /// Whether the topic's Kafka ID was checked against the recorded one.
    identity_checked: bool,
    window: Secs,
    max_record_lag: Duration,
    /// The partitions being read, with where each started and how it decides. Records
    /// of other partitions (fetched before a revoke) are dropped.
    readers: HashMap<i32, Reader>,
    /// Bumped for every new reader: a prepared poll batch whose reader was replaced
    /// meanwhile (revoked, reassigned, fallen back) is not applied.
    generation: u64,
    /// The state of readers that rebuilt it from the log (`Scope::Private`).
    private: PrivateScope,
    sink: Sink,
    dead_letters: bool,
    /// Rejected records since the last cut: their dead letters go with the next flush.
    rejected: Vec<Record>,
    /// Counted clicks by record timestamp since the last cut.
    freshness: t::ClicksByTenth,
    /// Cuts of partitions that fell back to private state, written with the next flush.
    carried: Flush,
    /// Partition clocks at the batch boundaries crossed since the last cut: written
    /// with the next flush, before its commits (`clickagg_clocks`).
    clocks: Vec<Checkpoint>,
    pub totals: BatchStats,
    health: Arc<Health>,
    log_limit: RateLimiter,
}

/// One partition being read (see `position`).
#[derive(Debug)]
struct Reader {
    generation: u64,
    /// The first offset counted; records before it only rebuild dedup state.
    count_from: i64,
    clock: PartitionClock,
    scope: Scope,
    /// Recorded cross-partition decisions for the offsets this reader reads next, loaded
    /// a window at a time ([`Stages::ensure_pins`]) and dropped once read, so a replay of
    /// a month holds no more than a window of them.
    pins: RecordedPins,
    /// The last offset taken in: anything at or below it is a stale fetch.
    last: i64,
}

impl Reader {
    /// The clock checkpoints of `offset`, which comes right after `self.last`: the
    /// boundary it crosses (unless the record before it ended a batch, which recorded
    /// the boundary already), with the clock before it; then, once `offset` is ticked,
    /// the boundary after it if it ends a batch.
    fn crossing(&self, n: BatchOffsets, partition: i32, offset: i64) -> Option<Checkpoint> {
        let b = n.start_of(offset);
        (b > self.last + 1).then_some(Checkpoint { partition, boundary: b, clock: self.clock })
    }

    fn batch_end(&self, n: BatchOffsets, partition: i32, offset: i64) -> Option<Checkpoint> {
        let next = offset + 1;
        (n.start_of(next) == next).then_some(Checkpoint { partition, boundary: next, clock: self.clock })
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
    fn as_str(self) -> &'static str {
        match self {
            Distrust::Undecidable => "undecidable",
        }
    }
}

pub struct StagesConfig {
    pub topic: String,
    /// The recorded settings versions (a member): no partition is read from before where
    /// the latest took over.
    pub rules: Option<crate::sink::RulesHistory>,
    pub batch_offsets: BatchOffsets,
    pub window: Secs,
    pub max_record_lag: Duration,
    pub dead_letters: bool,
}

impl StagesConfig {
    pub fn from_settings(s: &Settings) -> StagesConfig {
        StagesConfig {
            topic: s.kafka.topic.clone(),
            rules: None,
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
    /// Its partition's clock just before it: where a reader rewound to it starts.
    clock_before: PartitionClock,
    /// Before the reader's first counted offset: it only rebuilds dedup state.
    warm: bool,
    fingerprint: Option<Fingerprint>,
    verdict: Option<Verdict>,
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
    /// The claims for the shared cache, in record order; `claimed[i]` is claim i's item,
    /// or `None` for a sighting a private reader hands the cache as a warm-up claim
    /// (decided already; its verdict is not used).
    claims: ClaimBatch,
    claimed: Vec<Option<usize>>,
}

impl Prepared {
    /// A batch of nothing: handed to the claimer, it asks the cache whether it still holds
    /// what this member relies on (an idle member's check).
    pub fn empty() -> Prepared {
        Prepared { items: Vec::new(), claims: ClaimBatch::default(), claimed: Vec::new() }
    }

    /// Takes the claims to hand to the `Claimer` (the verdicts come back in this order),
    /// with the generation of the reader each came from.
    pub fn take_claims(&mut self) -> ClaimBatch {
        std::mem::take(&mut self.claims)
    }

    pub fn has_claims(&self) -> bool {
        !self.claimed.is_empty()
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
    pub fn new(cfg: StagesConfig, cache: Option<SharedCache>, sink: Sink, health: Arc<Health>) -> Stages {
        let window = cfg.window;
        Stages {
            topic: cfg.topic,
            agg: Aggregator::new(cfg.batch_offsets),
            cache,
            rules: cfg.rules,
            identity_checked: false,
            window,
            max_record_lag: cfg.max_record_lag,
            readers: HashMap::new(),
            generation: 0,
            private: PrivateScope::new(window),
            sink,
            dead_letters: cfg.dead_letters,
            rejected: Vec::new(),
            freshness: BTreeMap::new(),
            carried: Flush::default(),
            clocks: Vec::new(),
            totals: BatchStats::default(),
            health,
            log_limit: RateLimiter::new(Duration::from_secs(5)),
        }
    }

    /// The partitions being read.
    pub fn partitions(&self) -> impl Iterator<Item = i32> + '_ {
        self.readers.keys().copied()
    }

    /// Plans where each newly assigned partition starts (`position::shared_start`):
    /// the batch boundary at or below its committed offset, a warm-up when the cache
    /// lacks the sightings before it, and the recorded pins of what it will read.
    /// Blocking broker look-ups; called from the rebalance callback.
    pub async fn plan_shared_starts<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        partitions: &[i32],
    ) -> Result<Vec<(Start, RecordedPins)>, PipelineError> {
        // A cooperative rebalance may assign nothing new to this member.
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let timeout = Duration::from_secs(10);
        if !self.identity_checked {
            self.check_topic_identity(consumer, timeout).await?;
        }
        let count = source::partitions(consumer, &self.topic, timeout)?.len();
        self.shared()?.set_partition_count(count as u32);
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition(&self.topic, p);
        }
        let committed = consumer.committed_offsets(tpl, timeout)?;
        let requested: BTreeMap<i32, Option<i64>> = committed
            .elements()
            .iter()
            .map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
            .collect();
        let n = self.agg.batch_offsets();
        let at = source::boundaries(consumer, &self.topic, n, &requested, timeout)?;
        let marks = planner::marks(&self.sink, &self.topic, &at, self.window).await?;
        let frontiers = self.shared()?.frontiers(partitions).await?;
        let mut starts = Vec::new();
        let mut holds = BTreeMap::new();
        for (&p, &m) in &marks {
            let from = self.rules.as_ref().map_or(0, |r| r.latest_from(p));
            if m.boundary < from {
                return Err(PipelineError::Fatal(format!(
                    "partition {p} would be read from offset {}, before offset {from} where the topic's current \
                     dedup settings took over (`clickagg settings change`): a member decides only under the current \
                     settings. Reset the group to {from} or later; re-read older ranges with `clickagg replay`, \
                     which decides each range under the settings recorded for it.",
                    m.boundary
                )));
            }
            let (frontier, lost) = position::merge_frontiers(frontiers.get(&p).map_or(&[][..], Vec::as_slice), m);
            if lost {
                warn!(
                    partition = p,
                    "part of the dedup cache lost this partition's state (a Redis node that lost its data?); \
                     rebuilding it from the log"
                );
                metrics::counter!(t::DEDUP_REBUILDS, "reason" => "lost").increment(1);
            }
            let start = position::shared_start(p, m, frontier);
            let behind = frontier.is_none_or(|f| f.claimed + 1 < m.boundary);
            if matches!(start.scope, Scope::Shared { .. }) && behind {
                // The cache lacks everything before the lookback: its re-reads below the
                // boundary cannot be trusted after this warm-up, and the partition is not
                // ready (others' fresh sightings wait) until the warm-up reaches it. A
                // partition the cache never saw gets its frontier here.
                self.shared()?.restart(p, m.lookback.0, m.boundary).await?;
            }
            // The sweeper must keep what this reader needs before it reads anything, if it
            // starts far behind the wall clock with records to read (`Stages::holds`).
            holds.insert(p, self.hold(start.clock.now(), start.read_from < at[&p].high));
            // Every recorded decision from the first offset read on: a re-read applies it,
            // warm-up included, with the effect it had on the cache (the frontier may be lost).
            let pins = self.pins_from(p, start.read_from).await?;
            info!(
                partition = p,
                committed = ?requested.get(&p).copied().flatten(),
                count_from = start.count_from,
                read_from = start.read_from,
                cache_frontier = ?frontier.map(|f| f.claimed),
                "partition start planned"
            );
            starts.push((start, pins));
        }
        let lagging: Vec<i32> = holds.iter().filter(|(_, h)| h.is_some()).map(|(&p, _)| p).collect();
        if !lagging.is_empty() {
            info!(?lagging, "partitions lag the wall clock: the dedup cache keeps the sightings they still need");
        }
        self.shared()?.set_holds(&holds).await?;
        Ok(starts)
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
            self.health.status().reading(&start);
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
        self.health.status().revoked(partitions);
        self.publish_assignment();
        job
    }

    fn publish_assignment(&self) {
        self.health.set_assigned(self.readers.len());
        metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.readers.len() as f64);
    }

    /// The first step of a poll batch: clocks, fingerprints, the decisions of readers
    /// with private state, and the claims for the shared cache. Records of partitions
    /// not ours, and stale ones (at or below what was already taken in, fetched before a
    /// seek), are dropped.
    pub fn prepare(&mut self, records: Vec<Record>) -> Prepared {
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
            let clock = reader.clock.tick(r.timestamp_ms);
            self.clocks.extend(reader.batch_end(n, p, r.offset));
            let fingerprint = r.outcome.as_ref().ok().map(|c| c.click_id);
            let warm = r.offset < reader.count_from;
            let generation = reader.generation;
            items.push(Item { record: r, generation, clock, clock_before, warm, fingerprint, verdict: None });
        }
        self.health.status().read_up_to(self.readers.iter().map(|(&p, r)| (p, r.last)));
        self.record_lag(&items);
        let mut claims = Vec::new();
        let mut claimed = Vec::new();
        let mut generations = Vec::new();
        for (idx, i) in items.iter_mut().enumerate() {
            let p = i.record.partition;
            let Some(fp) = i.fingerprint else { continue };
            let o = i.record.offset;
            let reader = self.readers.get_mut(&p).expect("items come from readers");
            let pin = reader.pins.get(o);
            if let Scope::Private { resume } = reader.scope {
                if resume.is_some_and(|r| o >= r.shared_from()) {
                    // The cache holds everything before this offset again: back to it.
                    reader.scope = Scope::Shared { reread_until: None };
                    self.private.forget(p);
                    info!(partition = p, offset = o, "deciding through the dedup cache again");
                } else {
                    i.verdict = Some(self.private.sight(p, fp.0, i.clock, if i.warm { None } else { pin }));
                    if resume.is_some_and(|r| r.fills_cache(o)) {
                        // The cache's last warm-up did not get this far: finish it.
                        let sighting = Sighting { partition: p, offset: o, clock: i.clock };
                        claims.push(Claim { fingerprint: fp, sighting, mode: ClaimMode { pin, warm: true } });
                        claimed.push(None);
                        generations.push(i.generation);
                    }
                    continue;
                }
            }
            let mode = ClaimMode { pin, warm: i.warm };
            let sighting = Sighting { partition: p, offset: o, clock: i.clock };
            claims.push(Claim { fingerprint: fp, sighting, mode });
            claimed.push(Some(idx));
            generations.push(i.generation);
        }
        Prepared { items, claims: ClaimBatch { claims, generations }, claimed }
    }

    /// Records how far each partition's first counted record lags the wall clock.
    fn record_lag(&self, items: &[Item]) {
        let now = chrono::Utc::now().timestamp().max(0) as u64;
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
    pub fn holds(&self, behind: impl Fn(i32, i64) -> bool) -> BTreeMap<i32, Option<Secs>> {
        self.readers.iter().map(|(&p, r)| (p, self.hold(r.clock.now(), behind(p, r.last)))).collect()
    }

    /// A reader's hold at record time `clock`: `Some(clock)` while it lags the wall clock
    /// by more than half of `dedup.max_record_lag` with records still to read.
    fn hold(&self, clock: Secs, behind: bool) -> Option<Secs> {
        let now = chrono::Utc::now().timestamp().max(0) as u64;
        let lagging = now.saturating_sub(u64::from(clock)) > self.max_record_lag.as_secs() / 2;
        (lagging && behind).then_some(clock)
    }

    /// The second step of a poll batch: the shared cache's verdicts (in the order of
    /// the claims), then the aggregator. Returns the partitions that stop trusting the
    /// cache; the caller falls them back to private state (`fall_back_to_private`).
    pub fn apply(&mut self, prepared: Prepared, verdicts: Vec<Verdict>) -> Applied {
        let Prepared { mut items, claimed, .. } = prepared;
        let mut distrusted: BTreeMap<i32, (Distrust, u64)> = BTreeMap::new();
        // Per partition, the first sighting that must wait: (offset, clock before, generation).
        let mut waits: BTreeMap<i32, (i64, PartitionClock, u64)> = BTreeMap::new();
        for (idx, v) in claimed.into_iter().zip(verdicts) {
            let Some(idx) = idx else { continue };
            items[idx].verdict = Some(v);
            let item = &items[idx];
            let p = item.record.partition;
            if v == Verdict::Undecidable && !item.warm {
                distrusted.entry(p).or_insert((Distrust::Undecidable, item.generation));
            }
            if v == Verdict::Wait {
                waits.entry(p).or_insert((item.record.offset, item.clock_before, item.generation));
            }
        }
        // A reader replaced since this batch was prepared has nothing to fall back or rewind.
        let current = |readers: &HashMap<i32, Reader>, p: &i32, generation: u64| {
            readers.get(p).is_some_and(|r| r.generation == generation)
        };
        distrusted.retain(|p, (_, generation)| current(&self.readers, p, *generation));
        let distrusted: BTreeMap<i32, Distrust> = distrusted.into_iter().map(|(p, (why, _))| (p, why)).collect();
        waits.retain(|p, (_, _, generation)| !distrusted.contains_key(p) && current(&self.readers, p, *generation));
        let mut applied: BTreeMap<i32, i64> = BTreeMap::new();
        let mut stats = BatchStats::default();
        for i in items {
            let p = i.record.partition;
            let current = self.readers.get(&p).is_some_and(|r| r.generation == i.generation);
            let waiting = waits.get(&p).is_some_and(|&(from, _, _)| i.record.offset >= from);
            if !current || distrusted.contains_key(&p) || waiting {
                continue;
            }
            applied.insert(p, i.record.offset);
            if i.warm {
                stats.warmup += 1;
                continue;
            }
            stats.records += 1;
            let (counted, pin) = match (&i.record.outcome, i.verdict) {
                (Ok(click), Some(v)) => {
                    match v {
                        Verdict::Own => stats.redelivered += 1,
                        Verdict::Duplicate => stats.duplicates += 1,
                        Verdict::CrossDuplicate => {
                            stats.duplicates += 1;
                            stats.cross_partition += 1;
                        }
                        _ => {}
                    }
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
        metrics::counter!(t::RECORDS_CONSUMED).increment(stats.records);
        metrics::counter!(t::WARMUP_RECORDS).increment(stats.warmup);
        metrics::counter!(t::CLICKS_COUNTED).increment(stats.counted);
        metrics::counter!(t::REDELIVERIES).increment(stats.redelivered);
        metrics::counter!(t::DUPLICATES_DROPPED).increment(stats.duplicates);
        metrics::counter!(t::CROSS_PARTITION_DUPLICATES).increment(stats.cross_partition);
        metrics::gauge!(t::BUCKETS_HELD).set(self.unflushed_buckets() as f64);
        self.totals.add(&stats);
        for (p, offset) in applied {
            if let Some(reader) = self.readers.get_mut(&p) {
                // Read past: a re-read starts a new reader, which loads its own.
                reader.pins.pins = reader.pins.pins.split_off(&(offset + 1));
            }
        }
        // A sighting that waits for other partitions' state to be rebuilt is read again,
        // with everything after it in its partition: the reader goes back to just before it
        // (a new generation, so that batches already prepared past it are dropped).
        let mut rewinds = BTreeMap::new();
        for (p, (from, clock_before, _)) in waits {
            self.generation += 1;
            let reader = self.readers.get_mut(&p).expect("checked current");
            reader.last = from - 1;
            reader.clock = clock_before;
            reader.generation = self.generation;
            metrics::counter!(t::DEDUP_WAITS).increment(1);
            rewinds.insert(p, from);
        }
        Applied { fall_backs: distrusted, rewinds }
    }

    /// Stops deciding `partition` from the shared cache: its state so far (decided
    /// correctly) goes with the next flush, and it is read again from the start of its
    /// open batch with state rebuilt from the log (`position::private_start`), up to
    /// where the cache can decide again.
    pub async fn fall_back_to_private<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        partition: i32,
        why: Distrust,
    ) -> Result<(), PipelineError> {
        let Some(reader) = self.readers.get(&partition) else { return Ok(()) };
        // Every look-up first, so that a failed one leaves everything as it was and the
        // fall-back can simply be tried again.
        let from = self.agg.commit_offset(partition).unwrap_or(reader.count_from);
        let n = self.agg.batch_offsets();
        let requested = BTreeMap::from([(partition, Some(from))]);
        let timeout = Duration::from_secs(10);
        let at = tokio::task::block_in_place(|| source::boundaries(consumer, &self.topic, n, &requested, timeout))?;
        let marks = planner::marks(&self.sink, &self.topic, &at, self.window).await?;
        let m = marks[&partition];
        let frontiers = self.shared()?.frontiers(&[partition]).await?;
        let (frontier, _) = position::merge_frontiers(frontiers.get(&partition).map_or(&[][..], Vec::as_slice), m);
        let Some(f) = frontier else {
            // The cache no longer knows the partition at all: it was lost.
            let lost = crate::dedup::Lost { group: 0, why: "namespace".into(), detail: String::new() };
            return Err(DedupError::Lost(lost).into());
        };
        let resume = position::Resume { claimed: f.claimed, exact_from: f.exact_from };
        let start = position::private_start(partition, m, Some(resume));
        let pins = self.pins_from(partition, start.read_from).await?;
        tokio::task::block_in_place(|| {
            consumer.seek(&self.topic, partition, Offset::Offset(start.read_from), timeout)
        })?;
        let cut = self.agg.take_partitions(&[partition]);
        self.carried.merge(cut);
        warn!(
            partition,
            reason = why.as_str(),
            count_from = start.count_from,
            read_from = start.read_from,
            shared_from = resume.shared_from(),
            "the dedup cache cannot decide this partition's re-read; rebuilding its state from the log up to where it can"
        );
        metrics::counter!(t::DEDUP_REBUILDS, "reason" => why.as_str()).increment(1);
        self.private.forget(partition);
        self.generation += 1;
        self.health.status().reading(&start);
        self.readers.insert(partition, Reader::new(start, pins, self.generation));
        Ok(())
    }

    /// After the cache was lost (and renewed): every partition starts over as if just
    /// assigned — its unflushed state dropped, its start planned again from its
    /// committed offset, with a warm-up that rebuilds its state in the new namespace.
    /// Cuts carried from fall-backs keep their rows but commit nothing.
    pub async fn start_over<X: ConsumerContext>(&mut self, consumer: &impl Consumer<X>) -> Result<(), PipelineError> {
        let partitions: Vec<i32> = self.partitions().collect();
        self.carried.commits.clear();
        let starts =
            tokio::task::block_in_place(|| Handle::current().block_on(self.plan_shared_starts(consumer, &partitions)))?;
        let timeout = Duration::from_secs(10);
        for (start, _) in &starts {
            tokio::task::block_in_place(|| {
                consumer.seek(&self.topic, start.partition, Offset::Offset(start.read_from), timeout)
            })?;
        }
        self.assign(starts);
        metrics::counter!(t::DEDUP_REBUILDS, "reason" => "lost").increment(partitions.len() as u64);
        Ok(())
    }

    /// Refuses a topic whose Kafka ID is not the one recorded for its name: it was
    /// deleted and recreated, its offsets start over, and its batches would overwrite
    /// the old topic's rows and take its pins. Records the ID when none is.
    async fn check_topic_identity<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        timeout: Duration,
    ) -> Result<(), PipelineError> {
        let Some(now) = source::topic_id_of(consumer, &self.topic, timeout)? else {
            self.identity_checked = true;
            return Ok(()); // a broker without topic IDs
        };
        match self.sink.recorded_topic_id(&self.topic).await? {
            Some(recorded) if recorded != now => {
                return Err(PipelineError::Fatal(format!(
                    "kafka topic {} has ID {now}, but the counts in ClickHouse were recorded for a topic of that \
                     name with ID {recorded}: it was deleted and recreated, and its offsets would overwrite the \
                     old topic's batches and take its pins. Write the new topic into another database \
                     (clickhouse.database).",
                    self.topic
                )))
            }
            Some(_) => {}
            None => self.sink.record_topic_id(&self.topic, &now).await?,
        }
        self.identity_checked = true;
        Ok(())
    }

    /// The shared cache handle the stages plan with (the member recovers through it).
    pub fn cache(&mut self) -> &mut SharedCache {
        self.cache.as_mut().expect("a member's stages have the shared cache")
    }

    fn shared(&mut self) -> Result<&mut SharedCache, PipelineError> {
        self.cache.as_mut().ok_or_else(|| PipelineError::Fatal("a replay cannot use the shared cache".into()))
    }

    /// Loads the recorded pins of every reader that `records` take past what it holds:
    /// the next window of offsets. Retries while ClickHouse or Redis is unavailable.
    pub async fn ensure_pins(
        &mut self,
        records: &[Record],
        shutdown: &CancellationToken,
        max_backoff: Duration,
    ) -> Result<(), PipelineError> {
        let mut needed: BTreeMap<i32, i64> = BTreeMap::new();
        for r in records {
            if let Some(reader) = self.readers.get(&r.partition) {
                if r.offset > reader.pins.until && r.offset > reader.last {
                    let at = needed.entry(r.partition).or_insert(r.offset);
                    *at = (*at).max(r.offset);
                }
            }
        }
        for (p, beyond) in needed {
            let from = self.readers[&p].pins.until + 1;
            let to = beyond.max(from + self.pins_window() - 1);
            let mut retry = Retry::new(max_backoff, shutdown);
            let loaded = loop {
                match load_pins(&self.sink, self.cache.as_mut(), &self.topic, p, from, to).await {
                    Ok(pins) => break pins,
                    Err(e) => retry
                        .after(e, |e| warn!(error = %e, partition = p, "loading recorded decisions failed; retrying"))
                        .await
                        .map_err(|stopped| stopped_while(stopped, "loading recorded decisions"))?,
                }
            };
            if let Some(reader) = self.readers.get_mut(&p) {
                reader.pins.pins.extend(loaded);
                reader.pins.until = to;
            }
        }
        Ok(())
    }

    /// How many offsets of pins a reader loads at a time.
    fn pins_window(&self) -> i64 {
        (self.agg.batch_offsets().get() as i64).saturating_mul(16).max(100_000)
    }

    /// The first window of pins for a reader starting at `from`.
    async fn pins_from(&mut self, partition: i32, from: i64) -> Result<RecordedPins, PipelineError> {
        let until = from + self.pins_window() - 1;
        let pins = load_pins(&self.sink, self.cache.as_mut(), &self.topic, partition, from, until).await?;
        Ok(RecordedPins { pins, until })
    }

    /// Cuts a flush of everything changed since the last cut: the rows, the dead
    /// letters to acknowledge before its commits, the freshness of its clicks.
    pub fn cut(&mut self, commit_mode: CommitMode) -> Job {
        let flush = self.agg.take_flush();
        self.job(flush, commit_mode)
    }

    fn job(&mut self, flush: Flush, commit_mode: CommitMode) -> Job {
        let mut all = std::mem::take(&mut self.carried);
        all.merge(flush);
        let buckets = all.rows.iter().filter(|r| r.grain == crate::aggregate::Grain::Minute).count();
        Job {
            flush: all,
            clocks: std::mem::take(&mut self.clocks),
            dead_letters: std::mem::take(&mut self.rejected),
            freshness: std::mem::take(&mut self.freshness),
            buckets,
            commit_mode,
        }
    }

    /// Minute buckets held in the aggregator.
    pub fn unflushed_buckets(&self) -> usize {
        self.agg.buckets_held()
    }

    pub fn has_complete_batches(&self) -> bool {
        self.agg.has_complete_batches()
    }
}

impl Reader {
    fn new(start: Start, pins: RecordedPins, generation: u64) -> Reader {
        Reader {
            generation,
            count_from: start.count_from,
            clock: start.clock,
            scope: start.scope,
            pins,
            last: start.read_from - 1,
        }
    }
}

/// Every cross-partition decision recorded for `partition` in `[from, to]`: durable in
/// ClickHouse, or still only in the cache when the flush that records it has not
/// happened yet (a re-read after a crash; a member's only).
async fn load_pins(
    sink: &Sink,
    cache: Option<&mut SharedCache>,
    topic: &str,
    partition: i32,
    from: i64,
    to: i64,
) -> Result<BTreeMap<i64, Pin>, PipelineError> {
    let mut pins = sink.pins(topic, partition, from, to).await?;
    if let Some(cache) = cache {
        pins.extend(cache.cached_pins(partition, from, to).await?);
    }
    Ok(pins)
}

/// Runs a step until it succeeds (`retry::until_done`). Transient failures — a service
/// still coming up, a failover, on an older ClickHouse cluster another member's quorum
/// insert in the way — are logged and retried with backoff; a fatal one, or a shutdown,
/// ends it.
pub async fn until_done<T, F, Fut>(
    what: &str,
    max_backoff: Duration,
    shutdown: &CancellationToken,
    step: F,
) -> Result<T, PipelineError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, PipelineError>>,
{
    retry::until_done(what, max_backoff, shutdown, step).await.map_err(|stopped| stopped_while(stopped, what))
}

/// The error a retried step ends with: its fatal error, or a shutdown while `what` still failed.
pub fn stopped_while(stopped: Stopped<PipelineError>, what: &str) -> PipelineError {
    match stopped {
        Stopped::Fatal(e) => e,
        Stopped::ShutDown => PipelineError::ShutDown(what.to_string()),
    }
}
