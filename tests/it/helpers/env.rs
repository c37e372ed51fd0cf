//! The test environment: every test gets its own topic, consumer group, Redis key
//! prefix and ClickHouse database on the real services started by `scripts/stack up`.
//!
//! A missing service fails the test with a message saying how to start it; nothing
//! is skipped.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::config::Settings;
use clickagg::produce::{self, Planned, Spec, Truth};
use clickagg::replay::{StartAt, StopAt};
use clickagg::sink::Sink;
use rand::Rng;

use super::process::Member;
use super::stack::PrivateStack;
use super::wait::wait_until;

pub const BIN: &str = env!("CARGO_BIN_EXE_clickagg");

/// `seal.slack` of every test: a single ClickHouse server, whose inserts are readable
/// at once. A sealed hour is read from the sealed tables only once a seal was computed
/// more than this after the hour's last write.
pub const SEAL_SLACK: Duration = Duration::from_secs(1);
/// How long a test's sealing round is retried while it fails transiently.
pub const SEAL_RETRY_FOR: Duration = Duration::from_secs(120);

/// Service endpoints: `scripts/stack env` defaults, overridable like the product's.
pub fn brokers() -> String {
    std::env::var("CLICKAGG__KAFKA__BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}
pub fn redis_url() -> String {
    std::env::var("CLICKAGG__REDIS__URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}
pub fn clickhouse_url() -> String {
    std::env::var("CLICKAGG__CLICKHOUSE__URL").unwrap_or_else(|_| "http://127.0.0.1:8123".into())
}

fn host_port(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    rest.split('/').next().unwrap_or(rest).to_string()
}

/// Panics (fails the test) unless all three services accept connections.
pub fn require_services() {
    for (name, addr) in [
        ("Kafka", brokers().split(',').next().unwrap().to_string()),
        ("Redis", host_port(&redis_url())),
        ("ClickHouse", host_port(&clickhouse_url())),
    ] {
        let ok = addr.parse().ok().and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(3)).ok()).is_some();
        assert!(ok, "{name} is not reachable at {addr}: start the services with `scripts/stack up`");
    }
}

/// One test's isolated slice of the services.
pub struct TestEnv {
    pub brokers: String,
    pub redis_url: String,
    pub clickhouse_url: String,
    /// CA of a private ClickHouse HTTPS endpoint (`clickhouse.tls_ca_file`).
    pub clickhouse_ca: Option<PathBuf>,
    pub topic: String,
    pub group: String,
    pub redis_prefix: String,
    pub database: String,
    /// The ClickHouse cluster the tables live on (`clickhouse.cluster`), if any.
    pub clickhouse_cluster: Option<String>,
    /// Members find their Redis through these Sentinels (`redis.sentinel.urls`, master
    /// `clickagg`) instead of `redis_url`, which the test itself keeps using.
    pub redis_sentinels: Option<String>,
    pub batch_offsets: u64,
    pub log_dir: PathBuf,
    /// Extra `CLICKAGG__…` variables for every member.
    pub extra_env: Vec<(String, String)>,
}

impl TestEnv {
    pub async fn new(name: &str) -> TestEnv {
        require_services();
        Self::on(name, brokers(), redis_url(), clickhouse_url()).await
    }

    /// A test whose members use a private stack for some services (fault tests).
    pub async fn with_stack(name: &str, stack: &PrivateStack) -> TestEnv {
        require_services();
        Self::on(
            name,
            stack.brokers().unwrap_or_else(brokers),
            stack.redis_url().unwrap_or_else(redis_url),
            stack.clickhouse_url().unwrap_or_else(clickhouse_url),
        )
        .await
    }

    /// A test on the cluster stack (`scripts/stack up cluster`): three brokers, a Redis
    /// Cluster, ClickHouse tables replicated and sharded over the cluster's nodes.
    #[allow(dead_code)] // the cluster test target's
    pub async fn on_cluster(name: &str) -> TestEnv {
        let c = super::cluster::ClusterStack::require();
        Self::on_services(name, c.brokers(), c.redis_url(), c.clickhouse_url(), Some(c.clickhouse_cluster())).await
    }

    async fn on(name: &str, brokers: String, redis_url: String, clickhouse_url: String) -> TestEnv {
        Self::on_services(name, brokers, redis_url, clickhouse_url, None).await
    }

    async fn on_services(
        name: &str,
        brokers: String,
        redis_url: String,
        clickhouse_url: String,
        clickhouse_cluster: Option<String>,
    ) -> TestEnv {
        let tag: u32 = rand::rng().random();
        let tag = format!("{tag:08x}");
        let log_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("it-logs").join(format!("{name}-{tag}"));
        std::fs::create_dir_all(&log_dir).unwrap();
        let env = TestEnv {
            brokers,
            redis_url,
            clickhouse_url,
            clickhouse_ca: None,
            topic: format!("it-{name}-{tag}"),
            group: format!("it-{name}-{tag}"),
            redis_prefix: format!("it:{name}:{tag}:"),
            database: format!("it_{name}_{tag}"),
            clickhouse_cluster,
            redis_sentinels: None,
            batch_offsets: 1_000,
            log_dir,
            extra_env: Vec::new(),
        };
        eprintln!("test environment {}: members' logs in {}", env.topic, env.log_dir.display());
        env.migrate().await;
        env
    }

    /// Creates this test's tables. A transient error is retried, as a member retries
    /// it: on the cluster stack a ZooKeeper restart in the test before leaves the
    /// replicated tables' sessions expired for up to ten seconds (measured on 18.16).
    async fn migrate(&self) {
        wait_until("this test's tables are created", Duration::from_secs(120), || async {
            match self.sink().migrate().await {
                Ok(_) => Ok(()),
                Err(e) if e.is_fatal() => panic!("migrate: {e}"),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
    }

    /// Settings as a member would load them (no file, this test's names).
    pub fn settings(&self) -> Settings {
        let mut s = Settings::default();
        s.kafka.brokers = self.brokers.clone();
        s.kafka.topic = self.topic.clone();
        s.kafka.group = self.group.clone();
        s.redis.url = clickagg::config::SecretUrl::new(self.redis_url.clone());
        s.redis.key_prefix = self.redis_prefix.clone();
        s.clickhouse.url = clickagg::config::SecretUrl::new(self.clickhouse_url.clone());
        s.clickhouse.tls_ca_file = self.clickhouse_ca.clone();
        s.clickhouse.database = self.database.clone();
        s.clickhouse.cluster = self.clickhouse_cluster.clone();
        s.pipeline.batch_offsets = self.batch_offsets;
        s.seal.slack = SEAL_SLACK;
        s
    }

    pub fn sink(&self) -> Sink {
        let s = self.settings();
        Sink::new(&s.clickhouse).with_seal_slack(s.seal.slack)
    }

    /// The environment of a member process.
    pub fn member_env(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = [
            ("CLICKAGG__KAFKA__BROKERS", self.brokers.clone()),
            ("CLICKAGG__KAFKA__TOPIC", self.topic.clone()),
            ("CLICKAGG__KAFKA__GROUP", self.group.clone()),
            ("CLICKAGG__KAFKA__SESSION_TIMEOUT", "6s".into()),
            ("CLICKAGG__REDIS__URL", self.redis_url.clone()),
            ("CLICKAGG__REDIS__KEY_PREFIX", self.redis_prefix.clone()),
            ("CLICKAGG__CLICKHOUSE__URL", self.clickhouse_url.clone()),
            ("CLICKAGG__CLICKHOUSE__DATABASE", self.database.clone()),
            ("CLICKAGG__PIPELINE__BATCH_OFFSETS", self.batch_offsets.to_string()),
            ("CLICKAGG__PIPELINE__FLUSH_INTERVAL", "200ms".into()),
            ("CLICKAGG__PIPELINE__DRAIN_TIMEOUT", "5s".into()),
            ("CLICKAGG__PIPELINE__MAX_BACKOFF", "1s".into()),
            ("CLICKAGG__SEAL__SLACK", humantime::format_duration(SEAL_SLACK).to_string()),
            ("CLICKAGG__HTTP__ADDR", "127.0.0.1:0".into()),
            ("CLICKAGG__LOG__FORMAT", "json".into()),
            ("RUST_LOG", "clickagg=debug,librdkafka=warn,info".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(sentinels) = &self.redis_sentinels {
            v.retain(|(k, _)| k != "CLICKAGG__REDIS__URL");
            v.push(("CLICKAGG__REDIS__SENTINEL__URLS".into(), sentinels.clone()));
            v.push(("CLICKAGG__REDIS__SENTINEL__MASTER".into(), "clickagg".into()));
        }
        if let Some(ca) = &self.clickhouse_ca {
            v.push(("CLICKAGG__CLICKHOUSE__TLS_CA_FILE".into(), ca.display().to_string()));
        }
        if let Some(cluster) = &self.clickhouse_cluster {
            v.push(("CLICKAGG__CLICKHOUSE__CLUSTER".into(), cluster.clone()));
        }
        v.extend(self.extra_env.iter().cloned());
        v
    }

    /// Starts `clickagg <args>` as a child process with this test's settings.
    pub fn spawn(&self, label: &str, args: &[&str], extra: &[(&str, &str)]) -> Member {
        Member::start(label, self.command(args, extra), self.log_dir.join(format!("{label}.log")))
    }

    /// `clickagg <args>` with this test's settings, not started.
    pub fn command(&self, args: &[&str], extra: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args);
        // The parent's CLICKAGG__ variables must not leak into members.
        for (k, _) in std::env::vars() {
            if k.starts_with("CLICKAGG__") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.member_env());
        cmd.envs(extra.iter().map(|&(k, v)| (k, v)));
        cmd
    }

    pub fn spawn_member(&self, label: &str) -> Member {
        self.spawn(label, &["run"], &[])
    }

    /// Plans `spec` for this test (event times ending now).
    pub fn plan(&self, spec: Spec) -> (Vec<Planned>, Truth) {
        let start_ms = chrono::Utc::now().timestamp_millis() - spec.span.as_millis() as i64;
        produce::plan(&Spec { start_ms, ..spec })
    }

    pub async fn send(&self, records: &[Planned], partitions: i32, rate: Option<u64>) {
        produce::send(&self.settings().kafka, &self.topic, partitions, records, rate, |_| {}).await.expect("produce");
    }

    /// Produces `records` in the background at `rate` records/s, while the test goes on.
    pub fn spawn_producer(&self, records: &[Planned], partitions: i32, rate: u64) -> Producing {
        let settings = self.settings();
        let topic = self.topic.clone();
        let records = records.to_vec();
        // Sending at `rate`, plus the rounds that send again what a broker outage
        // stranded: anything longer is a hang, reported as one.
        let limit = Duration::from_secs_f64(records.len() as f64 / rate.max(1) as f64) + Duration::from_secs(240);
        let task = tokio::spawn(async move {
            produce::send(&settings.kafka, &topic, partitions, &records, Some(rate), |_| {}).await.expect("produce")
        });
        Producing { task, limit }
    }

    /// A connection to this test's Redis.
    pub async fn redis(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.redis_url.as_str()).expect("redis URL");
        // The client's default 500 ms per reply is too short for a SCAN of a loaded Redis
        // on a busy CI machine; a test that waits on Redis fails by its own deadline.
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(30)));
        client.get_multiplexed_async_connection_with_config(&config).await.expect("connect to Redis")
    }

    /// The names of every Redis key under this test's prefix (its dedup state).
    pub async fn dedup_keys(&self) -> Vec<String> {
        let mut conn = self.redis().await;
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.redis_prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            keys.extend(batch);
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }

    pub async fn dedup_key_count(&self) -> usize {
        self.dedup_keys().await.len()
    }

    /// Deletes this test's dedup state at once, as the end of the dedup window, a Redis
    /// restarted without persistence or a `FLUSHALL` would; returns how many keys there
    /// were. One transaction: deleted in chunks, a running member would claim between
    /// them against a cache that lost some chains but still has its namespace and
    /// frontiers — a partial loss, which can count a duplicate twice (guide, "Deploying
    /// as a consumer group", Redis), not the loss these tests are about.
    pub async fn delete_dedup_keys(&self) -> usize {
        let keys = self.dedup_keys().await;
        if keys.is_empty() {
            return 0;
        }
        let mut conn = self.redis().await;
        let mut all = redis::pipe();
        all.atomic();
        for chunk in keys.chunks(500) {
            all.cmd("UNLINK").arg(chunk).ignore();
        }
        let _: () = all.query_async(&mut conn).await.expect("UNLINK");
        keys.len()
    }

    /// Deletes every row of this test's topic from the count tables (the minute rows
    /// and everything sealed from them), keeping the recorded cross-partition decisions
    /// (`clickagg_pins`) and the batch size (`clickagg_topics`). A re-read into tables a member already filled
    /// proves nothing: a member's row outranks a replay's at the same offset (version
    /// 2·offset + rank), so an under-count or an ignored pin stays hidden. Into emptied
    /// tables, what the re-read writes is all there is.
    pub async fn empty_count_tables(&self) {
        self.delete_count_rows("1").await;
    }

    /// Deletes the rows of the batches that start in `[from, to)` of each partition
    /// named: the batches a re-read from `from` rewrites whole, so that only its rows
    /// decide them while the rows before `from` stay as the live run wrote them. The
    /// topic's seals go too: they were computed from the deleted rows (deleting minute
    /// rows is outside what a seal's version follows; guide, "Sealed hours").
    pub async fn empty_count_batches(&self, batches: &BTreeMap<i32, (i64, i64)>) {
        assert!(!batches.is_empty(), "no batches to empty");
        let any: Vec<String> = batches
            .iter()
            .map(|(p, (from, to))| format!("(partition = {p} AND batch_start >= {from} AND batch_start < {to})"))
            .collect();
        self.delete_count_rows(&any.join(" OR ")).await;
    }

    /// `ALTER TABLE … DELETE` (ClickHouse 18.16 has no lightweight DELETE; this is a
    /// mutation, applied in the background), then waits until every mutation of the
    /// test's database is done and no such row is left.
    async fn delete_count_rows(&self, condition: &str) {
        let sink = self.sink();
        let topic = clickagg::sink::quote_literal(&self.topic);
        let database = clickagg::sink::quote_literal(&self.database);
        let sealed = [
            "ad_clicks_sealed_hour",
            "ad_clicks_sealed_day",
            "clickagg_seals",
            "clickagg_touched",
            "clickagg_seal_progress",
        ];
        let tables: Vec<(&str, &str)> =
            std::iter::once(("ad_clicks_minute", condition)).chain(sealed.iter().map(|&t| (t, "1"))).collect();
        for &(table, condition) in &tables {
            sink.execute(&format!("ALTER TABLE {table} DELETE WHERE topic = {topic} AND ({condition})"))
                .await
                .unwrap_or_else(|e| panic!("deleting from {table}: {e}"));
        }
        wait_until("the count rows are deleted", Duration::from_secs(60), || async {
            let pending: u64 = sink
                .client()
                .query(&format!("SELECT count() FROM system.mutations WHERE database = {database} AND is_done = 0"))
                .fetch_one()
                .await
                .map_err(|e| e.to_string())?;
            let mut left = Vec::new();
            for &(table, condition) in &tables {
                let n: u64 = sink
                    .client()
                    .query(&format!("SELECT count() FROM {table} WHERE topic = {topic} AND ({condition})"))
                    .fetch_one()
                    .await
                    .map_err(|e| e.to_string())?;
                left.push(n);
            }
            if pending == 0 && left.iter().all(|&n| n == 0) {
                Ok(())
            } else {
                Err(format!("{pending} mutations pending; rows left in {tables:?}: {left:?}"))
            }
        })
        .await;
    }

    /// The batches a replay `--from from` rewrites whole, per partition: from the
    /// boundary it starts at to the log end (a replay reads to the end).
    pub async fn replayed_batches(&self, from: &str) -> BTreeMap<i32, (i64, i64)> {
        let (settings, from) = (self.settings(), from.parse::<StartAt>().expect("a --from of replay"));
        let (counted, _, _) =
            tokio::task::spawn_blocking(move || clickagg::replay::counted_ranges(&settings, &from, StopAt::Latest))
                .await
                .unwrap()
                .expect("the replay's plan");
        counted.partitions
    }

    /// Replays from `from` to the end twice, and checks after each that the counts are
    /// `expected` and the seals agree: over the rows already there, then with the
    /// batches the replay rewrites deleted first, so that its own rows are all there is.
    pub async fn replay_checked(&self, label: &str, from: &str, expected: &BTreeMap<BucketKey, u64>) {
        self.replay_to_end(&format!("{label}-over-live-rows"), from).await;
        self.assert_counts_exact(expected, &format!("{label} --from {from}, over the live rows")).await;
        self.empty_count_batches(&self.replayed_batches(from).await).await;
        self.replay_to_end(&format!("{label}-into-emptied-tables"), from).await;
        self.assert_counts_exact(expected, &format!("{label} --from {from}, into emptied tables")).await;
    }

    /// `clickagg replay --from from`, which must exit 0; its output.
    pub async fn replay_to_end(&self, label: &str, from: &str) -> String {
        let mut p = self.spawn(label, &["replay", "--from", from], &[]);
        let code = p.wait(Duration::from_secs(300)).await;
        assert_eq!(code, 0, "{label} exited {code}:\n{}", p.output());
        p.output()
    }

    /// Cross-partition decisions the live members recorded for this test's topic.
    pub async fn pin_count(&self) -> u64 {
        let topic = clickagg::sink::quote_literal(&self.topic);
        self.sink()
            .client()
            .query(&format!("SELECT count() FROM clickagg_pins WHERE topic = {topic}"))
            .fetch_one()
            .await
            .expect("counting pins")
    }

    pub async fn billing(&self) -> BTreeMap<BucketKey, u64> {
        self.sink().billing(Some(&self.topic), None, None).await.expect("billing")
    }

    /// [`billing`](Self::billing) for a wait: a transient error (a server down, or its
    /// ZooKeeper session expired after an outage the test made) is "not yet", a fatal
    /// one still fails the test.
    async fn billing_when_readable(&self) -> Result<BTreeMap<BucketKey, u64>, String> {
        match self.sink().billing(Some(&self.topic), None, None).await {
            Ok(b) => Ok(b),
            Err(e) if e.is_fatal() => panic!("billing: {e}"),
            Err(e) => Err(format!("billing not readable: {e}")),
        }
    }

    /// Waits until the billing counts equal `expected`, then checks they stay equal for
    /// a while (a late over-count would show up there), and that sealing every hour
    /// gives what the minute rows say. Panics with a diff otherwise.
    pub async fn assert_counts_converge(&self, expected: &BTreeMap<BucketKey, u64>, timeout: Duration) {
        self.assert_counts_settle(expected, timeout).await;
        self.assert_seals_agree().await;
    }

    /// [`assert_counts_converge`](Self::assert_counts_converge) without sealing.
    pub async fn assert_counts_settle(&self, expected: &BTreeMap<BucketKey, u64>, timeout: Duration) {
        let what = format!("counts converge (logs: {})", self.log_dir.display());
        wait_until(&what, timeout, || async {
            let d = clickagg::verify::diff(expected, &self.billing_when_readable().await?);
            if d.is_exact() {
                Ok(())
            } else {
                Err(d.report(20))
            }
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let d = clickagg::verify::diff(expected, &self.billing().await);
        assert!(d.is_exact(), "counts drifted after converging:\n{}", d.report(20));
    }

    /// The counts equal `expected` now, and the seals agree with them; panics with a
    /// diff naming `what` otherwise. For the state after a command that has ended (a
    /// replay), where nothing is left to converge.
    pub async fn assert_counts_exact(&self, expected: &BTreeMap<BucketKey, u64>, what: &str) {
        let d = clickagg::verify::diff(expected, &self.billing().await);
        assert!(d.is_exact(), "{what}:\n{}", d.report(20));
        self.assert_seals_agree().await;
    }

    /// One sealing round through `through` (Unix s), as `clickagg seal --through` runs
    /// it, in this process; after waiting out the slack, so that what was written
    /// before the call is in seals that reads use. Like the command, a round that fails
    /// transiently is retried: just after a replica comes back, ClickHouse refuses an
    /// insert until the quorum of the previous one is met (code 286). Panics on a fatal
    /// error, or when the round still fails after [`SEAL_RETRY_FOR`].
    pub async fn seal_through(&self, through: u32) -> clickagg::seal::Report {
        tokio::time::sleep(SEAL_SLACK * 2).await;
        let s = self.settings();
        let sealer =
            clickagg::seal::Sealer::new(self.sink(), &self.topic, clickagg::seal::Due::Through(through), s.seal.slack);
        let give_up = tokio_util::sync::CancellationToken::new();
        let deadline = {
            let give_up = give_up.clone();
            tokio::spawn(async move {
                tokio::time::sleep(SEAL_RETRY_FOR).await;
                give_up.cancel();
            })
        };
        let report =
            clickagg::retry::until_done("a sealing round", s.pipeline.max_backoff, &give_up, || sealer.round(None))
                .await;
        deadline.abort();
        match report {
            Ok(report) => report,
            Err(clickagg::retry::Stopped::Fatal(e)) => panic!("a sealing round failed: {e:?}"),
            Err(clickagg::retry::Stopped::ShutDown) => panic!("a sealing round still failed after {SEAL_RETRY_FOR:?}"),
        }
    }

    /// Seals every hour up to the current one (a round through the end of this hour) and
    /// checks that every sealed hour and day says what the minute rows say, summed per
    /// hour and day: every test that converges (through kills, replays, rebalances,
    /// outages) checks that sealing its rows is exact.
    pub async fn assert_seals_agree(&self) {
        let now = chrono::Utc::now().timestamp() as u32;
        self.seal_through(now + 3_600).await;
        let found = clickagg::seal::check::agreement(&self.sink(), &self.topic).await.expect("comparing seals");
        assert!(found.problems.is_empty(), "sealed hours or days disagree with the minute rows: {:?}", found.problems);
        assert!(found.hours > 0, "nothing was sealed");
    }
}

/// A producer sending a test's records in the background ([`TestEnv::spawn_producer`]).
pub struct Producing {
    task: tokio::task::JoinHandle<()>,
    limit: Duration,
}

impl Producing {
    /// Waits until every record is acknowledged; panics if the producer failed, or has
    /// not finished within its time (a hang must fail the test, not stall the suite).
    pub async fn finished(self) {
        match tokio::time::timeout(self.limit, self.task).await {
            Ok(joined) => joined.expect("the producer task"),
            Err(_) => panic!("the producer did not finish within {:?}", self.limit),
        }
    }

    /// Whether it is done sending.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops sending.
    pub fn abort(&self) {
        self.task.abort()
    }
}

/// One row of the minute table read back with its key, count and version (tests read
/// stored rows to write stale or wrong copies of them).
#[derive(Debug, Clone, Copy, clickhouse::Row, serde::Deserialize)]
pub struct StoredRow {
    pub ad_id: u64,
    pub minute: u32,
    pub partition: u32,
    pub batch_start: u64,
    pub clicks: u64,
    pub version: u64,
}
