//! Carrying the plan out: the group's members by slot (`Fleet`), the monitor that
//! samples their memory and notices members that exit on their own, and the injector
//! (`Chaos`) that executes the plan's faults one after the other.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::Rng;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::children::{self, Flushes, Launcher, Process};
use crate::schedule::{Event, Fault};
use crate::Log;

/// How long a mid-flush kill waits for its member to start a flush.
const FLUSH_WAIT: Duration = Duration::from_secs(15);

/// The group's members by slot (0–2 the group, 3 the member that joins and leaves).
pub struct Fleet {
    pub launcher: Launcher,
    /// Before each member's label (`m0-1`, `lost-m0-1`): the groups of the log-start
    /// cases have their own logs and PID files.
    name: String,
    /// The `http.addr` port of each slot, so members side by side never clash.
    pub http_ports: Vec<u16>,
    pub live: BTreeMap<usize, Process>,
    incarnations: BTreeMap<usize, u32>,
    pub peak_rss_kib: u64,
    pub peak_rss_of: String,
    /// Members that exited on their own, restarts that failed.
    pub incidents: Vec<String>,
}

pub type SharedFleet = Arc<tokio::sync::Mutex<Fleet>>;

impl Fleet {
    pub fn new(launcher: Launcher) -> Fleet {
        Fleet::named(launcher, "")
    }

    /// A fleet whose members' labels start with `name`.
    pub fn named(launcher: Launcher, name: &str) -> Fleet {
        Fleet {
            launcher,
            name: name.to_string(),
            http_ports: (0..4).map(|_| free_port()).collect(),
            live: BTreeMap::new(),
            incarnations: BTreeMap::new(),
            peak_rss_kib: 0,
            peak_rss_of: String::new(),
            incidents: Vec::new(),
        }
    }

    pub fn start(&mut self, slot: usize, log: &Log) -> Result<()> {
        let n = self.incarnations.entry(slot).or_insert(0);
        *n += 1;
        let label = format!("{}m{slot}-{n}", self.name);
        let addr = ("CLICKAGG__HTTP__ADDR".to_string(), format!("127.0.0.1:{}", self.http_ports[slot]));
        let p = self.launcher.spawn(&label, &["run"], &[addr])?;
        log.note(format!("started member {label} (pid {})", p.pid));
        self.live.insert(slot, p);
        Ok(())
    }

    /// Folds a member's peak memory in; sampled every second and before a kill.
    fn sample(&mut self, slot: usize) {
        let Some(p) = self.live.get(&slot) else { return };
        if let Some((_, hwm)) = children::memory_kib(p.pid) {
            if hwm > self.peak_rss_kib {
                self.peak_rss_kib = hwm;
                self.peak_rss_of = p.label.clone();
            }
        }
    }

    /// Takes a member out of the fleet to signal it, its memory sampled first.
    pub fn take(&mut self, slot: usize) -> Option<Process> {
        self.sample(slot);
        self.live.remove(&slot)
    }

    pub fn take_all(&mut self) -> Vec<Process> {
        let slots: Vec<usize> = self.live.keys().copied().collect();
        slots.into_iter().filter_map(|slot| self.take(slot)).collect()
    }
}

/// A free port below the kernel's ephemeral range (32768+), which an outgoing
/// connection could take between this check and the member's bind; never one handed
/// out before in this run (fleets side by side, their members not started yet).
fn free_port() -> u16 {
    static TAKEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().expect("not poisoned");
    loop {
        let port = rand::rng().random_range(20_000..32_000);
        if !taken.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            taken.push(port);
            return port;
        }
    }
}

/// Every second: the members' memory, and members that exited on their own (an
/// incident; restarted so the run goes on, unless the configuration is refused or
/// members keep failing: then `abort` is cancelled).
pub async fn monitor(fleet: SharedFleet, log: Log, abort: CancellationToken) {
    const EXIT_INVALID_CONFIGURATION: i32 = 2;
    const TOLERATED_FAILURES: usize = 5;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let mut f = fleet.lock().await;
        let slots: Vec<usize> = f.live.keys().copied().collect();
        for slot in slots {
            f.sample(slot);
            let exited = f.live.get_mut(&slot).and_then(Process::exited);
            if let Some(code) = exited {
                let p = f.live.remove(&slot).expect("present");
                let what = format!("{} exited on its own (exit {code:?}): {}", p.label, children::tail(&p.log, 5));
                log.note(&what);
                f.incidents.push(what);
                if code == Some(EXIT_INVALID_CONFIGURATION) || f.incidents.len() >= TOLERATED_FAILURES {
                    abort.cancel();
                    return;
                }
                if let Err(e) = f.start(slot, &log) {
                    f.incidents.push(format!("restarting slot {slot}: {e:#}"));
                }
            }
        }
    }
}

