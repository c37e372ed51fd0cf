//! One consumer-group member (`clickagg run`): the loop that drives [`Stages`].
//!
//! One loop (`select!` over shutdown, a fatal signal, the next batch of verdicts, the
//! flush ticker and the next poll batch) drives the stages, with two helpers running
//! beside it: the `Claimer`, which applies each poll batch's claims in Redis in order
//! while the loop decodes the next batch, and the `Flusher`, which makes the cut flushes
//! durable and then commits (the one owner of commits).
//!
//! Rebalance callbacks from librdkafka run *inside* the loop's poll of the consumer, on
//! the same task, so they reach the same `Stages` through a mutex that is never
//! contended. On revoke they cut the partitions' state, hand it to the flusher and wait
//! until it is durable and committed before librdkafka lets the partitions go
//! (docs/DESIGN.md §8: flush, then commit, then release). On assign they plan where each
//! partition starts (the batch boundary at or below its committed offset, after a
//! warm-up if the dedup cache needs one, `position`) and hand librdkafka those offsets,
//! whatever an operator reset the group to.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::statistics::Statistics;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::cache::{Claimer, DedupError, Lost, Recovery, Verdicts};
use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::flusher::{Committer, Flusher, FlusherConfig};
use crate::health::Health;
use crate::pipeline::{Prepared, Stages, StagesConfig};
use crate::planner::{stopped_while, until_done, PipelineError, Planner};
use crate::position::Start;
use crate::retry::{FatalSignal, Retry, Stopped};
use crate::sink::{Sink, Writer};
use crate::source::{self, Record};
use crate::telemetry::{self as t, RateLimiter};

/// The consumer context: routes librdkafka's logs, errors, statistics and rebalance
/// callbacks into the pipeline.
pub struct GroupContext {
    stages: Arc<Mutex<Stages>>,
    planner: Arc<Mutex<Planner>>,
    flusher: Arc<Flusher>,
    topic: String,
    runtime: Handle,
    /// Set when librdkafka reports an error retrying cannot fix (bad credentials): the
    /// loop stops with this message instead of retrying forever.
    fatal: FatalSignal,
    /// Ends the retries of an assignment whose start cannot be planned yet.
    shutdown: CancellationToken,
    max_backoff: Duration,
    /// How long a revoke may wait for its flush and commit.
    drain_timeout: Duration,
    /// Set while the loop holds consumption paused (backpressure): partitions assigned
    /// meanwhile are paused as they arrive, or they would be read without bound.
    paused: Arc<AtomicBool>,
    /// Set when planning an assignment found the dedup cache lost: the partitions are
    /// assigned unplanned (their records are dropped) and the loop starts every assigned
    /// partition over (`Loop::start_over`), which first moves to the renewed namespace.
    lost_in_plan: std::sync::Mutex<Option<Lost>>,
}

impl GroupContext {
    /// Runs `f` on this worker thread: callbacks run inside the loop's poll of the
    /// consumer, and flushing or planning needs async I/O.
    fn block_on<R>(&self, f: impl std::future::Future<Output = R>) -> R {
        tokio::task::block_in_place(|| self.runtime.block_on(f))
    }

    fn partitions_of(&self, tpl: &TopicPartitionList) -> Vec<i32> {
        tpl.elements().iter().filter(|e| e.topic() == self.topic).map(|e| e.partition()).collect()
    }

    /// Plans each partition's start, retrying while Redis, ClickHouse or the broker is
    /// unavailable (the member cannot count safely without a plan). `None` when the
    /// member is shutting down or hit a fatal error: then nothing of these partitions
    /// is processed.
    fn plan(
        &self,
        consumer: &BaseConsumer<Self>,
        partitions: &[i32],
    ) -> Option<Vec<(Start, crate::pipeline::RecordedPins)>> {
        let mut retry = Retry::new(self.max_backoff, &self.shutdown);
        loop {
            let planned = self.block_on(async { self.planner.lock().await.plan_starts(consumer, partitions).await });
            let e = match planned {
                Ok(starts) => return Some(starts),
                Err(PipelineError::Dedup(DedupError::Lost(lost))) => {
                    // Retrying cannot help: the namespace this member decides in is gone
                    // (Redis lost its data, or another member renewed it), and only the
                    // loop can move to another one, after the batches in flight.
                    warn!(%lost, ?partitions, "the dedup cache was lost while planning; the loop starts every partition over");
                    self.lost_in_plan.lock().expect("not poisoned").get_or_insert(lost);
                    return Some(Vec::new());
                }
                Err(e) => e,
            };
            let kafka = matches!(e, PipelineError::Kafka(_));
            let transient = |e: &PipelineError| warn!(error = %e, ?partitions, "cannot plan where the assigned partitions start yet; retrying");
            match self.block_on(retry.after(e, transient)) {
                Ok(()) => {}
                Err(Stopped::Fatal(e)) => {
                    self.fatal.raise(format!("planning the start of partitions {partitions:?}: {e}"));
                    return None;
                }
                Err(Stopped::ShutDown) => return None,
            }
            if kafka {
                // The offset look-ups go to each partition's leader as the client's
                // metadata names it, and nothing refreshes that metadata for partitions
                // not fetched yet: after a leader died it answered "unknown partition" for
                // a minute (cluster test). A metadata request updates it.
                let _ =
                    tokio::task::block_in_place(|| consumer.fetch_metadata(Some(&self.topic), Duration::from_secs(5)));
            }
        }
    }

