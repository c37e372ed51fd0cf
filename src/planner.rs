//! Where readers start, and the look-ups behind it, for the pure stages
//! (`pipeline::Stages`) to take over: the broker's offsets and log ends, the recorded
//! partition clocks at batch boundaries (`clickagg_clocks`), the dedup cache's
//! frontiers, and the recorded cross-partition decisions.
//!
//! The clocks give each reader the clock just before where it starts reading, and the
//! lookback that rebuilds its dedup state. The broker's time index is not used for
//! either: it holds aborted transactional records and a single absurd timestamp as
//! faithfully as any other, while the clock is a function of the committed records
//! read in order (`dedup::clock`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::Offset;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cache::{DedupError, SharedCache};
use crate::config::Settings;
use crate::dedup::{PartitionClock, Pin, Secs};
use crate::pipeline::{hold, wall_secs, Distrust, RecordedPins, Stages};
use crate::position::BatchOffsets;
use crate::position::{self, Boundary, Marks, Scope, Start};
use crate::record::Record;
use crate::retry::{self, Retry, Stopped};
use crate::sink::{RulesHistory, Sink, SinkError};
use crate::source;
use crate::telemetry as t;

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

impl crate::retry::Retryable for PipelineError {
    fn is_fatal(&self) -> bool {
        PipelineError::is_fatal(self)
    }
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

/// The look-ups of one reader process: a member (with the shared cache and the
/// recorded settings) or a replay (neither).
pub struct Planner {
    topic: String,
    sink: Sink,
    /// `None` for a replay, which never touches Redis.
    cache: Option<SharedCache>,
    n: BatchOffsets,
    window: Secs,
    max_record_lag: Duration,
    /// The recorded settings versions (a member): no partition is read from before where
    /// the latest took over.
    rules: Option<RulesHistory>,
    /// Whether the topic's Kafka ID was checked against the recorded one.
    identity_checked: bool,
    /// A replay's view of the members' progress (`None` for a member).
    group: Option<GroupProgress>,
}

/// What a replay knows of the decisions the members have made. A flush writes its pins
/// before it commits, so the recorded pins of the offsets below the group's committed
/// offset are final; above it the members may still pin copies. A replay that loaded a
/// window of pins ahead of the members and was then overtaken would apply only the pins
/// recorded at its load and count a copy the members pinned since; so where it reads at
/// or past the committed offset of its last load, it asks again and, if the members
/// have moved on, loads the pins once more.
struct GroupProgress {
    consumer: Arc<BaseConsumer>,
    /// Per partition: the group's committed offset when its pins were last loaded.
    final_below: BTreeMap<i32, i64>,
}

impl Planner {
    /// A member's: with the shared cache and the recorded settings versions.
    pub fn for_member(s: &Settings, sink: Sink, cache: SharedCache, rules: RulesHistory) -> Planner {
        Planner::new(s, sink, Some(cache), Some(rules))
    }

    /// A replay's: it never touches Redis, decides each range under the settings
    /// recorded for it, and follows the pins the group (`kafka.group`) records while it
    /// runs.
    pub fn for_replay(s: &Settings, sink: Sink) -> Result<Planner, PipelineError> {
        let consumer = source::group_lookup_consumer(&s.kafka, &s.kafka.group)?;
        let mut planner = Planner::new(s, sink, None, None);
        planner.group = Some(GroupProgress { consumer: Arc::new(consumer), final_below: BTreeMap::new() });
        Ok(planner)
    }

    fn new(s: &Settings, sink: Sink, cache: Option<SharedCache>, rules: Option<RulesHistory>) -> Planner {
        Planner {
            topic: s.kafka.topic.clone(),
            sink,
            cache,
            n: s.batch_offsets(),
            window: s.rules().window(),
            max_record_lag: s.dedup.max_record_lag,
            rules,
            identity_checked: false,
            group: None,
        }
    }

