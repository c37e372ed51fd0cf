//! Exactly once on the cluster stack (`scripts/stack up cluster`, run by
//! `scripts/test-cluster`): three Kafka brokers (replication factor 3, min ISR 2), a
//! Redis Cluster of three masters with a replica each, and ClickHouse as 2 shards x 2
//! replicas over ZooKeeper. Each test runs members on generated traffic, fails a node
//! mid-run the way a machine fails (SIGKILL; a stalled replica; a ZooKeeper restart),
//! brings it back, and ends with the billing counts exactly equal to the ground truth.
//!
//! A separate test binary from `tests/it`, which `scripts/test` runs: these need the
//! cluster stack, and they kill its nodes, so they run one at a time (`exclusive`). A
//! node that does not answer fails the test; nothing is skipped.

// The helpers of tests/it; this binary uses a part of them.
#[allow(dead_code, unused_imports)]
#[path = "../it/helpers/mod.rs"]
mod helpers;

use std::time::Duration;

use clickagg::produce::Spec;
use clickagg::sink::Sink;

use helpers::cluster::{exclusive, freeze, stack, ClusterStack};
use helpers::{wait_until, Member, TestEnv};

const CONVERGE: Duration = Duration::from_secs(300);
const PARTITIONS: i32 = 4;

/// A test's slice of the cluster stack, with members that recover quickly: an insert
/// whose quorum cannot be met fails after 5 s (and is retried) instead of 15 s.
async fn cluster_env(name: &str) -> TestEnv {
    let mut env = TestEnv::on_cluster(name).await;
    env.extra_env.push(("CLICKAGG__CLICKHOUSE__INSERT_QUORUM_TIMEOUT".into(), "5s".into()));
    env
}

async fn assigned(members: &[&Member]) {
    for m in members {
        m.wait_for_line("partitions assigned", 0, Duration::from_secs(90)).await;
    }
}

async fn sum_metric(members: &[&Member], name: &str) -> f64 {
    let mut total = 0.0;
    for m in members {
        total += m.metric(name, &[]).await;
    }
    total
}

/// A key of the topic's first key group: its master serves a share of every poll
/// batch's claims.
fn first_group_key(env: &TestEnv) -> String {
    let s = env.settings();
    clickagg::cache::SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic).expect("cache settings").shard_key(0)
}