    fn assign(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let partitions = self.partitions_of(tpl);
        metrics::counter!(t::REBALANCES, "kind" => "assign").increment(1);
        let starts = self.plan(consumer, &partitions).unwrap_or_default();
        for (start, _) in &starts {
            if let Err(e) = tpl.set_partition_offset(&self.topic, start.partition, Offset::Offset(start.read_from)) {
                warn!(error = %e, partition = start.partition, "could not set the start offset");
            }
        }
        let assigned = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_assign(tpl),
            _ => consumer.assign(tpl),
        };
        if let Err(e) = assigned {
            warn!(error = %e, "assigning partitions failed");
        }
        if self.paused.load(Ordering::Relaxed) {
            if let Err(e) = consumer.pause(tpl) {
                warn!(error = %e, "could not pause the assigned partitions");
            }
            info!(?partitions, "assigned partitions start paused, as the member is");
        }
        info!(?partitions, "partitions assigned");
        self.block_on(async {
            let mut st = self.stages.lock().await;
            st.assign(starts);
            self.flusher.set_owned(st.partitions());
        });
    }

    fn revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        let partitions = self.partitions_of(tpl);
        let lost = consumer.assignment_lost();
        metrics::counter!(t::REBALANCES, "kind" => "revoke").increment(1);
        info!(?partitions, lost, "partitions revoked");
        self.block_on(async {
            let mut st = self.stages.lock().await;
            if lost {
                // Another member may own them already: not one more commit for them.
                self.flusher.set_owned(st.partitions().filter(|p| !partitions.contains(p)));
            }
            let job = st.revoke(&partitions, lost);
            drop(st);
            if let Some(job) = job {
                if self.flusher.drain(job, Instant::now() + self.drain_timeout).await {
                    info!(?partitions, "flushed and committed revoked partitions");
                } else {
                    warn!("could not flush revoked partitions within the drain timeout; the next owner re-reads their open batches");
                }
            }
            let st = self.stages.lock().await;
            self.flusher.set_owned(st.partitions());
        });
        let released = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_unassign(tpl),
            _ => consumer.unassign(),
        };
        if let Err(e) = released {
            warn!(error = %e, "releasing partitions failed");
        }
    }
}

