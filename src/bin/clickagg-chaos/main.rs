//! `clickagg-chaos`: issue 9's chaos run, against a private stack (`scripts/chaos`
//! starts one and passes its endpoints; this binary refuses to restart services of a
//! stack that is not private).
//!
//! First, two cases at a topic's log start (issue 35), side by side on young topics of
//! their own (`young`): the dedup cache deleted while every restart point is offset 0,
//! and a first record stamped 2100 on every other partition, each checked exact.
//!
//! Then one consumer group of three `clickagg run` members consumes while the seeded
//! generator produces at a fixed rate — duplicates (some re-stamped into another
//! minute), copies of clicks on other partitions, invalid records; meanwhile the driver
//! SIGKILLs members (some while a flush is in flight, some while ClickHouse is down and
//! flushes are retried) and restarts them, has a fourth member join and leave, crashes
//! one, freezes one past its session timeout and lets it come back as a zombie, kills
//! Redis (restarted from its append-only file) and loses it (restarted without its
//! data), takes ClickHouse away, restarts the broker and runs replays of overlapping
//! ranges and `clickagg seal` through the current hour beside them (sealing the hour
//! the members go on writing, which their sealers then re-seal). Then it compares ClickHouse with the
//! generator's truth, the sealed hours and days (after a last sealing round) with the
//! minute rows, and the dead-letter topic with the generator's
//! invalid records, and reports the longest time a partition made no progress and the
//! members' peak memory. Exit 0 only if every check passes: the counts became exact
//! within the settle timeout and no click is lost or counted twice, the seals agree,
//! every dead letter is there, no partition stalled longer than the longest outage plus
//! 30 s, at least one planned mid-flush kill landed mid-flush, and no member, replay or
//! leave failed. Exit 1 otherwise, naming each failed check; 2 when the run could not
//! be carried out (a service that would not restart, members that keep exiting on their
//! own); 130 when interrupted.

mod children;
mod inject;
mod progress;
mod report;
mod schedule;
mod young;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use clickagg::config::{KafkaSettings, SecretUrl, Settings};
use clickagg::produce::{Generator, Spec, Truth};
use clickagg::sink::{Billing, Sink};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::consumer::BaseConsumer;
use tokio_util::sync::CancellationToken;

use children::{Launcher, Pids};
use inject::{Chaos, Fleet, SharedFleet};
use report::{DeadLetters, Outcome};
use schedule::Shape;

#[derive(Parser)]
#[command(about = "Kills, rebalances, outages and replays against one member group; exact counts or exit 1")]
struct Cli {
    /// Kafka of the private stack.
    #[arg(long)]
    brokers: String,
    #[arg(long)]
    redis_url: String,
    #[arg(long)]
    clickhouse_url: String,
    /// scripts/stack: run with this process's environment (the private stack's
    /// directory and ports) to restart and stop services.
    #[arg(long, default_value = "scripts/stack")]
    stack: PathBuf,
    /// Logs of every child, PID files, the event log.
    #[arg(long)]
    work_dir: PathBuf,
    /// The clickagg binary the members and replays run (default: beside this one).
    #[arg(long)]
    clickagg: Option<PathBuf>,
    /// The CI preset: 300 000 records, 5 kills, one fault of each hard kind, 1 replay.
    #[arg(long)]
    reduced: bool,
    /// Click records generated (duplicates and invalid records included).
    #[arg(long)]
    clicks: Option<u64>,
    /// SIGKILLs of members, each restarted (the crash rebalance comes on top).
    #[arg(long)]
    kills: Option<u32>,
    #[arg(long)]
    replays: Option<u32>,
    /// Records per second the generator sends: faults fall within clicks / rate seconds.
    #[arg(long)]
    rate: Option<u64>,
    #[arg(long)]
    partitions: Option<i32>,
    #[arg(long)]
    clickhouse_outage: Option<humantime::Duration>,
    #[arg(long, default_value_t = 2_000)]
    batch_offsets: u64,
    /// The members' kafka.session_timeout: how long a killed member's partitions wait
    /// for its session to expire before the group hands them on. Their
    /// pipeline.drain_timeout is 2 s shorter (it must be shorter, see config).
    #[arg(long, default_value = "10s")]
    session_timeout: humantime::Duration,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long after the last fault the counts may take to become exact.
    #[arg(long)]
    settle_timeout: Option<humantime::Duration>,
}

