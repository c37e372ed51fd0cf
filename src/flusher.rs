//! The flusher: the one task that makes flushes durable, and the one owner of commits.
//!
//! Flushes arrive in order on a bounded channel. Each is written completely — its dead
//! letters acknowledged, its pins, then its rows and their hour markers (each write only
//! while the dedup cache still holds the namespace its decisions were made in) — and only then are
//! the offsets it allows committed, and only then does the next flush start: a later
//! flush's commits assume the earlier rows are durable (docs/DESIGN.md §8). Meanwhile the
//! member goes on reading and deciding. When the channel is full the member waits to
//! hand over its next flush, its unflushed state grows, and at
//! `pipeline.max_unflushed_buckets` it pauses consumption.
//!
//! A revoke or a shutdown drains the flusher ([`Flusher::drain`]) before the partitions
//! are released. Transient failures (ClickHouse down, the dead-letter topic's broker
//! restarting) are retried with backoff, holding back every later flush; a fatal one
//! ends the task and stops the member.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::CommitMode;
use rdkafka::error::KafkaError;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info_span, warn, Instrument};

use crate::cache::{DedupError, SharedCache};
use crate::dead_letter::DeadLetters;
use crate::health::Health;
pub use crate::pipeline::Job;
use crate::record::Record;
use crate::retry::{FatalSignal, Retry, Retryable, Stopped};
use crate::sink::{Sink, SinkError, Writer};
use crate::telemetry::{self as t, RateLimiter};

/// Sends the commits a durable flush allows (the group consumer's `commit`).
pub type Committer = Box<dyn Fn(&BTreeMap<i32, i64>, CommitMode) -> Result<(), CommitError> + Send + Sync>;

/// Why the commits of a durable flush were not sent. Harmless for correctness either
/// way: the next commit covers them, or the next owner re-reads the batch.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The consumer that commits for the group is gone (the member left the group).
    #[error("no group consumer to commit through: the member left the group")]
    NoConsumer,
}

enum Message {
    /// A job, with the fence it was handed over under.
    Job(Box<Job>, u64),
    /// Answered once every job before it is durable and committed.
    Barrier(oneshot::Sender<()>),
}

/// What the flusher task needs.
pub struct FlusherConfig {
    pub sink: Sink,
    pub topic: String,
    pub writer: Writer,
    /// `None` for a replay: it owns no group offsets.
    pub committer: Option<Committer>,
    pub dead_letters: Option<DeadLetters>,
    /// Trims the cross-partition decisions a durable flush recorded from the cache.
    pub cache: Option<SharedCache>,
    pub health: Arc<Health>,
    pub max_backoff: Duration,
    pub fatal: FatalSignal,
}

/// The member's handle on the flusher task.
pub struct Flusher {
    tx: mpsc::Sender<Message>,
    shared: Arc<Shared>,
}

struct Shared {
    /// Minute buckets handed over and not durable yet.
    buckets: AtomicUsize,
    /// Partitions whose commits may still be sent (ours). A job cut before a partition
    /// was lost must not commit it.
    owned: Mutex<BTreeSet<i32>>,
    /// Set when the drain timed out: nothing more is written or committed.
    abandon: tokio_util::sync::CancellationToken,
    /// Bumped by [`Flusher::fence`]: a job handed over before is dropped unwritten (one
    /// already being written commits nothing).
    fence: AtomicU64,
    rows_flushed: AtomicUsize,
}

impl Flusher {
    /// Starts the task; it runs until the handle is dropped (or a fatal error).
    pub fn start(config: FlusherConfig) -> Flusher {
        // Two flushes in the queue: enough to overlap the next insert with reading,
        // few enough that a ClickHouse outage stops the member early (backpressure).
        let (tx, rx) = mpsc::channel(2);
        let shared = Arc::new(Shared {
            buckets: AtomicUsize::new(0),
            owned: Mutex::new(BTreeSet::new()),
            abandon: tokio_util::sync::CancellationToken::new(),
            fence: AtomicU64::new(0),
            rows_flushed: AtomicUsize::new(0),
        });
        tokio::spawn(run(config, rx, shared.clone()));
        Flusher { tx, shared }
    }

