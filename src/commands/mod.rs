//! One function per subcommand: wiring settings to the library, printing results,
//! choosing exit codes. The work itself lives in the pipeline modules.

pub mod cli;
pub mod settings;
pub mod status;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::config::Settings;
use crate::health::Health;
use crate::member::Exit;
use crate::member::Member;
use crate::produce::{self, Spec, Truth};
use crate::reconcile::ReconcileArgs;
use crate::replay::ReplayArgs;
use crate::server;
use crate::sink::Sink;
use crate::status::Identity;
use crate::telemetry;
use crate::verify;
use cli::{Command, MigrateArgs, ProduceArgs, SealArgs, VerifyArgs};

// Exit codes, the same for every command (guide, "Exit codes"): 0 done; 1 could not
// run or stopped on an error (a service unreachable or refusing, a file unreadable);
// 2 a bad setting or flag (`main`, and clap's own usage errors).

/// `run`: the drain timeout passed before everything was flushed.
pub const EXIT_DRAIN_TIMEOUT: u8 = 3;
/// A check ran and found a problem: `verify` and `reconcile` counts that differ,
/// `status` a stalled partition. Apart from 1, so that a script can tell a wrong count
/// from a check that could not run.
pub const EXIT_CHECK_FAILED: u8 = 4;

pub async fn dispatch(command: Command, settings: Settings) -> Result<ExitCode> {
    match command {
        Command::Migrate(args) => migrate(settings, args).await,
        Command::Run => run(settings).await,
        Command::Produce(args) => produce(&settings, args).await,
        Command::Verify(args) => verify(&settings, args).await,
        Command::Query(args) => crate::query::run(&settings, &args).await,
        Command::Explain(args) => crate::explain::run(&settings, &args).await,
        Command::Close(args) => crate::close::run(&settings, &args).await,
        Command::Replay(args) => replay(&settings, args).await,
        Command::Reconcile(args) => reconcile(&settings, args).await,
        Command::Seal(args) => seal(&settings, args).await,
        Command::Status(args) => status::run(&settings, &args).await,
        Command::Settings(command) => settings::run(&settings, &command).await,
        Command::Config => {
            print!("{}", settings.to_redacted_toml());
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn migrate(mut s: Settings, args: MigrateArgs) -> Result<ExitCode> {
    if let Some(cluster) = args.cluster {
        s.clickhouse.cluster = Some(cluster);
        s.validate()?;
    }
    let sink = Sink::new(&s.clickhouse);
    let applied = sink.migrate().await.context("migrating ClickHouse")?;
    let on = sink.cluster().map(|c| format!(" on cluster {c}")).unwrap_or_default();
    for name in applied {
        println!("applied {name} to database {}{on}", sink.database());
    }
    Ok(ExitCode::SUCCESS)
}

/// Cancels `token` on the first SIGINT or SIGTERM.
fn cancel_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => info!("SIGINT received; draining"),
            _ = term.recv() => info!("SIGTERM received; draining"),
        }
        token.cancel();
    });
}

async fn run(s: Settings) -> Result<ExitCode> {
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone());
    let health = Health::new();
    let client_id = crate::source::member_client_id(&s.kafka);
    let identity = Identity::new(client_id, s.kafka.group.clone(), s.kafka.topic.clone(), s.batch_offsets());
    health.status().set_identity(identity);
    let metrics = telemetry::metrics();
    telemetry::register_zeroes(&crate::readiness::RedisTrouble::ALL.map(|t| t.label()));
    let http_stop = CancellationToken::new();
    if s.http.enabled {
        let (addr, _) = server::serve(s.http.addr, health.clone(), metrics.clone(), http_stop.clone())
            .await
            .with_context(|| format!("binding http.addr {}", s.http.addr))?;
        info!(%addr, "serving /metrics, /livez, /readyz and the status page /");
        tokio::spawn(crate::server::sample_forever(health.clone(), metrics, Duration::from_secs(1), http_stop.clone()));
        let probe_redis = crate::cache::SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic)?;
        tokio::spawn(server::probe(
            health.clone(),
            probe_redis,
            Sink::new(&s.clickhouse),
            Duration::from_secs(5),
            http_stop.clone(),
        ));
    }
    let result = Member { settings: s, health }.run(shutdown).await;
    http_stop.cancel();
    match result {
        Ok(Exit::Drained) => Ok(ExitCode::SUCCESS),
        Ok(Exit::DrainTimedOut) => Ok(ExitCode::from(EXIT_DRAIN_TIMEOUT)),
        Err(e) => {
            error!(error = %e, "stopping");
            Err(e.into())
        }
    }
}