    /// Plans where each newly assigned partition starts (`position::shared_start`):
    /// the batch boundary at or below its committed offset, a warm-up when the cache
    /// lacks the sightings before it, and the recorded pins of what it will read.
    /// Blocking broker look-ups; called from the rebalance callback.
    pub async fn plan_starts<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        partitions: &[i32],
    ) -> Result<Vec<(Start, RecordedPins)>, PipelineError> {
        // A cooperative rebalance may assign nothing new to this member.
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let timeout = Duration::from_secs(10);
        if !self.identity_checked {
            self.check_topic_identity(consumer, timeout).await?;
        }
        let all = source::partitions(consumer, &self.topic, timeout)?;
        if all.iter().any(|&p| p >= crate::cache::MAX_PARTITIONS) {
            return Err(PipelineError::Fatal(format!(
                "kafka topic {} has {} partitions; the dedup cache holds partitions below {} (claim.lua's item \
                 layout): split the topic",
                self.topic,
                all.len(),
                crate::cache::MAX_PARTITIONS
            )));
        }
        self.shared()?.set_partition_count(all.len() as u32);
        // Every partition's committed position, not only ours: a warm-up must rebuild the
        // sightings the most lagging partition will still judge its copies against.
        let everyone = source::group_committed(consumer, &self.topic, &all, timeout)?;
        let everyone_at = source::boundaries(consumer, &self.topic, self.n, &everyone, timeout)?;
        // The nearest clocks of ours and of those with records left to read, each read once.
        let wanted: BTreeMap<i32, Boundary> = everyone_at
            .iter()
            .filter(|(p, b)| b.boundary < b.high || partitions.contains(p))
            .map(|(&p, &b)| (p, b))
            .collect();
        let nears = nears(&self.sink, &self.topic, &wanted).await?;
        let need = lagging_clock(&everyone_at, &nears);
        let requested: BTreeMap<i32, Option<i64>> =
            partitions.iter().map(|p| (*p, everyone.get(p).copied().flatten())).collect();
        let at: BTreeMap<i32, Boundary> = partitions.iter().filter_map(|p| Some((*p, *everyone_at.get(p)?))).collect();
        let marks = marks_from(&self.sink, &self.topic, &at, &nears, self.window, need).await?;
        let frontiers = self.shared()?.frontiers(partitions).await?;
        let mut starts = Vec::new();
        let mut holds = BTreeMap::new();
        for (&p, &m) in &marks {
            let from = self.rules.as_ref().map_or(0, |r| r.latest_from(p));
            if m.boundary < from {
                return Err(PipelineError::Fatal(format!(
                    "partition {p} would be read from offset {}, before offset {from} where the topic's current \
                     dedup settings took over (`clickagg settings change`): a member decides only under the current \
                     settings. Reset the group to {from} or later; re-read older ranges with `clickagg replay`, \
                     which decides each range under the settings recorded for it.",
                    m.boundary
                )));
            }
            let (frontier, lost) = position::merge_frontiers(frontiers.get(&p).map_or(&[][..], Vec::as_slice), m);
            if lost {
                warn!(
                    partition = p,
                    "part of the dedup cache lost this partition's state (a Redis node that lost its data?); \
                     rebuilding it from the log"
                );
                metrics::counter!(t::DEDUP_REBUILDS, "reason" => "lost").increment(1);
            }
            let mut start = position::shared_start(p, m, frontier);
            // Never above the log end: an offset reset past it would keep every commit back.
            let committed = requested.get(&p).copied().flatten().unwrap_or(0).min(at[&p].high);
            start.commit_floor = committed.max(start.count_from);
            let behind = frontier.is_none_or(|f| f.claimed + 1 < m.boundary);
            if matches!(start.scope, Scope::Shared { .. }) && behind {
                // The cache lacks everything before the lookback: its re-reads below the
                // boundary cannot be trusted after this warm-up, and the partition is not
                // ready (others' fresh sightings wait) until the warm-up reaches it. A
                // partition the cache never saw gets its frontier here.
                self.shared()?.restart(p, m.lookback.0, m.boundary).await?;
            }
            // The sweeper must keep what this reader needs before it reads anything, if it
            // starts far behind the wall clock with records to read (`Stages::holds`).
            holds.insert(p, hold(start.clock.now(), start.read_from < at[&p].high, self.max_record_lag, wall_secs()));
            // Every recorded decision from the first offset read on: a re-read applies it,
            // warm-up included, with the effect it had on the cache (the frontier may be lost).
            let pins = self.pins_from(p, start.read_from).await?;
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
        let lagging: Vec<i32> = holds.iter().filter(|(_, h)| h.is_some()).map(|(&p, _)| p).collect();
        if !lagging.is_empty() {
            info!(?lagging, "partitions lag the wall clock: the dedup cache keeps the sightings they still need");
        }
        self.shared()?.set_holds(&holds).await?;
        Ok(starts)
    }

    /// Plans the private re-read of `partition`, whose re-read the cache could not
    /// decide, from the start of its open batch up to where the cache can decide again,
    /// seeks the consumer there and hands the start to `stages`. Every look-up comes
    /// first, so that a failed one leaves everything as it was and can be tried again.
    pub async fn fall_back<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        stages: &mut Stages,
        partition: i32,
        why: Distrust,
    ) -> Result<(), PipelineError> {
        let Some(from) = stages.fall_back_from(partition) else { return Ok(()) };
        let requested = BTreeMap::from([(partition, Some(from))]);
        let timeout = Duration::from_secs(10);
        let at =
            tokio::task::block_in_place(|| source::boundaries(consumer, &self.topic, self.n, &requested, timeout))?;
        let marks = marks(&self.sink, &self.topic, &at, self.window).await?;
        let m = marks[&partition];
        let frontiers = self.shared()?.frontiers(&[partition]).await?;
        let (frontier, _) = position::merge_frontiers(frontiers.get(&partition).map_or(&[][..], Vec::as_slice), m);
        let Some(f) = frontier else {
            // The cache no longer knows the partition at all: it was lost.
            let lost = crate::cache::Lost { group: 0, why: "namespace".into(), detail: String::new() };
            return Err(DedupError::Lost(lost).into());
        };
        let resume = position::Resume { claimed: f.claimed, exact_from: f.exact_from };
        let start = position::private_start(partition, m, Some(resume));
        let pins = self.pins_from(partition, start.read_from).await?;
        tokio::task::block_in_place(|| {
            consumer.seek(&self.topic, partition, Offset::Offset(start.read_from), timeout)
        })?;
        info!(partition, shared_from = resume.shared_from(), "re-reading privately up to where the cache decides");
        stages.fall_back(start, pins, why);
        Ok(())
    }