    /// Whether a flush handed over now would be queued at once. The loop cuts a flush
    /// only then: while ClickHouse is down the state stays in the aggregator, where it
    /// counts towards pausing consumption, and the loop keeps serving the group.
    pub fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }

    /// Hands a flush over, waiting while the queue is full.
    pub async fn send(&self, job: Job) {
        if job.flush.is_empty() && job.dead_letters.is_empty() && job.clocks.is_empty() {
            return;
        }
        self.shared.buckets.fetch_add(job.buckets, Ordering::Relaxed);
        let fence = self.shared.fence.load(Ordering::Relaxed);
        // The task only ends with the member (or fatally, which the member sees).
        let _ = self.tx.send(Message::Job(Box::new(job), fence)).await;
    }

    /// Hands the last flush over and waits until everything handed over is durable and
    /// committed; `false` when the deadline passed first.
    pub async fn drain(&self, last: Job, deadline: Instant) -> bool {
        let (tx, rx) = oneshot::channel();
        let wait = async {
            self.send(last).await;
            self.tx.send(Message::Barrier(tx)).await.is_ok() && rx.await.is_ok()
        };
        tokio::time::timeout_at(deadline.into(), wait).await.unwrap_or(false)
    }

    /// Jobs handed over so far are not written and commit nothing: their decisions were
    /// made in a dedup cache that has since been lost, and their partitions start over
    /// from the committed offsets.
    pub fn fence(&self) {
        self.shared.fence.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until every job handed over so far is written, dropped (fenced) or
    /// abandoned. A member that starts over waits for it before it loads the recorded
    /// pins again: a job still being written may write its pins.
    pub async fn settle(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Message::Barrier(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Nothing more is written or committed (the drain timed out, or a fatal error).
    pub fn abandon(&self) {
        self.shared.abandon.cancel();
    }

    /// Minute buckets handed over and not durable yet.
    pub fn buckets_in_flight(&self) -> usize {
        self.shared.buckets.load(Ordering::Relaxed)
    }

    pub fn rows_flushed(&self) -> u64 {
        self.shared.rows_flushed.load(Ordering::Relaxed) as u64
    }

    /// The partitions whose commits may be sent.
    pub fn set_owned(&self, partitions: impl IntoIterator<Item = i32>) {
        *self.shared.owned.lock().expect("not poisoned") = partitions.into_iter().collect();
    }
}

async fn run(mut c: FlusherConfig, mut rx: mpsc::Receiver<Message>, shared: Arc<Shared>) {
    let log_limit = RateLimiter::new(Duration::from_secs(5));
    let mut clock = t::StageClock::new("flusher");
    while let Some(message) = rx.recv().await {
        clock.mark("idle");
        let job = match message {
            Message::Barrier(done) => {
                let _ = done.send(());
                continue;
            }
            Message::Job(job, fence) => (job, fence),
        };
        let (job, fence) = job;
        let fenced = || fence != shared.fence.load(Ordering::Relaxed);
        if shared.abandon.is_cancelled() {
            shared.buckets.fetch_sub(job.buckets, Ordering::Relaxed);
            continue;
        }
        if fenced() {
            // Decided in a cache lost since: its partitions are read again from the
            // committed offsets, and another member may be deciding them already.
            drop_fenced("the member noticed the dedup cache was lost after this flush was cut");
            shared.buckets.fetch_sub(job.buckets, Ordering::Relaxed);
            continue;
        }
        match write(&mut c, &job, &shared, &log_limit).await {
            Ok(Written::Durable) if !fenced() => commit(&mut c, &job, &shared).await,
            Ok(Written::Durable) => debug!("a job cut before the dedup cache was lost: written, nothing committed"),
            Ok(Written::Fenced) => {
                drop_fenced("the dedup cache no longer holds the namespace this flush was decided in")
            }
            Ok(Written::Abandoned) => {} // not durable, nothing is committed
            Err(e) => {
                shared.abandon.cancel();
                c.fatal.raise(e);
            }
        }
        shared.buckets.fetch_sub(job.buckets, Ordering::Relaxed);
        clock.mark("busy");
    }
}

/// What became of a job.
enum Written {
    /// Its dead letters, pins, clocks and rows are durable.
    Durable,
    /// Shut down (or abandoned) first: not durable.
    Abandoned,
    /// Not written: its decisions were made in a dedup cache that is gone.
    Fenced,
}

fn drop_fenced(why: &str) {
    metrics::counter!(t::FENCED_FLUSHES).increment(1);
    warn!(why, "a flush decided in a lost dedup cache is dropped, not written; its partitions are counted again");
}

/// Makes one job durable, retrying transient failures.
///
/// Before its pins and again before its rows, the member checks that the cache still
/// holds the namespace the job was decided in. A member frozen past its session (a
/// stalled process, a paused VM) while the cache was lost wakes with flushes of
/// decisions nobody else knows; the member that took its partitions over decided them
/// again in a new namespace, and those rows or pins, written after its own, would outrank
/// or contradict them (counted twice, or lost). What remains is a freeze between a check
/// and the insert after it (guide, "Known limits").
async fn write(c: &mut FlusherConfig, job: &Job, shared: &Shared, log_limit: &RateLimiter) -> Result<Written, String> {
    let f = &job.flush;
    let span = info_span!("flush", rows = f.rows.len(), pins = f.pins.len(), dead_letters = job.dead_letters.len(), commits = ?f.commits);
    // An abandoned flusher (a drain that timed out) stops waiting; a shutdown alone lets
    // the queued flushes finish: that is the drain.
    let mut retry = Retry::new(c.max_backoff, &shared.abandon);
    // No retry fixes a fatal error (no WRITE on the topic, bad credentials, a missing
    // table): stop and say what to change.
    let stopped = |s: Stopped<String>| match s {
        Stopped::Fatal(e) => Err(e),
        Stopped::ShutDown => Ok(Written::Abandoned),
    };
    async {
        if let Some(dl) = &mut c.dead_letters {
            let rejected: Vec<&Record> = job.dead_letters.iter().collect();
            loop {
                let Err(e) = dl.send(&rejected).await else { break };
                let failed = Failed { fatal: e.is_fatal(), message: e.to_string() };
                let topic = dl.topic().to_string();
                let transient = |e: &Failed| {
                    metrics::counter!(t::KAFKA_ERRORS, "op" => "dead_letter").increment(1);
                    if log_limit.allow("dead_letter", Instant::now()).is_some() {
                        warn!(error = %e, %topic, "producing dead letters failed; retrying with a new producer");
                    }
                };
                if let Err(s) = retry.after(failed, transient).await {
                    return stopped(s.map(|f| f.message));
                }
                if let Err(e) = dl.renew() {
                    warn!(error = %e, "could not create a dead-letter producer");
                }
            }
            retry.reset();
        }
        loop {
            let started = Instant::now();
            let cache = &mut c.cache;
            let result = async {
                if !still_decided_in(cache).await? {
                    return Ok(false);
                }
                c.sink.insert_pins(&c.topic, &f.pins).await?;
                c.sink.insert_clocks(&c.topic, &job.clocks).await?;
                if !f.rows.is_empty() && !still_decided_in(cache).await? {
                    return Ok(false);
                }
                c.sink.insert(&c.topic, &f.rows, c.writer).await?;
                Ok(true)
            }
            .await;
            match result {
                Ok(false) => return Ok(Written::Fenced),
                Ok(true) => {
                    metrics::histogram!(t::FLUSH_DURATION).record(started.elapsed().as_secs_f64());
                    metrics::counter!(t::FLUSHES).increment(1);
                    metrics::counter!(t::ROWS_FLUSHED).increment(f.rows.len() as u64);
                    shared.rows_flushed.fetch_add(f.rows.len(), Ordering::Relaxed);
                    c.health.set_clickhouse(true);
                    debug!(elapsed_ms = started.elapsed().as_millis() as u64, "flushed");
                    return Ok(Written::Durable);
                }
                Err(e) => {
                    let health = &c.health;
                    let transient = |e: &StepError| {
                        match e {
                            StepError::Sink(_) => {
                                health.set_clickhouse(false);
                                metrics::counter!(t::CLICKHOUSE_ERRORS).increment(1);
                                metrics::counter!(t::CLICKHOUSE_RETRIES).increment(1);
                            }
                            StepError::Cache(DedupError::Transient { trouble, .. }) => {
                                metrics::counter!(t::REDIS_ERRORS, "kind" => trouble.label()).increment(1)
                            }
                            StepError::Cache(_) => {}
                        }
                        if log_limit.allow("flush", Instant::now()).is_some() {
                            warn!(error = %e, "flush failed; keeping the rows and retrying");
                        }
                    };
                    if let Err(s) = retry.after(e, transient).await {
                        return stopped(s.map(|e| e.to_string()));
                    }
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// Whether the dedup cache still holds the namespace the member decides in (a replay,
/// with no cache, always decides in its own memory).
async fn still_decided_in(cache: &mut Option<SharedCache>) -> Result<bool, StepError> {
    match cache {
        Some(cache) => cache.holds_namespace().await.map_err(StepError::Cache),
        None => Ok(true),
    }
}

/// A failure of the ClickHouse part of a flush, or of the cache check before it.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("checking the dedup cache before a flush: {0}")]
    Cache(DedupError),
}

impl Retryable for StepError {
    fn is_fatal(&self) -> bool {
        match self {
            StepError::Sink(e) => e.is_fatal(),
            StepError::Cache(e) => matches!(e, DedupError::Fatal(_)),
        }
    }
}

/// A failure of one step of a flush, as the retry sees it.
struct Failed {
    fatal: bool,
    message: String,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Retryable for Failed {
    fn is_fatal(&self) -> bool {
        self.fatal
    }
}

/// Commits what the durable job allows, for the partitions still ours, and records how
/// fresh the counts it made visible are.
async fn commit(c: &mut FlusherConfig, job: &Job, shared: &Shared) {
    let now = chrono::Utc::now().timestamp_millis() as f64 / 1000.0;
    for (&tenth, &n) in &job.freshness {
        metrics::histogram!(t::FRESHNESS).record_many(t::age_seconds(now, tenth), n as usize);
    }
    // The partitions still ours only; commits sent before go again with this job's
    // (`Stages::commit_latest_again`), but they are no flush of theirs.
    let (flushed, again): (BTreeMap<i32, i64>, BTreeMap<i32, i64>) = {
        let owned = shared.owned.lock().expect("not poisoned");
        let ours =
            |m: &BTreeMap<i32, i64>| m.iter().filter(|(p, _)| owned.contains(p)).map(|(&p, &o)| (p, o)).collect();
        (ours(&job.flush.commits), ours(&job.again))
    };
    for p in flushed.keys() {
        metrics::gauge!(t::LAST_FLUSH, "partition" => p.to_string()).set(now);
    }
    c.health.status().flushed(flushed.keys().copied(), &job.freshness, now);
    let Some(committer) = &c.committer else { return };
    let commits: BTreeMap<i32, i64> = flushed.into_iter().chain(again).collect();
    if commits.is_empty() || shared.abandon.is_cancelled() {
        return;
    }
    match committer(&commits, job.commit_mode) {
        Ok(()) => {
            for (&p, &offset) in &commits {
                metrics::gauge!(t::COMMITTED_OFFSET, "partition" => p.to_string()).set(offset as f64);
            }
            c.health.status().committed(&commits);
            debug!(?commits, "committed");
        }
        Err(e) => {
            // Harmless for correctness: the next commit covers it, or the batch is re-read.
            metrics::counter!(t::KAFKA_ERRORS, "op" => "commit").increment(1);
            warn!(error = %e, "offset commit failed");
        }
    }
    if !job.flush.pins.is_empty() {
        if let Some(cache) = &mut c.cache {
            // The pins are durable now; their cached copies below the commits can go.
            if let Err(e) = cache.trim_cached_pins(&commits).await {
                warn!(error = %e, "could not trim cached cross-partition decisions; they are trimmed later");
            }
        }
    }
}
