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
use crate::dedup::{Claim, Dedup, DedupError, Verdict};
use crate::health::Health;
use crate::sink::{Sink, SinkError};
use crate::source::Record;
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
    pub records: u64,
    pub counted: u64,
    pub redelivered: u64,
    pub duplicates: u64,
    pub invalid: u64,
    pub skipped: u64,
}

impl BatchStats {
    pub fn add(&mut self, o: &BatchStats) {
        self.records += o.records;
        self.counted += o.counted;
        self.redelivered += o.redelivered;
        self.duplicates += o.duplicates;
        self.invalid += o.invalid;
        self.skipped += o.skipped;
    }
}

/// Every stage's state. Owned by the loop, reached by rebalance callbacks.
pub struct Stages {
    topic: String,
    limits: Limits,
    pub agg: Aggregator,
    dedup: Dedup,
    dead_letters: Option<DeadLetters>,
    sink: Sink,
    /// A flush cut from the aggregator but not yet durable. Flushes land one at a time
    /// and in order: a later flush's commits assume the earlier rows are durable.
    pending: Option<Flush>,
    next_flush_attempt: Instant,
    flush_backoff: Backoff,
    max_backoff: Duration,
    drain_timeout: Duration,
    /// Partitions this member owns now. Records of other partitions (fetched before a
    /// revoke) are dropped; commits are only sent for owned partitions.
    assigned: BTreeSet<i32>,
    /// Assigned partitions whose first record has not arrived yet.
    fresh: BTreeSet<i32>,
    /// Per partition, records below this offset are skipped: their batch starts before
    /// the log start (retention removed its beginning), so a count of it would be partial.
    skip_below: HashMap<i32, i64>,
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

pub struct StagesConfig {
    pub topic: String,
    pub limits: Limits,
    pub batch_offsets: BatchOffsets,
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

impl Stages {
    pub fn new(
        cfg: StagesConfig,
        dedup: Dedup,
        dead_letters: Option<DeadLetters>,
        sink: Sink,
        health: Arc<Health>,
    ) -> Stages {
        Stages {
            topic: cfg.topic,
            limits: cfg.limits,
            agg: Aggregator::new(cfg.batch_offsets),
            dedup,
            dead_letters,
            sink,
            pending: None,
            next_flush_attempt: Instant::now(),
            flush_backoff: Backoff::new(cfg.max_backoff),
            max_backoff: cfg.max_backoff,
            drain_timeout: cfg.drain_timeout,
            assigned: BTreeSet::new(),
            fresh: BTreeSet::new(),
            skip_below: HashMap::new(),
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

    /// Partitions become ours: any state left from an earlier ownership is stale
    /// (the consumer restarts from the committed boundary), so it is dropped.
    pub fn assign(&mut self, partitions: &[i32]) {
        for &p in partitions {
            self.agg.forget(p);
            self.skip_below.remove(&p);
            self.assigned.insert(p);
            self.fresh.insert(p);
        }
        self.health.set_assigned(self.assigned.len());
        metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.assigned.len() as f64);
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
                self.assigned.remove(&p);
                self.fresh.remove(&p);
                self.skip_below.remove(&p);
            }
            self.health.set_assigned(self.assigned.len());
            metrics::gauge!(t::ASSIGNED_PARTITIONS).set(self.assigned.len() as f64);
        }
        .instrument(span)
        .await
    }