impl ClientContext for GroupContext {
    fn stats(&self, stats: Statistics) {
        let Some(topic) = stats.topics.get(&self.topic) else { return };
        for (id, p) in &topic.partitions {
            if *id < 0 || p.consumer_lag < 0 {
                continue;
            }
            metrics::gauge!(t::CONSUMER_LAG, "partition" => id.to_string()).set(p.consumer_lag as f64);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        metrics::counter!(t::KAFKA_ERRORS, "op" => "client").increment(1);
        if source::is_fatal_kafka(error.rdkafka_error_code()) {
            self.fatal.raise(format!(
                "Kafka refused this member: {error} ({reason}); check kafka.security_protocol, kafka.sasl_* and kafka.ssl_* settings"
            ));
        }
        warn!(error = %error, reason, "kafka client error");
    }
}

impl ConsumerContext for GroupContext {
    /// Replaces librdkafka's default rebalance handling so that an assignment starts at
    /// planned offsets (`assign`), and a revocation flushes and commits first (`revoke`).
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.assign(consumer, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.revoke(consumer, tpl),
            other => {
                let code: RDKafkaErrorCode = other.into();
                warn!(error = %code, "rebalance error");
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(e) = result {
            metrics::counter!(t::KAFKA_ERRORS, "op" => "commit").increment(1);
            warn!(error = %e, "offset commit failed");
        }
    }
}

/// How often the loop tells the sweeper which partitions lag (`Loop::give_holds`).
const HOLDS_EVERY: Duration = Duration::from_secs(5);

/// How long a partition rests after a rewind before it is read again (`Loop::rewind`).
const REWIND_PAUSE: Duration = Duration::from_millis(300);

const SEEK_TIMEOUT: Duration = Duration::from_secs(10);

/// How a member ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Everything read was flushed and committed.
    Drained,
    /// The drain timeout passed first; nothing unflushed was committed, and the next
    /// owner re-reads the open batches.
    DrainTimedOut,
}

/// Everything a member needs that is built before the loop starts.
pub struct Member {
    pub settings: Settings,
    pub health: Arc<Health>,
}

impl Member {
    /// Connects, checks the stored batch size and the setup, joins the group and runs the
    /// loop until `shutdown`; then flushes, commits and leaves within the drain timeout.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Exit, PipelineError> {
        let s = &self.settings;
        let sink = Sink::new(&s.clickhouse);
        // Start-up steps wait out transient failures (services still coming up, a cluster
        // failing over). Stopped meanwhile, the member has joined no group and read
        // nothing, so the stop owes nothing: exit 0.
        let started = async {
            let (ch, backoff) = (&sink, s.pipeline.max_backoff);
            until_done("reaching ClickHouse", backoff, &shutdown, || async { Ok(ch.ping().await?) }).await?;
            until_done("registering pipeline.batch_offsets", backoff, &shutdown, || async {
                Ok(ch.register_batch_offsets(&s.kafka.topic, s.pipeline.batch_offsets).await?)
            })
            .await?;
            until_done("checking the topic against the stored batches", backoff, &shutdown, || {
                check_topic_not_recreated(s, ch)
            })
            .await?;
            let rules =
                until_done("checking the recorded dedup settings", backoff, &shutdown, || check_recorded_rules(s, ch))
                    .await?;
            self.health.set_clickhouse(true);
            check_topic_config(s).await?;
            let mut cache = crate::cache::SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic)?;
            wait_for_redis(&mut cache, s.pipeline.max_backoff, &shutdown).await?;
            Ok::<_, PipelineError>((cache, rules))
        }
        .await;
        let (cache, rules) = match started {
            Err(PipelineError::ShutDown(what)) => {
                info!(%what, "shut down before joining the group; nothing was read");
                return Ok(Exit::Drained);
            }
            started => started?,
        };
        let sweeper = CancellationToken::new();
        tokio::spawn(crate::cache::sweeper::sweep_forever(
            cache.handle(),
            s.dedup_window(),
            s.dedup.max_record_lag,
            sweeper.clone(),
        ));
        let dead_letters = if s.dead_letter.enabled {
            let topic = s.dead_letter_topic();
            source::ensure_topic(&s.kafka, &topic, 1).await?;
            Some(DeadLetters::new(&s.kafka, topic, "run")?)
        } else {
            None
        };

        // The flusher commits through the consumer, which is built after it: a weak
        // reference, so that dropping the consumer (leaving the group) is not delayed.
        let consumer_cell: Arc<OnceLock<Weak<StreamConsumer<GroupContext>>>> = Arc::new(OnceLock::new());
        let fatal = FatalSignal::default();
        let flusher = Arc::new(Flusher::start(FlusherConfig {
            sink: sink.clone(),
            topic: s.kafka.topic.clone(),
            writer: Writer::Member,
            committer: Some(committer(consumer_cell.clone(), s.kafka.topic.clone())),
            dead_letters,
            cache: Some(cache.handle()),
            health: self.health.clone(),
            max_backoff: s.pipeline.max_backoff,
            fatal: fatal.clone(),
        }));
        let (claimer, verdicts) = Claimer::start(cache.handle(), s.pipeline.max_backoff, self.health.clone());
        let stages = Arc::new(Mutex::new(Stages::new(StagesConfig::from_settings(s), self.health.clone())));
        let planner = Arc::new(Mutex::new(Planner::new(
            &s.kafka.topic,
            sink,
            Some(cache),
            s.batch_offsets(),
            s.rules().window(),
            s.dedup.max_record_lag,
            Some(rules),
        )));
        let paused = Arc::new(AtomicBool::new(false));
        let context = GroupContext {
            stages: stages.clone(),
            planner: planner.clone(),
            flusher: flusher.clone(),
            topic: s.kafka.topic.clone(),
            runtime: Handle::current(),
            fatal: fatal.clone(),
            shutdown: shutdown.clone(),
            max_backoff: s.pipeline.max_backoff,
            drain_timeout: s.pipeline.drain_timeout,
            paused: paused.clone(),
            lost_in_plan: std::sync::Mutex::new(None),
        };
        let consumer: Arc<StreamConsumer<GroupContext>> =
            Arc::new(source::group_consumer_config(&s.kafka).create_with_context(context)?);
        let _ = consumer_cell.set(Arc::downgrade(&consumer));
        consumer.subscribe(&[s.kafka.topic.as_str()])?;
        info!(topic = %s.kafka.topic, group = %s.kafka.group, batch_offsets = s.pipeline.batch_offsets, "member started");