    /// After the cache was lost (and renewed): plans every assigned partition again from
    /// its committed offset, with a warm-up that rebuilds its state in the new namespace,
    /// seeks the consumer there, and starts the stages over. The assignment, not the
    /// stages: a partition whose plan found the cache lost was assigned unplanned.
    pub async fn start_over<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        stages: &mut Stages,
    ) -> Result<(), PipelineError> {
        let assigned = consumer.assignment()?;
        let mut partitions: Vec<i32> =
            assigned.elements().iter().filter(|e| e.topic() == self.topic).map(|e| e.partition()).collect();
        partitions.extend(stages.partitions());
        partitions.sort_unstable();
        partitions.dedup();
        let starts =
            tokio::task::block_in_place(|| Handle::current().block_on(self.plan_starts(consumer, &partitions)))?;
        let timeout = Duration::from_secs(10);
        for (start, _) in &starts {
            tokio::task::block_in_place(|| {
                consumer.seek(&self.topic, start.partition, Offset::Offset(start.read_from), timeout)
            })?;
        }
        stages.start_over(starts);
        Ok(())
    }

    /// Loads the recorded pins every reader of `stages` needs for `records`: the next
    /// window of offsets. Retries while ClickHouse or Redis is unavailable.
    pub async fn ensure_pins(
        &mut self,
        stages: &mut Stages,
        records: &[Record],
        shutdown: &CancellationToken,
        max_backoff: Duration,
    ) -> Result<(), PipelineError> {
        let mut loads: BTreeMap<i32, (i64, i64)> = stages
            .pins_needed(records)
            .into_iter()
            .map(|(p, (from, beyond))| (p, (from, beyond.max(from + self.pins_window() - 1))))
            .collect();
        // A replay: the members' committed offsets now, for the partitions it loads pins
        // of or reads past where they stood at its last load (then loaded again).
        let mut committed = BTreeMap::new();
        if let Some(group) = &self.group {
            let mut reads: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
            for r in records {
                let at = reads.entry(r.partition).or_insert((r.offset, r.offset));
                *at = (at.0.min(r.offset), at.1.max(r.offset));
            }
            let ask: Vec<i32> = reads
                .iter()
                .filter(|(p, (_, hi))| loads.contains_key(p) || group.final_below.get(p).is_some_and(|fb| hi >= fb))
                .map(|(&p, _)| p)
                .collect();
            if !ask.is_empty() {
                committed = until_done("asking for the group's committed offsets", max_backoff, shutdown, || {
                    let (consumer, topic, ask) = (group.consumer.clone(), self.topic.clone(), ask.clone());
                    async move {
                        tokio::task::spawn_blocking(move || {
                            source::group_committed(&*consumer, &topic, &ask, Duration::from_secs(10))
                        })
                        .await
                        .map_err(|e| PipelineError::Fatal(format!("the offset look-up panicked: {e}")))?
                        .map_err(PipelineError::from)
                    }
                })
                .await?
                .into_iter()
                .map(|(p, c)| (p, c.unwrap_or(0)))
                .collect();
            }
            for (&p, &now) in &committed {
                let (Some(until), Some(&fb)) = (stages.pins_until(p), group.final_below.get(&p)) else { continue };
                if now > fb && !loads.contains_key(&p) {
                    loads.insert(p, (reads[&p].0, until));
                }
            }
        }
        for (p, (from, to)) in loads {
            let mut retry = Retry::new(max_backoff, shutdown);
            let loaded = loop {
                match load_pins(&self.sink, self.cache.as_mut(), &self.topic, p, from, to).await {
                    Ok(pins) => break pins,
                    Err(e) => retry
                        .after(e, |e| warn!(error = %e, partition = p, "loading recorded decisions failed; retrying"))
                        .await
                        .map_err(|stopped| stopped_while(stopped, "loading recorded decisions"))?,
                }
            };
            stages.add_pins(p, loaded, to);
            if let (Some(group), Some(&now)) = (self.group.as_mut(), committed.get(&p)) {
                group.final_below.insert(p, now);
            }
        }
        Ok(())
    }

    /// Refuses a topic whose Kafka ID is not the one recorded for its name: it was
    /// deleted and recreated, its offsets start over, and its batches would overwrite
    /// the old topic's rows and take its pins. Records the ID when none is.
    async fn check_topic_identity<X: ConsumerContext>(
        &mut self,
        consumer: &impl Consumer<X>,
        timeout: Duration,
    ) -> Result<(), PipelineError> {
        let Some(now) = source::topic_id_of(consumer, &self.topic, timeout)? else {
            self.identity_checked = true;
            return Ok(()); // a broker without topic IDs
        };
        match self.sink.recorded_topic_id(&self.topic).await? {
            Some(recorded) if recorded != now => {
                return Err(PipelineError::Fatal(format!(
                    "kafka topic {} has ID {now}, but the counts in ClickHouse were recorded for a topic of that \
                     name with ID {recorded}: it was deleted and recreated, and its offsets would overwrite the \
                     old topic's batches and take its pins. Write the new topic into another database \
                     (clickhouse.database).",
                    self.topic
                )))
            }
            Some(_) => {}
            None => self.sink.record_topic_id(&self.topic, &now).await?,
        }
        self.identity_checked = true;
        Ok(())
    }

    /// The shared cache handle the planner plans with (the member recovers through it).
    pub fn cache(&mut self) -> &mut SharedCache {
        self.cache.as_mut().expect("a member's planner has the shared cache")
    }

    fn shared(&mut self) -> Result<&mut SharedCache, PipelineError> {
        self.cache.as_mut().ok_or_else(|| PipelineError::Fatal("a replay cannot use the shared cache".into()))
    }

    /// How many offsets of pins a reader loads at a time.
    fn pins_window(&self) -> i64 {
        (self.n.get() as i64).saturating_mul(16).max(100_000)
    }

    /// The first window of pins for a reader starting at `from`.
    async fn pins_from(&mut self, partition: i32, from: i64) -> Result<RecordedPins, PipelineError> {
        let until = from + self.pins_window() - 1;
        let pins = load_pins(&self.sink, self.cache.as_mut(), &self.topic, partition, from, until).await?;
        Ok(RecordedPins { pins, until })
    }
}

