//! The stages of one member, in pipeline order, and what they do to a poll batch:
//!
//! ```text
//! poll batch ─► decode/validate ─► dead letters ─► dedup (one Redis pipeline)
//!            ─► aggregate ─► flush (ClickHouse) ─► commit offsets
//! ```
//!
//! [`Stages`] holds every stage's state; `member` drives it from the consumer-group
//! loop and `replay` from a directly assigned reader.
//!
//! Error classes: a rejected record is routed to the dead-letter topic and counted; a
//! transient Redis, ClickHouse or Kafka failure is retried with backoff while nothing
//! is committed; a fatal one (bad credentials, a missing table, a batch-size mismatch)
//! stops the member with a message saying what to fix.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::aggregate::{Aggregator, BatchOffsets, BucketKey, Flush};
use crate::click::Limits;
use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::dedup::{
    Claim, ClaimMode, DedupError, Fingerprint, Fingerprinter, PartitionClock, Pin, PrivateScope, Secs, SharedCache,
    Sighting, Verdict,
};
use crate::health::Health;
use crate::position::{self, Scope, Start};
use crate::sink::{Sink, SinkError, Writer};
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
}

impl PipelineError {
    /// Whether retrying cannot help (the member stops with the message).
    pub fn is_fatal(&self) -> bool {
        match self {
            PipelineError::Dedup(e) => e.is_fatal(),
            PipelineError::Sink(e) => e.is_fatal(),
            PipelineError::Kafka(e) => source::is_fatal_kafka(e.rdkafka_error_code()),
            PipelineError::Config(_) | PipelineError::Fatal(_) => true,
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

/// Every stage's state. Owned by the loop, reached by rebalance callbacks.
pub struct Stages {
    topic: String,
    limits: Limits,
    pub agg: Aggregator,
    cache: SharedCache,
    fingerprints: Fingerprinter,
    window: Secs,
    max_record_lag: Duration,
    /// The partitions being read, with where each started and how it decides. Records
    /// of other partitions (fetched before a revoke) are dropped; commits are only sent
    /// for these.
    readers: HashMap<i32, Reader>,
    /// The state of readers that rebuilt it from the log (`Scope::Private`).
    private: PrivateScope,
    dead_letters: Option<DeadLetters>,
    sink: Sink,
    /// A flush cut from the aggregator but not yet durable. Flushes land one at a time
    /// and in order: a later flush's commits assume the earlier rows are durable.
    pending: Option<Flush>,
    next_flush_attempt: Instant,
    flush_backoff: Backoff,
    max_backoff: Duration,
    drain_timeout: Duration,
    /// Set when the drain failed: revocation then forgets state without writing.
    abandoned: bool,
    /// `false` for `replay`, which reads by direct assignment and owns no group offsets.
    commit_offsets: bool,
    pub totals: BatchStats,
    /// Rows written to ClickHouse by this process.
    pub rows_flushed: u64,
    health: Arc<Health>,
    log_limit: RateLimiter,
}

/// One partition being read (see `position`).
#[derive(Debug)]
struct Reader {
    /// The first offset counted; records before it only rebuild dedup state.
    count_from: i64,
    clock: PartitionClock,
    scope: Scope,
    /// Recorded cross-partition decisions for offsets this reader reads.
    pins: BTreeMap<i64, Pin>,
    /// The last offset processed: anything at or below it is a stale fetch.
    last: i64,
}

impl Reader {
    fn new(start: Start, pins: BTreeMap<i64, Pin>) -> Reader {
        Reader {
            count_from: start.count_from,
            clock: PartitionClock::at(start.clock),
            scope: start.scope,
            pins,
            last: start.read_from - 1,
        }
    }
}

/// Why a member stops trusting the shared cache for a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Distrust {
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
    pub limits: Limits,
    pub batch_offsets: BatchOffsets,
    pub window: Duration,
    pub max_record_lag: Duration,
    pub max_backoff: Duration,
    pub drain_timeout: Duration,
    pub commit_offsets: bool,
}

impl StagesConfig {
    pub fn from_settings(s: &Settings) -> StagesConfig {
        StagesConfig {
            topic: s.kafka.topic.clone(),
            limits: s.validation.limits(),
            batch_offsets: s.batch_offsets(),
            window: s.dedup_window(),
            max_record_lag: s.dedup.max_record_lag,
            max_backoff: s.pipeline.max_backoff,
            drain_timeout: s.pipeline.drain_timeout,
            commit_offsets: true,
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
struct Item<'a> {
    record: &'a Record,
    /// Its record time.
    clock: Secs,
    /// Before the reader's first counted offset: it only rebuilds dedup state.
    warm: bool,
    fingerprint: Option<Fingerprint>,
    verdict: Option<Verdict>,
}

impl Stages {
    pub fn new(
        cfg: StagesConfig,
        cache: SharedCache,
        fingerprints: Fingerprinter,
        dead_letters: Option<DeadLetters>,
        sink: Sink,
        health: Arc<Health>,
    ) -> Stages {
        let window = cfg.window.as_secs().try_into().unwrap_or(Secs::MAX);
        Stages {
            topic: cfg.topic,
            limits: cfg.limits,
            agg: Aggregator::new(cfg.batch_offsets),
            cache,
            fingerprints,
            window,
            max_record_lag: cfg.max_record_lag,
            readers: HashMap::new(),
            private: PrivateScope::new(window),
            dead_letters,
            sink,
            pending: None,
            next_flush_attempt: Instant::now(),
            flush_backoff: Backoff::new(cfg.max_backoff),
            max_backoff: cfg.max_backoff,
            drain_timeout: cfg.drain_timeout,
            abandoned: false,
            commit_offsets: cfg.commit_offsets,
            totals: BatchStats::default(),
            rows_flushed: 0,
            health,
            log_limit: RateLimiter::new(Duration::from_secs(5)),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Plans where each newly assigned partition starts (`position::shared_start`):
    /// the batch boundary at or below its committed offset, a warm-up when the cache
    /// lacks the sightings before it, and the recorded pins of what it will re-read.
    /// Blocking broker look-ups; called from the rebalance callback.
    pub async fn plan_shared_starts<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
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
            let start = position::shared_start(p, m, frontiers.get(&p).copied());
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
                cache_frontier = ?frontiers.get(&p).map(|f| f.claimed),
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
            self.readers.insert(p, Reader::new(start, pins));
        }
        self.health.set_assigned(self.readers.len());
        metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.readers.len() as f64);
    }

    /// Partitions stop being ours: flush their state and commit, within the drain
    /// timeout, then forget them. When the assignment was lost (session timeout),
    /// another member may own them already: forget without committing.
    pub async fn revoke<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>, partitions: &[i32], lost: bool) {
        let span = info_span!("revoke", partitions = ?partitions, lost);
        async {
            if !lost && !self.abandoned {
                let cut = self.agg.take_partitions(partitions);
                match self.pending.as_mut() {
                    Some(pending) => pending.merge(cut),
                    None => self.pending = Some(cut),
                }
                let deadline = Instant::now() + self.drain_timeout;
                match self.flush_until(deadline, consumer, CommitMode::Sync).await {
                    Ok(true) => info!("flushed and committed revoked partitions"),
                    Ok(false) => warn!("could not flush revoked partitions within the drain timeout; the next owner re-reads their open batches"),
                    Err(e) => error!(error = %e, "flushing revoked partitions failed"),
                }
            }
            for &p in partitions {
                self.agg.forget(p);
                self.private.forget(p);
                self.readers.remove(&p);
            }
            self.health.set_assigned(self.readers.len());
            metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.readers.len() as f64);
        }
        .instrument(span)
        .await
    }

    /// Applies one poll batch: dead letters, dedup, aggregation. Returns early only on
    /// shutdown or a fatal error; transient failures are retried here with backoff.
    pub async fn process<C: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<C>,
        records: Vec<Record>,
        shutdown: &CancellationToken,
    ) -> Result<BatchStats, Interrupted> {
        let mut stats = BatchStats::default();
        let mut items = self.clock_in(&records);
        stats.warmup = items.iter().filter(|i| i.warm).count() as u64;
        stats.records = items.len() as u64 - stats.warmup;

        let counted_records: Vec<&Record> = items.iter().filter(|i| !i.warm).map(|i| i.record).collect();
        if counted_records.iter().any(|r| r.outcome.is_err()) {
            stats.invalid = self.route_rejected(&counted_records, shutdown).await?;
        }

        let mut distrusted: BTreeMap<i32, Distrust> = self.lagging(&items);
        self.decide_private(&mut items);
        self.decide_shared(&mut items, &distrusted, shutdown).await?;
        for i in &items {
            if !i.warm && i.verdict == Some(Verdict::Undecidable) {
                distrusted.entry(i.record.partition).or_insert(Distrust::Undecidable);
            }
        }

        for i in items.iter().filter(|i| !i.warm && !distrusted.contains_key(&i.record.partition)) {
            let r = i.record;
            let (counted, pin) = match (&r.outcome, i.verdict) {
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
            stats.counted += u64::from(counted.is_some());
            self.agg.observe(r.partition, r.offset, counted, pin);
        }

        for (p, why) in distrusted {
            self.fall_back_to_private(consumer, p, why).await.map_err(Interrupted::Fatal)?;
        }

        metrics::counter!(t::RECORDS_CONSUMED).increment(stats.records);
        metrics::counter!(t::WARMUP_RECORDS).increment(stats.warmup);
        metrics::counter!(t::CLICKS_COUNTED).increment(stats.counted);
        metrics::counter!(t::REDELIVERIES).increment(stats.redelivered);
        metrics::counter!(t::DUPLICATES_DROPPED).increment(stats.duplicates);
        metrics::counter!(t::CROSS_PARTITION_DUPLICATES).increment(stats.cross_partition);
        metrics::gauge!(t::BUCKETS_HELD).set(self.unflushed_buckets() as f64);
        self.totals.add(&stats);
        Ok(stats)
    }

    /// Advances each partition's clock over the batch and says which records are
    /// warm-up. Records of partitions not ours, and stale ones (at or below what was
    /// already processed, fetched before a seek), are dropped.
    fn clock_in<'a>(&mut self, records: &'a [Record]) -> Vec<Item<'a>> {
        let mut items = Vec::with_capacity(records.len());
        for r in records {
            let Some(reader) = self.readers.get_mut(&r.partition) else { continue };
            if r.offset <= reader.last {
                continue;
            }
            reader.last = r.offset;
            let clock = reader.clock.tick(r.timestamp_ms);
            let fingerprint = r.outcome.as_ref().ok().map(|c| self.fingerprints.of(c.click_id.as_str()));
            let warm = r.offset < reader.count_from;
            items.push(Item { record: r, clock, warm, fingerprint, verdict: None });
        }
        items
    }

    /// Partitions read from the shared cache whose first counted record lags the wall
    /// clock by more than `dedup.max_record_lag`: the cache may have collected entries
    /// they need.
    fn lagging(&self, items: &[Item<'_>]) -> BTreeMap<i32, Distrust> {
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
                out.insert(p, Distrust::Lag);
            }
        }
        out
    }

    /// Decides the records of partitions with private state.
    fn decide_private(&mut self, items: &mut [Item<'_>]) {
        for i in items.iter_mut() {
            let p = i.record.partition;
            let Some(fp) = i.fingerprint else { continue };
            let reader = self.readers.get(&p).expect("clocked in");
            if reader.scope != Scope::Private {
                continue;
            }
            let pin = if i.warm { None } else { reader.pins.get(&i.record.offset).copied() };
            i.verdict = Some(self.private.sight(p, fp.0, i.clock, pin));
        }
    }

    /// Decides the records of partitions read from the shared cache, with one `FCALL` per
    /// poll batch (and key group); a record with a recorded pin has it applied.
    async fn decide_shared(
        &mut self,
        items: &mut [Item<'_>],
        distrusted: &BTreeMap<i32, Distrust>,
        shutdown: &CancellationToken,
    ) -> Result<(), Interrupted> {
        let mut claims = Vec::new();
        let mut claimed = Vec::new();
        for (idx, i) in items.iter_mut().enumerate() {
            let p = i.record.partition;
            let Some(fp) = i.fingerprint else { continue };
            let reader = self.readers.get(&p).expect("clocked in");
            if reader.scope == Scope::Private || distrusted.contains_key(&p) {
                continue;
            }
            let mode = ClaimMode { pin: reader.pins.get(&i.record.offset).copied(), warm: i.warm };
            let sighting = Sighting { partition: p, offset: i.record.offset, clock: i.clock };
            claims.push(Claim { fingerprint: fp, sighting, mode });
            claimed.push(idx);
        }
        let verdicts = self.claim_with_retry(&claims, shutdown).await?;
        for (idx, v) in claimed.into_iter().zip(verdicts) {
            items[idx].verdict = Some(v);
        }
        Ok(())
    }

    /// Stops deciding `partition` from the shared cache: its rows so far (decided
    /// correctly) go to the next flush, and it is read again from the start of its
    /// open batch with state rebuilt from the log (`position::private_start`).
    async fn fall_back_to_private<C: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<C>,
        partition: i32,
        why: Distrust,
    ) -> Result<(), PipelineError> {
        let Some(reader) = self.readers.get(&partition) else { return Ok(()) };
        let cut = self.agg.take_partitions(&[partition]);
        let from = cut.commits.get(&partition).copied().unwrap_or(reader.count_from);
        match self.pending.as_mut() {
            Some(pending) => pending.merge(cut),
            None => self.pending = Some(cut),
        }
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
        self.readers.insert(partition, Reader::new(start, pins));
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

    async fn route_rejected(&mut self, records: &[&Record], shutdown: &CancellationToken) -> Result<u64, Interrupted> {
        let mut invalid = 0u64;
        for r in records {
            if let Err(rejected) = &r.outcome {
                invalid += 1;
                let reason = rejected.rejection.reason.as_str();
                metrics::counter!(t::INVALID_RECORDS, "reason" => reason).increment(1);
                if let Some(suppressed) = self.log_limit.allow(reason, Instant::now()) {
                    warn!(
                        partition = r.partition,
                        offset = r.offset,
                        reason,
                        detail = %rejected.rejection.detail,
                        suppressed_since_last = suppressed,
                        "rejected record"
                    );
                }
            }
        }
        let Some(dl) = &mut self.dead_letters else { return Ok(invalid) };
        let mut backoff = Backoff::new(self.max_backoff);
        loop {
            match dl.send(records).await {
                Ok(n) => {
                    metrics::counter!(t::DEAD_LETTERS).increment(n as u64);
                    return Ok(invalid);
                }
                Err(e) if e.is_fatal() => return Err(Interrupted::Fatal(PipelineError::Fatal(e.to_string()))),
                Err(e) => {
                    metrics::counter!(t::KAFKA_ERRORS, "op" => "dead_letter").increment(1);
                    warn!(error = %e, topic = dl.topic(), "producing dead letters failed; retrying with a new producer");
                    if let Err(e) = dl.renew() {
                        warn!(error = %e, "could not create a dead-letter producer");
                    }
                    sleep_or_shutdown(backoff.next_delay(), shutdown).await?;
                }
            }
        }
    }

    async fn claim_with_retry(
        &mut self,
        claims: &[Claim],
        shutdown: &CancellationToken,
    ) -> Result<Vec<Verdict>, Interrupted> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let mut backoff = Backoff::new(self.max_backoff);
        loop {
            match self.cache.claim(claims).await {
                Ok(v) => {
                    self.health.set_redis(true);
                    return Ok(v);
                }
                Err(e) if e.is_fatal() => return Err(Interrupted::Fatal(e.into())),
                Err(e) => {
                    // Dedup is never skipped: the batch waits, nothing is committed.
                    self.health.set_redis(false);
                    metrics::counter!(t::REDIS_ERRORS).increment(1);
                    metrics::counter!(t::REDIS_RETRIES).increment(1);
                    if self.log_limit.allow("redis", Instant::now()).is_some() {
                        warn!(error = %e, "dedup failed; retrying with backoff");
                    }
                    sleep_or_shutdown(backoff.next_delay(), shutdown).await?;
                }
            }
        }
    }

    /// Buckets held in memory, including a flush waiting to be retried.
    pub fn unflushed_buckets(&self) -> usize {
        self.agg.buckets_held() + self.pending.as_ref().map_or(0, |f| f.rows.len())
    }

    pub fn has_complete_batches(&self) -> bool {
        self.agg.has_complete_batches()
    }

    /// One flush attempt, unless a retry is not due yet. Transient failures keep the
    /// rows for the next attempt; fatal ones are returned.
    pub async fn flush<C: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<C>,
        mode: CommitMode,
    ) -> Result<bool, SinkError> {
        if self.pending.is_none() {
            let f = self.agg.take_flush();
            if f.is_empty() {
                return Ok(true);
            }
            self.pending = Some(f);
        }
        if Instant::now() < self.next_flush_attempt {
            return Ok(false);
        }
        let pending = self.pending.as_ref().expect("set above");
        let started = Instant::now();
        let span =
            info_span!("flush", rows = pending.rows.len(), pins = pending.pins.len(), commits = ?pending.commits);
        let write = async {
            self.sink.insert_pins(&self.topic, &pending.pins).await?;
            let writer = if self.commit_offsets { Writer::Member } else { Writer::Replay };
            self.sink.insert(&self.topic, &pending.rows, writer).await
        };
        let result = write.instrument(span.clone()).await;
        match result {
            Ok(()) => {
                metrics::histogram!(t::FLUSH_DURATION).record(started.elapsed().as_secs_f64());
                metrics::counter!(t::FLUSHES).increment(1);
                metrics::counter!(t::ROWS_FLUSHED).increment(pending.rows.len() as u64);
                self.rows_flushed += pending.rows.len() as u64;
                span.in_scope(|| debug!(elapsed_ms = started.elapsed().as_millis() as u64, "flushed"));
                self.health.set_clickhouse(true);
                let pending = self.pending.take().expect("set above");
                self.commit(consumer, &pending.commits, mode);
                if self.commit_offsets && !pending.pins.is_empty() {
                    // The pins are durable now; their cached copies below the commits can go.
                    if let Err(e) = self.cache.trim_cached_pins(&pending.commits).await {
                        warn!(error = %e, "could not trim cached cross-partition decisions; they are trimmed later");
                    }
                }
                metrics::gauge!(t::BUCKETS_HELD).set(self.unflushed_buckets() as f64);
                self.flush_backoff.reset();
                self.next_flush_attempt = Instant::now();
                Ok(true)
            }
            Err(e) if e.is_fatal() => Err(e),
            Err(e) => {
                self.health.set_clickhouse(false);
                metrics::counter!(t::CLICKHOUSE_ERRORS).increment(1);
                metrics::counter!(t::CLICKHOUSE_RETRIES).increment(1);
                let delay = self.flush_backoff.next_delay();
                self.next_flush_attempt = Instant::now() + delay;
                if self.log_limit.allow("clickhouse", Instant::now()).is_some() {
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, unflushed_buckets = self.unflushed_buckets(), "flush failed; keeping the rows and retrying");
                }
                Ok(false)
            }
        }
    }

    /// Flushes everything until done or `deadline`. `Ok(true)` when all is durable and committed.
    pub async fn flush_until<C: ConsumerContext>(
        &mut self,
        deadline: Instant,
        consumer: &impl Consumer<C>,
        mode: CommitMode,
    ) -> Result<bool, SinkError> {
        loop {
            if self.flush(consumer, mode).await? && self.pending.is_none() {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let wait = self.next_flush_attempt.saturating_duration_since(now).min(deadline - now);
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }

    /// Commits the offsets a durable flush allows, for the partitions still ours.
    fn commit<C: ConsumerContext>(&self, consumer: &impl Consumer<C>, commits: &BTreeMap<i32, i64>, mode: CommitMode) {
        if !self.commit_offsets {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (&p, &offset) in commits {
            if self.readers.contains_key(&p) {
                let _ = tpl.add_partition_offset(&self.topic, p, Offset::Offset(offset));
            }
        }
        if tpl.count() == 0 {
            return;
        }
        match consumer.commit(&tpl, mode) {
            Ok(()) => {
                for (&p, &offset) in commits {
                    if self.readers.contains_key(&p) {
                        metrics::gauge!(t::COMMITTED_OFFSET, "partition" => p.to_string()).set(offset as f64);
                    }
                }
                debug!(?commits, "committed");
            }
            Err(e) => {
                // Harmless for correctness: the next commit covers it, or the batch is re-read.
                metrics::counter!(t::KAFKA_ERRORS, "op" => "commit").increment(1);
                warn!(error = %e, "offset commit failed");
            }
        }
    }

    /// Called when the drain failed: later revocations must not write or commit.
    pub fn abandon(&mut self) {
        self.abandoned = true;
    }
}

pub(crate) async fn sleep_or_shutdown(d: Duration, shutdown: &CancellationToken) -> Result<(), Interrupted> {
    tokio::select! {
        _ = shutdown.cancelled() => Err(Interrupted::Shutdown),
        _ = tokio::time::sleep(d) => Ok(()),
    }
}