        let parts = Loop {
            consumer: &consumer,
            stages: &stages,
            planner: &planner,
            flusher: &flusher,
            claimer,
            verdicts,
            health: &self.health,
            paused: &paused,
            holds: BTreeMap::new(),
            rewound: BTreeMap::new(),
            max_backoff: s.pipeline.max_backoff,
            shutdown: &shutdown,
            log_waits: RateLimiter::new(Duration::from_secs(5)),
            topic: &s.kafka.topic,
        };
        let exit = match parts.run(s, &shutdown, &fatal).await {
            Ok(()) => drain(&stages, &flusher, s.pipeline.drain_timeout).await,
            Err(e) => {
                // Fatal: do not write or commit anything more on the way out.
                flusher.abandon();
                Err(e)
            }
        };
        // Dropping the consumer leaves the group; the revoke callback runs in here.
        drop(consumer);
        sweeper.cancel();
        let totals = stages.lock().await.totals;
        info!(?totals, rows_flushed = flusher.rows_flushed(), "member stopped");
        exit
    }
}

/// Commits `offsets` through the group consumer, once it exists and while it does.
fn committer(cell: Arc<OnceLock<Weak<StreamConsumer<GroupContext>>>>, topic: String) -> Committer {
    Box::new(move |offsets: &BTreeMap<i32, i64>, mode: CommitMode| {
        let Some(consumer) = cell.get().and_then(Weak::upgrade) else { return Ok(()) };
        let mut tpl = TopicPartitionList::new();
        for (&p, &offset) in offsets {
            tpl.add_partition_offset(&topic, p, Offset::Offset(offset))?;
        }
        consumer.commit(&tpl, mode)
    })
}

/// The loop and what it drives.
struct Loop<'a> {
    consumer: &'a StreamConsumer<GroupContext>,
    stages: &'a Mutex<Stages>,
    planner: &'a Mutex<Planner>,
    flusher: &'a Flusher,
    claimer: Claimer,
    verdicts: Verdicts,
    health: &'a Health,
    /// Shared with the rebalance callbacks (`GroupContext::paused`).
    paused: &'a AtomicBool,
    /// The holds last given to the sweeper (`Stages::holds`).
    holds: BTreeMap<i32, Option<crate::dedup::Secs>>,
    /// Partitions paused after a rewind, and when they resume (`Loop::rewind`).
    rewound: BTreeMap<i32, Instant>,
    max_backoff: Duration,
    shutdown: &'a CancellationToken,
    log_waits: RateLimiter,
    topic: &'a str,
}

