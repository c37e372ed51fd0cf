//! The cluster stack (`scripts/stack up cluster`): its endpoints, and its nodes, which a
//! test kills, stops and starts through `scripts/stack` (by PID file, never by name).
//!
//! Endpoints come from `scripts/stack env cluster` (`CLICKAGG_STACK_…` variables, which
//! the single-node stack's settings never shadow); without them, the stack's default
//! ports. A node that does not answer fails the test with the command that starts it.

use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};

use super::wait::wait_until;

/// The three clusters' endpoints.
pub struct ClusterStack {
    brokers: String,
    /// Redis Cluster nodes 1..6, in node order (`redis-cluster:N` is `redis_nodes[N-1]`).
    redis_nodes: Vec<String>,
    clickhouse_urls: Vec<String>,
    clickhouse_cluster: String,
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| default.to_string())
}

fn port_of(url: &str) -> u16 {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let host_port = rest.split('/').next().unwrap_or(rest);
    host_port.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in {url}"))
}

impl ClusterStack {
    /// The endpoints; panics (fails the test) unless every node of the three clusters
    /// accepts connections.
    pub fn require() -> ClusterStack {
        let split = |v: String| v.split(',').map(str::to_string).collect::<Vec<_>>();
        let c = ClusterStack {
            brokers: var("CLICKAGG_STACK_KAFKA_CLUSTER_BROKERS", "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"),
            redis_nodes: split(var(
                "CLICKAGG_STACK_REDIS_CLUSTER_NODES",
                "redis://127.0.0.1:7001/,redis://127.0.0.1:7002/,redis://127.0.0.1:7003/,\
                 redis://127.0.0.1:7004/,redis://127.0.0.1:7005/,redis://127.0.0.1:7006/",
            )),
            clickhouse_urls: split(var(
                "CLICKAGG_STACK_CLICKHOUSE_CLUSTER_URLS",
                "http://127.0.0.1:18123,http://127.0.0.1:18124,http://127.0.0.1:18125,http://127.0.0.1:18126",
            )),
            clickhouse_cluster: var("CLICKAGG_STACK_CLICKHOUSE_CLUSTER", "clickagg_cluster"),
        };
        let kafka = c.brokers.split(',').map(|b| format!("kafka://{b}"));
        for url in kafka.chain(c.redis_nodes.iter().cloned()).chain(c.clickhouse_urls.iter().cloned()) {
            let addr = format!("127.0.0.1:{}", port_of(&url));
            let up = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(3)).is_ok();
            assert!(up, "cluster node {url} is not reachable: start the cluster stack with `scripts/stack up cluster`");
        }
        c
    }

    pub fn brokers(&self) -> String {
        self.brokers.clone()
    }

    /// Every Redis node as a seed, comma-separated: what `redis.url` takes.
    pub fn redis_url(&self) -> String {
        self.redis_nodes.join(",")
    }

    /// ClickHouse node 1, where clickagg connects.
    pub fn clickhouse_url(&self) -> String {
        self.clickhouse_urls[0].clone()
    }

    /// ClickHouse node `n` (1 to 4; nodes 1 and 2 hold shard 1, 3 and 4 shard 2).
    pub fn clickhouse_node_url(&self, n: usize) -> String {
        self.clickhouse_urls[n - 1].clone()
    }

    pub fn clickhouse_cluster(&self) -> String {
        self.clickhouse_cluster.clone()
    }

    async fn redis(&self, node: usize) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.redis_nodes[node - 1].as_str()).expect("Redis URL");
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        client.get_multiplexed_async_connection_with_config(&config).await.expect("connect to a Redis node")
    }

    /// `CLUSTER NODES` as one live node sees it: per node, (its number here, flags,
    /// master's id or "-", its id, its slot ranges).
    async fn redis_cluster_nodes(&self, ask: usize) -> Result<Vec<RedisNode>, String> {
        let client = redis::Client::open(self.redis_nodes[ask - 1].as_str()).map_err(|e| e.to_string())?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        let mut conn = client.get_multiplexed_async_connection_with_config(&config).await.map_err(|e| e.to_string())?;
        let text: String =
            redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await.map_err(|e| e.to_string())?;
        Ok(text
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                let port: u16 = f.get(1)?.split('@').next()?.rsplit(':').next()?.parse().ok()?;
                let number = self.redis_nodes.iter().position(|u| port_of(u) == port)? + 1;
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| match s.split_once('-') {
                        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                        None => s.parse().ok().map(|x| (x, x)),
                    })
                    .collect();
                Some(RedisNode {
                    number,
                    id: f[0].to_string(),
                    flags: f[2].to_string(),
                    master: f[3].to_string(),
                    slots,
                })
            })
            .collect())
    }

    /// The Redis node (its number) that serves `key`'s slot as master, asking node `ask`.
    pub async fn redis_master_of(&self, key: &str, ask: usize) -> Result<usize, String> {
        let slot = clickagg::cache::slot_of(key);
        let nodes = self.redis_cluster_nodes(ask).await?;
        nodes
            .iter()
            .find(|n| n.flags.contains("master") && !n.flags.contains("fail") && n.serves(slot))
            .map(|n| n.number)
            .ok_or_else(|| format!("no live master serves slot {slot} (of {key}): {nodes:?}"))
    }

    /// The replica (its number) of Redis node `master`.
    pub async fn redis_replica_of(&self, master: usize) -> usize {
        let nodes = self.redis_cluster_nodes(master).await.expect("CLUSTER NODES");
        let id = &nodes.iter().find(|n| n.number == master).expect("the master itself").id;
        nodes.iter().find(|n| &n.master == id).map(|n| n.number).expect("a replica")
    }

    /// `ROLE` of Redis node `node`: "master" or "slave".
    pub async fn redis_role(&self, node: usize) -> String {
        let mut conn = self.redis(node).await;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await.expect("ROLE");
        redis::from_redis_value_ref(&role[0]).expect("role name")
    }

    /// Waits until a live master other than `dead` serves `key` (the failover is done),
    /// asking node `ask`; returns it.
    pub async fn wait_for_failover(&self, key: &str, dead: usize, ask: usize) -> usize {
        wait_until(&format!("a replica of redis-cluster:{dead} takes over"), Duration::from_secs(60), || async {
            match self.redis_master_of(key, ask).await {
                Ok(n) if n != dead => Ok(n),
                Ok(n) => Err(format!("redis-cluster:{n} still named master")),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// The broker (`node.id`, so `kafka-cluster:N`) leading `topic`'s `partition`.
    pub async fn kafka_leader(&self, topic: &str, partition: i32) -> i32 {
        let (brokers, topic) = (self.brokers.clone(), topic.to_string());
        tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
            let md = c.fetch_metadata(Some(&topic), Duration::from_secs(10)).expect("metadata");
            md.topics()[0].partitions().iter().find(|p| p.id() == partition).expect("partition").leader()
        })
        .await
        .unwrap()
    }

    /// `topic`'s replication factor (replicas of partition 0) and `min.insync.replicas`.
    pub async fn kafka_replication(&self, topic: &str) -> (usize, String) {
        let (brokers, name) = (self.brokers.clone(), topic.to_string());
        let replicas = tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
            let md = c.fetch_metadata(Some(&name), Duration::from_secs(10)).expect("metadata");
            md.topics()[0].partitions()[0].replicas().len()
        })
        .await
        .unwrap();
        let admin: AdminClient<DefaultClientContext> =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &self.brokers).create().unwrap();
        let configs = admin.describe_configs([&ResourceSpecifier::Topic(topic)], &AdminOptions::new()).await.unwrap();
        let config = configs.into_iter().next().unwrap().expect("topic config");
        let min_isr = config.get("min.insync.replicas").and_then(|e| e.value.clone()).unwrap_or_default();
        (replicas, min_isr)
    }
}

