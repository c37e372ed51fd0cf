//! The two cases at a topic's log start (issue 35, defects 1 and 2), run before the main
//! run, side by side: each on a young topic of its own (fewer records per partition than
//! the members' `pipeline.batch_offsets`, so no batch completes and every start the
//! members plan reads from offset 0, which their logs must show) with a group of two
//! members, the generator's traffic (retries, 30 % of them re-stamped into another
//! minute, and copies on other partitions), and the counts checked against the
//! generator's truth.
//!
//! - **Cache lost at the log start** (defect 1): every dedup key of the topic deleted while
//!   the members run, as the integration test
//!   `a_cache_lost_while_every_partition_restarts_at_the_log_start_counts_again` does it: one
//!   member frozen (within its session), every key under the prefix deleted, and once the
//!   other member moved to a new namespace and its sightings wait for the frozen member's
//!   partitions, the frontier hashes of that namespace too (the tail of a key-by-key
//!   deletion whose `SCAN` meets the keys created meanwhile); then the frozen member is let
//!   go. Before the fix every partition waited "for other partitions' dedup state to be
//!   rebuilt from the log", `from=0`, for ever: the counts never settled. No invalid
//!   records here: a first record that is no click acknowledges its partition's frontier,
//!   which let even the old members notice the loss.
//! - **Far-future first record** (defect 2): on a topic that accepts any CreateTime
//!   (`message.timestamp.after.max.ms` raised), the first record of every other partition
//!   is a junk click stamped 2100 (dead-lettered: its event time lies a century behind its
//!   timestamp), then the traffic; one member is SIGKILLed halfway and restarted, so its
//!   partitions are read again from offset 0, the junk record first. Before the fix such a
//!   record set its partition's clock to 2100, no copy on a partition without one was
//!   within the window of its original, and both copies counted. Only every other
//!   partition: with every clock in 2100, every record would be judged alike and the
//!   copies would meet again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clickagg::click::RejectReason;
use clickagg::config::{KafkaSettings, Settings};
use clickagg::produce::{Generator, Kind, Planned, Spec, Truth};
use clickagg::sink::Sink;
use clickagg::verify::Diff;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::children::{self, Launcher};
use crate::inject::{self, Fleet, SharedFleet};
use crate::report::{doubled, lost, DeadLetters};
use crate::Log;

/// The members' `pipeline.batch_offsets` on the young topics: several times the records a
/// partition gets, so every restart point is offset 0 from the first record to the last.
pub const YOUNG_BATCH_OFFSETS: u64 = 10_000;

/// 2100-01-01T00:00:00Z.
pub const YEAR_2100_MS: i64 = 4_102_444_800_000;

/// The young members' session: the frozen member must keep its partitions (the other one
/// must wait for them) on a loaded machine too.
const YOUNG_SESSION_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the frozen member stays frozen at most, waiting for the other to wait.
const FREEZE_LIMIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    CacheLost,
    FarFuture,
}

impl Case {
    /// Its check in the report.
    pub fn check(self) -> &'static str {
        match self {
            Case::CacheLost => "log start: cache lost at offset 0, counts exact",
            Case::FarFuture => "log start: first record in 2100, counts exact",
        }
    }

    /// Its topic's suffix, its members' label prefix.
    fn slug(self) -> &'static str {
        match self {
            Case::CacheLost => "lost",
            Case::FarFuture => "far",
        }
    }
}

/// How much traffic each case sends.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub records: u64,
    pub rate: u64,
    pub partitions: i32,
    pub settle_timeout: Duration,
}

/// What the driver's run gives both cases.
pub struct Setup {
    pub settings: Settings,
    /// The main group's launcher: its binary, log directory, PID files and settings,
    /// which each case changes for its own topic.
    pub launcher: Launcher,
    pub redis_url: String,
    pub sink: Sink,
    pub log: Log,
    pub seed: u64,
    pub sizes: Sizes,
}