/// Every cross-partition decision recorded for `partition` in `[from, to]`: durable in
/// ClickHouse, or still only in the cache when the flush that records it has not
/// happened yet (a re-read after a crash; a member's only).
async fn load_pins(
    sink: &Sink,
    cache: Option<&mut SharedCache>,
    topic: &str,
    partition: i32,
    from: i64,
    to: i64,
) -> Result<BTreeMap<i64, Pin>, PipelineError> {
    let mut pins = sink.pins(topic, partition, from, to).await?;
    if let Some(cache) = cache {
        pins.extend(cache.cached_pins(partition, from, to).await?);
    }
    Ok(pins)
}

/// Runs a step until it succeeds (`retry::until_done`). Transient failures — a service
/// still coming up, a failover, on an older ClickHouse cluster another member's quorum
/// insert in the way — are logged and retried with backoff; a fatal one, or a shutdown,
/// ends it.
pub async fn until_done<T, F, Fut>(
    what: &str,
    max_backoff: Duration,
    shutdown: &CancellationToken,
    step: F,
) -> Result<T, PipelineError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, PipelineError>>,
{
    retry::until_done(what, max_backoff, shutdown, step).await.map_err(|stopped| stopped_while(stopped, what))
}

/// The error a retried step ends with: its fatal error, or a shutdown while `what` still failed.
pub fn stopped_while(stopped: Stopped<PipelineError>, what: &str) -> PipelineError {
    match stopped {
        Stopped::Fatal(e) => e,
        Stopped::ShutDown => PipelineError::ShutDown(what.to_string()),
    }
}

