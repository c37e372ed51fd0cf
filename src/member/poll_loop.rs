//! The loop: one `select!` over shutdown, a fatal signal, the next batch of verdicts,
//! the flush ticker and the next poll batch; and what it does on a lost cache, a
//! fall-back, a rewind and backpressure.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::rebalance::GroupContext;
use super::Shared;
use crate::cache::{Claimer, DedupError, Lost, Recovery, Verdicts};
use crate::config::Settings;
use crate::dedup::{Secs, Verdict};
use crate::flusher::Flusher;
use crate::health::Health;
use crate::pipeline::{Prepared, Stages};
use crate::planner::{stopped_while, PipelineError, Planner};
use crate::record::{Decoder, Record};
use crate::retry::{FatalSignal, Retry};
use crate::source;
use crate::telemetry::{self as t, RateLimiter};

/// How often the loop tells the sweeper which partitions lag (`Loop::give_holds`).
pub(super) const HOLDS_EVERY: Duration = Duration::from_secs(5);
/// How often each partition's latest commit is sent again (`Loop::tick`): one offset
/// commit per member, as often as librdkafka's auto-commit would send one.
const COMMIT_AGAIN_EVERY: Duration = Duration::from_secs(5);

/// How long a partition rests after a rewind before it is read again (`Loop::rewind`).
pub(super) const REWIND_PAUSE: Duration = Duration::from_millis(300);

pub(super) const SEEK_TIMEOUT: Duration = Duration::from_secs(10);

/// The loop and what it drives.
pub(super) struct Loop<'a> {
    consumer: &'a StreamConsumer<GroupContext>,
    stages: &'a Mutex<Stages>,
    planner: &'a Mutex<Planner>,
    flusher: &'a Flusher,
    claimer: Claimer,
    verdicts: Verdicts,
    health: &'a Health,
    /// Shared with the rebalance callbacks (`GroupContext::paused`).
    paused: &'a AtomicBool,
    /// Poll batches whose claims are in Redis, oldest first; their verdicts come back
    /// in this order: `pipeline.claims_in_flight` in Redis, and one more being decoded.
    in_flight: VecDeque<Prepared>,
    /// Set when a claim found the dedup cache lost: no more batches are read until
    /// those in flight are answered, then every partition starts over.
    lost: Option<Lost>,
    /// The holds last given to the sweeper (`Stages::holds`), in the namespace in use.
    holds: BTreeMap<i32, Option<Secs>>,
    /// When the holds were last given (`Loop::give_holds`).
    last_holds: Instant,
    /// When the partitions' latest commits were last sent again (`Loop::tick`).
    last_commit_again: Instant,
    /// Cancelled once the holds of a first assignment were given: the sweeper's first
    /// walk waits for it (`sweeper::sweep_forever`).
    holds_given: CancellationToken,
    /// Partitions paused after a rewind, and when they resume (`Loop::rewind`).
    rewound: BTreeMap<i32, Instant>,
    max_backoff: Duration,
    /// `pipeline.max_unflushed_buckets`: consumption pauses there.
    max_unflushed: usize,
    shutdown: &'a CancellationToken,
    log_waits: RateLimiter,
    log_kafka: RateLimiter,
    topic: &'a str,
}