/// What the injector needs from the run's configuration.
pub struct Setup {
    pub stack: PathBuf,
    /// The private stack's directory (`CLICKAGG_STACK_DIR`): where Redis keeps its data.
    pub stack_dir: PathBuf,
    pub session_timeout: Duration,
    /// How long the group gets to recover after a disruption before the next one starts.
    pub calm: Duration,
    pub clickhouse_outage: Duration,
    /// The record time of the first record and the production span: replays name
    /// their ranges by record time.
    pub start_ms: i64,
    pub production: Duration,
}

/// The kills as they happened. A planned mid-flush kill counts as one only if the
/// killed member's log shows a flush started and not completed: a flush can finish in
/// the moment between its "flushing" line and the signal.
#[derive(Default, Debug, Clone, Copy)]
pub struct Kills {
    pub mid_flush: u32,
    /// Planned mid-flush, but the flush completed before the signal landed.
    pub flush_completed_first: u32,
    /// Planned mid-flush, but no flush with rows started within `FLUSH_WAIT`.
    pub flushing_never_came: u32,
    pub during_outage: u32,
    pub at_random: u32,
}

impl Kills {
    pub fn planned_mid_flush(&self) -> u32 {
        self.mid_flush + self.flush_completed_first + self.flushing_never_came
    }
}

/// The fault injector: executes the plan's events one after the other.
pub struct Chaos {
    setup: Setup,
    fleet: SharedFleet,
    launcher: Launcher,
    log: Log,
    rng: StdRng,
    /// Members killed and waiting to be started again.
    restarts: JoinSet<()>,
    replays: Vec<(String, String, Process)>,
    /// How long each service was unavailable, as measured around the scripts.
    pub outages: BTreeMap<&'static str, Duration>,
    /// The next disruption waits until then.
    calm_after: Instant,
    pub kills: Kills,
    rebalances: Vec<String>,
    replay_notes: Vec<String>,
    /// Replays and stops that failed.
    pub incidents: Vec<String>,
}

impl Chaos {
    pub fn new(setup: Setup, fleet: SharedFleet, log: Log, rng: StdRng) -> Chaos {
        let launcher = fleet.try_lock().expect("not shared yet").launcher.clone();
        Chaos {
            setup,
            fleet,
            launcher,
            log,
            rng,
            restarts: JoinSet::new(),
            replays: Vec::new(),
            outages: BTreeMap::new(),
            calm_after: Instant::now(),
            kills: Kills::default(),
            rebalances: Vec::new(),
            replay_notes: Vec::new(),
            incidents: Vec::new(),
        }
    }

    pub async fn inject(&mut self, event: &Event) -> Result<()> {
        if event.fault.is_outage() {
            self.finish_replays().await;
        }
        if event.fault.is_disruption() && Instant::now() < self.calm_after {
            let wait = self.calm_after - Instant::now();
            self.log.note(format!(
                "{:?} waits {:.0} s: the group recovers from the last disruption",
                event.fault,
                wait.as_secs_f64()
            ));
            tokio::time::sleep(wait).await;
        }
        match &event.fault {
            Fault::Kill { mid_flush: false } => {
                let slot = self.pick(0..4).await;
                self.kills.at_random += 1;
                let delay = self.rng.random_range(500..3_000);
                self.kill_and_restart(slot, "at a random moment", delay).await;
            }
            Fault::Kill { mid_flush: true } => self.kill_mid_flush().await,
            Fault::Join => {
                self.fleet.lock().await.start(3, &self.log)?;
                self.rebalances.push("join (a 4th member)".into());
            }
            Fault::Leave => self.leave().await,
            Fault::Crash => {
                let slot = self.pick(0..3).await;
                // Back only after its session expired: the group rebalances without it.
                let away = self.setup.session_timeout + Duration::from_secs(5);
                self.kill_and_restart(slot, "as the crash rebalance", away.as_millis() as u64).await;
                self.rebalances.push(format!("crash (slot {slot}, SIGKILL, back after {} s)", away.as_secs()));
                self.calm_after = Instant::now() + self.setup.session_timeout + self.setup.calm;
            }
            Fault::Zombie => self.zombie().await,
            Fault::RedisRestart => {
                let took = self.stack(&["restart", "redis"]).await?;
                self.outage("Redis restart (data kept)", took);
            }
            Fault::RedisKill => {
                let started = Instant::now();
                self.stack(&["kill", "redis"]).await?;
                self.stack(&["up", "redis"]).await?;
                self.outage("Redis SIGKILL (restarted from its append-only file)", started.elapsed());
            }
            Fault::RedisLost => {
                let started = Instant::now();
                self.stack(&["down", "redis"]).await?;
                let deleted = self.delete_redis_data()?;
                self.log.note(format!("deleted Redis's data: {}", deleted.join(", ")));
                self.stack(&["up", "redis"]).await?;
                self.outage("Redis lost (restarted without its data: the cache is empty)", started.elapsed());
            }
            Fault::ClickHouseOutage { kills } => self.clickhouse_outage(*kills).await?,
            Fault::BrokerRestart => {
                let took = self.stack(&["restart", "kafka"]).await?;
                self.outage("broker restart", took);
            }
            Fault::Replay { from, to } => {
                self.replay(*from, *to)?;
                self.seal()?;
            }
        }
        Ok(())
    }

