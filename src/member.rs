//! One consumer-group member (`clickagg run`): the loop that drives [`Stages`].
//!
//! One loop (`select!` over shutdown, a fatal signal, the flush ticker and the next
//! poll batch) drives the stages. Rebalance callbacks from librdkafka run *inside* the
//! loop's poll of the consumer, on the same task, so they reach the same `Stages`
//! through a mutex that is never contended: on revoke they flush the partitions and
//! commit before librdkafka lets the partitions go (DESIGN.md §3: flush, then commit,
//! then release); on assign they plan where each partition starts (the batch boundary
//! at or below its committed offset, after a warm-up if the dedup cache needs one,
//! `position`) and hand librdkafka those offsets, whatever an operator reset the
//! group to.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
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

use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::dedup::Pin;
use crate::health::Health;
use crate::pipeline::{sleep_or_shutdown, Backoff, Exit, Interrupted, PipelineError, Stages, StagesConfig};
use crate::position::Start;
use crate::sink::Sink;
use crate::source::{self, Record};
use crate::telemetry::{self as t, RateLimiter};

/// The consumer context: routes librdkafka's logs, errors, statistics and rebalance
/// callbacks into the pipeline.
pub struct GroupContext {
    stages: Arc<Mutex<Stages>>,
    topic: String,
    runtime: Handle,
    /// Set when librdkafka reports an error retrying cannot fix (bad credentials): the
    /// loop stops with this message instead of retrying forever.
    fatal: FatalSignal,
    /// Ends the retries of an assignment whose start cannot be planned yet.
    shutdown: CancellationToken,
    max_backoff: Duration,
}

/// A fatal condition reported from a librdkafka callback thread to the loop.
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

impl GroupContext {
    fn with_stages<R>(&self, f: impl AsyncFnOnce(&mut Stages) -> R) -> R {
        // Callbacks run inside the loop's poll of the consumer, when the loop holds no
        // lock; flushing needs async I/O, so block this worker thread on it.
        tokio::task::block_in_place(|| {
            self.runtime.block_on(async {
                let mut stages = self.stages.lock().await;
                f(&mut stages).await
            })
        })
    }

    fn partitions_of(&self, tpl: &TopicPartitionList) -> Vec<i32> {
        tpl.elements().iter().filter(|e| e.topic() == self.topic).map(|e| e.partition()).collect()
    }