async fn produce(s: &Settings, a: ProduceArgs) -> Result<ExitCode> {
    let start_ms = match &a.start {
        Some(t) => chrono::DateTime::parse_from_rfc3339(t).context("--start must be RFC 3339")?.timestamp_millis(),
        None => chrono::Utc::now().timestamp_millis() - a.span.as_millis() as i64,
    };
    for (name, v) in [
        ("duplicate", a.duplicate_ratio),
        ("late", a.late_ratio),
        ("malformed", a.malformed_ratio),
        ("cross-partition", a.cross_partition_ratio),
        ("retry-drift", a.retry_drift_ratio),
    ] {
        if !(0.0..=1.0).contains(&v) {
            bail!("--{name}-ratio must be between 0 and 1");
        }
    }
    let seed = a.seed.unwrap_or_else(rand::random);
    // Read first: a truth file that cannot be added to stops the run before it sends.
    let earlier = if a.add_to_truth && a.truth.exists() {
        Some(Truth::read_csv(&a.truth).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let spec = Spec {
        count: a.count,
        seed,
        ads: a.ads,
        zipf_exponent: a.zipf_exponent,
        duplicate_ratio: a.duplicate_ratio,
        late_ratio: a.late_ratio,
        malformed_ratio: a.malformed_ratio,
        cross_partition_ratio: a.cross_partition_ratio,
        retry_drift_ratio: a.retry_drift_ratio,
        start_ms,
        span: a.span.into(),
        encoding: match a.format {
            crate::config::Format::Json => produce::Encoding::Json,
            crate::config::Format::Avro => produce::Encoding::Avro { id: a.schema_id, revision: a.schema_revision },
            crate::config::Format::Protobuf => {
                produce::Encoding::Protobuf { id: a.schema_id, revision: a.schema_revision }
            }
        },
    };
    if let Some(dir) = &a.schema_dir {
        produce::write_schema_file(dir, spec.encoding)
            .with_context(|| format!("writing the schema to {}", dir.display()))?;
    }
    let (records, truth) = produce::plan(&spec);
    let write_truth =
        |truth: &Truth| truth.write_csv(&a.truth).with_context(|| format!("writing {}", a.truth.display()));
    if !a.add_to_truth {
        write_truth(&truth)?;
    }
    println!("seed {seed} (--seed {seed} sends the same records again)");
    let started = Instant::now();
    let bar = progress_bar(records.len() as u64, "producing");
    produce::send(&s.kafka, &s.kafka.topic, a.partitions, &records, Some(a.rate), |n| bar.set_position(n))
        .await
        .context("producing click events")?;
    bar.finish_and_clear();
    if a.add_to_truth {
        // Only once every record is in the topic: the file then always describes it.
        let mut total = truth.clone();
        for (bucket, clicks) in earlier.into_iter().flatten() {
            *total.counts.entry(bucket).or_default() += clicks;
        }
        write_truth(&total)?;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "sent {} records to {} in {:.1}s ({:.0}/s): {}",
        records.len(),
        s.kafka.topic,
        secs,
        records.len() as f64 / secs,
        truth.summary()
    );
    let added = if a.add_to_truth { " (this run's counts added to what it held)" } else { "" };
    println!("ground truth: {}{added}", a.truth.display());
    Ok(ExitCode::SUCCESS)
}

async fn verify(s: &Settings, a: VerifyArgs) -> Result<ExitCode> {
    let expected = Truth::read_csv(&a.expected).map_err(anyhow::Error::msg)?;
    let sink = Sink::new(&s.clickhouse);
    let topic = (!a.all_topics).then_some(s.kafka.topic.as_str());
    let actual = sink.billing(topic, None, None).await.context("reading billing counts")?;
    if a.print {
        println!("{:>20}  {:<20}  {:>8}", "ad_id", "minute", "clicks");
        for (k, c) in &actual {
            println!("{:>20}  {:<20}  {:>8}", k.ad_id, k.minute.to_rfc3339(), c);
        }
    }
    let d = verify::diff(&expected, &actual);
    print!("{}", d.report(20));
    Ok(check(d.is_exact()))
}

async fn replay(s: &Settings, a: ReplayArgs) -> Result<ExitCode> {
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone());
    let summary = crate::replay::replay(s, &a, shutdown.clone()).await?;
    println!("{}", summary.report());
    // Interrupted replays flushed what they read; say so with a non-zero status.
    Ok(if shutdown.is_cancelled() { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

async fn reconcile(s: &Settings, a: ReconcileArgs) -> Result<ExitCode> {
    let report = crate::reconcile::reconcile(s, &a).await?;
    print!("{}", report.render(a.limit));
    Ok(check(report.diff.is_exact()))
}

/// The exit code of a check that ran: 0 when it passed, [`EXIT_CHECK_FAILED`] otherwise.
fn check(passed: bool) -> ExitCode {
    if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CHECK_FAILED)
    }
}

/// `clickagg seal`: one round, retried while ClickHouse or Kafka are unavailable.
async fn seal(s: &Settings, a: SealArgs) -> Result<ExitCode> {
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone());
    let sink = Sink::new(&s.clickhouse);
    let sealer = match a.through {
        Some(t) => {
            let through = u32::try_from(t.timestamp()).context("--through is outside 1970..2106")?;
            crate::seal::Sealer::new(sink, &s.kafka.topic, crate::seal::Due::Through(through), s.seal.slack)
        }
        None => crate::seal::Sealer::for_group(s, sink),
    };
    let recompute_from = a
        .recompute_from
        .map(|t| u32::try_from(t.timestamp()))
        .transpose()
        .context("--recompute-from is outside 1970..2106")?;
    let started = Instant::now();
    let report =
        crate::retry::until_done("sealing", s.pipeline.max_backoff, &shutdown, || sealer.round(recompute_from))
            .await
            .map_err(|stopped| match stopped {
            crate::retry::Stopped::Fatal(e) => anyhow::Error::new(e),
            crate::retry::Stopped::ShutDown => anyhow::anyhow!("interrupted while sealing"),
        })?;
    println!("{} in {:.1}s", report.summary(), started.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

/// A progress bar on a terminal; hidden otherwise (logs carry progress there).
pub fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}
