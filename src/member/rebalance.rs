//! The consumer context: librdkafka's logs, errors and statistics, and the rebalance
//! callbacks, which run inside the loop's poll: revoke flushes and commits before the
//! partitions go; assign plans where each starts (`Planner::plan_starts`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::statistics::Statistics;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Shared;
use crate::cache::{DedupError, Lost};
use crate::config::Settings;
use crate::flusher::Flusher;
use crate::pipeline::Stages;
use crate::planner::{PipelineError, Planner};
use crate::position::Start;
use crate::retry::{FatalSignal, Retry, Stopped};
use crate::source;
use crate::telemetry::{self as t};

/// The consumer context: routes librdkafka's logs, errors, statistics and rebalance
/// callbacks into the pipeline.
pub struct GroupContext {
    pub(super) stages: Arc<Mutex<Stages>>,
    pub(super) planner: Arc<Mutex<Planner>>,
    pub(super) flusher: Arc<Flusher>,
    pub(super) topic: String,
    pub(super) runtime: Handle,
    /// Set when librdkafka reports an error retrying cannot fix (bad credentials): the
    /// loop stops with this message instead of retrying forever.
    pub(super) fatal: FatalSignal,
    /// Ends the retries of an assignment whose start cannot be planned yet.
    pub(super) shutdown: CancellationToken,
    pub(super) max_backoff: Duration,
    /// How long a revoke may wait for its flush and commit.
    pub(super) drain_timeout: Duration,
    /// Set while the loop holds consumption paused (backpressure): partitions assigned
    /// meanwhile are paused as they arrive, or they would be read without bound.
    pub(super) paused: Arc<AtomicBool>,
    /// Set when planning an assignment found the dedup cache lost: the partitions are
    /// assigned unplanned (their records are dropped) and the loop starts every assigned
    /// partition over (`Loop::start_over`), which first moves to the renewed namespace.
    pub(super) lost_in_plan: std::sync::Mutex<Option<Lost>>,
}

impl GroupContext {
    /// The context of a member of `s`'s group, reaching `shared`'s stages, planner and
    /// flusher.
    pub(super) fn new(
        s: &Settings,
        shared: &Shared,
        fatal: &FatalSignal,
        shutdown: &CancellationToken,
    ) -> GroupContext {
        GroupContext {
            stages: shared.stages.clone(),
            planner: shared.planner.clone(),
            flusher: shared.flusher.clone(),
            topic: s.kafka.topic.clone(),
            runtime: Handle::current(),
            fatal: fatal.clone(),
            shutdown: shutdown.clone(),
            max_backoff: s.pipeline.max_backoff,
            drain_timeout: s.pipeline.drain_timeout,
            paused: shared.paused.clone(),
            lost_in_plan: std::sync::Mutex::new(None),
        }
    }

    /// Runs `f` on this worker thread: callbacks run inside the loop's poll of the
    /// consumer, and flushing or planning needs async I/O.
    pub(super) fn block_on<R>(&self, f: impl std::future::Future<Output = R>) -> R {
        tokio::task::block_in_place(|| self.runtime.block_on(f))
    }

    pub(super) fn partitions_of(&self, tpl: &TopicPartitionList) -> Vec<i32> {
        tpl.elements().iter().filter(|e| e.topic() == self.topic).map(|e| e.partition()).collect()
    }

    /// Plans each partition's start, retrying while Redis, ClickHouse or the broker is
    /// unavailable (the member cannot count safely without a plan). `None` when the
    /// member is shutting down or hit a fatal error: then nothing of these partitions
    /// is processed.
    pub(super) fn plan(
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

    pub(super) fn assign(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
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
        // librdkafka keeps a partition's pause flag across a revoke and a new assignment
        // of it: a partition revoked while the loop held consumption paused (a lost
        // assignment after a long stall, which the loop's resume no longer reaches) came
        // back paused, and was never read again. So the flag is set either way.
        if self.paused.load(Ordering::Relaxed) {
            if let Err(e) = consumer.pause(tpl) {
                warn!(error = %e, "could not pause the assigned partitions");
            }
            info!(?partitions, "assigned partitions start paused, as the member is");
        } else if let Err(e) = consumer.resume(tpl) {
            warn!(error = %e, "could not resume the assigned partitions");
        }
        info!(?partitions, "partitions assigned");
        self.block_on(async {
            let mut st = self.stages.lock().await;
            st.assign(starts);
            self.flusher.set_owned(st.partitions());
        });
    }

    pub(super) fn revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
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

    /// Seldom called: the member's consumer does not serve commit results (librdkafka's
    /// COMMITFAIL log says when an asynchronous commit was refused), so the loop sends
    /// each partition's latest commit again now and then (`Stages::commit_latest_again`).
    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(e) = result {
            metrics::counter!(t::KAFKA_ERRORS, "op" => "commit").increment(1);
            warn!(error = %e, "offset commit failed");
        }
    }
}