/// For every partition, the recorded clocks a reader counting from its boundary needs
/// ([`Marks`]): the nearest recorded clock at or below the boundary, and the latest
/// recorded boundary before which every record lies more than `window` before that
/// clock (the lookback; the record just before it judged at a pending jump's time too). Where nothing is recorded, the log start with a fresh clock:
/// the clock there is the definition's when the log starts at offset 0, and what
/// retention left of it otherwise.
pub async fn marks(
    sink: &Sink,
    topic: &str,
    at: &BTreeMap<i32, Boundary>,
    window: Secs,
) -> Result<BTreeMap<i32, Marks>, SinkError> {
    let nears = nears(sink, topic, at).await?;
    marks_from(sink, topic, at, &nears, window, None).await
}

/// What a private reader reads (a replay, `explain --records`): per partition, where it
/// starts (counting from a batch boundary, after the warm-up that rebuilds its dedup
/// state) and where it ends.
#[derive(Debug, Clone)]
pub struct ReplayPlan {
    pub starts: Vec<Start>,
    /// The offsets counted, `[count_from, end)`.
    pub counted: source::Ranges,
    /// The offsets read, warm-up included, `[read_from, end)`.
    pub read: source::Ranges,
}

/// Where each partition's private reader starts to count `counted` under settings `s`:
/// from its batch boundary, after the warm-up that rebuilds its dedup state from the
/// log (`lows`: each partition's log start).
pub async fn plan_replay(
    s: &Settings,
    sink: &Sink,
    counted: source::Ranges,
    lows: &BTreeMap<i32, i64>,
) -> Result<ReplayPlan, SinkError> {
    let at = counted
        .partitions
        .iter()
        .map(|(&p, &(start, _))| (p, Boundary { boundary: start, low: lows[&p], high: i64::MAX }))
        .collect();
    let marks = marks(sink, &s.kafka.topic, &at, s.rules().window()).await?;
    let starts: Vec<Start> = marks.iter().map(|(&p, &m)| position::private_start(p, m, None)).collect();
    for st in &starts {
        let low = lows[&st.partition];
        if st.read_from == low && low > 0 && st.read_from < st.count_from {
            warn!(
                partition = st.partition,
                log_start = low,
                "retention removed part of the window before the replayed range: a retry whose original \
                 was deleted counts as a new click"
            );
        }
    }
    let read = source::Ranges {
        partitions: starts
            .iter()
            .map(|st| (st.partition, (st.read_from, counted.partitions[&st.partition].1)))
            .collect(),
    };
    Ok(ReplayPlan { starts, counted, read })
}