impl Loop<'_> {
    async fn run(
        mut self,
        s: &Settings,
        shutdown: &CancellationToken,
        fatal: &FatalSignal,
    ) -> Result<(), PipelineError> {
        let max_unflushed = s.pipeline.max_unflushed_buckets;
        let mut chunks = self.consumer.stream().ready_chunks(s.pipeline.max_poll_records);
        let mut ticker = tokio::time::interval(s.pipeline.flush_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Poll batches whose claims are in Redis, oldest first; their verdicts come back
        // in this order. Two at most: one being decided while the next is decoded.
        let mut in_flight: VecDeque<Prepared> = VecDeque::new();
        let kafka_log = RateLimiter::new(Duration::from_secs(5));
        let decoder = crate::source::Decoder::new(&s.validation, &s.dedup.fingerprint_key);
        // Set when a claim found the dedup cache lost: no more batches are read until
        // those in flight are answered, then every partition starts over.
        let mut lost: Option<Lost> = None;
        let mut last_holds = Instant::now();

        loop {
            if let Some(l) = self.consumer.context().lost_in_plan.lock().expect("not poisoned").take() {
                lost.get_or_insert(l);
            }
            if in_flight.is_empty() {
                if let Some(l) = lost.take() {
                    self.start_over(&l, s.pipeline.max_backoff, shutdown).await?;
                }
            }
            let paused = self.backpressure(max_unflushed).await?;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                message = fatal.raised() => return Err(PipelineError::Fatal(message)),
                answer = self.verdicts.recv(), if !in_flight.is_empty() => {
                    let prepared = in_flight.pop_front().expect("checked");
                    metrics::gauge!(t::RECORDS_AWAITING_CLAIMS).decrement(prepared.len() as f64);
                    match answer.ok_or_else(|| PipelineError::Fatal("the claim task stopped".into()))? {
                        Ok(verdicts) if lost.is_none() => {
                            if let Some(l) = self.apply(prepared, verdicts).await? {
                                lost = Some(l);
                            }
                        }
                        // After a loss, every batch is read again once the member started over.
                        Ok(_) => {}
                        Err(DedupError::Lost(l)) => {
                            lost.get_or_insert(l);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                // Always armed: besides cutting flushes, the tick re-checks backpressure
                // while consumption is paused and nothing else wakes the loop.
                _ = ticker.tick() => {
                    if self.flusher.has_room() {
                        let job = self.stages.lock().await.cut(CommitMode::Async);
                        self.flusher.send(job).await;
                    }
                    if in_flight.is_empty() && lost.is_none() {
                        // An idle member asks the cache too whether it still holds what the
                        // member relies on: a loss must be noticed (and this member's
                        // partitions rebuilt) even where no click arrives.
                        self.claimer.claim(Default::default());
                        in_flight.push_back(Prepared::empty());
                    }
                    self.resume_rewound()?;
                    if last_holds.elapsed() >= HOLDS_EVERY {
                        last_holds = Instant::now();
                        self.give_holds().await;
                    }
                }
                // Polled even with two batches in flight while paused: polling keeps the
                // member in the group and serves rebalances through a long outage, and
                // little arrives once consumption is paused.
                chunk = chunks.next(), if (in_flight.len() < 2 || paused) && lost.is_none() => {
                    let Some(chunk) = chunk else { return Ok(()) };
                    let mut records = Vec::with_capacity(chunk.len());
                    for message in chunk {
                        match message {
                            Ok(msg) => records.push(Record::decode(&msg, &decoder)),
                            Err(e) => {
                                metrics::counter!(t::KAFKA_ERRORS, "op" => "consume").increment(1);
                                if source::is_fatal_kafka(e.rdkafka_error_code()) {
                                    fatal.raise(format!("Kafka refused this member: {e}; check the kafka security settings"));
                                }
                                if kafka_log.allow("consume", Instant::now()).is_some() {
                                    warn!(error = %e, "kafka consume error");
                                }
                            }
                        }
                    }
                    let mut prepared = {
                        let mut st = self.stages.lock().await;
                        let mut planner = self.planner.lock().await;
                        planner.ensure_pins(&mut st, &records, shutdown, s.pipeline.max_backoff).await?;
                        drop(planner);
                        st.prepare(records)
                    };
                    // Every batch goes through the claim task, claims or not, so that
                    // the verdicts come back in batch order.
                    self.claimer.claim(prepared.take_claims());
                    metrics::gauge!(t::RECORDS_AWAITING_CLAIMS).increment(prepared.len() as f64);
                    in_flight.push_back(prepared);
                }
            }
        }
    }

    /// After a claim found the dedup cache lost: moves to a new namespace (or the one
    /// another member already moved to), fences the flusher (flushes cut so far commit
    /// nothing) and starts every partition over from its committed offset, rebuilding
    /// its state in the new namespace.
    async fn start_over(
        &mut self,
        lost: &Lost,
        max_backoff: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), PipelineError> {
        warn!(%lost, "the dedup cache lost what this member relied on; rebuilding every partition's state from the log");
        self.health.set_claims_failing(Some(crate::health::RedisTrouble::Rebuilding));
        self.flusher.fence();
        let mut retry = Retry::new(max_backoff, shutdown);
        loop {
            let attempt = async {
                let mut st = self.stages.lock().await;
                let mut planner = self.planner.lock().await;
                let recovery = planner.cache().recover(lost).await?;
                if let Recovery::Renewed(namespace) = &recovery {
                    info!(%namespace, "dedup cache namespace");
                }
                planner.start_over(self.consumer, &mut st).await?;
                self.flusher.set_owned(st.partitions());
                Ok::<_, PipelineError>(())
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) => retry
                    .after(e, |e| warn!(error = %e, "starting over after the dedup cache was lost failed; retrying"))
                    .await
                    .map_err(|stopped| stopped_while(stopped, "rebuilding the dedup cache"))?,
            }
        }
    }

    /// Tells the sweeper which partitions lag far enough behind to need old sightings
    /// (`Stages::holds`), when that changed.
    async fn give_holds(&mut self) {
        let st = self.stages.lock().await;
        let (consumer, topic) = (self.consumer, self.topic);
        let holds =
            st.holds(|p, last| source::cached_high_watermark(consumer, topic, p).is_some_and(|high| high > last + 1));
        if holds == self.holds {
            return;
        }
        drop(st);
        match self.planner.lock().await.cache().set_holds(&holds).await {
            Ok(()) => {
                let lagging: Vec<i32> = holds.iter().filter(|(_, h)| h.is_some()).map(|(&p, _)| p).collect();
                metrics::gauge!(t::DEDUP_HELD_PARTITIONS).set(lagging.len() as f64);
                if !lagging.is_empty() {
                    info!(
                        ?lagging,
                        "partitions lag the wall clock: the dedup cache keeps the sightings they still need"
                    );
                }
                self.holds = holds;
            }
            Err(e) => warn!(error = %e, "could not tell the dedup cache's sweeper which partitions lag; retrying"),
        }
    }

    /// Applies one batch's verdicts; falls back partitions the cache cannot decide, and
    /// hands a flush over when a batch completed.
    /// Returns what was found lost, when a fall-back found the cache gone.
    async fn apply(
        &mut self,
        prepared: Prepared,
        verdicts: Vec<crate::dedup::Verdict>,
    ) -> Result<Option<Lost>, PipelineError> {
        let mut st = self.stages.lock().await;
        let applied = st.apply(prepared, verdicts);
        drop(st);
        for (p, why) in applied.fall_backs {
            // Transient trouble (a broker restarting, ClickHouse or Redis away) is waited
            // out; the fall-back changes nothing until every look-up succeeded.
            let mut retry = Retry::new(self.max_backoff, self.shutdown);
            loop {
                let attempt = {
                    let mut st = self.stages.lock().await;
                    self.planner.lock().await.fall_back(self.consumer, &mut st, p, why).await
                };
                match attempt {
                    Ok(()) => break,
                    Err(PipelineError::Dedup(DedupError::Lost(l))) => return Ok(Some(l)),
                    Err(e) => retry
                        .after(e, |e| warn!(error = %e, partition = p, "re-reading a partition failed; retrying"))
                        .await
                        .map_err(|stopped| stopped_while(stopped, "re-reading a partition"))?,
                }
            }
        }
        for (p, from) in applied.rewinds {
            self.rewind(p, from).await?;
        }
        let mut st = self.stages.lock().await;
        if st.has_complete_batches() && self.flusher.has_room() {
            let job = st.cut(CommitMode::Async);
            drop(st);
            self.flusher.send(job).await;
        }
        Ok(None)
    }

    /// Reads `partition` again from `from` after a short pause: a sighting there waits
    /// until other partitions' dedup state is rebuilt from the log (their members are
    /// warming them up), and asking again at once would only spin.
    async fn rewind(&mut self, partition: i32, from: i64) -> Result<(), PipelineError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(self.topic, partition);
        // The reader was rewound already: the consumer must follow, or records would be
        // skipped. A broker that is restarting is waited out.
        let mut retry = Retry::new(self.max_backoff, self.shutdown);
        while let Err(e) = tokio::task::block_in_place(|| {
            self.consumer.seek(self.topic, partition, Offset::Offset(from), SEEK_TIMEOUT)
        }) {
            // Any seek error is worth another try: the partition is ours and assigned.
            let e = PipelineError::Kafka(e);
            let transient = |e: &PipelineError| warn!(error = %e, partition, from, "seeking back failed; retrying");
            retry.after(e, transient).await.map_err(|stopped| stopped_while(stopped, "seeking a partition back"))?;
        }
        self.consumer.pause(&tpl)?;
        if self.log_waits.allow("wait", Instant::now()).is_some() {
            info!(partition, from, "waiting for other partitions' dedup state to be rebuilt from the log");
        }
        self.rewound.insert(partition, Instant::now() + REWIND_PAUSE);
        Ok(())
    }

    /// Resumes the partitions whose pause after a rewind is over (unless the whole
    /// member is paused: backpressure resumes them with the rest).
    fn resume_rewound(&mut self) -> Result<(), PipelineError> {
        let now = Instant::now();
        let due: Vec<i32> = self.rewound.iter().filter(|(_, &at)| at <= now).map(|(&p, _)| p).collect();
        for p in due {
            self.rewound.remove(&p);
            if !self.paused.load(Ordering::Relaxed) {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(self.topic, p);
                self.consumer.resume(&tpl)?;
            }
        }
        Ok(())
    }

    /// While ClickHouse cannot take the rows, or Redis refuses claims (unreachable, out
    /// of memory, read-only), stop fetching but keep polling, so the member stays in the
    /// group and rebalances are served. Returns whether paused.
    async fn backpressure(&self, max_unflushed: usize) -> Result<bool, PipelineError> {
        let held = self.stages.lock().await.unflushed_buckets() + self.flusher.buckets_in_flight();
        let redis = self.health.claims_failing();
        let pause = held >= max_unflushed || redis.is_some();
        if pause != self.paused.load(Ordering::Relaxed) {
            // Set before pausing: a rebalance callback checks it for new partitions.
            self.paused.store(pause, Ordering::Relaxed);
            let assignment = self.consumer.assignment()?;
            if pause {
                self.consumer.pause(&assignment)?;
                match redis {
                    Some(trouble) => warn!(redis = trouble.label(), "pausing consumption until Redis accepts claims"),
                    None => warn!(unflushed_buckets = held, "pausing consumption until ClickHouse takes the backlog"),
                }
            } else {
                self.consumer.resume(&assignment)?;
                info!("resuming consumption");
            }
            metrics::gauge!(t::PAUSED).set(if pause { 1.0 } else { 0.0 });
        }
        metrics::gauge!(t::BUCKETS_HELD).set(held as f64);
        Ok(pause)
    }
}

