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
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::aggregate::{Aggregator, BatchOffsets, BucketKey, Flush};
use crate::config::Settings;
use crate::dedup::{
    Claim, ClaimMode, DedupError, Fingerprint, PartitionClock, Pin, PrivateScope, Secs, SharedCache, Sighting, Verdict,
};
use crate::flusher::Job;
use crate::health::Health;
use crate::position::{self, Scope, Start};
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

/// Exponential backoff between retries of one failing service.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(max: Duration) -> Backoff {
        Backoff { next: Duration::from_millis(100), max }
    }

    /// The delay before the next attempt; doubles up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = Duration::from_millis(100);
    }
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

/// A fatal condition reported from another task or a librdkafka callback to the loop.
#[derive(Clone, Default)]
pub struct FatalSignal {
    token: CancellationToken,
    message: Arc<std::sync::Mutex<Option<String>>>,
}

impl FatalSignal {
    pub fn raise(&self, message: String) {
        self.message.lock().expect("not poisoned").get_or_insert(message);
        self.token.cancel();
    }

    pub async fn raised(&self) -> String {
        self.token.cancelled().await;
        self.message.lock().expect("not poisoned").clone().unwrap_or_default()
    }
}

/// The state of the stages up to the cut of a flush. Owned by the loop, reached by
/// rebalance callbacks.
pub struct Stages {
    topic: String,
    pub agg: Aggregator,
    /// For planning starts, restarts and the cached pins (claims go through a `Claimer`).
    cache: SharedCache,
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
    /// Recorded cross-partition decisions for offsets this reader reads.
    pins: BTreeMap<i64, Pin>,
    /// The last offset taken in: anything at or below it is a stale fetch.
    last: i64,
}

/// Why a member stops trusting the shared cache for a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    /// A re-read the cache could not decide.
    Undecidable,
    /// The partition lags the wall clock by more than `dedup.max_record_lag`: entries
    /// it needs may have been collected.
    Lag,
}

impl Distrust {
    fn as_str(self) -> &'static str {
        match self {
            Distrust::Undecidable => "undecidable",
            Distrust::Lag => "lag",
        }
    }
}

pub struct StagesConfig {
    pub topic: String,
    pub batch_offsets: BatchOffsets,
    pub window: Duration,
    pub max_record_lag: Duration,
    pub dead_letters: bool,
}

impl StagesConfig {
    pub fn from_settings(s: &Settings) -> StagesConfig {
        StagesConfig {
            topic: s.kafka.topic.clone(),
            batch_offsets: s.batch_offsets(),
            window: s.dedup_window(),
            max_record_lag: s.dedup.max_record_lag,
            dead_letters: s.dead_letter.enabled,
        }
    }
}

/// Why processing stopped before the poll batch was fully applied.
#[derive(Debug)]
pub enum Interrupted {
    Shutdown,
    Fatal(PipelineError),
}

/// One record of a poll batch on its way through the stages.
struct Item {
    record: Record,
    generation: u64,
    /// Its record time.
    clock: Secs,
    /// Before the reader's first counted offset: it only rebuilds dedup state.
    warm: bool,
    fingerprint: Option<Fingerprint>,
    verdict: Option<Verdict>,
}

/// A poll batch between [`Stages::prepare`] and [`Stages::apply`].
pub struct Prepared {
    items: Vec<Item>,
    /// The claims for the shared cache, in record order; `claimed[i]` is claim i's item.
    claims: Vec<Claim>,
    claimed: Vec<usize>,
    /// Partitions that stop trusting the cache before this batch (lag), with the
    /// generation of the reader that saw it.
    distrusted: BTreeMap<i32, (Distrust, u64)>,
}

