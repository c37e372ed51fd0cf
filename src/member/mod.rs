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
//!
//! Files: `rebalance` (the consumer context: assign and revoke), `poll_loop` (the loop),
//! `checks` (what a member refuses to start with).

mod checks;
mod poll_loop;
mod rebalance;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::cache::sweeper::sweep_forever;
use crate::cache::{Claimer, SharedCache};
use crate::config::Settings;
use crate::dead_letter::DeadLetters;
use crate::flusher::{CommitError, Committer, Flusher, FlusherConfig};
use crate::health::Health;
use crate::pipeline::{Stages, StagesConfig};
use crate::planner::{until_done, PipelineError, Planner};
use crate::retry::FatalSignal;
use crate::sink::{RulesHistory, Sink, Writer};
use crate::source;

use checks::{check_recorded_rules, check_topic_config, check_topic_not_recreated, wait_for_redis};
use poll_loop::Loop;
use rebalance::GroupContext;

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

/// The group consumer of a member, with the rebalance callbacks in its context.
type GroupConsumer = StreamConsumer<GroupContext>;

/// What the loop and the rebalance callbacks both drive.
struct Shared {
    stages: Arc<Mutex<Stages>>,
    planner: Arc<Mutex<Planner>>,
    flusher: Arc<Flusher>,
    /// Set while the loop holds consumption paused (`GroupContext::paused`).
    paused: Arc<AtomicBool>,
}

impl Member {
    /// Connects, checks the stored batch size and the setup, joins the group and runs the
    /// loop until `shutdown`; then flushes, commits and leaves within the drain timeout.
    pub async fn run(self, shutdown: CancellationToken) -> Result<Exit, PipelineError> {
        let s = &self.settings;
        let sink = Sink::new(&s.clickhouse);
        // Stopped during start-up, the member has joined no group and read nothing, so
        // the stop owes nothing: exit 0.
        let (cache, rules) = match self.start_up(&sink, &shutdown).await {
            Err(PipelineError::ShutDown(what)) => {
                info!(%what, "shut down before joining the group; nothing was read");
                return Ok(Exit::Drained);
            }
            started => started?,
        };
        // The tasks beside the pipeline (the sweeper, the sealer) stop with the member.
        let background = CancellationToken::new();
        let holds_given = CancellationToken::new();
        let (window, max_record_lag) = (s.dedup_window(), s.dedup.max_record_lag);
        tokio::spawn(sweep_forever(cache.handle(), window, max_record_lag, holds_given.clone(), background.clone()));
        let dead_letters = self.dead_letters().await?;
        // The flusher commits through the consumer, which is built after it: a weak
        // reference, so that dropping the consumer (leaving the group) is not delayed.
        let consumer_cell: Arc<OnceLock<Weak<GroupConsumer>>> = Arc::new(OnceLock::new());
        let fatal = FatalSignal::default();
        // The sealer: one member of the group at a time (a lease), beside the pipeline.
        tokio::spawn(crate::seal::task::seal_forever(s.clone(), fatal.clone(), background.clone()));
        let committer = committer(consumer_cell.clone(), s.kafka.topic.clone());
        let flusher = Arc::new(self.start_flusher(&sink, &cache, dead_letters, committer, &fatal));
        let (max_backoff, in_flight) = (s.pipeline.max_backoff, s.pipeline.claims_in_flight);
        let claims = Claimer::start(cache.handle(), max_backoff, in_flight, self.health.clone());
        let shared = Shared {
            stages: Arc::new(Mutex::new(Stages::new(StagesConfig::from_settings(s), self.health.board()))),
            planner: Arc::new(Mutex::new(Planner::for_member(s, sink, cache, rules))),
            flusher,
            paused: Arc::new(AtomicBool::new(false)),
        };
        let consumer = join_group(s, GroupContext::new(s, &shared, &fatal, &shutdown), &consumer_cell)?;
        let parts = Loop::new(s, &shared, &consumer, claims, &self.health, holds_given, &shutdown);
        let exit = match parts.run(s, &fatal).await {
            Ok(()) => drain(&shared.stages, &shared.flusher, s.pipeline.drain_timeout).await,
            Err(e) => {
                // Fatal: do not write or commit anything more on the way out.
                shared.flusher.abandon();
                Err(e)
            }
        };
        // Dropping the consumer leaves the group; the revoke callback runs in here.
        drop(consumer);
        background.cancel();
        let totals = shared.stages.lock().await.totals;
        info!(?totals, rows_flushed = shared.flusher.rows_flushed(), "member stopped");
        exit
    }