/// The defaults of a full run and of the CI run.
struct Preset {
    clicks: u64,
    kills: u32,
    replays: u32,
    rate: u64,
    partitions: i32,
    clickhouse_outage: Duration,
    settle_timeout: Duration,
    /// How long the group recovers after a disruption before the next one starts.
    calm: Duration,
    /// Also the gentle Redis restart (data kept), besides its kill and its loss.
    redis_restart: bool,
    /// The two cases at a topic's log start (`young`): records and rate of each young
    /// topic, and how long its counts may take to become exact after its last record.
    young_records: u64,
    young_rate: u64,
    young_settle_timeout: Duration,
}

const FULL: Preset = Preset {
    clicks: 5_000_000,
    kills: 20,
    replays: 3,
    rate: 10_000,
    partitions: 8,
    clickhouse_outage: Duration::from_secs(30),
    settle_timeout: Duration::from_secs(300),
    calm: Duration::from_secs(20),
    redis_restart: true,
    young_records: 16_000,
    young_rate: 800,
    young_settle_timeout: Duration::from_secs(120),
};

/// Every hard fault of the full run, in about the time the CI run took before the
/// Redis kill, the Redis loss and the zombie were added: a shorter calm between
/// disruptions, and no gentle Redis restart.
const REDUCED: Preset = Preset {
    clicks: 300_000,
    kills: 5,
    replays: 1,
    rate: 3_000,
    partitions: 4,
    clickhouse_outage: Duration::from_secs(12),
    settle_timeout: Duration::from_secs(180),
    calm: Duration::from_secs(12),
    redis_restart: false,
    young_records: 6_000,
    young_rate: 500,
    young_settle_timeout: Duration::from_secs(90),
};

/// Copies of clicks on other partitions (a producer that does not key by click ID),
/// whose recorded decisions every re-read must honour, and retries re-stamped into
/// another minute, which a pipeline counting a retry instead of its original gets wrong.
const CROSS_PARTITION_RATIO: f64 = 0.3;
const RETRY_DRIFT_RATIO: f64 = 0.3;

/// The run's settings, preset and flags resolved.
struct Config {
    cli: Cli,
    /// The preset with the flags that override it.
    run: Preset,
    settings: Settings,
}

impl Config {
    fn resolve(cli: Cli) -> Result<Config> {
        let p = if cli.reduced { REDUCED } else { FULL };
        let seed = cli.seed;
        let mut settings = Settings::default();
        settings.kafka.brokers = cli.brokers.clone();
        settings.kafka.topic = format!("chaos-{seed}-{}", chrono::Utc::now().format("%Y%m%dT%H%M%S"));
        settings.kafka.group = format!("{}-group", settings.kafka.topic);
        settings.redis.url = SecretUrl::new(cli.redis_url.clone());
        settings.redis.key_prefix = format!("{}:", settings.kafka.topic);
        settings.clickhouse.url = SecretUrl::new(cli.clickhouse_url.clone());
        settings.clickhouse.database = "chaos".into();
        settings.pipeline.batch_offsets = cli.batch_offsets;
        let run = Preset {
            clicks: cli.clicks.unwrap_or(p.clicks),
            kills: cli.kills.unwrap_or(p.kills),
            replays: cli.replays.unwrap_or(p.replays),
            rate: cli.rate.unwrap_or(p.rate),
            partitions: cli.partitions.unwrap_or(p.partitions),
            clickhouse_outage: cli.clickhouse_outage.map_or(p.clickhouse_outage, Into::into),
            settle_timeout: cli.settle_timeout.map_or(p.settle_timeout, Into::into),
            calm: p.calm,
            redis_restart: p.redis_restart,
            young_records: p.young_records,
            young_rate: p.young_rate,
            young_settle_timeout: p.young_settle_timeout,
        };
        let c = Config { cli, run, settings };
        ensure!(
            c.run.rate > 0 && c.run.clicks > 0 && c.run.partitions > 0,
            "--clicks, --rate and --partitions must be positive"
        );
        Ok(c)
    }

    fn drain_timeout(&self) -> Duration {
        Duration::from(self.cli.session_timeout).saturating_sub(Duration::from_secs(2)).max(Duration::from_secs(1))
    }

