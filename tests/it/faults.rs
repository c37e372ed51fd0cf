//! Outages without loss: each test stops one service of a private stack mid-run and
//! starts it again; the member recovers by itself and the counts end exact.

use std::time::{Duration, Instant};

use clickagg::produce::Spec;

use crate::helpers::{equals, wait_until, Member, PrivateStack, TestEnv};

const CONVERGE: Duration = Duration::from_secs(240);

/// Polls `/readyz` until its status is `want`; returns the body.
async fn wait_ready(member: &Member, want: u16, timeout: Duration) -> String {
    wait_until(&format!("/readyz answers {want}"), timeout, || async {
        match member.http_get("/readyz").await {
            (status, body) if status == want => Ok(body),
            (status, body) => Err(format!("{status} {body}")),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_for_20s_pauses_processing_commits_nothing_and_counts_exactly() {
    let stack = PrivateStack::start("redis-outage", &["redis"]).await;
    let env = TestEnv::with_stack("redisout", &stack).await;
    let (records, truth) = env.plan(Spec { count: 90_000, seed: 31, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 2_500);
    let mut member = env.spawn_member("m");
    member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    wait_ready(&member, 200, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    stack.down("redis").await;
    let outage = Instant::now();
    let body = wait_ready(&member, 503, Duration::from_secs(15)).await;
    assert!(body.contains("redis unreachable"), "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = env.committed_offsets().await;
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(outage.elapsed())).await;
    assert_eq!(env.committed_offsets().await, before, "nothing may be committed while dedup is impossible");
    assert!(member.metric("clickagg_redis_errors_total", &[]).await > 0.0);
    stack.up("redis").await;

    wait_ready(&member, 200, Duration::from_secs(30)).await;
    producer.await.unwrap();
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clickhouse_down_for_30s_keeps_bounded_state_commits_nothing_and_counts_exactly() {
    let stack = PrivateStack::start("ch-outage", &["clickhouse"]).await;
    let mut env = TestEnv::with_stack("chout", &stack).await;
    let bound = 3_000;
    env.extra_env.push(("CLICKAGG__PIPELINE__MAX_UNFLUSHED_BUCKETS".into(), bound.to_string()));
    let (records, truth) = env.plan(Spec { count: 90_000, seed: 32, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 2_500);
    let mut member = env.spawn_member("m");
    member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    stack.down("clickhouse").await;
    let outage = Instant::now();
    let body = wait_ready(&member, 503, Duration::from_secs(15)).await;
    assert!(body.contains("clickhouse unreachable"), "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = env.committed_offsets().await;
    // Consumption pauses once the unflushed state reaches the bound: memory stays bounded.
    wait_until("consumption pauses", Duration::from_secs(25), || async {
        equals(member.metric("clickagg_consumption_paused", &[]).await, 1.0)
    })
    .await;
    let held = member.metric("clickagg_unflushed_buckets", &[]).await;
    assert!(held >= bound as f64 && held < (bound + 2 * 2_000) as f64, "{held} buckets held, bound {bound}");
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(outage.elapsed())).await;
    assert_eq!(env.committed_offsets().await, before, "nothing may be committed while ClickHouse is down");
    assert!(member.metric("clickagg_clickhouse_retries_total", &[]).await > 0.0);
    stack.up("clickhouse").await;

    wait_ready(&member, 200, Duration::from_secs(30)).await;
    producer.await.unwrap();
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.metric("clickagg_consumption_paused", &[]).await, 0.0);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_broker_restart_mid_run_is_survived_and_counts_exactly() {
    let stack = PrivateStack::start("kafka-restart", &["kafka"]).await;
    let env = TestEnv::with_stack("kafkarestart", &stack).await;
    // Plenty of bad records, so the outage also hits dead letters in flight.
    let (records, truth) = env.plan(Spec { count: 90_000, seed: 33, malformed_ratio: 0.05, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 3_000);
    let mut member = env.spawn_member("m");
    member.wait_for_line("partitions assigned", 0, Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_secs(5)).await;

    stack.down("kafka").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stack.up("kafka").await;

    producer.await.unwrap();
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(member.metric("clickagg_kafka_errors_total", &[]).await > 0.0, "the member saw the broker go away");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_past_the_drain_timeout_exits_non_zero_without_committing_unflushed_work() {
    let stack = PrivateStack::start("drain-timeout", &["clickhouse"]).await;
    let mut env = TestEnv::with_stack("draintimeout", &stack).await;
    env.extra_env.push(("CLICKAGG__PIPELINE__DRAIN_TIMEOUT".into(), "3s".into()));
    let (records, truth) = env.plan(Spec { count: 30_000, seed: 34, ..Spec::default() });
    let (first, rest) = records.split_at(15_000);
    env.send(first, 4, None).await;
    let mut member = env.spawn_member("m");
    wait_until("the member consumes the first half", Duration::from_secs(60), || async {
        equals(member.metric("clickagg_records_consumed_total", &[]).await as usize, first.len())
    })
    .await;
    stack.down("clickhouse").await;
    // Clicks read while ClickHouse is down can only be flushed by a later owner.
    env.send(rest, 4, None).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = env.committed_offsets().await;
    let started = Instant::now();
    let code = member.terminate(Duration::from_secs(30)).await;
    assert_eq!(code, 3, "exit 3 when the drain timeout passes:\n{}", member.output());
    assert!(started.elapsed() < Duration::from_secs(15), "the drain is bounded by its timeout");
    assert_eq!(env.committed_offsets().await, before, "nothing unflushed was committed");

    stack.up("clickhouse").await;
    let mut next = env.spawn_member("next");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(next.terminate(Duration::from_secs(30)).await, 0);
}
