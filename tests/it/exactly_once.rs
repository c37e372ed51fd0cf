//! The promise: every valid click counted exactly once, whatever fails.

use std::time::Duration;

use clickagg::produce::Spec;
use rand::Rng;
use rdkafka::Offset;

use crate::helpers::{equals, wait_until, Member, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_clicks_with_ten_percent_duplicates_count_exactly() {
    let env = TestEnv::new("exact100k").await;
    // Retries re-stamped into another minute: counting a retry instead of its original
    // would put a click in the wrong minute, not just look exact.
    let spec = Spec { count: 100_000, duplicate_ratio: 0.1, retry_drift_ratio: 0.5, seed: 1, ..Spec::default() };
    let (records, truth) = env.plan(spec);
    assert!(truth.duplicates > 9_000 && truth.drifted > 4_000, "{}", truth.summary());
    env.send(&records, 4, None).await;

    let mut member = env.spawn_member("m0");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    // Duplicates after the last counted click may still be in flight: wait for them.
    wait_until("every duplicate dropped", CONVERGE, || async {
        equals(member.metric("clickagg_duplicates_dropped_total", &[]).await as u64, truth.duplicates)
    })
    .await;
    // A caught-up member's commits are its flushed positions: the log end, as lag tools
    // read them, within a flush interval or so (200 ms here) — not the start of each
    // partition's open batch.
    let high = env.high_watermarks().await;
    wait_until("commits at the log end while the member runs", Duration::from_secs(10), || async {
        let committed = env.committed_offsets().await;
        if committed == high {
            Ok(())
        } else {
            Err(format!("committed {committed:?}, log end {high:?}"))
        }
    })
    .await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0, "SIGTERM drains and exits 0");
    assert_eq!(env.committed_offsets().await, high, "the drain moves no commit back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_killed_with_sigkill_mid_stream_and_mid_flush_count_exactly() {
    let env = TestEnv::new("sigkill").await;
    let spec = Spec { count: 150_000, seed: 2, retry_drift_ratio: 0.3, ..Spec::default() };
    let (records, truth) = env.plan(spec);
    assert!(truth.drifted > 2_000, "{}", truth.summary());
    // Produce while the members consume, so every kill lands mid-stream.
    let producer = env.spawn_producer(&records, 4, 15_000);
    // Static membership: a restarted member takes its partitions back at once.
    let extra = [("CLICKAGG__KAFKA__GROUP_INSTANCE_ID", "member-0")];
    // Every other member is killed as soon as it logs that a flush with rows starts; its
    // log then shows whether the kill came before the flush completed. Kills go on
    // until three did land mid-flush, or fail after twelve such attempts.
    let (mut attempts, mut mid_flush) = (0, 0);
    for round in 0.. {
        if mid_flush >= MID_FLUSH_KILLS {
            break;
        }
        assert!(
            attempts < 4 * MID_FLUSH_KILLS,
            "only {mid_flush} of {attempts} kills right after \"flushing\" came before the flush completed"
        );
        let mut member = env.spawn(&format!("m{round}"), &["run"], &extra);
        let seen = member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
        if round % 2 == 0 {
            let started = flush_with_rows(&member, seen).await;
            member.kill9().await;
            attempts += 1;
            if flush_in_flight(&member.lines()[started..]) {
                mid_flush += 1;
            }
        } else {
            let ms = rand::rng().random_range(100..1500);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            member.kill9().await;
        }
    }
    let mut last = env.spawn("last", &["run"], &extra);
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(last.terminate(Duration::from_secs(30)).await, 0);
}

/// Kills that must land while a flush's insert is in flight.
const MID_FLUSH_KILLS: usize = 3;

/// Waits for the member to log that a flush writing rows starts (flushes of commits
/// alone take no time); returns the number of lines up to it.
async fn flush_with_rows(member: &Member, from: usize) -> usize {
    let mut from = from;
    loop {
        let at = member.wait_for_line(r#""message":"flushing""#, from, Duration::from_secs(30)).await;
        let line: serde_json::Value = serde_json::from_str(&member.lines()[at - 1]).expect("a JSON log line");
        if line["rows"].as_u64().is_some_and(|rows| rows > 0) {
            return at;
        }
        from = at;
    }
}

/// Whether the output after a "flushing" line (a killed member's, complete) shows the
/// flush never completed: no "flushed" from the flusher, so its offsets were not
/// committed either.
fn flush_in_flight(after: &[String]) -> bool {
    !after.iter().any(|l| l.contains(r#""message":"flushed""#))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_joining_and_leaving_the_group_count_exactly() {
    let env = TestEnv::new("rebalance").await;
    let (records, truth) = env.plan(Spec { count: 150_000, seed: 3, ..Spec::default() });
    let producer = env.spawn_producer(&records, 6, 12_000);
    let mut a = env.spawn_member("a");
    a.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut b = env.spawn_member("b");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut c = env.spawn_member("c");
    c.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A leaves gracefully (flush, commit, leave group); B crashes.
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    b.kill9().await;
    let mut d = env.spawn_member("d");
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(a.output().contains("partitions revoked"), "a saw its partitions move");
    assert_eq!(c.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(d.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resetting_the_group_to_the_beginning_and_consuming_again_changes_no_count() {
    let env = TestEnv::new("reset").await;
    let (records, truth) = env.plan(Spec { count: 50_000, seed: 4, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut first = env.spawn_member("first");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(first.terminate(Duration::from_secs(30)).await, 0);
    let before = env.billing().await;

    env.reset_group_offsets(Offset::Beginning).await;
    assert!(env.committed_offsets().await.values().all(|&o| o == 0));
    let mut second = env.spawn_member("second");
    wait_until("the second pass re-reads the topic", CONVERGE, || async {
        equals(second.metric("clickagg_records_consumed_total", &[]).await as usize, records.len())
    })
    .await;
    // Every valid click is found in Redis under its own position: counted again in its
    // batch (same cumulative rows), never as new.
    assert_eq!(second.metric("clickagg_redelivered_clicks_total", &[]).await as u64, truth.clicks);
    assert_eq!(second.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(env.billing().await, before);
    env.assert_counts_converge(&truth.counts, Duration::from_secs(10)).await;
}

/// Issue 17: flushes are coalesced per member, so with `flush_interval` 1 s each table
/// takes at most one insert per second, whatever the partitions and batches. Counted by
/// ClickHouse itself: every insert into a MergeTree table takes the next block number,
/// and merged parts keep the range, so the highest block number of a table is the
/// number of inserts it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_second_flush_interval_gives_at_most_one_insert_per_table_per_second() {
    let mut env = TestEnv::new("coalesce").await;
    env.extra_env.push(("CLICKAGG__PIPELINE__FLUSH_INTERVAL".into(), "1s".into()));
    // Small batches, so that a batch boundary is crossed many times a second on every
    // partition: a flush per batch would show at once.
    env.batch_offsets = 100;
    let spec = Spec { count: 48_000, cross_partition_ratio: 0.3, seed: 71, ..Spec::default() };
    let (records, truth) = env.plan(spec);
    let producer = env.spawn_producer(&records, 8, 2_000);
    let mut member = env.spawn_member("m");
    member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    wait_until("rows arrive", CONVERGE, || async {
        let n = inserts(&env).await.values().sum::<u64>();
        if n > 0 {
            Ok(())
        } else {
            Err("no insert yet".to_string())
        }
    })
    .await;

    // A window of steady traffic: the inserts each table took in it.
    let before = inserts(&env).await;
    let began = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let after = inserts(&env).await;
    let secs = began.elapsed().as_secs_f64();
    assert!(!producer.is_finished(), "the traffic must outlast the window: send more records");
    let allowed = secs.ceil() as u64 + 1;
    for (table, &n) in &after {
        let n = n - before.get(table).copied().unwrap_or(0);
        assert!(n <= allowed, "{table}: {n} inserts in {secs:.1} s (at most {allowed})");
    }
    assert!(after.len() >= 2, "the counts and the pins at least were written: {after:?}");
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// Table → inserts it took so far (its highest block number), in the test's database.
async fn inserts(env: &TestEnv) -> std::collections::BTreeMap<String, u64> {
    let sink = env.sink();
    let sql = "SELECT table, toUInt64(max(max_block_number)) FROM system.parts WHERE database = ? GROUP BY table";
    let rows: Vec<(String, u64)> = sink.client().query(sql).bind(env.database.as_str()).fetch_all().await.unwrap();
    rows.into_iter().collect()
}
