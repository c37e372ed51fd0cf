//! Private service instances for fault tests: `scripts/stack` with other ports and a
//! private directory, so a test can stop and restart them without disturbing others.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use rand::Rng;

/// Ports handed out in this process, so two private stacks never get the same one.
static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A free port below the kernel's ephemeral range (32768+). Ports from that range can
/// be taken by any outgoing connection between the check and the server's bind (the
/// suite opens thousands), which made a private broker fail to start now and then.
pub fn free_port() -> u16 {
    let mut taken = TAKEN.lock().unwrap();
    let taken = taken.get_or_insert_with(HashSet::new);
    loop {
        let port = rand::rng().random_range(20_000..32_000);
        if taken.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            taken.insert(port);
            return port;
        }
    }
}

pub struct PrivateStack {
    dir: PathBuf,
    env: Vec<(String, String)>,
    services: Vec<&'static str>,
}

impl PrivateStack {
    pub async fn start(name: &str, services: &[&'static str]) -> PrivateStack {
        Self::start_with(name, services, &[]).await
    }

    /// Like [`start`](Self::start), with extra port settings of `scripts/stack` (such
    /// as `REDIS_TLS_PORT`) set to free ports.
    pub async fn start_with(name: &str, services: &[&'static str], extra_ports: &[&str]) -> PrivateStack {
        Self::start_configured(name, services, extra_ports, &[]).await
    }

    /// Like [`start_with`](Self::start_with), with other settings of `scripts/stack`
    /// (such as `KAFKA_AUTHORIZER=1`).
    pub async fn start_configured(
        name: &str,
        services: &[&'static str],
        extra_ports: &[&str],
        settings: &[(&str, &str)],
    ) -> PrivateStack {
        let tag: u32 = rand::rng().random();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("private-stacks").join(format!("{name}-{tag:08x}"));
        let mut env = vec![
            ("CLICKAGG_STACK_DIR".to_string(), dir.display().to_string()),
            ("CLICKAGG_STACK_NO_INSTALL".to_string(), "1".to_string()),
            ("KAFKA_HEAP".to_string(), "512m".to_string()),
        ];
        let ports = ["KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "KAFKA_SASL_PORT", "REDIS_PORT"];
        let clickhouse =
            ["CLICKHOUSE_HTTP_PORT", "CLICKHOUSE_TCP_PORT", "CLICKHOUSE18_HTTP_PORT", "CLICKHOUSE18_TCP_PORT"];
        let ports = ports.iter().chain(&clickhouse).chain(extra_ports);
        env.extend(ports.map(|k| (k.to_string(), free_port().to_string())));
        env.extend(settings.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let stack = PrivateStack { dir, env, services: services.to_vec() };
        for s in services {
            stack.up(s).await;
        }
        stack
    }

    pub fn dir(&self) -> &Path {
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

    /// The current ClickHouse (`clickhouse`), or else ClickHouse 18.16 (`clickhouse18`).
    pub fn clickhouse_url(&self) -> Option<String> {
        let port = if self.has("clickhouse") {
            "CLICKHOUSE_HTTP_PORT"
        } else if self.has("clickhouse18") {
            "CLICKHOUSE18_HTTP_PORT"
        } else {
            return None;
        };
        Some(format!("http://127.0.0.1:{}", self.port(port)))
    }

    fn stack(&self, command: &str, service: &str) -> Command {
        let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"));
        cmd.args([command, service]).envs(self.env.iter().cloned());
        cmd
    }

    /// Runs the script off the test's runtime: it blocks for as long as a broker takes
    /// to start, and the test's producer tasks must keep running meanwhile.
    async fn must(&self, command: &str, service: &str) {
        let mut cmd = self.stack(command, service);
        let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/stack")).await.unwrap();
        assert!(
            out.status.success(),
            "scripts/stack {command} {service} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The PID of `service` (`scripts/stack pid`); panics if it is down.
    pub async fn pid(&self, service: &str) -> i32 {
        let mut cmd = self.stack("pid", service);
        let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/stack")).await.unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().unwrap_or_else(|_| panic!("no PID for {service}: {text:?}"))
    }

    /// Starts `service` and returns once it answers (the script waits for readiness).
    pub async fn up(&self, service: &str) {
        self.must("up", service).await;
    }

    /// SIGKILLs `service` (or one node of it, `SERVICE:N`), as a crash does.
    pub async fn kill(&self, service: &str) {
        self.must("kill", service).await;
    }

    /// Stops `service` and returns once its process is gone.
    pub async fn down(&self, service: &str) {
        self.must("down", service).await;
    }

    /// Restarts this stack's Redis with none of its data: what a Redis without
    /// persistence, or a failover to an empty replica, does to the dedup cache.
    pub async fn restart_redis_empty(&self) {
        self.down("redis").await;
        self.wipe_redis_data();
        self.up("redis").await;
    }

    /// Deletes the data of this stack's Redis, which must be down.
    pub fn wipe_redis_data(&self) {
        let data = self.dir.join("redis");
        for name in ["appendonlydir", "appendonly.aof", "dump.rdb"] {
            let path = data.join(name);
            if path.is_dir() {
                std::fs::remove_dir_all(&path).expect("remove the Redis AOF directory");
            } else if path.exists() {
                std::fs::remove_file(&path).expect("remove a Redis data file");
            }
        }
    }

    /// Runs Kafka's `kafka-acls` tool against this stack's broker (`scripts/stack acls`,
    /// as the super user; the broker needs `KAFKA_AUTHORIZER=1`); asserts success.
    pub async fn kafka_acls(&self, args: &[&str]) {
        let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"));
        cmd.arg("acls").args(args).envs(self.env.iter().cloned());
        let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/stack acls")).await.unwrap();
        assert!(
            out.status.success(),
            "scripts/stack acls {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivateStack {
    fn drop(&mut self) {
        for s in &self.services {
            let _ = self.stack("down", s).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