/// Final flush and synchronous commit. Past the drain timeout, nothing more is written
/// or committed and the exit is reported as [`Exit::DrainTimedOut`].
async fn drain(stages: &Mutex<Stages>, flusher: &Flusher, timeout: Duration) -> Result<Exit, PipelineError> {
    let deadline = Instant::now() + timeout;
    let (job, last_read) = {
        let mut st = stages.lock().await;
        let last_read = st.agg.last_offsets();
        info!(unflushed_buckets = st.unflushed_buckets(), ?last_read, "draining: final flush and commit");
        (st.cut(CommitMode::Sync), last_read)
    };
    if flusher.drain(job, deadline).await {
        info!(last_read = %serde_json::to_string(&last_read).unwrap_or_default(), "drained: everything read is flushed and committed");
        Ok(Exit::Drained)
    } else {
        error!(timeout_ms = timeout.as_millis() as u64, "drain timed out; leaving without committing unflushed work");
        flusher.abandon();
        Ok(Exit::DrainTimedOut)
    }
}

/// Checks the dedup cache's eviction policy, waiting while Redis is unreachable (a
/// member may start while a Redis Cluster fails over) instead of exiting.
async fn wait_for_redis(
    cache: &mut crate::cache::SharedCache,
    max_backoff: Duration,
    shutdown: &CancellationToken,
) -> Result<(), PipelineError> {
    let mut retry = Retry::new(max_backoff, shutdown);
    loop {
        let checked = async {
            cache.check_eviction_policy().await?;
            cache.open().await.map(drop)
        };
        match checked.await {
            Ok(()) => return Ok(()),
            Err(e) => retry
                .after(e, |e| warn!(error = %e, "waiting for Redis"))
                .await
                .map_err(|stopped| stopped_while(stopped.map(PipelineError::from), "reaching Redis"))?,
        }
    }
}

