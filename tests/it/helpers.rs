//! Test harness: every test gets its own topic, consumer group, Redis key prefix and
//! ClickHouse database on the real services started by `scripts/stack up`, and runs
//! the real `clickagg` binary as child processes it can SIGTERM or SIGKILL.
//!
//! A missing service fails the test with a message saying how to start it; nothing
//! is skipped.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clickagg::aggregate::BucketKey;
use clickagg::config::Settings;
use clickagg::produce::{self, Planned, Spec, Truth};
use clickagg::sink::Sink;
use rand::Rng;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

pub const BIN: &str = env!("CARGO_BIN_EXE_clickagg");

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

    async fn on(name: &str, brokers: String, redis_url: String, clickhouse_url: String) -> TestEnv {
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
            batch_offsets: 1_000,
            log_dir,
            extra_env: Vec::new(),
        };
        env.sink().migrate().await.expect("migrate");
        env
    }

    /// Settings as a member would load them (no file, this test's names).
    pub fn settings(&self) -> Settings {
        let mut s = Settings::default();
        s.kafka.brokers = self.brokers.clone();
        s.kafka.topic = self.topic.clone();
        s.kafka.group = self.group.clone();
        s.redis.url = clickagg::config::SecretUrl::new(self.redis_url.clone());
        s.redis.key_prefix = self.redis_prefix.clone();
        s.clickhouse.url = self.clickhouse_url.clone();
        s.clickhouse.tls_ca_file = self.clickhouse_ca.clone();
        s.clickhouse.database = self.database.clone();
        s.pipeline.batch_offsets = self.batch_offsets;
        s
    }

    pub fn sink(&self) -> Sink {
        Sink::new(&self.settings().clickhouse)
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
            ("CLICKAGG__HTTP__ADDR", "127.0.0.1:0".into()),
            ("CLICKAGG__LOG__FORMAT", "json".into()),
            ("RUST_LOG", "clickagg=debug,librdkafka=warn,info".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(ca) = &self.clickhouse_ca {
            v.push(("CLICKAGG__CLICKHOUSE__TLS_CA_FILE".into(), ca.display().to_string()));
        }
        v.extend(self.extra_env.iter().cloned());
        v
    }

    /// Starts `clickagg <args>` as a child process with this test's settings.
    pub fn spawn(&self, label: &str, args: &[&str], extra: &[(&str, &str)]) -> Member {
        let log_path = self.log_dir.join(format!("{label}.log"));
        let mut cmd = Command::new(BIN);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // The parent's CLICKAGG__ variables must not leak into members.
        for (k, _) in std::env::vars() {
            if k.starts_with("CLICKAGG__") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in self.member_env() {
            cmd.env(k, v);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn clickagg");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let file = Arc::new(Mutex::new(std::fs::File::create(&log_path).unwrap()));
        for stream in [
            Box::new(child.stderr.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        ] {
            let lines = lines.clone();
            let file = file.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = writeln!(file.lock().unwrap(), "{line}");
                    lines.lock().unwrap().push(line);
                }
            });
        }
        Member { label: label.to_string(), child: Some(child), lines, log_path }
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
    pub fn spawn_producer(&self, records: &[Planned], partitions: i32, rate: u64) -> tokio::task::JoinHandle<()> {
        let settings = self.settings();
        let topic = self.topic.clone();
        let records = records.to_vec();
        tokio::spawn(async move {
            produce::send(&settings.kafka, &topic, partitions, &records, Some(rate), |_| {}).await.expect("produce")
        })
    }

    pub async fn billing(&self) -> BTreeMap<BucketKey, u64> {
        self.sink().billing(Some(&self.topic), None, None).await.expect("billing")
    }

    /// Waits until the billing counts equal `expected`, then checks they stay equal for
    /// `settle` (a late over-count would show up there). Panics with a diff otherwise.
    pub async fn assert_counts_converge(&self, expected: &BTreeMap<BucketKey, u64>, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let actual = self.billing().await;
            let d = clickagg::verify::diff(expected, &actual);
            if d.is_exact() {
                break;
            }
            if Instant::now() > deadline {
                panic!(
                    "counts did not converge within {timeout:?}:\n{}\nlogs: {}",
                    d.report(20),
                    self.log_dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let d = clickagg::verify::diff(expected, &self.billing().await);
        assert!(d.is_exact(), "counts drifted after converging:\n{}", d.report(20));
    }

    /// Commits `offset` for every partition of the topic in this test's group (no
    /// member may be running): what `kafka-consumer-groups --reset-offsets` does.
    pub fn reset_group_offsets(&self, to: Offset) {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let parts = clickagg::source::partitions(&consumer, &self.topic, Duration::from_secs(10)).unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in parts {
            let (low, high) = consumer.fetch_watermarks(&self.topic, p, Duration::from_secs(10)).unwrap();
            let o = match to {
                Offset::Beginning => low,
                Offset::End => high,
                Offset::Offset(o) => o,
                other => panic!("unsupported {other:?}"),
            };
            tpl.add_partition_offset(&self.topic, p, Offset::Offset(o)).unwrap();
        }
        consumer.commit(&tpl, CommitMode::Sync).expect("commit reset offsets");
    }

    /// Committed offsets of this test's group, per partition.
    pub fn committed_offsets(&self) -> BTreeMap<i32, i64> {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .create()
            .unwrap();
        let parts = clickagg::source::partitions(&consumer, &self.topic, Duration::from_secs(10)).unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in &parts {
            tpl.add_partition(&self.topic, *p);
        }
        let c = consumer.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        c.elements().iter().map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { o } else { -1 })).collect()
    }

    /// Partition → high watermark of the topic.
    pub fn high_watermarks(&self) -> BTreeMap<i32, i64> {
        let consumer: BaseConsumer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &self.brokers).create().unwrap();
        let parts = clickagg::source::partitions(&consumer, &self.topic, Duration::from_secs(10)).unwrap();
        parts
            .into_iter()
            .map(|p| (p, consumer.fetch_watermarks(&self.topic, p, Duration::from_secs(10)).unwrap().1))
            .collect()
    }
}