    /// Plans each partition's start, retrying while Redis, ClickHouse or the broker is
    /// unavailable (the member cannot count safely without a plan). `None` when the
    /// member is shutting down or hit a fatal error: then nothing of these partitions
    /// is processed.
    fn plan(&self, consumer: &BaseConsumer<Self>, partitions: &[i32]) -> Option<Vec<(Start, BTreeMap<i64, Pin>)>> {
        let mut backoff = Backoff::new(self.max_backoff);
        loop {
            let planned = self.with_stages(async |s| s.plan_shared_starts(consumer, partitions).await);
            match planned {
                Ok(starts) => return Some(starts),
                Err(e) if e.is_fatal() => {
                    self.fatal.raise(format!("planning the start of partitions {partitions:?}: {e}"));
                    return None;
                }
                Err(e) => {
                    warn!(error = %e, ?partitions, "cannot plan where the assigned partitions start yet; retrying");
                    let delay = backoff.next_delay();
                    let stopped = tokio::task::block_in_place(|| {
                        self.runtime.block_on(sleep_or_shutdown(delay, &self.shutdown)).is_err()
                    });
                    if stopped {
                        return None;
                    }
                }
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
        info!(?partitions, "partitions assigned");
        self.with_stages(async |s| s.assign(starts));
    }

    fn revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        let partitions = self.partitions_of(tpl);
        let lost = consumer.assignment_lost();
        metrics::counter!(t::REBALANCES, "kind" => "revoke").increment(1);
        info!(?partitions, lost, "partitions revoked");
        self.with_stages(async |s| s.revoke(consumer, &partitions, lost).await);
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

/// Everything a member needs that is built before the loop starts.
pub struct Member {
    pub settings: Settings,
    pub health: Arc<Health>,
}

impl Member {
    /// Connects, checks the stored batch size, joins the group and runs the loop until
    /// `shutdown`; then flushes, commits and leaves within the drain timeout.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Exit, PipelineError> {
        let s = &self.settings;
        let sink = Sink::new(&s.clickhouse);
        wait_for_clickhouse(&sink, s.pipeline.max_backoff, &shutdown).await?;
        sink.register_batch_offsets(&s.kafka.topic, s.pipeline.batch_offsets).await?;
        check_topic_not_recreated(s, &sink).await?;
        self.health.set_clickhouse(true);
        refuse_compacted_topic(s).await?;

        let mut cache = s.shared_cache()?;
        cache.check_eviction_policy().await?;
        tokio::spawn(crate::dedup::shared::sweep_forever(
            s.shared_cache()?,
            s.dedup_window(),
            s.dedup.max_record_lag,
            shutdown.clone(),
        ));
        let dead_letters = if s.dead_letter.enabled {
            let topic = s.dead_letter_topic();
            source::ensure_topic(&s.kafka, &topic, 1).await?;
            Some(DeadLetters::new(&s.kafka, topic, "run")?)
        } else {
            None
        };
        let stages = Arc::new(Mutex::new(Stages::new(
            StagesConfig::from_settings(s),
            cache,
            s.fingerprinter(),
            dead_letters,
            sink,
            self.health.clone(),
        )));
        let fatal = FatalSignal::default();
        let context = GroupContext {
            stages: stages.clone(),
            topic: s.kafka.topic.clone(),
            runtime: Handle::current(),
            fatal: fatal.clone(),
            shutdown: shutdown.clone(),
            max_backoff: s.pipeline.max_backoff,
        };
        let consumer: StreamConsumer<GroupContext> =
            source::group_consumer_config(&s.kafka).create_with_context(context)?;
        consumer.subscribe(&[s.kafka.topic.as_str()])?;
        info!(topic = %s.kafka.topic, group = %s.kafka.group, batch_offsets = s.pipeline.batch_offsets, "member started");

        let exit = consume(&consumer, &stages, s, &shutdown, &fatal).await;
        let exit = match exit {
            Ok(()) => drain(&consumer, &stages, s.pipeline.drain_timeout).await,
            Err(e) => {
                // Fatal: do not write or commit anything more on the way out.
                stages.lock().await.abandon();
                Err(e)
            }
        };
        // Dropping the consumer leaves the group; the revoke callback runs in here.
        drop(consumer);
        let (totals, rows_flushed) = {
            let st = stages.lock().await;
            (st.totals, st.rows_flushed)
        };
        info!(?totals, rows_flushed, "member stopped");
        exit
    }
}

async fn consume(
    consumer: &StreamConsumer<GroupContext>,
    stages: &Mutex<Stages>,
    s: &Settings,
    shutdown: &CancellationToken,
    fatal: &FatalSignal,
) -> Result<(), PipelineError> {
    let max_records = s.pipeline.max_poll_records;
    let max_unflushed = s.pipeline.max_unflushed_buckets;
    let mut stream = consumer.stream();
    let mut ticker = tokio::time::interval(s.pipeline.flush_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut paused = false;
    let kafka_log = RateLimiter::new(Duration::from_secs(5));
    let limits = stages.lock().await.limits().clone();

    loop {
        // Backpressure: while ClickHouse cannot take the rows, stop fetching but keep
        // polling, so the member stays in the group and rebalances are served.
        {
            let st = stages.lock().await;
            let over = st.unflushed_buckets() >= max_unflushed;
            if over != paused {
                let assignment = consumer.assignment()?;
                if over {
                    consumer.pause(&assignment)?;
                    warn!(
                        unflushed_buckets = st.unflushed_buckets(),
                        "pausing consumption until ClickHouse takes the backlog"
                    );
                } else {
                    consumer.resume(&assignment)?;
                    info!("resuming consumption");
                }
                paused = over;
                metrics::gauge!(t::PAUSED).set(if paused { 1.0 } else { 0.0 });
            }
        }

        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            message = fatal.raised() => return Err(PipelineError::Fatal(message)),
            _ = ticker.tick() => {
                let mut st = stages.lock().await;
                st.flush(consumer, CommitMode::Async).await?;
            }
            next = stream.next() => {
                let mut records = Vec::with_capacity(max_records);
                let mut pending = next;
                loop {
                    match pending {
                        Some(Ok(msg)) => {
                            records.push(Record::decode(&msg, &limits));
                        }
                        Some(Err(e)) => {
                            metrics::counter!(t::KAFKA_ERRORS, "op" => "consume").increment(1);
                            if source::is_fatal_kafka(e.rdkafka_error_code()) {
                                fatal.raise(format!("Kafka refused this member: {e}; check the kafka security settings"));
                            }
                            if kafka_log.allow("consume", Instant::now()).is_some() {
                                warn!(error = %e, "kafka consume error");
                            }
                            break;
                        }
                        None => break,
                    }
                    if records.len() >= max_records {
                        break;
                    }
                    match stream.next().now_or_never() {
                        Some(n) => pending = n,
                        None => break,
                    }
                }
                if records.is_empty() {
                    continue;
                }
                let mut st = stages.lock().await;
                match st.process(consumer, records, shutdown).await {
                    Ok(_) => {}
                    Err(Interrupted::Shutdown) => return Ok(()),
                    Err(Interrupted::Fatal(e)) => return Err(e),
                }
                if st.has_complete_batches() {
                    st.flush(consumer, CommitMode::Async).await?;
                }
            }
        }
    }
}

/// Final flush and synchronous commit. Past the drain timeout, nothing more is written
/// or committed and the exit is reported as [`Exit::DrainTimedOut`].
async fn drain(
    consumer: &StreamConsumer<GroupContext>,
    stages: &Mutex<Stages>,
    timeout: Duration,
) -> Result<Exit, PipelineError> {
    let deadline = Instant::now() + timeout;
    let mut st = stages.lock().await;
    let last_read = st.agg.last_offsets();
    info!(unflushed_buckets = st.unflushed_buckets(), ?last_read, "draining: final flush and commit");
    match st.flush_until(deadline, consumer, CommitMode::Sync).await {
        Ok(true) => {
            info!(last_read = %serde_json::to_string(&last_read).unwrap_or_default(), "drained: everything read is flushed and committed");
            Ok(Exit::Drained)
        }
        Ok(false) => {
            error!(
                timeout_ms = timeout.as_millis() as u64,
                "drain timed out; leaving without committing unflushed work"
            );
            st.abandon();
            Ok(Exit::DrainTimedOut)
        }
        Err(e) => {
            st.abandon();
            Err(e.into())
        }
    }
}

/// At startup ClickHouse may still be coming up: wait with backoff (a fatal error such
/// as a wrong password ends the wait at once).
async fn wait_for_clickhouse(
    sink: &Sink,
    max_backoff: Duration,
    shutdown: &CancellationToken,
) -> Result<(), PipelineError> {
    let mut backoff = Backoff::new(max_backoff);
    loop {
        match sink.ping().await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_fatal() => return Err(e.into()),
            Err(e) => {
                warn!(error = %e, "waiting for ClickHouse");
                if sleep_or_shutdown(backoff.next_delay(), shutdown).await.is_err() {
                    return Err(PipelineError::Fatal("shut down while waiting for ClickHouse".into()));
                }
            }
        }
    }
}

/// Refuses a compacted click topic: compaction deletes earlier records with the same
/// key, so a re-read would no longer see the originals its duplicates were judged by.
async fn refuse_compacted_topic(s: &Settings) -> Result<(), PipelineError> {
    match source::cleanup_policy(&s.kafka, &s.kafka.topic).await {
        Ok(Some(policy)) if policy.contains("compact") => Err(PipelineError::Fatal(format!(
            "kafka topic {} has cleanup.policy={policy}: compaction deletes the originals that decide which \
             retries are duplicates, so a re-read would count differently; set cleanup.policy=delete on the topic",
            s.kafka.topic
        ))),
        // A topic that does not exist yet is created with the broker's default policy.
        Ok(_) | Err(_) => Ok(()),
    }
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