    /// The start-up steps: ClickHouse reached, the batch size registered, the topic and
    /// the recorded dedup settings checked, Redis reached. Each waits out transient
    /// failures (services still coming up, a cluster failing over). Returns the cache
    /// and the recorded rules.
    async fn start_up(
        &self,
        sink: &Sink,
        shutdown: &CancellationToken,
    ) -> Result<(SharedCache, RulesHistory), PipelineError> {
        let s = &self.settings;
        let backoff = s.pipeline.max_backoff;
        until_done("reaching ClickHouse", backoff, shutdown, || async { Ok(sink.ping().await?) }).await?;
        until_done("registering pipeline.batch_offsets", backoff, shutdown, || async {
            Ok(sink.register_batch_offsets(&s.kafka.topic, s.pipeline.batch_offsets).await?)
        })
        .await?;
        until_done("checking the topic against the stored batches", backoff, shutdown, || {
            check_topic_not_recreated(s, sink)
        })
        .await?;
        let rules =
            until_done("checking the recorded dedup settings", backoff, shutdown, || check_recorded_rules(s, sink))
                .await?;
        self.health.set_clickhouse(true);
        check_topic_config(s).await?;
        let mut cache = SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic)?;
        wait_for_redis(&mut cache, backoff, shutdown).await?;
        Ok((cache, rules))
    }

    /// The producer of dead letters, its topic made if missing (`None` when disabled).
    async fn dead_letters(&self) -> Result<Option<DeadLetters>, PipelineError> {
        let s = &self.settings;
        if !s.dead_letter.enabled {
            return Ok(None);
        }
        let topic = s.dead_letter_topic();
        source::ensure_topic(&s.kafka, &topic, 1).await?;
        Ok(Some(DeadLetters::new(source::producer_config(&s.kafka), &s.kafka.topic, topic, "run")?))
    }

    /// The flusher task of this member: its writes, then its commits through `committer`.
    fn start_flusher(
        &self,
        sink: &Sink,
        cache: &SharedCache,
        dead_letters: Option<DeadLetters>,
        committer: Committer,
        fatal: &FatalSignal,
    ) -> Flusher {
        let s = &self.settings;
        Flusher::start(FlusherConfig {
            sink: sink.clone(),
            topic: s.kafka.topic.clone(),
            writer: Writer::Member,
            committer: Some(committer),
            dead_letters,
            cache: Some(cache.handle()),
            health: self.health.clone(),
            max_backoff: s.pipeline.max_backoff,
            fatal: fatal.clone(),
        })
    }
}

/// The group consumer with `context`, subscribed to the topic; `cell` holds it for the
/// committer from before the subscription on.
fn join_group(
    s: &Settings,
    context: GroupContext,
    cell: &OnceLock<Weak<GroupConsumer>>,
) -> Result<Arc<GroupConsumer>, PipelineError> {
    let consumer: Arc<GroupConsumer> = Arc::new(source::group_consumer_config(&s.kafka).create_with_context(context)?);
    let _ = cell.set(Arc::downgrade(&consumer));
    consumer.subscribe(&[s.kafka.topic.as_str()])?;
    info!(topic = %s.kafka.topic, group = %s.kafka.group, batch_offsets = s.pipeline.batch_offsets, "member started");
    Ok(consumer)
}

/// Commits `offsets` through the group consumer, once it exists and while it does:
/// before it is built or once it is dropped, a commit is [`CommitError::NoConsumer`].
fn committer(cell: Arc<OnceLock<Weak<GroupConsumer>>>, topic: String) -> Committer {
    Box::new(move |offsets: &BTreeMap<i32, i64>, mode: CommitMode| {
        let consumer = cell.get().and_then(Weak::upgrade).ok_or(CommitError::NoConsumer)?;
        let mut tpl = TopicPartitionList::new();
        for (&p, &offset) in offsets {
            tpl.add_partition_offset(&topic, p, Offset::Offset(offset))?;
        }
        Ok(consumer.commit(&tpl, mode)?)
    })
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