/// The billing counts each ClickHouse node holds in its own replica (through FINAL),
/// per node: replicas of a shard must agree, and the shards must add up.
async fn per_node_totals(env: &TestEnv) -> Vec<u64> {
    let urls = std::env::var("CLICKAGG_STACK_CLICKHOUSE_CLUSTER_URLS").unwrap_or_else(|_| {
        "http://127.0.0.1:18123,http://127.0.0.1:18124,http://127.0.0.1:18125,http://127.0.0.1:18126".into()
    });
    let mut out = Vec::new();
    for url in urls.split(',') {
        let mut s = env.settings().clickhouse.clone();
        s.url = clickagg::config::SecretUrl::new(url.to_string());
        s.cluster = None;
        let sink = Sink::new(&s);
        let sql = format!(
            "SELECT toUInt64(sum(clicks)) FROM {}.ad_clicks_minute_local FINAL WHERE topic = '{}'",
            env.database, env.topic
        );
        out.push(sink.client().query(&sql).fetch_one::<u64>().await.expect("per-replica total"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_function_decides_as_the_rust_model_does_on_a_redis_cluster() {
    let _only = exclusive().await;
    let env = cluster_env("luacluster").await;
    let s = env.settings();
    assert!(s.redis.is_cluster(), "the seed nodes make it a cluster client");
    let window = helpers::cache_model::WINDOW;
    let cache = clickagg::cache::SharedCache::new(
        clickagg::cache::RedisTarget::from_settings(&s.redis).unwrap(),
        &env.redis_prefix,
        &env.topic,
        helpers::cache_model::SHARDS,
        16,
        clickagg::dedup::Secs::new(window),
        s.redis.timeout,
    )
    .with_wait(s.redis.wait());
    let c = ClusterStack::require();
    let mut masters = std::collections::BTreeSet::new();
    for g in 0..16 {
        masters.insert(c.redis_master_of(&cache.shard_key(g), 1).await.unwrap());
    }
    assert!(masters.len() > 1, "the 16 key groups live on several masters: {masters:?}");
    let checked = helpers::cache_model::compare(cache, 21).await;
    assert!(checked > 5_000, "{checked} claims compared");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_master_killed_while_its_replica_lags_fails_over_without_a_double_count() {
    let _only = exclusive().await;
    let c = ClusterStack::require();
    let env = cluster_env("redismaster").await;
    let (records, truth) = env.plan(Spec { count: 80_000, seed: 101, ..Spec::default() });
    let producer = env.spawn_producer(&records, PARTITIONS, 4_000);
    let mut a = env.spawn_member("a");
    let mut b = env.spawn_member("b");
    assigned(&[&a, &b]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // The replica of a master the members claim on falls behind (stopped), so the
    // master acknowledges claims its replica never gets. Those are exactly the claims
    // a failover forgets: the members must not use them (WAIT fails, they retry).
    let key = first_group_key(&env);
    let master = c.redis_master_of(&key, 1).await.unwrap();
    let replica = c.redis_replica_of(master).await;
    let errors_before = sum_metric(&[&a, &b], "clickagg_redis_errors_total").await;
    let frozen = freeze(&format!("redis-cluster:{replica}")).await;
    // Claims acknowledged before the freeze may still be flushed and committed, later
    // on a loaded machine. Once the commits have stood still for 5 s, none may move: a
    // member that used claims no replica holds would keep committing, never stand still.
    let committed = wait_until("the commits stand still", Duration::from_secs(60), || async {
        let before = env.committed_offsets().await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = env.committed_offsets().await;
        if before == after {
            Ok(after)
        } else {
            Err(format!("{before:?} then {after:?}"))
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.committed_offsets().await, committed, "no claim is used before a replica holds it");
    assert!(sum_metric(&[&a, &b], "clickagg_redis_errors_total").await > errors_before, "WAIT failures are retried");

    // The master dies; its replica, stale by those claims, takes over.
    stack("kill", &format!("redis-cluster:{master}")).await;
    drop(frozen);
    let promoted = c.wait_for_failover(&key, master, replica).await;
    assert_eq!(promoted, replica, "the replica was promoted");
    // Until the old master is back as its replica, the new master's claims cannot be
    // made durable: the members wait. Then they go on.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stack("up", &format!("redis-cluster:{master}")).await;
    assert_eq!(c.redis_role(master).await, "slave", "the old master came back as a replica");

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clickhouse_replica_killed_mid_run_holds_the_commits_until_it_is_back_and_counts_stay_exact() {
    let _only = exclusive().await;
    ClusterStack::require();
    let env = cluster_env("chreplica").await;
    let (records, truth) = env.plan(Spec { count: 80_000, seed: 102, ..Spec::default() });
    let producer = env.spawn_producer(&records, PARTITIONS, 4_000);
    let mut a = env.spawn_member("a");
    let mut b = env.spawn_member("b");
    assigned(&[&a, &b]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // Node 3 holds shard 2 with node 4; clickagg talks to node 1. Every flush has rows
    // for both shards, and an insert waits for both replicas of each (insert_quorum 2).
    stack("kill", "clickhouse-cluster:3").await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let committed = env.committed_offsets().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(env.committed_offsets().await, committed, "nothing is committed without the quorum");
    assert!(sum_metric(&[&a, &b], "clickagg_clickhouse_retries_total").await > 0.0, "the flushes are retried");
    stack("up", "clickhouse-cluster:3").await;

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
    // Every row is on both replicas of its shard, and the shards add up to the truth.
    let totals = per_node_totals(&env).await;
    assert_eq!((totals[0], totals[2]), (totals[1], totals[3]), "replicas of a shard agree: {totals:?}");
    assert_eq!(totals[0] + totals[2], truth.clicks, "{totals:?}");
}

/// Runs `sql` on one ClickHouse node over HTTP.
async fn on_node(url: &str, sql: &str) {
    let s = clickagg::config::ClickHouseSettings {
        url: clickagg::config::SecretUrl::new(url.to_string()),
        database: "system".into(),
        ..Default::default()
    };
    Sink::new(&s).client().query(sql).execute().await.unwrap_or_else(|e| panic!("{sql} on {url}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_reading_through_a_replica_that_stopped_fetching_sees_every_acknowledged_write_and_counts_stay_exact()
{
    let _only = exclusive().await;
    let cluster = ClusterStack::require();
    let env = cluster_env("laggingread").await;
    let spec = Spec { count: 60_000, seed: 106, duplicate_ratio: 0.2, cross_partition_ratio: 0.3, ..Spec::default() };
    let (records, truth) = env.plan(spec);
    let producer = env.spawn_producer(&records, PARTITIONS, 3_000);
    let mut a = env.spawn_member("a");
    assigned(&[&a]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // Node 2 stops fetching: it lags behind node 1, the other replica of shard 1, from
    // now on. Member a writes through node 1; a flush is acknowledged only once both
    // replicas of each shard hold it (insert_quorum 2), so none is while node 2 lags.
    let node2 = cluster.clickhouse_node_url(2);
    on_node(&node2, "SYSTEM STOP FETCHES").await;
    // A flush acknowledged just before may still be committed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let committed = env.committed_offsets().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(a.metric("clickagg_clickhouse_retries_total", &[]).await > 0.0, "a's flushes wait for the quorum");
    // a dies; b takes over reading and writing through node 2, whose Distributed table
    // reads shard 1 from node 2's own replica (prefer_localhost_replica): every pin and
    // clock it finds there was acknowledged, and what it lacks was not.
    a.kill9().await;
    let mut b_env = env.extra_env.clone();
    b_env.push(("CLICKAGG__CLICKHOUSE__URL".into(), node2.clone()));
    let b_cmd = env.command(&["run"], &b_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>());
    let mut b = Member::start("b", b_cmd, env.log_dir.join("b.log"));
    b.wait_for_line("partitions assigned", 0, Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(env.committed_offsets().await, committed, "nothing is acknowledged while a replica of shard 1 lags");
    on_node(&node2, "SYSTEM START FETCHES").await;

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
    let totals = per_node_totals(&env).await;
    assert_eq!((totals[0], totals[2]), (totals[1], totals[3]), "replicas of a shard agree: {totals:?}");
    assert_eq!(totals[0] + totals[2], truth.clicks, "{totals:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zookeeper_restart_mid_run_makes_flushes_wait_and_counts_stay_exact() {
    let _only = exclusive().await;
    ClusterStack::require();
    let env = cluster_env("zookeeper").await;
    let (records, truth) = env.plan(Spec { count: 80_000, seed: 103, ..Spec::default() });
    let producer = env.spawn_producer(&records, PARTITIONS, 4_000);
    let mut a = env.spawn_member("a");
    assigned(&[&a]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // Without ZooKeeper the replicated tables take no inserts (read-only).
    stack("down", "zookeeper").await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    stack("up", "zookeeper").await;

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(a.metric("clickagg_clickhouse_retries_total", &[]).await > 0.0, "the flushes waited for ZooKeeper");
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_broker_of_a_click_partition_killed_mid_run_loses_nothing_and_counts_stay_exact() {
    let _only = exclusive().await;
    let c = ClusterStack::require();
    let env = cluster_env("kafkaleader").await;
    let (records, truth) = env.plan(Spec { count: 80_000, seed: 104, ..Spec::default() });
    let producer = env.spawn_producer(&records, PARTITIONS, 4_000);
    let mut a = env.spawn_member("a");
    let mut b = env.spawn_member("b");
    assigned(&[&a, &b]).await;
    // The topics clickagg created are on all three brokers, two of them in sync for a write.
    for topic in [env.topic.clone(), format!("{}.dlq", env.topic)] {
        assert_eq!(c.kafka_replication(&topic).await, (3, "2".to_string()), "{topic}");
    }
    tokio::time::sleep(Duration::from_secs(4)).await;

    let leader = c.kafka_leader(&env.topic, 0).await;
    stack("kill", &format!("kafka-cluster:{leader}")).await;
    wait_until("another broker leads partition 0", Duration::from_secs(60), || async {
        match c.kafka_leader(&env.topic, 0).await {
            l if l != leader && l >= 0 => Ok(()),
            l => Err(format!("leader {l}")),
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    stack("up", &format!("kafka-cluster:{leader}")).await;

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_with_a_crash_and_a_join_while_a_node_of_each_cluster_dies_count_exactly() {
    let _only = exclusive().await;
    let c = ClusterStack::require();
    let env = cluster_env("allatonce").await;
    let (records, truth) = env.plan(Spec { count: 120_000, seed: 105, ..Spec::default() });
    let producer = env.spawn_producer(&records, 6, 4_000);
    let mut a = env.spawn_member("a");
    let mut b = env.spawn_member("b");
    let mut m3 = env.spawn_member("c");
    assigned(&[&a, &b, &m3]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // At once: a member crashes, and a Redis master, a ClickHouse replica and the
    // leader of a click partition die.
    let key = first_group_key(&env);
    let redis_master = c.redis_master_of(&key, 1).await.unwrap();
    let replica = c.redis_replica_of(redis_master).await;
    let leader = c.kafka_leader(&env.topic, 1).await;
    b.kill9().await;
    stack("kill", &format!("redis-cluster:{redis_master}")).await;
    stack("kill", "clickhouse-cluster:4").await;
    stack("kill", &format!("kafka-cluster:{leader}")).await;
    // A fourth member joins meanwhile.
    let mut d = env.spawn_member("d");
    c.wait_for_failover(&key, redis_master, replica).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    stack("up", &format!("redis-cluster:{redis_master}")).await;
    stack("up", "clickhouse-cluster:4").await;
    stack("up", &format!("kafka-cluster:{leader}")).await;

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    for m in [&mut a, &mut m3, &mut d] {
        assert_eq!(m.terminate(Duration::from_secs(30)).await, 0, "{} drains and exits 0", m.label);
    }
    let totals = per_node_totals(&env).await;
    assert_eq!((totals[0], totals[2]), (totals[1], totals[3]), "replicas of a shard agree: {totals:?}");
}
