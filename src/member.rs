//! One consumer-group member (`clickagg run`): the loop that drives [`Stages`].
//!
//! One loop (`select!` over shutdown, a fatal signal, the flush ticker and the next
//! poll batch) drives the stages. Rebalance callbacks from librdkafka run *inside* the
//! loop's poll of the consumer, on the same task, so they reach the same `Stages`
//! through a mutex that is never contended: on revoke they flush the partitions and
//! commit before librdkafka lets the partitions go (DESIGN.md §3: flush, then commit,
//! then release).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::statistics::Statistics;
use rdkafka::TopicPartitionList;
use tokio::runtime::Handle;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::dedup::Dedup;
use crate::health::Health;
use crate::pipeline::{sleep_or_shutdown, Backoff, Exit, Interrupted, PipelineError, Stages, StagesConfig};
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

/// Kafka errors that no retry can fix.
fn is_fatal_kafka(code: Option<rdkafka::types::RDKafkaErrorCode>) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        code,
        Some(
            C::Authentication
                | C::SaslAuthenticationFailed
                | C::TopicAuthorizationFailed
                | C::GroupAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::SSL
        )
    )
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
        if is_fatal_kafka(error.rdkafka_error_code()) {
            self.fatal.raise(format!(
                "Kafka refused this member: {error} ({reason}); check kafka.security_protocol, kafka.sasl_* and kafka.ssl_* settings"
            ));
        }
        warn!(error = %error, reason, "kafka client error");
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let partitions = self.partitions_of(tpl);
                let lost = consumer.assignment_lost();
                metrics::counter!(t::REBALANCES, "kind" => "revoke").increment(1);
                info!(?partitions, lost, "partitions revoked");
                self.with_stages(async |s| s.revoke(consumer, &partitions, lost).await);
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let partitions = self.partitions_of(tpl);
            metrics::counter!(t::REBALANCES, "kind" => "assign").increment(1);
            info!(?partitions, "partitions assigned");
            self.with_stages(async |s| s.assign(&partitions));
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

        let dedup = Dedup::new(s.redis_client()?, s.redis.key_prefix.clone(), s.redis.dedup_ttl, s.redis.timeout);
        let dead_letters = if s.dead_letter.enabled {
            let topic = s.dead_letter_topic();
            source::ensure_topic(&s.kafka, &topic, 1).await?;
            Some(DeadLetters::new(&s.kafka, topic, "run")?)
        } else {
            None
        };
        let stages = Arc::new(Mutex::new(Stages::new(
            StagesConfig::from_settings(s),
            dedup,
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
                            if is_fatal_kafka(e.rdkafka_error_code()) {
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