/// One case's result.
#[derive(Debug, Clone)]
pub struct CaseOutcome {
    pub case: Case,
    pub records_sent: u64,
    pub clicks_sent: u64,
    pub diff: Diff,
    /// How long the counts took to become exact after the last record was sent; `None`:
    /// not within `settle_timeout`.
    pub settled_after: Option<Duration>,
    pub settle_timeout: Duration,
    /// What was injected, the log ends.
    pub notes: Vec<String>,
    /// A case that did not hold as planned, members that failed, missing dead letters.
    pub problems: Vec<String>,
    pub took: Duration,
}

impl CaseOutcome {
    /// What failed (empty: passed).
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        if lost(&self.diff) > 0 {
            out.push(format!("{} clicks lost", lost(&self.diff)));
        }
        if doubled(&self.diff) > 0 {
            out.push(format!("{} clicks counted twice", doubled(&self.diff)));
        }
        if self.settled_after.is_none() {
            out.push(format!(
                "the counts were not exact within {} s of the last record",
                self.settle_timeout.as_secs()
            ));
        }
        out.extend(self.problems.iter().cloned());
        out
    }

    /// Its row in the table.
    pub fn summary(&self) -> String {
        let settled = match self.settled_after {
            Some(d) => format!("exact {:.0} s after the last record", d.as_secs_f64()),
            None => format!("not exact within {} s", self.settle_timeout.as_secs()),
        };
        let mut s = format!(
            "{} records, {} clicks, {} counted, {} lost, {} double; {settled}; {:.0} s",
            self.records_sent,
            self.clicks_sent,
            self.diff.clicks_actual,
            lost(&self.diff),
            doubled(&self.diff),
            self.took.as_secs_f64()
        );
        for n in &self.notes {
            s.push_str("; ");
            s.push_str(n);
        }
        s
    }
}