    /// Applies one poll batch: dead letters, dedup, aggregation. Returns early only on
    /// shutdown or a fatal error; transient failures are retried here with backoff.
    pub async fn process<C: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<C>,
        mut records: Vec<Record>,
        shutdown: &CancellationToken,
    ) -> Result<BatchStats, Interrupted> {
        let mut stats = BatchStats::default();
        records.retain(|r| self.assigned.contains(&r.partition));
        self.skip_partial_batches(consumer, &mut records, &mut stats);
        stats.records = records.len() as u64 + stats.skipped;

        if records.iter().any(|r| r.outcome.is_err()) {
            stats.invalid = self.route_rejected(&records, shutdown).await?;
        }

        let claims: Vec<Claim> = records
            .iter()
            .filter_map(|r| {
                r.outcome.as_ref().ok().map(|c| Claim {
                    click_id: c.click_id.as_str(),
                    partition: r.partition,
                    offset: r.offset,
                })
            })
            .collect();
        let verdicts = self.claim_with_retry(&claims, shutdown).await?;

        let mut verdicts = verdicts.into_iter();
        for r in &records {
            let counted = match &r.outcome {
                Ok(click) => match verdicts.next().expect("one verdict per valid record") {
                    Verdict::First => {
                        stats.counted += 1;
                        Some(BucketKey { ad_id: click.ad_id, minute: click.minute })
                    }
                    Verdict::Redelivered => {
                        stats.counted += 1;
                        stats.redelivered += 1;
                        Some(BucketKey { ad_id: click.ad_id, minute: click.minute })
                    }
                    Verdict::Duplicate => {
                        stats.duplicates += 1;
                        None
                    }
                },
                Err(_) => None,
            };
            self.agg.observe(r.partition, r.offset, counted);
        }

        metrics::counter!(t::RECORDS_CONSUMED).increment(stats.records);
        metrics::counter!(t::CLICKS_COUNTED).increment(stats.counted);
        metrics::counter!(t::REDELIVERIES).increment(stats.redelivered);
        metrics::counter!(t::DUPLICATES_DROPPED).increment(stats.duplicates);
        metrics::counter!(t::SKIPPED_PARTIAL_BATCH).increment(stats.skipped);
        metrics::gauge!(t::BUCKETS_HELD).set(self.unflushed_buckets() as f64);
        self.totals.add(&stats);
        Ok(stats)
    }

