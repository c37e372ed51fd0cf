//! Outages without loss: each test stops one service of a private stack mid-run and
//! starts it again; the member recovers by itself and the counts end exact.

use std::time::{Duration, Instant};

use clickagg::produce::Spec;

use crate::helpers::{equals, wait_ready, wait_until, PrivateStack, TestEnv};

const CONVERGE: Duration = Duration::from_secs(240);

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
    producer.finished().await;
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
    // The outage begins after a fixed share of the records is read, so the clicks that
    // arrive during it (and the buckets they open) do not depend on how fast this
    // machine starts a member: CI once took so long that too few were left to reach
    // the bound.
    let (first, rest) = records.split_at(20_000);
    env.send(first, 4, None).await;
    let mut member = env.spawn_member("m");
    wait_until("the member consumes the first records", Duration::from_secs(90), || async {
        equals(member.metric("clickagg_records_consumed_total", &[]).await as usize, first.len())
    })
    .await;

    stack.down("clickhouse").await;
    let outage = Instant::now();
    let body = wait_ready(&member, 503, Duration::from_secs(15)).await;
    assert!(body.contains("clickhouse unreachable"), "{body}");
    let producer = env.spawn_producer(rest, 4, 2_500);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = env.committed_offsets().await;
    // Consumption pauses once the unflushed state reaches the bound: memory stays bounded.
    // The 70 000 records sent meanwhile open several times the bound's buckets.
    wait_until("consumption pauses", Duration::from_secs(60), || async {
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
    producer.finished().await;
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

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(member.metric("clickagg_kafka_errors_total", &[]).await > 0.0, "the member saw the broker go away");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_the_generator_could_not_deliver_through_a_broker_outage_are_sent_again() {
    // A broker restart can strand a producer's records until `message.timeout.ms` (CI
    // once saw a flush give up on them). The generator's ground truth holds every
    // planned record, so it sends the failed ones again; a redelivery is one more
    // producer retry, which the pipeline deduplicates.
    let stack = PrivateStack::start("kafka-resend", &["kafka"]).await;
    let env = TestEnv::with_stack("kafkaresend", &stack).await;
    let (records, truth) = env.plan(Spec { count: 20_000, seed: 35, ..Spec::default() });
    let mut kafka = env.settings().kafka;
    kafka.properties.insert("message.timeout.ms".into(), clickagg::config::Secret::new("3000"));
    let topic = env.topic.clone();
    let producer =
        tokio::spawn(async move { clickagg::produce::send(&kafka, &topic, 4, &records, Some(2_000), |_| {}).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    stack.down("kafka").await;
    // Longer than message.timeout.ms: the records queued meanwhile fail and are sent again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    stack.up("kafka").await;
    producer.await.unwrap().expect("every record delivered, the failed ones on a later round");

    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
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

/// Issue 9: partitions a paused member takes over must be paused too, or it reads
/// them without bound while it cannot process what it read. Here the pause comes from
/// Redis refusing claims (out of memory): planning a start only reads Redis, so the
/// takeover goes through while claims cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_taken_over_while_paused_are_paused_and_nothing_piles_up() {
    let stack = PrivateStack::start("takeover", &["redis"]).await;
    let mut env = TestEnv::with_stack("takeover", &stack).await;
    let chunk = 500;
    env.extra_env.extend([
        ("CLICKAGG__PIPELINE__MAX_POLL_RECORDS".to_string(), chunk.to_string()),
        ("CLICKAGG__PIPELINE__DRAIN_TIMEOUT".to_string(), "3s".to_string()),
    ]);
    let (records, truth) = env.plan(Spec { count: 120_000, seed: 35, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 3_000);
    let mut first = env.spawn_member("first");
    let mut second = env.spawn_member("second");
    first.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    second.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    let mut redis = env.redis().await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1").query_async(&mut redis).await.unwrap();
    for m in [&first, &second] {
        wait_until("both members pause", Duration::from_secs(30), || async {
            equals(m.metric("clickagg_consumption_paused", &[]).await, 1.0)
        })
        .await;
    }
    // The second member leaves; the first takes its partitions over while paused.
    let seen = first.lines().len();
    second.terminate(Duration::from_secs(30)).await;
    first.wait_for_line("partitions assigned", seen, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let awaiting = first.metric("clickagg_records_awaiting_claims", &[]).await;
    assert!(
        awaiting <= (4 * chunk) as f64,
        "{awaiting} records read and waiting for Redis after the takeover: the new partitions were not paused"
    );
    assert_eq!(first.metric("clickagg_consumption_paused", &[]).await, 1.0);
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query_async(&mut redis).await.unwrap();

    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(first.metric("clickagg_consumption_paused", &[]).await, 0.0);
    assert_eq!(first.terminate(Duration::from_secs(30)).await, 0);
}

/// Issue 9: Redis refusing writes (out of memory, or turned into a read-only replica)
/// pauses consumption, turns readiness false with the reason and shows in a metric;
/// the member keeps polling (it is not evicted even when the refusal outlasts
/// `kafka.max_poll_interval`), commits nothing past an unclaimed click, and recovers
/// by itself once Redis accepts writes again.
async fn redis_refusing_writes(name: &str, refuse: redis::Cmd, accept: redis::Cmd, reason: &str, kind: &str) {
    let stack = PrivateStack::start(name, &["redis"]).await;
    let mut env = TestEnv::with_stack(name, &stack).await;
    env.extra_env.extend([
        ("CLICKAGG__KAFKA__SESSION_TIMEOUT".to_string(), "6s".to_string()),
        ("CLICKAGG__KAFKA__MAX_POLL_INTERVAL".to_string(), "10s".to_string()),
    ]);
    let (records, truth) = env.plan(Spec { count: 90_000, seed: 36, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 2_500);
    let mut member = env.spawn_member("m");
    member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    wait_ready(&member, 200, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    let mut redis = env.redis().await;
    let _: () = refuse.query_async(&mut redis).await.expect("make Redis refuse writes");
    let refused = Instant::now();
    let body = wait_ready(&member, 503, Duration::from_secs(15)).await;
    assert!(body.contains(reason), "{body}");
    wait_until("consumption pauses", Duration::from_secs(15), || async {
        equals(member.metric("clickagg_consumption_paused", &[]).await, 1.0)
    })
    .await;
    assert!(member.metric("clickagg_redis_errors_total", &[&format!("kind=\"{kind}\"")]).await > 0.0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = env.committed_offsets().await;
    // Longer than kafka.max_poll_interval: a member that stopped polling would be evicted.
    tokio::time::sleep(Duration::from_secs(25).saturating_sub(refused.elapsed())).await;
    assert_eq!(env.committed_offsets().await, before, "nothing may be committed past an unclaimed click");
    assert_eq!(member.http_get("/readyz").await.0, 503);
    let _: () = accept.query_async(&mut redis).await.expect("let Redis accept writes");

    wait_ready(&member, 200, Duration::from_secs(30)).await;
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.metric("clickagg_consumption_paused", &[]).await, 0.0);
    let output = member.output();
    assert!(!output.contains("maximum poll interval"), "the member stopped polling:\n{output}");
    assert!(!output.contains("partitions revoked"), "the member lost its partitions:\n{output}");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_pauses_consumption_turns_not_ready_and_recovers_by_itself() {
    let mut refuse = redis::cmd("CONFIG");
    refuse.arg("SET").arg("maxmemory").arg("1");
    let mut accept = redis::cmd("CONFIG");
    accept.arg("SET").arg("maxmemory").arg("0");
    redis_refusing_writes("redisoom", refuse, accept, "redis out of memory", "out_of_memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_turned_read_only_pauses_consumption_turns_not_ready_and_recovers_by_itself() {
    // A replica of a master that does not exist: it keeps its data and refuses writes.
    let mut refuse = redis::cmd("REPLICAOF");
    refuse.arg("127.0.0.1").arg(crate::helpers::stack::free_port());
    let mut accept = redis::cmd("REPLICAOF");
    accept.arg("NO").arg("ONE");
    redis_refusing_writes("redisro", refuse, accept, "redis read-only", "read_only").await;
}

/// ClickHouse answers a flush with an error code clickagg's table does not know (here
/// 395, FUNCTION_THROW_IF_VALUE_IS_NON_ZERO, raised by a materialized view on the
/// minute table): the member retries it like an outage, counts it by code, and counts
/// exactly once the error passes. It used to stop, and on Kubernetes crash-loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_clickhouse_error_code_during_flushes_is_retried_counted_and_exact() {
    let env = TestEnv::new("unknowncode").await;
    let (records, truth) = env.plan(Spec { count: 20_000, seed: 36, ..Spec::default() });
    let inject = "CREATE MATERIALIZED VIEW injected_error ENGINE = Null AS \
                  SELECT throwIf(clicks > 0, 'an error clickagg has never heard of') AS x FROM ad_clicks_minute";
    env.sink().client().query(inject).execute().await.expect("create the view that fails every insert");
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m");
    wait_until("flushes fail with the unknown code", Duration::from_secs(90), || async {
        match member.metric("clickagg_clickhouse_unknown_errors_total", &[]).await {
            n if n >= 3.0 => Ok(()),
            n => Err(format!("{n} errors with code 395")),
        }
    })
    .await;
    member
        .wait_for_line("error code 395 is not in clickagg's table of codes: retried", 0, Duration::from_secs(10))
        .await;
    let before = env.committed_offsets().await;
    assert!(before.values().all(|&o| o <= 0), "nothing committed while no flush succeeds: {before:?}");
    env.sink().client().query("DROP VIEW injected_error").execute().await.expect("drop the view");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0, "the member never stopped");
}