/// The junk records of the far-future case: on every other partition (0, 2, …) a click
/// stamped 2100 whose event time is `now_ms`, a century behind its record, so it is
/// rejected (`timestamp_behind`) and dead-lettered; sent before anything else.
pub fn far_future_firsts(partitions: i32, now_ms: i64) -> Vec<Planned> {
    (0..partitions)
        .step_by(2)
        .map(|p| {
            let id = format!("far-future-first-{p}");
            Planned {
                payload: format!(r#"{{"click_id":"{id}","ad_id":9,"ts":{now_ms}}}"#).into_bytes(),
                key: id,
                timestamp_ms: YEAR_2100_MS,
                kind: Kind::Malformed(RejectReason::TimestampBehind),
                partition: Some(p),
            }
        })
        .collect()
}

/// The traffic of a case: retries (20 % of the records), 30 % of them on other
/// partitions and 30 % of the others re-stamped into another minute; no invalid records.
fn traffic(case: Case, seed: u64, sizes: &Sizes, start_ms: i64) -> Spec {
    Spec {
        count: sizes.records,
        seed: seed ^ if case == Case::CacheLost { 0x10c5_7a47 } else { 0x2100 },
        start_ms,
        span: Duration::from_secs_f64(sizes.records as f64 / sizes.rate as f64),
        duplicate_ratio: 0.2,
        malformed_ratio: 0.0,
        cross_partition_ratio: crate::CROSS_PARTITION_RATIO,
        retry_drift_ratio: crate::RETRY_DRIFT_RATIO,
        ..Spec::default()
    }
}

/// Both cases, side by side.
pub async fn run_both(cx: &Setup) -> Result<Vec<CaseOutcome>> {
    let (lost, far) = tokio::join!(run(Case::CacheLost, cx), run(Case::FarFuture, cx));
    Ok(vec![lost?, far?])
}

/// One case, from its topic's creation to its members' exit.
async fn run(case: Case, cx: &Setup) -> Result<CaseOutcome> {
    let began = Instant::now();
    let tag = format!("[{}]", case.slug());
    let note = |m: String| cx.log.note(format!("{tag} {m}"));
    let mut s = cx.settings.clone();
    s.kafka.topic = format!("{}-{}", cx.settings.kafka.topic, case.slug());
    s.kafka.group = format!("{}-group", s.kafka.topic);
    s.redis.key_prefix = format!("{}:", s.kafka.topic);
    let k = s.kafka.clone();
    let partitions = cx.sizes.partitions;
    match case {
        Case::CacheLost => clickagg::source::ensure_topic(&k, &k.topic, partitions).await?,
        Case::FarFuture => create_topic_accepting_any_time(&k, partitions).await?,
    }
    note(format!(
        "topic {} ({partitions} partitions), {} records at {}/s, pipeline.batch_offsets {YOUNG_BATCH_OFFSETS}",
        k.topic, cx.sizes.records, cx.sizes.rate
    ));

    let launcher = Launcher { env: member_env(case, &cx.launcher.env, &s), ..cx.launcher.clone() };
    let fleet: SharedFleet = Arc::new(tokio::sync::Mutex::new(Fleet::named(launcher, &format!("{}-", case.slug()))));
    for slot in 0..2 {
        fleet.lock().await.start(slot, &cx.log)?;
    }
    let abort = CancellationToken::new();
    let monitor = tokio::spawn(inject::monitor(fleet.clone(), cx.log.clone(), abort.clone()));
    let mut rng = StdRng::seed_from_u64(cx.seed ^ 0x5eed_0035 ^ case as u64);
    let mut notes = Vec::new();
    let mut problems = Vec::new();

    let body = async {
        // Both members in the group with partitions of their own before the first record.
        let ports = fleet.lock().await.http_ports.clone();
        if let Err(e) =
            wait_metric(&ports[..2], clickagg::telemetry::ASSIGNED_PARTITIONS, 1.0, Duration::from_secs(60)).await
        {
            problems.push(format!("the two members never both had partitions: {e}"));
        }
        let start_ms = chrono::Utc::now().timestamp_millis();
        let mut junk = Vec::new();
        if case == Case::FarFuture {
            junk = far_future_firsts(partitions, start_ms);
            clickagg::produce::send(&k, &k.topic, partitions, &junk, None, |_| {}).await?;
            note(format!(
                "sent the first record of partitions {:?}: stamped 2100-01-01 (a century ahead of its event time)",
                junk.iter().filter_map(|r| r.partition).collect::<Vec<_>>()
            ));
        }
        let spec = traffic(case, cx.seed, &cx.sizes, start_ms);
        let span = spec.span;
        let producer = tokio::spawn({
            let (k, rate) = (k.clone(), cx.sizes.rate);
            async move {
                let mut generator = Generator::new(spec);
                clickagg::produce::send(&k, &k.topic, partitions, &mut generator, Some(rate), |_| {}).await?;
                anyhow::Ok(generator.into_truth())
            }
        });
        let traffic_began = Instant::now();
        match case {
            Case::CacheLost => {
                tokio::time::sleep_until((traffic_began + span.mul_f64(0.4)).into()).await;
                // Both members have counted clicks through the cache: it has state to lose.
                if let Err(e) =
                    wait_metric(&ports[..2], clickagg::telemetry::RECORDS_CONSUMED, 100.0, Duration::from_secs(60))
                        .await
                {
                    problems.push(format!("the members had not both consumed records before the loss: {e}"));
                }
                let (deleted, how) = lose_cache(&fleet, &cx.redis_url, &s.redis.key_prefix, &mut rng, &note).await?;
                if deleted == 0 {
                    problems.push("no dedup key to delete: the loss was not injected".to_string());
                }
                notes.push(how);
            }
            Case::FarFuture => {
                tokio::time::sleep_until((traffic_began + span.mul_f64(0.5)).into()).await;
                let slot = rng.random_range(0..2);
                let p = fleet.lock().await.take(slot);
                if let Some(p) = p {
                    let label = p.label.clone();
                    p.kill().await;
                    note(format!("SIGKILL {label}; restart in 1 s: its partitions are read again from offset 0"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    fleet.lock().await.start(slot, &cx.log)?;
                    notes.push(format!("{label} SIGKILLed halfway and restarted"));
                }
            }
        }
        let mut truth: Truth = producer.await.context("producer task")??;
        for r in &junk {
            if let Kind::Malformed(reason) = r.kind {
                *truth.malformed.entry(reason).or_default() += 1;
            }
        }
        note(format!("production done: {}", truth.summary()));
        let sent = Instant::now();
        let exact =
            crate::settle(&cx.sink, &k.topic, &truth.counts, cx.sizes.settle_timeout, Duration::from_secs(2), &cx.log)
                .await?;
        let settled_after = exact.then(|| sent.elapsed());
        anyhow::Ok((truth, junk, settled_after))
    };
    let (truth, junk, settled_after) = tokio::select! {
        r = body => r?,
        _ = abort.cancelled() => bail!("{tag} members keep failing:\n{}", fleet.lock().await.incidents.join("\n")),
    };
    monitor.abort();
    note(if settled_after.is_some() {
        "counts are exact; stopping the members".into()
    } else {
        "counts did not settle; stopping the members".to_string()
    });
    let members = fleet.lock().await.take_all();
    for p in members {
        let (label, log_path) = (p.label.clone(), p.log.clone());
        let code = p.terminate(Duration::from_secs(60)).await;
        if code != Some(0) {
            problems
                .push(format!("{label} did not drain on SIGTERM (exit {code:?}): {}", children::tail(&log_path, 5)));
        }
    }
    problems.append(&mut fleet.lock().await.incidents);

    let actual = cx.sink.billing(Some(&k.topic), None, None).await.context("reading billing counts")?;
    let diff = clickagg::verify::diff(&truth.counts, &actual);
    if !diff.is_exact() {
        note(format!("counts differ from the truth:\n{}", diff.report(20)));
    }
    // Every start planned at the log start, and how the members noticed a loss: what their
    // logs say.
    let starts = planned_starts(&cx.launcher.logs, &format!("{}-m", case.slug()))?;
    notes.push(starts.summary());
    problems.extend(starts.problems());
    // Every partition still below its first batch boundary at the end.
    let ends = {
        let (k, topic) = (k.clone(), k.topic.clone());
        tokio::task::spawn_blocking(move || log_ends(&k, &topic, partitions)).await??
    };
    let furthest = ends.values().copied().max().unwrap_or(0);
    notes.push(format!(
        "log ends {}..{} (pipeline.batch_offsets {YOUNG_BATCH_OFFSETS})",
        ends.values().copied().min().unwrap_or(0),
        furthest
    ));
    if furthest >= YOUNG_BATCH_OFFSETS as i64 {
        problems.push(format!(
            "a partition reached offset {furthest}, past its first batch boundary: the topic was not young"
        ));
    }
    if case == Case::FarFuture {
        let (k, dlq) = (k.clone(), s.dead_letter_topic());
        let letters = tokio::task::spawn_blocking(move || DeadLetters::read(&k, &dlq)).await??;
        problems.extend(far_future_letters(&junk, &letters));
        notes.push(format!("{} dead letters of the 2100 records", letters.received(RejectReason::TimestampBehind)));
    }
    let records_sent = truth.clicks + truth.duplicates + truth.malformed_total();
    Ok(CaseOutcome {
        case,
        records_sent,
        clicks_sent: truth.clicks,
        diff,
        settled_after,
        settle_timeout: cx.sizes.settle_timeout,
        notes,
        problems,
        took: began.elapsed(),
    })
}

/// The main group's settings for a case's members: its topic, group and key prefix, the
/// young batch size, and for the lost cache a session the frozen member outlasts and the
/// debug line that says a member's sightings wait for other partitions.
fn member_env(case: Case, base: &[(String, String)], s: &Settings) -> Vec<(String, String)> {
    let session = if case == Case::CacheLost { Some(YOUNG_SESSION_TIMEOUT) } else { None };
    base.iter()
        .map(|(k, v)| {
            let v = match k.as_str() {
                "CLICKAGG__KAFKA__TOPIC" => s.kafka.topic.clone(),
                "CLICKAGG__KAFKA__GROUP" => s.kafka.group.clone(),
                "CLICKAGG__REDIS__KEY_PREFIX" => s.redis.key_prefix.clone(),
                "CLICKAGG__PIPELINE__BATCH_OFFSETS" => YOUNG_BATCH_OFFSETS.to_string(),
                "CLICKAGG__KAFKA__SESSION_TIMEOUT" => match session {
                    Some(t) => humantime::format_duration(t).to_string(),
                    None => v.clone(),
                },
                "CLICKAGG__PIPELINE__DRAIN_TIMEOUT" => match session {
                    Some(t) => humantime::format_duration(t - Duration::from_secs(2)).to_string(),
                    None => v.clone(),
                },
                "RUST_LOG" if case == Case::CacheLost => format!("{v},clickagg::cache::claims=debug"),
                _ => v.clone(),
            };
            (k.clone(), v)
        })
        .collect()
}

/// The cache lost at the log start, as `a_cache_lost_while_every_partition_restarts_at_the_log_start_counts_again`
/// loses it: one member frozen, every key under `prefix` deleted, then — once the other
/// member's sightings wait for the frozen one's partitions in the namespace it moved to —
/// that namespace's frontier hashes, and the frozen member let go. Returns how many keys
/// the first deletion found, and what happened.
async fn lose_cache(
    fleet: &SharedFleet,
    redis_url: &str,
    prefix: &str,
    rng: &mut StdRng,
    note: &impl Fn(String),
) -> Result<(usize, String)> {
    let frozen = rng.random_range(0..2usize);
    let other = 1 - frozen;
    let (frozen_label, other_label, other_log) = {
        let mut f = fleet.lock().await;
        let watched = f.live.get(&other).map(|p| (p.label.clone(), p.log.clone()));
        let Some((other_label, other_log)) = watched else { bail!("no member in slot {other}") };
        let Some(p) = f.live.get_mut(&frozen) else { bail!("no member in slot {frozen} to freeze") };
        p.freeze(true);
        (p.label.clone(), other_label, other_log)
    };
    note(format!("SIGSTOP {frozen_label} (within its session)"));
    let result = async {
        let from = std::fs::metadata(&other_log).map(|m| m.len()).unwrap_or(0);
        let deleted = inject::delete_cache_keys(redis_url, prefix, |_| true).await?;
        note(format!("deleted every dedup key under {prefix}: {deleted} keys"));
        // The other member notices, moves to a new namespace and plans its partitions there
        // from offset 0; their fresh sightings then wait for the frozen member's.
        let waited = wait_for_line(&other_log, from, "sightings wait for other partitions' state", FREEZE_LIMIT).await;
        let frontiers = inject::delete_cache_keys(redis_url, prefix, |k| k.ends_with(":frontier")).await?;
        note(format!(
            "{} the new namespace's frontier hashes: {frontiers} deleted",
            if waited {
                format!("{other_label}'s sightings wait for {frozen_label}'s partitions;")
            } else {
                format!("{other_label} logged no wait within {} s;", FREEZE_LIMIT.as_secs())
            }
        ));
        let how = format!(
            "{frozen_label} frozen, {deleted} keys deleted, then {frontiers} frontier hashes of the new namespace{}",
            if waited { format!(" while {other_label} waited") } else { String::new() }
        );
        anyhow::Ok((deleted, how))
    }
    .await;
    if let Some(p) = fleet.lock().await.live.get_mut(&frozen) {
        p.freeze(false);
    }
    note(format!("SIGCONT {frozen_label}"));
    result
}

/// What the members' logs say of where they planned their partitions' starts, and of the
/// losses of the cache they noticed.
#[derive(Debug, Default, PartialEq)]
struct Starts {
    /// Starts planned ("partition start planned"), and those not reading from offset 0:
    /// (partition, read_from).
    planned: u64,
    elsewhere: Vec<(i64, i64)>,
    /// Why a member found the cache lost, each reason once.
    losses: BTreeSet<String>,
}

impl Starts {
    fn read(&mut self, line: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { return };
        let field = |k: &str| v.get(k);
        match field("message").and_then(|m| m.as_str()) {
            Some("partition start planned") => {
                self.planned += 1;
                let read_from = field("read_from").and_then(|o| o.as_i64()).unwrap_or(-1);
                if read_from != 0 {
                    self.elsewhere.push((field("partition").and_then(|p| p.as_i64()).unwrap_or(-1), read_from));
                }
            }
            Some(m) if m.starts_with("the dedup cache lost what this member relied on") => {
                if let Some(why) = field("lost").and_then(|w| w.as_str()) {
                    // The namespace names differ from loss to loss; the reasons do not.
                    self.losses.insert(why.split(", ").next().unwrap_or(why).to_string());
                }
            }
            _ => {}
        }
    }

    fn summary(&self) -> String {
        let mut s = format!("{} partition starts planned", self.planned);
        if self.elsewhere.is_empty() {
            s.push_str(", all from offset 0");
        }
        if !self.losses.is_empty() {
            s.push_str(&format!("; losses noticed: {}", self.losses.iter().cloned().collect::<Vec<_>>().join(" | ")));
        }
        s
    }

    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.planned == 0 {
            out.push("no member logged a planned partition start".to_string());
        }
        if !self.elsewhere.is_empty() {
            out.push(format!(
                "starts planned past the log start (partition, offset): {:?}: the topic was not young",
                self.elsewhere
            ));
        }
        out
    }
}

/// Reads the logs of every member whose label starts with `prefix` (all incarnations).
fn planned_starts(logs: &std::path::Path, prefix: &str) -> Result<Starts> {
    let mut starts = Starts::default();
    for entry in std::fs::read_dir(logs).with_context(|| format!("reading {}", logs.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(prefix) && name.ends_with(".log") {
            let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            String::from_utf8_lossy(&text).lines().for_each(|l| starts.read(l));
        }
    }
    Ok(starts)
}

/// Whether `line` appears in the log at `path` after byte `from` within `timeout`.
async fn wait_for_line(path: &std::path::Path, from: u64, line: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read(path) {
            let tail = text.get(from as usize..).unwrap_or_default();
            if String::from_utf8_lossy(tail).contains(line) {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until every member on `ports` reports `metric` at `at_least` or more.
async fn wait_metric(ports: &[u16], metric: &str, at_least: f64, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut last = Vec::new();
        for &port in ports {
            last.push(metric_of(port, metric).await);
        }
        if last.iter().all(|v| v.is_some_and(|v| v >= at_least)) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{metric} {last:?} after {} s", timeout.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A member's metric, summed over its label sets, from its `/metrics`; `None` when it does
/// not answer (not up yet) or has no such series.
async fn metric_of(port: u16, name: &str) -> Option<f64> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        std::io::Result::Ok(String::from_utf8_lossy(&resp).into_owned())
    };
    let resp = tokio::time::timeout(Duration::from_secs(5), exchange).await.ok()?.ok()?;
    metric_value(resp.split_once("\r\n\r\n")?.1, name)
}

fn metric_value(body: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ' | b'{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The log end of every partition. Blocking: broker round trips.
fn log_ends(k: &KafkaSettings, topic: &str, partitions: i32) -> Result<BTreeMap<i32, i64>> {
    let c: BaseConsumer = clickagg::source::assigned_consumer_config(k, "clickagg-chaos-log-ends").create()?;
    (0..partitions).map(|p| Ok((p, c.fetch_watermarks(topic, p, Duration::from_secs(15))?.1))).collect()
}

/// What is wrong with the far-future case's dead letters: each junk record has one (by
/// its position, offset 0 of its partition), and nothing else has.
fn far_future_letters(junk: &[Planned], letters: &DeadLetters) -> Vec<String> {
    let want: BTreeSet<(i32, i64)> = junk.iter().filter_map(|r| Some((r.partition?, 0))).collect();
    let mut out = Vec::new();
    let got = letters.positions.get(RejectReason::TimestampBehind.as_str()).cloned().unwrap_or_default();
    if got != want {
        out.push(format!("dead letters of the 2100 records at {got:?}, expected {want:?}"));
    }
    for (reason, at) in &letters.positions {
        if reason != RejectReason::TimestampBehind.as_str() {
            out.push(format!("{} {reason} dead letters, none expected", at.len()));
        }
    }
    if letters.unreadable > 0 {
        out.push(format!("{} dead letters without their source headers", letters.unreadable));
    }
    out
}

/// Creates the far-future case's topic, accepting records stamped any time ahead (Kafka 4
/// refuses those more than an hour ahead by default; 3.x accepted any).
async fn create_topic_accepting_any_time(k: &KafkaSettings, partitions: i32) -> Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = clickagg::source::client_config(k).create()?;
    let max = i64::MAX.to_string();
    let topic =
        NewTopic::new(&k.topic, partitions, TopicReplication::Fixed(1)).set("message.timestamp.after.max.ms", &max);
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.create_topics([&topic], &opts).await? {
        r.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clickagg::click::{decode, Limits};

    #[test]
    fn every_other_partition_starts_with_a_record_stamped_2100_that_is_dead_lettered_as_behind() {
        let now = 1_764_489_600_000;
        let junk = far_future_firsts(5, now);
        assert_eq!(junk.iter().map(|r| r.partition).collect::<Vec<_>>(), vec![Some(0), Some(2), Some(4)]);
        for r in &junk {
            assert_eq!(r.timestamp_ms, YEAR_2100_MS);
            let rejected = decode(Some(&r.payload), Some(r.timestamp_ms), &Limits::default()).unwrap_err();
            assert_eq!(rejected.reason, RejectReason::TimestampBehind);
            assert_eq!(r.kind, Kind::Malformed(RejectReason::TimestampBehind));
        }
    }

    #[test]
    fn the_traffic_has_retries_copies_and_drift_and_no_invalid_record() {
        let sizes = Sizes { records: 6_000, rate: 500, partitions: 4, settle_timeout: Duration::from_secs(90) };
        for case in [Case::CacheLost, Case::FarFuture] {
            let spec = traffic(case, 1, &sizes, 1_764_489_600_000);
            let (records, truth) = clickagg::produce::plan(&spec);
            assert_eq!(records.len(), 6_000);
            assert_eq!(truth.malformed_total(), 0, "{case:?}");
            assert!(records.iter().any(|r| r.key.contains("#copy")), "{case:?}: copies on other partitions");
            assert!(truth.drifted > 0 && truth.duplicates > 900, "{case:?}: {}", truth.summary());
            // Every partition far below the young batch size: by key hash, an even share.
            assert!(6_000 / 4 * 3 < YOUNG_BATCH_OFFSETS as usize);
        }
        let a = traffic(Case::CacheLost, 1, &sizes, 0);
        let b = traffic(Case::FarFuture, 1, &sizes, 0);
        assert_ne!(a.seed, b.seed, "the two topics carry other clicks");
    }

    #[test]
    fn the_members_logs_tell_where_each_start_was_planned_and_why_the_cache_was_lost() {
        let mut s = Starts::default();
        for line in [
            r#"{"timestamp":"2026-12-07T17:34:14.867473Z","level":"INFO","message":"partition start planned","partition":0,"committed":"None","count_from":0,"read_from":0,"cache_frontier":"Some(-1)","target":"clickagg::planner"}"#,
            r#"{"timestamp":"2026-12-07T17:34:19.937826Z","level":"WARN","message":"the dedup cache lost what this member relied on; rebuilding every partition's state from the log","lost":"key group 0 holds no dedup state at all","target":"clickagg::member::poll_loop"}"#,
            r#"{"timestamp":"2026-12-07T17:34:21.364743Z","level":"WARN","message":"the dedup cache lost what this member relied on; rebuilding every partition's state from the log","lost":"key group 0 holds another namespace, 287656fef3.6a97718cfbd7b6d4","target":"clickagg::member::poll_loop"}"#,
            r#"{"timestamp":"2026-12-07T17:34:22.349748Z","level":"WARN","message":"the dedup cache lost what this member relied on; rebuilding every partition's state from the log","lost":"key group 0 lost claims of partition 2 it had acknowledged","target":"clickagg::member::poll_loop"}"#,
            r#"{"timestamp":"2026-12-07T17:34:32.423430Z","level":"INFO","message":"partition start planned","partition":2,"committed":"Some(776)","count_from":0,"read_from":0,"cache_frontier":"Some(777)","target":"clickagg::planner"}"#,
            "not json",
        ] {
            s.read(line);
        }
        assert_eq!(s.planned, 2);
        assert!(s.problems().is_empty());
        assert_eq!(
            s.summary(),
            "2 partition starts planned, all from offset 0; losses noticed: key group 0 holds another namespace | \
             key group 0 holds no dedup state at all | key group 0 lost claims of partition 2 it had acknowledged"
        );
        s.read(r#"{"message":"partition start planned","partition":3,"read_from":10000}"#);
        assert_eq!(
            s.problems(),
            vec!["starts planned past the log start (partition, offset): [(3, 10000)]: the topic was not young"
                .to_string()]
        );
        assert_eq!(Starts::default().problems(), vec!["no member logged a planned partition start".to_string()]);
    }

    #[test]
    fn the_far_future_case_wants_exactly_one_letter_per_junk_record() {
        let junk = far_future_firsts(4, 1_764_489_600_000);
        let mut letters = DeadLetters::default();
        letters.positions.entry("timestamp_behind".into()).or_default().insert((0, 0));
        assert_eq!(far_future_letters(&junk, &letters).len(), 1, "partition 2's is missing");
        letters.positions.entry("timestamp_behind".into()).or_default().insert((2, 0));
        assert!(far_future_letters(&junk, &letters).is_empty());
        letters.positions.entry("oversized".into()).or_default().insert((1, 7));
        assert_eq!(far_future_letters(&junk, &letters), vec!["1 oversized dead letters, none expected".to_string()]);
    }

    #[test]
    fn a_case_fails_on_a_loss_a_double_count_no_settling_or_a_problem() {
        use clickagg::aggregate::BucketKey;
        use clickagg::click::Minute;
        let k = BucketKey { ad_id: 1, minute: Minute::from_epoch_seconds(60) };
        let o = |expected: u64, actual: u64, settled: bool| CaseOutcome {
            case: Case::FarFuture,
            records_sent: expected,
            clicks_sent: expected,
            diff: clickagg::verify::diff(&BTreeMap::from([(k, expected)]), &BTreeMap::from([(k, actual)])),
            settled_after: settled.then_some(Duration::from_secs(3)),
            settle_timeout: Duration::from_secs(90),
            notes: vec![],
            problems: vec![],
            took: Duration::from_secs(40),
        };
        assert!(o(5, 5, true).failures().is_empty());
        assert_eq!(
            o(5, 7, false).failures(),
            vec![
                "2 clicks counted twice".to_string(),
                "the counts were not exact within 90 s of the last record".into()
            ]
        );
        let mut p = o(5, 5, true);
        p.problems.push("a partition reached offset 10000".into());
        assert_eq!(p.failures().len(), 1);
        assert!(o(5, 3, true).summary().contains("2 lost"));
    }
}