/// A running `clickagg` child process and its captured output.
pub struct Member {
    pub label: String,
    child: Option<Child>,
    lines: Arc<Mutex<Vec<String>>>,
    pub log_path: PathBuf,
}

impl Member {
    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn output(&self) -> String {
        self.lines().join("\n")
    }

    /// Waits until a line containing `needle` was printed after line `from`; returns
    /// the number of lines seen so far.
    pub fn wait_for_line(&self, needle: &str, from: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let lines = self.lines.lock().unwrap();
                if let Some(i) = lines.iter().skip(from).position(|l| l.contains(needle)) {
                    return from + i + 1;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{}: no line with {needle:?} within {timeout:?}; log {}",
                self.label,
                self.log_path.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.child.as_mut().unwrap().wait().unwrap();
    }

    /// Sends SIGTERM and waits for the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> i32 {
        self.signal(libc::SIGTERM);
        self.wait(timeout)
    }

    pub fn wait(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().unwrap();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{} did not exit within {timeout:?}; log {}", self.label, self.log_path.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The address of this member's HTTP server, from its start-up log line.
    pub fn http_addr(&self) -> String {
        self.wait_for_line("serving /metrics", 0, Duration::from_secs(30));
        let line = self.lines().into_iter().find(|l| l.contains("serving /metrics")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        v["addr"].as_str().unwrap().to_string()
    }

    /// GET `path` from the member's HTTP server: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get(&self.http_addr(), path)
    }

    /// The value of a metric line (`name{labels} value`) summed over label sets that
    /// contain every `label_filter`.
    pub fn metric(&self, name: &str, label_filter: &[&str]) -> f64 {
        let (_, body) = self.http_get("/metrics");
        metric_value(&body, name, label_filter)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if child.try_wait().ok().flatten().is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

pub fn metric_value(body: &str, name: &str, label_filter: &[&str]) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{')))
        .filter(|l| label_filter.iter().all(|f| l.contains(f)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to member http");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status: u16 = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
    // axum answers with chunked encoding for streamed bodies; strip chunk sizes crudely.
    let body = if resp.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(&body) } else { body };
    (status, body)
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// Services of the test's own, started with `scripts/stack` on free ports in a private
/// directory, so a test can stop and restart them without disturbing other tests.
pub struct PrivateStack {
    dir: PathBuf,
    env: Vec<(String, String)>,
    services: Vec<&'static str>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl PrivateStack {
    pub fn start(name: &str, services: &[&'static str]) -> PrivateStack {
        Self::start_with(name, services, &[])
    }

    /// Like [`start`](Self::start), with extra port settings of `scripts/stack` (such
    /// as `REDIS_TLS_PORT`) set to free ports.
    pub fn start_with(name: &str, services: &[&'static str], extra_ports: &[&str]) -> PrivateStack {
        let tag: u32 = rand::rng().random();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("private-stacks").join(format!("{name}-{tag:08x}"));
        let env = vec![
            ("CLICKAGG_STACK_DIR".to_string(), dir.display().to_string()),
            ("CLICKAGG_STACK_NO_INSTALL".to_string(), "1".to_string()),
            ("KAFKA_PORT".to_string(), free_port().to_string()),
            ("KAFKA_CONTROLLER_PORT".to_string(), free_port().to_string()),
            ("KAFKA_SASL_PORT".to_string(), free_port().to_string()),
            ("KAFKA_HEAP".to_string(), "512m".to_string()),
            ("REDIS_PORT".to_string(), free_port().to_string()),
            ("CLICKHOUSE_HTTP_PORT".to_string(), free_port().to_string()),
            ("CLICKHOUSE_TCP_PORT".to_string(), free_port().to_string()),
        ];
        let mut env = env;
        env.extend(extra_ports.iter().map(|k| (k.to_string(), free_port().to_string())));
        let stack = PrivateStack { dir, env, services: services.to_vec() };
        for s in services {
            stack.up(s);
        }
        stack
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn port(&self, key: &str) -> String {
        self.env.iter().find(|(k, _)| k == key).unwrap().1.clone()
    }

    fn has(&self, service: &str) -> bool {
        self.services.contains(&service)
    }

    pub fn brokers(&self) -> Option<String> {
        self.has("kafka").then(|| format!("127.0.0.1:{}", self.port("KAFKA_PORT")))
    }

    pub fn redis_url(&self) -> Option<String> {
        self.has("redis").then(|| format!("redis://127.0.0.1:{}/", self.port("REDIS_PORT")))
    }

    pub fn clickhouse_url(&self) -> Option<String> {
        self.has("clickhouse").then(|| format!("http://127.0.0.1:{}", self.port("CLICKHOUSE_HTTP_PORT")))
    }

    fn stack(&self, command: &str, service: &str) {
        let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"))
            .args([command, service])
            .envs(self.env.iter().cloned())
            .output()
            .expect("run scripts/stack");
        assert!(
            out.status.success(),
            "scripts/stack {command} {service} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn up(&self, service: &str) {
        self.stack("up", service);
    }

    pub fn down(&self, service: &str) {
        self.stack("down", service);
    }
}

impl Drop for PrivateStack {
    fn drop(&mut self) {
        for s in &self.services {
            let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"))
                .args(["down", s])
                .envs(self.env.iter().cloned())
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A dead letter as read back: raw payload and headers.
pub struct DeadLetter {
    pub payload: Option<Vec<u8>>,
    pub headers: BTreeMap<String, String>,
}

pub fn consumer(env: &TestEnv) -> BaseConsumer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &env.brokers)
        .set("group.id", format!("{}-reader", env.group))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap()
}

/// Reads up to `want` records of the test's dead-letter topic (waiting up to a minute).
pub fn read_dead_letters(env: &TestEnv, want: usize) -> Vec<DeadLetter> {
    let topic = format!("{}.dlq", env.topic);
    let c = consumer(env);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&topic, 0, Offset::Beginning).unwrap();
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < want && Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(500)) {
            let headers = m
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                        .collect()
                })
                .unwrap_or_default();
            out.push(DeadLetter { payload: m.payload().map(<[u8]>::to_vec), headers });
        }
    }
    out
}