#[derive(Debug)]
struct RedisNode {
    number: usize,
    id: String,
    flags: String,
    master: String,
    slots: Vec<(u16, u16)>,
}

impl RedisNode {
    fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
    }
}

/// Runs `scripts/stack <command> <node>` (e.g. `kill redis-cluster:2`) off the test's
/// runtime; asserts success.
pub async fn stack(command: &str, node: &str) {
    let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"));
    cmd.args([command, node]);
    let what = format!("scripts/stack {command} {node}");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/stack")).await.unwrap();
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The PID of a node of the cluster stack, as `scripts/stack pid` reads it from the
/// node's PID file: a process the stack started.
async fn pid_of(node: &str) -> i32 {
    let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"));
    cmd.args(["pid", node]);
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/stack pid")).await.unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or_else(|_| panic!("no PID for {node}"))
}

/// A node frozen with SIGSTOP. Dropping it sends SIGCONT, so a test that fails while
/// the node is frozen does not leave it frozen for the tests after it (they share the
/// stack, and a frozen replica fails every `WAIT`).
pub struct Frozen {
    pid: i32,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }
}

/// SIGSTOPs a node of the cluster stack until the guard is dropped.
pub async fn freeze(node: &str) -> Frozen {
    let pid = pid_of(node).await;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP to {node} (pid {pid})");
    Frozen { pid }
}

/// Serialises the tests that kill nodes: they share one cluster stack.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}