impl<'a> Loop<'a> {
    /// The loop of a member of `s`'s group over `consumer`, which drives `shared` and
    /// hands its claims to the claim task (`claims`: its handle and its verdicts).
    pub(super) fn new(
        s: &'a Settings,
        shared: &'a Shared,
        consumer: &'a StreamConsumer<GroupContext>,
        claims: (Claimer, Verdicts),
        health: &'a Health,
        holds_given: CancellationToken,
        shutdown: &'a CancellationToken,
    ) -> Loop<'a> {
        let (claimer, verdicts) = claims;
        Loop {
            consumer,
            stages: &shared.stages,
            planner: &shared.planner,
            flusher: &shared.flusher,
            claimer,
            verdicts,
            health,
            paused: &shared.paused,
            in_flight: VecDeque::new(),
            lost: None,
            holds: BTreeMap::new(),
            last_holds: Instant::now(),
            last_commit_again: Instant::now(),
            holds_given,
            rewound: BTreeMap::new(),
            max_backoff: s.pipeline.max_backoff,
            max_unflushed: s.pipeline.max_unflushed_buckets,
            shutdown,
            log_waits: RateLimiter::new(Duration::from_secs(5)),
            log_kafka: RateLimiter::new(Duration::from_secs(5)),
            topic: &s.kafka.topic,
        }
    }

    /// Runs until shutdown (`Ok`) or a fatal error.
    pub(super) async fn run(mut self, s: &Settings, fatal: &FatalSignal) -> Result<(), PipelineError> {
        let mut chunks = self.consumer.stream().ready_chunks(s.pipeline.max_poll_records);
        let mut ticker = tokio::time::interval(s.pipeline.flush_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let max_in_flight = s.pipeline.claims_in_flight + 1;
        let decoder = crate::schema_registry::decoder(s)?;
        let shutdown = self.shutdown;
        let mut clock = t::StageClock::new("loop");
        loop {
            self.after_loss().await?;
            let paused = self.backpressure(self.max_unflushed).await?;
            clock.mark("busy");
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                message = fatal.raised() => return Err(PipelineError::Fatal(message)),
                answer = self.verdicts.recv(), if !self.in_flight.is_empty() => {
                    clock.mark("waiting_for_claims");
                    self.answered(answer).await?;
                }
                // Always armed: besides cutting flushes, the tick re-checks backpressure
                // while consumption is paused and nothing else wakes the loop.
                _ = ticker.tick() => {
                    clock.mark("waiting_for_tick");
                    self.tick().await?;
                }
                // Polled even with every batch slot in flight while paused: polling keeps the
                // member in the group and serves rebalances through a long outage, and
                // little arrives once consumption is paused.
                chunk = chunks.next(), if (self.in_flight.len() < max_in_flight || paused) && self.lost.is_none() => {
                    clock.mark("waiting_for_kafka");
                    let Some(chunk) = chunk else { return Ok(()) };
                    self.take_in(chunk, &decoder, fatal).await?;
                }
            }
        }
    }

    /// A loss that planning an assignment found is the loop's to handle; once no batch
    /// is in flight, a loss starts every partition over.
    async fn after_loss(&mut self) -> Result<(), PipelineError> {
        if let Some(l) = self.consumer.context().lost_in_plan.lock().expect("not poisoned").take() {
            self.lost.get_or_insert(l);
        }
        if self.in_flight.is_empty() {
            if let Some(l) = self.lost.take() {
                self.start_over(&l, self.max_backoff, self.shutdown).await?;
            }
        }
        Ok(())
    }

    /// The claim task answered the oldest batch in flight: its verdicts are applied,
    /// unless the cache was found lost (then every batch is read again once the member
    /// started over).
    async fn answered(&mut self, answer: Option<Result<Vec<Verdict>, DedupError>>) -> Result<(), PipelineError> {
        let prepared = self.in_flight.pop_front().expect("checked");
        metrics::gauge!(t::RECORDS_AWAITING_CLAIMS).decrement(prepared.len() as f64);
        match answer.ok_or_else(|| PipelineError::Fatal("the claim task stopped".into()))? {
            Ok(verdicts) if self.lost.is_none() => {
                if let Some(l) = self.apply(prepared, verdicts).await? {
                    self.lost = Some(l);
                }
            }
            Ok(_) => {}
            Err(DedupError::Lost(l)) => {
                self.lost.get_or_insert(l);
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// The flush ticker: cuts a flush (every `COMMIT_AGAIN_EVERY` with each partition's
    /// latest commit sent again), has an idle member ask the cache, resumes the
    /// partitions rewound long enough, and gives the sweeper its holds.
    async fn tick(&mut self) -> Result<(), PipelineError> {
        if self.flusher.has_room() {
            let mut st = self.stages.lock().await;
            if self.last_commit_again.elapsed() >= COMMIT_AGAIN_EVERY {
                self.last_commit_again = Instant::now();
                st.commit_latest_again();
            }
            let job = st.cut(CommitMode::Async);
            drop(st);
            self.flusher.send(job).await;
        }
        if self.in_flight.is_empty() && self.lost.is_none() {
            // An idle member asks the cache too whether it still holds what the
            // member relies on: a loss must be noticed (and this member's
            // partitions rebuilt) even where no click arrives.
            self.claimer.claim(Default::default());
            self.in_flight.push_back(Prepared::empty());
        }
        self.resume_rewound()?;
        // Until the first assignment's holds are given (the sweeper waits for
        // them), and whenever the partitions read changed, at once.
        if self.last_holds.elapsed() >= HOLDS_EVERY || self.holds_outdated().await {
            self.last_holds = Instant::now();
            self.give_holds().await;
        }
        Ok(())
    }

    /// A poll batch from Kafka: decoded, prepared, and its claims handed to the claim
    /// task. Nothing is taken in once the member stopped at a batch the client cannot
    /// decode.
    async fn take_in(
        &mut self,
        chunk: Vec<KafkaResult<BorrowedMessage<'_>>>,
        decoder: &Decoder,
        fatal: &FatalSignal,
    ) -> Result<(), PipelineError> {
        if self.health.undecodable() {
            return Ok(());
        }
        metrics::histogram!(t::POLL_BATCH_RECORDS).record(chunk.len() as f64);
        let records = self.decode(chunk, decoder, fatal).await?;
        let mut prepared = {
            let mut st = self.stages.lock().await;
            let mut planner = self.planner.lock().await;
            planner.ensure_pins(&mut st, &records, self.shutdown, self.max_backoff).await?;
            drop(planner);
            st.prepare(records)
        };
        // Every batch goes through the claim task, claims or not, so that
        // the verdicts come back in batch order.
        self.claimer.claim(prepared.take_claims());
        metrics::gauge!(t::RECORDS_AWAITING_CLAIMS).increment(prepared.len() as f64);
        self.in_flight.push_back(prepared);
        Ok(())
    }

    /// Decodes a poll batch. Avro and Protobuf: the schemas it names are fetched before
    /// any record is decoded (a registry outage waits here, consumption paused with it).
    /// A consume error is counted (and raises `fatal` when Kafka refuses the member);
    /// at a record batch the client cannot decode the member stops taking in records,
    /// and what came after it in this poll batch is dropped, unread.
    async fn decode(
        &self,
        chunk: Vec<KafkaResult<BorrowedMessage<'_>>>,
        decoder: &Decoder,
        fatal: &FatalSignal,
    ) -> Result<Vec<Record>, PipelineError> {
        let ids = decoder.schema_ids(chunk.iter().flatten().map(|m| m.payload()));
        let health = self.health;
        decoder.resolve(ids, self.max_backoff, self.shutdown, |ok| health.set_schema_registry(ok)).await.map_err(
            |stopped| stopped_while(stopped.map(|e| PipelineError::Fatal(e.to_string())), "fetching schemas"),
        )?;
        let mut records = Vec::with_capacity(chunk.len());
        for message in chunk {
            match message {
                Ok(msg) => records.push(source::decode(&msg, decoder)),
                Err(e) => {
                    metrics::counter!(t::KAFKA_ERRORS, "op" => "consume").increment(1);
                    if source::is_fatal_kafka(e.rdkafka_error_code()) {
                        fatal.raise(format!("Kafka refused this member: {e}; check the kafka security settings"));
                    }
                    if source::is_undecodable(e.rdkafka_error_code()) {
                        self.stop_undecodable(&e);
                        break;
                    }
                    if self.log_kafka.allow("consume", Instant::now()).is_some() {
                        warn!(error = %e, "kafka consume error");
                    }
                }
            }
        }
        Ok(records)
    }

    /// After a claim found the dedup cache lost: moves to a new namespace (or the one
    /// another member already moved to), fences the flusher (flushes cut so far are
    /// dropped unwritten), waits until the one being written is done, and starts
    /// every partition over from its committed offset, rebuilding its state in the new
    /// namespace.
    pub(super) async fn start_over(
        &mut self,
        lost: &Lost,
        max_backoff: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), PipelineError> {
        warn!(%lost, "the dedup cache lost what this member relied on; rebuilding every partition's state from the log");
        self.health.set_claims_failing(Some(crate::readiness::RedisTrouble::Rebuilding));
        self.flusher.fence();
        // A flush being written may still write its pins: planning loads the pins, and one
        // written after it would contradict a decision made again in the new namespace.
        tokio::select! {
            _ = shutdown.cancelled() => return Err(PipelineError::ShutDown("writing the flushes cut before the loss".into())),
            _ = self.flusher.settle() => {}
        }
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
                Ok(()) => {
                    // The holds live in the namespace: given in the old one, they are not in
                    // the new one, which the sweeper walks from now on. Given again at once,
                    // before the warm-ups claim anything in it.
                    self.holds.clear();
                    self.give_holds().await;
                    return Ok(());
                }
                Err(e) => retry
                    .after(e, |e| warn!(error = %e, "starting over after the dedup cache was lost failed; retrying"))
                    .await
                    .map_err(|stopped| stopped_while(stopped, "rebuilding the dedup cache"))?,
            }
        }
    }

    /// Whether the holds given so far are not those of the partitions read now (a first
    /// assignment, a rebalance), or none were given yet for an assignment.
    async fn holds_outdated(&self) -> bool {
        let st = self.stages.lock().await;
        let mut partitions: Vec<i32> = st.partitions().collect();
        partitions.sort_unstable();
        (!self.holds_given.is_cancelled() && !partitions.is_empty()) || !partitions.iter().eq(self.holds.keys())
    }

    /// Tells the sweeper which partitions lag far enough behind to need old sightings
    /// (`Stages::holds`), when that changed; the first holds of an assignment let the
    /// sweeper start.
    pub(super) async fn give_holds(&mut self) {
        let st = self.stages.lock().await;
        let (consumer, topic) = (self.consumer, self.topic);
        // A partition whose log end the consumer has not heard yet (its first fetch is
        // still on its way) is behind: releasing its hold then let another member's
        // sweeper delete the sightings it was about to judge copies against.
        let holds =
            st.holds(|p, last| source::cached_high_watermark(consumer, topic, p).is_none_or(|high| high > last + 1));
        if holds == self.holds && (self.holds_given.is_cancelled() || holds.is_empty()) {
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
                if !holds.is_empty() {
                    self.holds_given.cancel();
                }
                self.holds = holds;
            }
            Err(e) => warn!(error = %e, "could not tell the dedup cache's sweeper which partitions lag; retrying"),
        }
    }

    /// Applies one batch's verdicts; falls back partitions the cache cannot decide, and
    /// hands a flush over when a batch completed.
    /// Returns what was found lost, when a fall-back found the cache gone.
    pub(super) async fn apply(
        &mut self,
        prepared: Prepared,
        verdicts: Vec<Verdict>,
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
        // Flushes are cut by the ticker, one per `pipeline.flush_interval` for all
        // partitions (one insert per table), whatever the batches do; only a backlog
        // half-way to the pause threshold cuts one early, so memory stays bounded.
        let mut st = self.stages.lock().await;
        if st.unflushed_buckets() >= self.max_unflushed / 2 && self.flusher.has_room() {
            let job = st.cut(CommitMode::Async);
            drop(st);
            self.flusher.send(job).await;
        }
        Ok(None)
    }

    /// Reads `partition` again from `from` after a short pause: a sighting there waits
    /// until other partitions' dedup state is rebuilt from the log (their members are
    /// warming them up), and asking again at once would only spin.
    pub(super) async fn rewind(&mut self, partition: i32, from: i64) -> Result<(), PipelineError> {
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
    pub(super) fn resume_rewound(&mut self) -> Result<(), PipelineError> {
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

    /// A record batch the client cannot decode: librdkafka skips it, and its error does
    /// not say which partition it was in, so the member stops taking in records for
    /// good (until a restart) rather than count on past it and lose its clicks. What was
    /// taken in before it is still flushed and committed; the member stays in the group,
    /// not ready, so that an operator sees it (`clickagg_consumption_stopped`, the alert
    /// ClickaggConsumptionStopped) and fixes the client or the topic.
    fn stop_undecodable(&self, e: &rdkafka::error::KafkaError) {
        metrics::counter!(t::UNDECODABLE_BATCHES).increment(1);
        if !self.health.undecodable() {
            tracing::error!(error = %e, "the Kafka client cannot decode a record batch: consumption stops here, and \
                 nothing read after it is counted or committed; a member built with every codec, or a repaired \
                 topic, reads on from the last commit");
        }
        self.health.set_undecodable();
        metrics::gauge!(t::CONSUMPTION_STOPPED).set(1.0);
    }

    /// While ClickHouse cannot take the rows, or Redis refuses claims (unreachable, out
    /// of memory, read-only), stop fetching but keep polling, so the member stays in the
    /// group and rebalances are served. Returns whether paused.
    pub(super) async fn backpressure(&self, max_unflushed: usize) -> Result<bool, PipelineError> {
        let held = self.stages.lock().await.unflushed_buckets() + self.flusher.buckets_in_flight();
        let redis = self.health.claims_failing();
        let stopped = self.health.undecodable();
        let pause = held >= max_unflushed || redis.is_some() || stopped;
        if pause != self.paused.load(Ordering::Relaxed) {
            // Set before pausing: a rebalance callback checks it for new partitions.
            self.paused.store(pause, Ordering::Relaxed);
            let assignment = self.consumer.assignment()?;
            if pause {
                self.consumer.pause(&assignment)?;
                match redis {
                    _ if stopped => warn!("pausing consumption for good: a record batch cannot be decoded"),
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