    fn outage(&mut self, what: &'static str, took: Duration) {
        self.outages.insert(what, took);
        self.calm_after = Instant::now() + self.setup.calm;
    }

    /// Deletes what Redis persists (the append-only files, a snapshot), while it is down;
    /// the names of what was there. None is a failure: the fault would not be injected.
    fn delete_redis_data(&self) -> Result<Vec<String>> {
        let dir = self.setup.stack_dir.join("redis");
        let mut deleted = Vec::new();
        for name in ["appendonlydir", "appendonly.aof", "dump.rdb"] {
            let path = dir.join(name);
            let gone = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            match gone {
                Ok(()) => deleted.push(name.to_string()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("deleting {}", path.display())),
            }
        }
        if deleted.is_empty() {
            bail!("no Redis data in {} to delete", dir.display());
        }
        Ok(deleted)
    }

    /// A member killed right after it logs that a flush with rows starts, and restarted;
    /// its log then tells whether the kill came while the flush was in flight.
    async fn kill_mid_flush(&mut self) {
        let slot = self.pick(0..4).await;
        let flushes = self.fleet.lock().await.live.get(&slot).map(|p| p.flushes.clone());
        let started = match flushes {
            Some(mut rx) => {
                let before = rx.borrow_and_update().started;
                tokio::time::timeout(FLUSH_WAIT, rx.wait_for(|f| f.started > before || f.ended))
                    .await
                    .is_ok_and(|r| r.is_ok_and(|f| f.started > before))
            }
            None => false,
        };
        let delay = self.rng.random_range(500..3_000);
        if !started {
            self.kills.flushing_never_came += 1;
            let how = format!("after waiting {} s in vain for a flush to start (not mid-flush)", FLUSH_WAIT.as_secs());
            self.kill_and_restart(slot, &how, delay).await;
            return;
        }
        match self.kill_and_restart(slot, "right after it logged \"flushing\"", delay).await {
            Some(f) if f.in_flight => {
                self.kills.mid_flush += 1;
                self.log.note("  its log shows the flush in flight: the kill landed mid-flush");
            }
            _ => {
                self.kills.flush_completed_first += 1;
                self.log.note("  its log shows the flush completed before the kill landed: not mid-flush");
            }
        }
    }