/// Checks the click topic's settings against the definition of what counts: a
/// compacted topic is refused (compaction deletes earlier records with the same key, so
/// a re-read would no longer see the originals its duplicates were judged by); a
/// retention shorter than the window plus `dedup.max_record_lag`, and record
/// timestamps accepted without a bound ahead, are named in a loud warning (what they do
/// to the counts is in README, "What counts").
async fn check_topic_config(s: &Settings) -> Result<(), PipelineError> {
    // A topic that does not exist yet is created with the broker's defaults.
    let Ok(configs) = source::topic_configs(&s.kafka, &s.kafka.topic).await else { return Ok(()) };
    let topic = &s.kafka.topic;
    if let Some(policy) = configs.get("cleanup.policy").filter(|p| p.contains("compact")) {
        return Err(PipelineError::Fatal(format!(
            "kafka topic {topic} has cleanup.policy={policy}: compaction deletes the originals that decide which \
             retries are duplicates, so a re-read would count differently; set cleanup.policy=delete on the topic"
        )));
    }
    let needed = s.dedup_window() + s.dedup.max_record_lag;
    if let Some(ms) = configs.get("retention.ms").and_then(|v| v.parse::<i64>().ok()).filter(|&ms| ms >= 0) {
        if (ms as u128) < needed.as_millis() {
            warn!(
                topic = %topic,
                retention_ms = ms,
                needed_ms = needed.as_millis() as u64,
                "RETENTION SHORTER THAN THE DEDUP WINDOW: retention.ms of the click topic is shorter than \
                 dedup.window + dedup.max_record_lag; once it deletes an original, a re-read or a warm-up no \
                 longer sees it and counts a retry that followed within the window. Raise retention.ms."
            );
        }
    }
    let create_time = configs.get("message.timestamp.type").is_none_or(|t| t == "CreateTime");
    let ahead = configs.get("message.timestamp.after.max.ms").and_then(|v| v.parse::<i64>().ok());
    if create_time && ahead.is_none_or(|ms| ms > i64::from(crate::dedup::CLOCK_JUMP) * 1000) {
        warn!(
            topic = %topic,
            after_max_ms = ?ahead,
            "UNBOUNDED RECORD TIMESTAMPS: the click topic accepts producer timestamps far ahead of the broker's \
             clock (message.timestamp.after.max.ms); a single such record does not move a partition's clock, but \
             two in a row do, and every later record of the partition is then judged at that time. Set \
             message.timestamp.after.max.ms to 3600000 or less."
        );
    }
    Ok(())
}