    /// The first record of a newly assigned partition tells whether its batch is whole
    /// in the log. If retention removed the batch's start, counting the rest would write
    /// a smaller cumulative count over the complete one; skip to the next boundary.
    fn skip_partial_batches<C: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<C>,
        records: &mut Vec<Record>,
        stats: &mut BatchStats,
    ) {
        let n = self.agg.batch_offsets();
        for r in records.iter() {
            if !self.fresh.remove(&r.partition) || n.start_of(r.offset) == r.offset {
                continue;
            }
            let low = tokio::task::block_in_place(|| {
                consumer.fetch_watermarks(&self.topic, r.partition, Duration::from_secs(10))
            });
            match low {
                Ok((low, _)) if n.start_of(r.offset) < low => {
                    let boundary = n.boundary_at_or_after(r.offset);
                    warn!(
                        partition = r.partition,
                        log_start = low,
                        first_offset = r.offset,
                        resume_at = boundary,
                        "the batch at the log start was partly removed by retention; skipping to the next batch boundary"
                    );
                    self.skip_below.insert(r.partition, boundary);
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(partition = r.partition, error = %e, "could not read the log start; assuming the batch is whole")
                }
            }
        }
        if self.skip_below.is_empty() {
            return;
        }
        records.retain(|r| match self.skip_below.get(&r.partition) {
            Some(&b) if r.offset < b => {
                stats.skipped += 1;
                false
            }
            _ => true,
        });
    }

    async fn route_rejected(&mut self, records: &[Record], shutdown: &CancellationToken) -> Result<u64, Interrupted> {
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
        claims: &[Claim<'_>],
        shutdown: &CancellationToken,
    ) -> Result<Vec<Verdict>, Interrupted> {
        let mut backoff = Backoff::new(self.max_backoff);
        loop {
            match self.dedup.claim(&self.topic, claims).await {
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
        let span = info_span!("flush", rows = pending.rows.len(), commits = ?pending.commits);
        let result = self.sink.insert(&self.topic, &pending.rows).instrument(span.clone()).await;
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
            if self.assigned.contains(&p) {
                let _ = tpl.add_partition_offset(&self.topic, p, Offset::Offset(offset));
            }
        }
        if tpl.count() == 0 {
            return;
        }
        match consumer.commit(&tpl, mode) {
            Ok(()) => {
                for (&p, &offset) in commits {
                    if self.assigned.contains(&p) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::click::Minute;
    use crate::dedup::{decide, owner_token};
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Dedup and aggregation together, against a model of Redis (a map that survives
    /// crashes) and of `ReplacingMergeTree` read with FINAL: whatever the crash points,
    /// each click ID is counted once, in the bucket of its first sighting.
    fn run_with_crashes(log: &[(u8, u64)], n: u64, crashes: &[(usize, bool)]) -> BTreeMap<BucketKey, u64> {
        let n = BatchOffsets::new(n).unwrap();
        let key = |ad: u64| BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(0) };
        let mut redis: HashMap<u8, String> = HashMap::new();
        let mut table: HashMap<(i64, BucketKey), (u64, i64)> = HashMap::new();
        let mut committed = 0usize;
        let apply = |f: &Flush, table: &mut HashMap<(i64, BucketKey), (u64, i64)>| {
            for r in &f.rows {
                let slot = table.entry((r.batch_start, r.key)).or_insert((r.clicks, r.version));
                if r.version >= slot.1 {
                    *slot = (r.clicks, r.version);
                }
            }
        };
        let member = |from: usize,
                      upto: Option<usize>,
                      flush_at_end: bool,
                      redis: &mut HashMap<u8, String>,
                      table: &mut HashMap<(i64, BucketKey), (u64, i64)>|
         -> Option<usize> {
            let mut agg = Aggregator::new(n);
            let end = upto.map_or(log.len(), |u| (from + u).min(log.len()));
            for (o, &(id, ad)) in log.iter().enumerate().take(end).skip(from) {
                let mine = owner_token("t", 0, o as i64);
                let previous = redis.get(&id).cloned();
                if previous.is_none() {
                    redis.insert(id, mine.clone());
                }
                let counted = decide(previous.as_deref().map(str::as_bytes), &mine).counts().then(|| key(ad));
                agg.observe(0, o as i64, counted);
            }
            if flush_at_end && agg.partitions().next().is_some() {
                let f = agg.take_flush();
                apply(&f, table);
                return Some(f.commits[&0] as usize);
            }
            None
        };
        for &(crash_after, flushed) in crashes {
            if let Some(c) = member(committed, Some(crash_after), flushed, &mut redis, &mut table) {
                committed = c;
            }
        }
        member(committed, None, true, &mut redis, &mut table);
        let mut billing = BTreeMap::new();
        for ((_, k), (c, _)) in table {
            *billing.entry(k).or_default() += c;
        }
        billing.retain(|_, c: &mut u64| *c > 0);
        billing
    }

    proptest! {
        #[test]
        fn each_click_id_counts_once_through_crashes_restarts_and_redeliveries(
            log in prop::collection::vec((0u8..40, 0u64..3), 1..250),
            n in 1u64..30,
            crashes in prop::collection::vec((0usize..120, any::<bool>()), 0..6),
        ) {
            let mut first: HashMap<u8, u64> = HashMap::new();
            for &(id, ad) in &log {
                first.entry(id).or_insert(ad);
            }
            let mut expected: BTreeMap<BucketKey, u64> = BTreeMap::new();
            for ad in first.values() {
                *expected.entry(BucketKey { ad_id: *ad, minute: Minute::from_epoch_seconds(0) }).or_default() += 1;
            }
            let billing = run_with_crashes(&log, n, &crashes);
            prop_assert_eq!(billing.values().sum::<u64>(), first.len() as u64, "total equals distinct clicks");
            prop_assert_eq!(billing, expected);
        }
    }

    #[test]
    fn a_plain_setnx_would_lose_the_click_of_a_crashed_member() {
        // The hazard the owner token exists for: claim, crash before the flush, re-read.
        let mine = owner_token("t", 0, 7);
        assert_eq!(decide(None, &mine), crate::dedup::Verdict::First);
        // With SETNX the re-read sees "key exists" and drops the click; with the owner
        // token it recognises its own position and counts it again.
        assert_eq!(decide(Some(mine.as_bytes()), &mine), crate::dedup::Verdict::Redelivered);
        assert_eq!(decide(Some(b"t/0/3"), &mine), crate::dedup::Verdict::Duplicate);
    }
}