    /// A member frozen (SIGSTOP) past its session timeout, so the group hands its
    /// partitions on, then thawed (SIGCONT): it resumes with the state it had, a zombie,
    /// until it learns it was fenced.
    async fn zombie(&mut self) {
        let slot = self.pick(0..3).await;
        // Out of the fleet while frozen: nothing else signals it meanwhile.
        let Some(mut p) = self.fleet.lock().await.take(slot) else { return };
        let frozen_for = self.setup.session_timeout + Duration::from_secs(5);
        p.freeze(true);
        self.log.note(format!("SIGSTOP {}: frozen for {} s", p.label, frozen_for.as_secs()));
        tokio::time::sleep(frozen_for).await;
        p.freeze(false);
        self.log.note(format!("SIGCONT {}: back as a zombie", p.label));
        self.rebalances.push(format!("zombie ({}, SIGSTOP {} s, then SIGCONT)", p.label, frozen_for.as_secs()));
        // Nothing starts a slot whose member is alive, but never two members in a slot.
        let spare = match self.fleet.lock().await.live.entry(slot) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(p);
                None
            }
            std::collections::btree_map::Entry::Occupied(_) => Some(p),
        };
        if let Some(p) = spare {
            p.kill().await;
        }
        self.calm_after = Instant::now() + self.setup.session_timeout + self.setup.calm;
    }

    /// ClickHouse SIGKILLed (gone at once, inserts in flight cut off; a SIGTERM lets the
    /// server wait up to 30 s for its connections), `kills` members killed while their
    /// flushes are retried, then ClickHouse started again.
    async fn clickhouse_outage(&mut self, kills: u32) -> Result<()> {
        self.stack(&["kill", "clickhouse"]).await?;
        let down = Instant::now();
        let outage = self.setup.clickhouse_outage;
        for j in 1..=kills {
            tokio::time::sleep_until((down + outage.mul_f64(f64::from(j) / f64::from(kills + 1))).into()).await;
            let slot = self.pick(0..4).await;
            self.kills.during_outage += 1;
            let delay = self.rng.random_range(500..3_000);
            self.kill_and_restart(slot, "while ClickHouse is down (its flushes retrying)", delay).await;
        }
        tokio::time::sleep_until((down + outage).into()).await;
        self.stack(&["up", "clickhouse"]).await?;
        self.outage("ClickHouse outage", down.elapsed());
        Ok(())
    }

    /// The fourth member leaves: SIGTERM, and it must drain and exit 0.
    async fn leave(&mut self) {
        self.pick(3..4).await;
        let p = self.fleet.lock().await.take(3).expect("picked");
        let (label, log) = (p.label.clone(), p.log.clone());
        self.log.note(format!("SIGTERM {label}: it drains and leaves"));
        let code = p.terminate(Duration::from_secs(60)).await;
        self.log.note(format!("{label} left (exit {code:?})"));
        if code != Some(0) {
            self.incident(format!(
                "{label} did not leave cleanly on SIGTERM (exit {code:?}): {}",
                children::tail(&log, 5)
            ));
        }
        self.rebalances.push(format!("leave ({label}, SIGTERM, exit {code:?})"));
    }

    /// A live member among `slots`, chosen at random; waits while none is live (all
    /// of them killed a moment ago and about to restart).
    async fn pick(&mut self, slots: std::ops::Range<usize>) -> usize {
        loop {
            let live: Vec<usize> = self.fleet.lock().await.live.keys().copied().filter(|s| slots.contains(s)).collect();
            if !live.is_empty() {
                return live[self.rng.random_range(0..live.len())];
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILLs `slot`'s member and restarts it after a while; what its log said of its
    /// flushes, once complete (`None`: no member in that slot).
    async fn kill_and_restart(&mut self, slot: usize, how: &str, restart_after_ms: u64) -> Option<Flushes> {
        let p = self.fleet.lock().await.take(slot)?;
        let label = p.label.clone();
        let flushes = p.kill().await;
        self.log.note(format!("SIGKILL {label} {how}; restart in {:.1} s", restart_after_ms as f64 / 1000.0));
        let (fleet, log) = (self.fleet.clone(), self.log.clone());
        self.restarts.spawn(async move {
            tokio::time::sleep(Duration::from_millis(restart_after_ms)).await;
            let mut f = fleet.lock().await;
            if let Err(e) = f.start(slot, &log) {
                f.incidents.push(format!("restarting slot {slot}: {e:#}"));
            }
        });
        Some(flushes)
    }

    /// Runs `scripts/stack ARGS` on the private stack; how long it took.
    async fn stack(&self, args: &[&str]) -> Result<Duration> {
        self.log.note(format!("scripts/stack {}", args.join(" ")));
        let started = Instant::now();
        let out = tokio::process::Command::new(&self.setup.stack).args(args).output().await?;
        if !out.status.success() {
            bail!("scripts/stack {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        let took = started.elapsed();
        self.log.note(format!("scripts/stack {} done in {:.1} s", args.join(" "), took.as_secs_f64()));
        Ok(took)
    }

    /// Starts `clickagg replay` over the records sent between two fractions of the
    /// production span, by record time.
    fn replay(&mut self, from: f64, to: Option<f64>) -> Result<()> {
        let time = |fraction: f64| {
            let ms = self.setup.start_ms + (self.setup.production.as_millis() as f64 * fraction) as i64;
            let t = chrono::DateTime::from_timestamp_millis(ms).context("a record time of this run")?;
            anyhow::Ok(t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        };
        let (from_t, to_t) = (time(from)?, to.map_or(Ok("latest".to_string()), time)?);
        let label = format!("replay-{}", self.replay_notes.len() + self.replays.len() + 1);
        let p = self.launcher.spawn(&label, &["replay", "--from", &from_t, "--to", &to_t], &[])?;
        self.log.note(format!("started {label} --from {from_t} --to {to_t} (pid {})", p.pid));
        self.replays.push((label, format!("{from_t} .. {to_t}"), p));
        Ok(())
    }

    /// Starts `clickagg seal --through` the end of the current hour: the hour the members
    /// are still writing gets sealed, and their later writes must re-seal it.
    fn seal(&mut self) -> Result<()> {
        let now = (chrono::Utc::now() + chrono::Duration::hours(1)).format("%Y-%m-%dT%H:%M:%SZ").to_string();
        let label = format!("seal-{}", self.replay_notes.len() + self.replays.len() + 1);
        let p = self.launcher.spawn(&label, &["seal", "--through", &now], &[])?;
        self.log.note(format!("started {label} --through {now} (pid {})", p.pid));
        self.replays.push((label, format!("through {now}"), p));
        Ok(())
    }

    /// Waits for the replays (and seals) started so far; a failed one is an incident.
    pub async fn finish_replays(&mut self) {
        for (label, range, p) in std::mem::take(&mut self.replays) {
            let log = p.log.clone();
            let code = p.wait().await;
            let summary = children::tail(&log, 40)
                .lines()
                .rev()
                .find(|l| l.starts_with("replayed ") || l.starts_with("sealed "))
                .map(|l| l.split(';').next().unwrap_or(l).to_string())
                .unwrap_or_default();
            self.log.note(format!("{label} exited {code:?}: {summary}"));
            self.replay_notes.push(format!("{label} {range}: exit {code:?}, {summary}"));
            if code != Some(0) {
                self.incident(format!("{label} failed (exit {code:?}): {}", children::tail(&log, 5)));
            }
        }
    }

    /// Every restart of a killed member is done.
    pub async fn finish_restarts(&mut self) {
        while self.restarts.join_next().await.is_some() {}
    }

    pub fn incident(&mut self, what: String) {
        self.log.note(&what);
        self.incidents.push(what);
    }

    /// What was injected, for the table.
    pub fn summary(&self) -> Vec<String> {
        let k = &self.kills;
        let total = k.planned_mid_flush() + k.during_outage + k.at_random;
        let mut out = vec![
            format!(
                "{total} SIGKILLs, each restarted: {} planned mid-flush, {} during the ClickHouse outage, {} at random",
                k.planned_mid_flush(),
                k.during_outage,
                k.at_random
            ),
            format!(
                "mid-flush kills: {} landed with a flush in flight, {} after it completed, {} found no flush in {} s",
                k.mid_flush,
                k.flush_completed_first,
                k.flushing_never_came,
                FLUSH_WAIT.as_secs()
            ),
        ];
        out.push(format!("rebalances: {}", self.rebalances.join("; ")));
        for (what, took) in &self.outages {
            out.push(format!("{what}: {:.0} s unavailable", took.as_secs_f64()));
        }
        out.extend(self.replay_notes.iter().cloned());
        out
    }
}

/// Deletes the keys under `prefix` that `which` picks, as `redis-cli --scan --pattern
/// 'PREFIX*' | xargs redis-cli unlink` does, while Redis runs on (what a clean-up of
/// its keys or a failover to an empty replica does to running members): how many
/// there were.
pub async fn delete_cache_keys(redis_url: &str, prefix: &str, which: impl Fn(&str) -> bool) -> Result<usize> {
    if prefix.is_empty() || prefix.contains(['*', '?', '[', ']', '\\']) {
        bail!("{prefix:?} is not a literal key prefix");
    }
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(30)));
    let mut conn = redis::Client::open(redis_url)?.get_multiplexed_async_connection_with_config(&config).await?;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1_000)
            .query_async(&mut conn)
            .await
            .context("SCAN")?;
        keys.extend(batch.into_iter().filter(|k| which(k)));
        if next == 0 {
            break;
        }
        cursor = next;
    }
    for chunk in keys.chunks(500) {
        let () = redis::cmd("UNLINK").arg(chunk).query_async(&mut conn).await.context("UNLINK")?;
    }
    Ok(keys.len())
}