impl Prepared {
    /// Takes the claims to hand to the `Claimer` (the verdicts come back in this order).
    pub fn take_claims(&mut self) -> Vec<Claim> {
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
    pub fn new(cfg: StagesConfig, cache: SharedCache, sink: Sink, health: Arc<Health>) -> Stages {
        let window = cfg.window.as_secs().try_into().unwrap_or(Secs::MAX);
        Stages {
            topic: cfg.topic,
            agg: Aggregator::new(cfg.batch_offsets),
            cache,
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
    ) -> Result<Vec<(Start, BTreeMap<i64, Pin>)>, PipelineError> {
        // A cooperative rebalance may assign nothing new to this member.
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition(&self.topic, p);
        }
        let timeout = Duration::from_secs(10);
        let committed = consumer.committed_offsets(tpl, timeout)?;
        let requested: BTreeMap<i32, Option<i64>> = committed
            .elements()
            .iter()
            .map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
            .collect();
        let n = self.agg.batch_offsets();
        let marks = source::marks(consumer, &self.topic, n, &requested, self.window, timeout)?;
        let frontiers = self.cache.frontiers(partitions).await?;
        let mut starts = Vec::new();
        for (&p, &m) in &marks {
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
            if start.read_from == m.lookback && m.lookback < m.boundary {
                // The cache lacks everything before the lookback: its re-reads below the
                // boundary cannot be trusted after this warm-up.
                self.cache.restart(p, m.lookback, m.boundary).await?;
            }
            // Every recorded decision from the first offset read on: a re-read applies it,
            // warm-up included, with the effect it had on the cache (the frontier may be lost).
            let pins = self.pins(p, start.read_from, i64::MAX).await?;
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
        Ok(starts)
    }

    /// Partitions become ours, starting as planned: any state left from an earlier
    /// ownership is stale, so it is dropped.
    pub fn assign(&mut self, starts: Vec<(Start, BTreeMap<i64, Pin>)>) {
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
        let mut items = Vec::with_capacity(records.len());
        for r in records {
            let Some(reader) = self.readers.get_mut(&r.partition) else { continue };
            if r.offset <= reader.last {
                continue;
            }
            reader.last = r.offset;
            let clock = reader.clock.tick(r.timestamp_ms);
            let fingerprint = r.outcome.as_ref().ok().map(|c| c.click_id);
            let warm = r.offset < reader.count_from;
            let generation = reader.generation;
            items.push(Item { record: r, generation, clock, warm, fingerprint, verdict: None });
        }
        self.health.status().read_up_to(self.readers.iter().map(|(&p, r)| (p, r.last)));
        let distrusted = self.lagging(&items);
        let mut claims = Vec::new();
        let mut claimed = Vec::new();
        for (idx, i) in items.iter_mut().enumerate() {
            let p = i.record.partition;
            let Some(fp) = i.fingerprint else { continue };
            let reader = &self.readers[&p];
            if distrusted.contains_key(&p) {
                continue;
            }
            match reader.scope {
                Scope::Private => {
                    let pin = if i.warm { None } else { reader.pins.get(&i.record.offset).copied() };
                    i.verdict = Some(self.private.sight(p, fp.0, i.clock, pin));
                }
                Scope::Shared { .. } => {
                    let mode = ClaimMode { pin: reader.pins.get(&i.record.offset).copied(), warm: i.warm };
                    let sighting = Sighting { partition: p, offset: i.record.offset, clock: i.clock };
                    claims.push(Claim { fingerprint: fp, sighting, mode });
                    claimed.push(idx);
                }
            }
        }
        Prepared { items, claims, claimed, distrusted }
    }

    /// Partitions read from the shared cache whose first counted record lags the wall
    /// clock by more than `dedup.max_record_lag`: the cache may have collected entries
    /// they need.
    fn lagging(&self, items: &[Item]) -> BTreeMap<i32, (Distrust, u64)> {
        let now = chrono::Utc::now().timestamp().max(0) as u64;
        let limit = self.max_record_lag.as_secs();
        let mut out = BTreeMap::new();
        let mut seen = BTreeSet::new();
        for i in items.iter().filter(|i| !i.warm) {
            let p = i.record.partition;
            if !seen.insert(p) {
                continue;
            }
            let lag = now.saturating_sub(u64::from(i.clock));
            metrics::gauge!(t::RECORD_LAG, "partition" => p.to_string()).set(lag as f64);
            let shared = matches!(self.readers.get(&p).map(|r| r.scope), Some(Scope::Shared { .. }));
            if shared && lag > limit {
                out.insert(p, (Distrust::Lag, i.generation));
            }
        }
        out
    }

    /// The second step of a poll batch: the shared cache's verdicts (in the order of
    /// the claims), then the aggregator. Returns the partitions that stop trusting the
    /// cache; the caller falls them back to private state (`fall_back_to_private`).
    pub fn apply(&mut self, prepared: Prepared, verdicts: Vec<Verdict>) -> BTreeMap<i32, Distrust> {
        let Prepared { mut items, claimed, mut distrusted, .. } = prepared;
        for (idx, v) in claimed.into_iter().zip(verdicts) {
            items[idx].verdict = Some(v);
            if v == Verdict::Undecidable && !items[idx].warm {
                let item = &items[idx];
                distrusted.entry(item.record.partition).or_insert((Distrust::Undecidable, item.generation));
            }
        }
        // A reader replaced since this batch was prepared has nothing to fall back.
        distrusted.retain(|p, (_, generation)| self.readers.get(p).is_some_and(|r| r.generation == *generation));
        let distrusted: BTreeMap<i32, Distrust> = distrusted.into_iter().map(|(p, (why, _))| (p, why)).collect();
        let mut stats = BatchStats::default();
        for i in items {
            let p = i.record.partition;
            let current = self.readers.get(&p).is_some_and(|r| r.generation == i.generation);
            if !current || distrusted.contains_key(&p) {
                continue;
            }
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
        distrusted
    }

    /// Stops deciding `partition` from the shared cache: its state so far (decided
    /// correctly) goes with the next flush, and it is read again from the start of its
    /// open batch with state rebuilt from the log (`position::private_start`).
    pub async fn fall_back_to_private<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        partition: i32,
        why: Distrust,
    ) -> Result<(), PipelineError> {
        let Some(reader) = self.readers.get(&partition) else { return Ok(()) };
        let cut = self.agg.take_partitions(&[partition]);
        let from = cut.commits.get(&partition).copied().unwrap_or(reader.count_from);
        self.carried.merge(cut);
        let n = self.agg.batch_offsets();
        let requested = BTreeMap::from([(partition, Some(from))]);
        let timeout = Duration::from_secs(10);
        let marks =
            tokio::task::block_in_place(|| source::marks(consumer, &self.topic, n, &requested, self.window, timeout))?;
        let start = position::private_start(partition, marks[&partition]);
        let pins = self.pins(partition, start.count_from, i64::MAX).await?;
        warn!(
            partition,
            reason = why.as_str(),
            count_from = start.count_from,
            read_from = start.read_from,
            "the dedup cache cannot decide this partition; rebuilding its state from the log"
        );
        metrics::counter!(t::DEDUP_REBUILDS, "reason" => why.as_str()).increment(1);
        self.private.forget(partition);
        self.generation += 1;
        self.health.status().reading(&start);
        self.readers.insert(partition, Reader::new(start, pins, self.generation));
        tokio::task::block_in_place(|| {
            consumer.seek(&self.topic, partition, Offset::Offset(start.read_from), timeout)
        })?;
        Ok(())
    }

    /// Every cross-partition decision recorded for `partition` in `[from, to]`: durable
    /// in ClickHouse, or still only in the cache when the flush that records it has not
    /// happened yet (a re-read after a crash).
    async fn pins(&mut self, partition: i32, from: i64, to: i64) -> Result<BTreeMap<i64, Pin>, PipelineError> {
        let mut pins = self.sink.pins(&self.topic, partition, from, to).await?;
        pins.extend(self.cache.cached_pins(partition, from, to).await?);
        Ok(pins)
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
    fn new(start: Start, pins: BTreeMap<i64, Pin>, generation: u64) -> Reader {
        Reader {
            generation,
            count_from: start.count_from,
            clock: PartitionClock::at(start.clock),
            scope: start.scope,
            pins,
            last: start.read_from - 1,
        }
    }
}

/// Runs a start-up step until it succeeds. Transient failures — a service still
/// coming up, a failover, on an older ClickHouse cluster another member's quorum insert
/// in the way — are logged and retried with backoff; a fatal one, or a shutdown, ends it.
pub async fn until_done<T, F, Fut>(
    what: &str,
    max_backoff: Duration,
    shutdown: &CancellationToken,
    mut step: F,
) -> Result<T, PipelineError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, PipelineError>>,
{
    let mut backoff = Backoff::new(max_backoff);
    loop {
        match step().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_fatal() => return Err(e),
            Err(e) => {
                warn!(error = %e, "{what} failed; retrying");
                if sleep_or_shutdown(backoff.next_delay(), shutdown).await.is_err() {
                    return Err(PipelineError::ShutDown(what.to_string()));
                }
            }
        }
    }
}

pub(crate) async fn sleep_or_shutdown(d: Duration, shutdown: &CancellationToken) -> Result<(), Interrupted> {
    tokio::select! {
        _ = shutdown.cancelled() => Err(Interrupted::Shutdown),
        _ = tokio::time::sleep(d) => Ok(()),
    }
}