/// Refuses to run with decision settings other than the topic's (`clickagg_settings`,
/// registering ours when none are recorded). Returns the recorded versions, for the
/// planning of each partition's start.
async fn check_recorded_rules(s: &Settings, sink: &Sink) -> Result<crate::sink::RulesHistory, PipelineError> {
    let ours = s.rules();
    // The topic's ID is checked once the group has assigned partitions (`Stages`): the
    // broker is known to answer then, and a member with bad credentials stops at once.
    let history = sink.register_rules(&s.kafka.topic, &ours, None).await?;
    let latest = history.latest().expect("registration leaves at least one version");
    let differences = ours.differences(&latest.rules);
    if !differences.is_empty() {
        let list: Vec<String> = differences
            .iter()
            .map(|(name, mine, recorded)| format!("{name} is {mine} here but {recorded} in the topic's record"))
            .collect();
        return Err(PipelineError::Fatal(format!(
            "the settings that decide which clicks count differ from those recorded for topic {} (settings \
             version {}): {}. Run every member with the recorded settings, or change them on purpose with \
             `clickagg settings change` (README, \"Changing what counts\").",
            s.kafka.topic,
            latest.version,
            list.join("; ")
        )));
    }
    Ok(history)
}

/// Refuses to write a topic whose offsets are behind the batches already stored for it:
/// the topic was deleted and recreated, and its new offsets would reuse old batch IDs.
async fn check_topic_not_recreated(s: &Settings, sink: &Sink) -> Result<(), PipelineError> {
    let stored = sink.max_batch_start(&s.kafka.topic).await?;
    if stored.is_empty() {
        return Ok(());
    }
    let k = s.kafka.clone();
    let topic = s.kafka.topic.clone();
    let marks = tokio::task::spawn_blocking(move || -> Result<Vec<(i32, i64)>, KafkaError> {
        let c = source::lookup_consumer(&k)?;
        let mut out = Vec::new();
        for p in source::partitions(&c, &topic, Duration::from_secs(10))? {
            out.push((p, c.fetch_watermarks(&topic, p, Duration::from_secs(10))?.1));
        }
        Ok(out)
    })
    .await
    .map_err(|e| PipelineError::Fatal(e.to_string()))?;
    let marks = match marks {
        Ok(m) => m,
        // The topic may not exist yet (auto-created on first produce): nothing to compare.
        Err(_) => return Ok(()),
    };
    for (p, high) in marks {
        if let Some(&start) = stored.get(&p) {
            if start > high {
                return Err(PipelineError::Fatal(format!(
                    "ClickHouse holds batch {start} of {}/{p}, but the partition's log ends at offset {high}: \
                     the topic looks deleted and recreated, and its new offsets would overwrite old batches. \
                     Write the new topic into another database (clickhouse.database) or under another topic name.",
                    s.kafka.topic
                )));
            }
        }
    }
    Ok(())
}