    fn production(&self) -> Duration {
        Duration::from_secs_f64(self.run.clicks as f64 / self.run.rate as f64)
    }

    /// Settings every child gets, as `CLICKAGG__` variables.
    fn child_env(&self) -> Vec<(String, String)> {
        let s = &self.settings;
        [
            ("CLICKAGG__KAFKA__BROKERS", s.kafka.brokers.clone()),
            ("CLICKAGG__KAFKA__TOPIC", s.kafka.topic.clone()),
            ("CLICKAGG__KAFKA__GROUP", s.kafka.group.clone()),
            ("CLICKAGG__KAFKA__SESSION_TIMEOUT", self.cli.session_timeout.to_string()),
            ("CLICKAGG__REDIS__URL", self.cli.redis_url.clone()),
            ("CLICKAGG__REDIS__KEY_PREFIX", s.redis.key_prefix.clone()),
            ("CLICKAGG__CLICKHOUSE__URL", self.cli.clickhouse_url.clone()),
            ("CLICKAGG__CLICKHOUSE__DATABASE", s.clickhouse.database.clone()),
            ("CLICKAGG__PIPELINE__BATCH_OFFSETS", s.pipeline.batch_offsets.to_string()),
            ("CLICKAGG__PIPELINE__DRAIN_TIMEOUT", humantime::format_duration(self.drain_timeout()).to_string()),
            ("CLICKAGG__LOG__FORMAT", "json".into()),
            // Sealing rounds often, so that members re-seal what `seal --through` sealed
            // while they go on writing it.
            ("CLICKAGG__SEAL__INTERVAL", "5s".into()),
            // The sink's debug line "flushing" is what a mid-flush kill waits for; the
            // flusher's say what was committed, for the evidence.
            ("RUST_LOG", "info,librdkafka=warn,clickagg::sink=debug,clickagg::flusher=debug".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// Restarting services is only safe on a stack of our own: the shared one on the
/// default ports serves other people's tests.
fn refuse_shared_stack(c: &Config) -> Result<()> {
    let var = |k: &str| std::env::var(k).ok();
    ensure!(
        var("CLICKAGG_STACK_DIR").is_some(),
        "CLICKAGG_STACK_DIR is not set: run through scripts/chaos, which starts a private stack"
    );
    let port_of = |url: &str| url.trim_end_matches('/').rsplit(':').next().map(str::to_string);
    for (name, url, default) in [
        ("KAFKA_PORT", c.cli.brokers.as_str(), "9092"),
        ("REDIS_PORT", c.cli.redis_url.as_str(), "6379"),
        ("CLICKHOUSE_HTTP_PORT", c.cli.clickhouse_url.as_str(), "8123"),
    ] {
        let port = port_of(url);
        ensure!(
            var(name).is_some() && var(name) == port,
            "{name} must be set to the port of {url}: the faults go to the stack scripts/stack sees"
        );
        ensure!(port.as_deref() != Some(default), "{url} is the shared stack's port; use a private stack");
    }
    Ok(())
}

/// Timestamped notes on stderr and in `events.log`.
#[derive(Clone)]
struct Log {
    t0: Instant,
    file: Arc<Mutex<std::fs::File>>,
}

impl Log {
    fn note(&self, msg: impl AsRef<str>) {
        let line = format!("[chaos {:>7.1}s] {}", self.t0.elapsed().as_secs_f64(), msg.as_ref());
        eprintln!("{line}");
        let _ = writeln!(self.file.lock().expect("not poisoned"), "{line}");
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let pids = match Pids::new(cli.work_dir.join("pids")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("chaos: {e:#}");
            return ExitCode::from(2);
        }
    };
    let interrupted = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let result = tokio::select! {
        r = run(cli, pids.clone()) => r,
        _ = interrupted => {
            pids.kill_all();
            eprintln!("chaos: interrupted; every member and replay it started was killed");
            return ExitCode::from(130);
        }
    };
    // Whatever happened, no child outlives the run.
    pids.kill_all();
    match result {
        Ok(outcome) => {
            println!("{}", outcome.table());
            if outcome.failures().is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("chaos: the run could not be carried out: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli, pids: Pids) -> Result<Outcome> {
    let c = Config::resolve(cli)?;
    refuse_shared_stack(&c)?;
    let work = c.cli.work_dir.clone();
    std::fs::create_dir_all(work.join("logs"))?;
    let log = Log { t0: Instant::now(), file: Arc::new(Mutex::new(std::fs::File::create(work.join("events.log"))?)) };
    let s = &c.settings;
    let bin = match &c.cli.clickagg {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("clickagg"),
    };
    ensure!(bin.is_file(), "{} not found: build it first (scripts/chaos does)", bin.display());
    let production = c.production();
    log.note(format!(
        "topic {} ({} partitions), {} records at {}/s ({:.0} s; copies on other partitions {}, retries re-stamped {}), \
         {} kills, {} replays, ClickHouse outage {:?}, seed {}",
        s.kafka.topic,
        c.run.partitions,
        c.run.clicks,
        c.run.rate,
        production.as_secs_f64(),
        CROSS_PARTITION_RATIO,
        RETRY_DRIFT_RATIO,
        c.run.kills,
        c.run.replays,
        c.run.clickhouse_outage,
        c.cli.seed
    ));
    let sink = Sink::new(&s.clickhouse);
    sink.migrate().await.context("migrating ClickHouse")?;
    let launcher = Launcher { bin, env: c.child_env(), logs: work.join("logs"), pids };

    // First the two cases at a topic's log start, each on a young topic of its own.
    let young = young::Setup {
        settings: s.clone(),
        launcher: launcher.clone(),
        redis_url: c.cli.redis_url.clone(),
        sink: sink.clone(),
        log: log.clone(),
        seed: c.cli.seed,
        sizes: young::Sizes {
            records: c.run.young_records,
            rate: c.run.young_rate,
            partitions: c.run.partitions,
            settle_timeout: c.run.young_settle_timeout,
        },
    };
    let log_start = young::run_both(&young).await.context("the cases at a topic's log start")?;
    for o in &log_start {
        log.note(format!("{}: {}", o.case.check(), o.summary()));
    }

    clickagg::source::ensure_topic(&s.kafka, &s.kafka.topic, c.run.partitions).await?;
    // The group, the monitor of its members and the sampler of its progress.
    let fleet: SharedFleet = Arc::new(tokio::sync::Mutex::new(Fleet::new(launcher)));
    for slot in 0..3 {
        fleet.lock().await.start(slot, &log)?;
    }
    let abort = CancellationToken::new();
    let monitor = tokio::spawn(inject::monitor(fleet.clone(), log.clone(), abort.clone()));
    let group_reader: BaseConsumer = clickagg::source::client_config(&s.kafka)
        .set("group.id", &s.kafka.group)
        .set("enable.auto.commit", "false")
        .create()?;
    let sampler = progress::Sampler::start(
        group_reader,
        s.kafka.topic.clone(),
        (0..c.run.partitions).collect(),
        progress::Stalls::new(c.cli.batch_offsets),
        log.t0,
    );

    // The records, at the rate asked, their record times following the wall clock.
    let start_ms = chrono::Utc::now().timestamp_millis();
    let spec = Spec {
        count: c.run.clicks,
        seed: c.cli.seed,
        start_ms,
        span: production,
        cross_partition_ratio: CROSS_PARTITION_RATIO,
        retry_drift_ratio: RETRY_DRIFT_RATIO,
        ..Spec::default()
    };
    let producer = tokio::spawn(produce(s.kafka.clone(), c.run.partitions, c.run.rate, spec, log.clone()));

    // The faults, meanwhile.
    let shape = Shape {
        production,
        kills: c.run.kills,
        replays: c.run.replays,
        seed: c.cli.seed,
        redis_restart: c.run.redis_restart,
    };
    let setup = inject::Setup {
        stack: c.cli.stack.clone(),
        stack_dir: std::env::var_os("CLICKAGG_STACK_DIR").map(PathBuf::from).context("CLICKAGG_STACK_DIR")?,
        session_timeout: c.cli.session_timeout.into(),
        calm: c.run.calm,
        clickhouse_outage: c.run.clickhouse_outage,
        start_ms,
        production,
    };
    let mut chaos = Chaos::new(setup, fleet.clone(), log.clone(), StdRng::seed_from_u64(c.cli.seed ^ 0x00c4_a05e));
    let began = Instant::now();
    let faults = async {
        for event in schedule::plan(&shape) {
            tokio::time::sleep_until((began + event.at).into()).await;
            chaos.inject(&event).await.with_context(|| format!("injecting {:?}", event.fault))?;
        }
        chaos.finish_restarts().await;
        chaos.finish_replays().await;
        anyhow::Ok(())
    };
    tokio::select! {
        r = faults => r?,
        _ = abort.cancelled() => bail!("members keep failing:\n{}", fleet.lock().await.incidents.join("\n")),
    }
    let truth = producer.await.context("producer task")??;
    log.note(format!("production done: {}", truth.summary()));

    // Every fault is over: the counts must become exact, and stay so through a drain.
    let settled =
        settle(&sink, &s.kafka.topic, &truth.counts, c.run.settle_timeout, Duration::from_secs(5), &log).await?;
    let (stall, commits_back) = sampler.stop();
    monitor.abort();
    log.note(if settled {
        "counts are exact; stopping the members"
    } else {
        "counts did not settle; stopping the members"
    });
    let members = fleet.lock().await.take_all();
    for p in members {
        let (label, log_path) = (p.label.clone(), p.log.clone());
        let code = p.terminate(Duration::from_secs(60)).await;
        if code != Some(0) {
            chaos.incident(format!(
                "{label} did not drain on SIGTERM (exit {code:?}): {}",
                children::tail(&log_path, 5)
            ));
        }
    }
    let actual = sink.billing(Some(&s.kafka.topic), None, None).await.context("reading billing counts")?;
    let diff = clickagg::verify::diff(&truth.counts, &actual);
    if !diff.is_exact() {
        log.note(format!("counts differ from the truth:\n{}", diff.report(40)));
    }
    let (seals, compared) = report::seal_disagreements(&sink, &s.kafka.topic, s.seal.slack).await?;
    log.note(format!("seals: {compared}"));
    for r in &seals {
        log.note(format!("seals: {r}"));
    }
    let (k, dlq) = (s.kafka.clone(), s.dead_letter_topic());
    let dead_letters = tokio::task::spawn_blocking(move || DeadLetters::read(&k, &dlq)).await??;

    let longest_outage = chaos.outages.values().copied().max().unwrap_or_default();
    let mut f = fleet.lock().await;
    let mut incidents = std::mem::take(&mut f.incidents);
    incidents.append(&mut chaos.incidents);
    Ok(Outcome {
        records_sent: c.run.clicks,
        clicks_sent: truth.clicks,
        duplicates_sent: truth.duplicates,
        drifted_sent: truth.drifted,
        diff,
        settled,
        settle_timeout: c.run.settle_timeout,
        seals,
        invalid_sent: truth.malformed.clone(),
        dead_letters,
        stall,
        commits_back,
        stall_limit: longest_outage + Duration::from_secs(30),
        kills: chaos.kills,
        peak_rss_kib: f.peak_rss_kib,
        peak_rss_of: f.peak_rss_of.clone(),
        faults: chaos.summary(),
        log_start,
        incidents,
        wall: log.t0.elapsed(),
    })
}

/// Sends the generator's records at `rate` and returns their ground truth.
async fn produce(k: KafkaSettings, partitions: i32, rate: u64, spec: Spec, log: Log) -> Result<Truth> {
    let total = spec.count;
    let mut generator = Generator::new(spec);
    let mut next_note = 0;
    clickagg::produce::send(&k, &k.topic, partitions, &mut generator, Some(rate), |n| {
        if n * 10 >= next_note * total {
            log.note(format!("produced {n} records"));
            next_note += 1;
        }
    })
    .await
    .context("producing")?;
    Ok(generator.into_truth())
}

/// Polls ClickHouse `every` so often until the counts equal the truth; `false` after
/// `timeout`.
async fn settle(
    sink: &Sink,
    topic: &str,
    truth: &Billing,
    timeout: Duration,
    every: Duration,
    log: &Log,
) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        match sink.billing(Some(topic), None, None).await {
            Ok(actual) => {
                let d = clickagg::verify::diff(truth, &actual);
                if d.is_exact() {
                    return Ok(true);
                }
                log.note(format!("settling {topic}: {} of {} clicks counted", d.clicks_actual, d.clicks_expected));
            }
            Err(e) => log.note(format!("settling {topic}: reading counts failed: {e}")),
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(every).await;
    }
}