/// The nearest recorded clock at or below each boundary of `at`: its offset and the
/// clock just before it, or the log start and a fresh clock where nothing is recorded.
async fn nears(
    sink: &Sink,
    topic: &str,
    at: &BTreeMap<i32, Boundary>,
) -> Result<BTreeMap<i32, (i64, PartitionClock)>, SinkError> {
    let mut out = BTreeMap::new();
    for (&p, b) in at {
        let near = sink.clock_at_or_below(topic, p, b.low, b.boundary).await?;
        out.insert(p, near.unwrap_or((b.low, PartitionClock::default())));
    }
    Ok(out)
}

/// [`marks`] from the nearest clocks already read. With `need` (a warm-up of the shared
/// cache: [`lagging_clock`]), the lookback reaches a window before `need` too when that
/// lies further back: the rebuilt cache must hold what this partition read that a
/// lagging partition's copies are still judged against.
async fn marks_from(
    sink: &Sink,
    topic: &str,
    at: &BTreeMap<i32, Boundary>,
    nears: &BTreeMap<i32, (i64, PartitionClock)>,
    window: Secs,
    need: Option<Secs>,
) -> Result<BTreeMap<i32, Marks>, SinkError> {
    let mut out = BTreeMap::new();
    for (&p, b) in at {
        let log_start = (b.low, PartitionClock::default());
        let near = nears[&p];
        let lookback = match near.1.get() {
            // Nothing stamped before it: everything before matters as much as it can.
            None => log_start,
            Some(c) => {
                let from = need.map_or(c, |n| n.min(c)).saturating_sub(window);
                sink.clock_before_time(topic, p, b.low, near.0, from.get()).await?.unwrap_or(log_start)
            }
        };
        let lookback = if lookback.0 > near.0 { near } else { lookback };
        out.insert(p, Marks { boundary: b.boundary, near, lookback });
    }
    Ok(out)
}

/// The earliest clock from which a partition with records still to read (its boundary
/// below the log end) goes on: the nearest recorded clock below its boundary. `Some(0)`
/// when one of them has no clock recorded yet (never read: its records may lie anywhere
/// in time, so every warm-up starts at the log start); `None` when none is pending.
pub fn lagging_clock(everyone: &BTreeMap<i32, Boundary>, nears: &BTreeMap<i32, (i64, PartitionClock)>) -> Option<Secs> {
    let mut need: Option<Secs> = None;
    for (q, _) in everyone.iter().filter(|(_, b)| b.boundary < b.high) {
        match nears.get(q).and_then(|(_, c)| c.get()) {
            Some(c) => need = Some(need.map_or(c, |n| n.min(c))),
            None => return Some(Secs::ZERO),
        }
    }
    need
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(boundary: i64, high: i64) -> Boundary {
        Boundary { boundary, low: 0, high }
    }

    #[test]
    fn the_lagging_clock_is_the_earliest_of_the_partitions_with_records_left_to_read() {
        let at = |c: u32| (100, PartitionClock::at(Some(Secs::new(c))));
        let everyone = BTreeMap::from([(0, b(100, 500)), (1, b(100, 900)), (2, b(100, 100))]);
        let nears = BTreeMap::from([(0, at(5_000)), (1, at(4_000)), (2, at(1_000))]);
        // Partition 2 is read to its end: it judges nothing more.
        assert_eq!(lagging_clock(&everyone, &nears), Some(Secs::new(4_000)));
        // A partition never read (no clock recorded) may hold records of any time.
        let fresh = BTreeMap::from([(0, at(5_000)), (1, (0, PartitionClock::default())), (2, at(1_000))]);
        assert_eq!(lagging_clock(&everyone, &fresh), Some(Secs::ZERO));
        let done = BTreeMap::from([(0, b(500, 500))]);
        assert_eq!(lagging_clock(&done, &nears), None);
    }
}
