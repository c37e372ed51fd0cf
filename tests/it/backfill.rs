//! Replay for backfill and reconciliation against the topic. Every topic here has
//! copies of clicks on other partitions, and every replay also runs into emptied count
//! tables: over the rows a live member wrote, a replay's own rows lose (a member's row
//! outranks a replay's at the same offset), so only there can its mistakes show.

use std::time::Duration;

use clickagg::aggregate::{BatchRow, BucketKey};
use clickagg::produce::Spec;
use clickagg::sink::Writer;

use crate::helpers::{positions_of_keys, read_dead_letters, redis_url, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);
const EXIT: Duration = Duration::from_secs(300);

/// Runs `clickagg <args>` to completion and returns its whole output; asserts exit status.
async fn run_to_end(env: &TestEnv, label: &str, args: &[&str], extra: &[(&str, &str)], expect: i32) -> String {
    let mut p = env.spawn(label, args, extra);
    let code = p.wait(EXIT).await;
    assert_eq!(code, expect, "{label} exited {code}:\n{}", p.output());
    p.output()
}

/// A topic with clicks, fully counted by a live member that then stopped.
async fn counted_topic(name: &str, count: u64, seed: u64) -> (TestEnv, clickagg::produce::Truth) {
    let env = TestEnv::new(name).await;
    let (records, truth) = env.plan(Spec { count, seed, cross_partition_ratio: 0.3, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    assert!(env.pin_count().await > 0, "the live run recorded no cross-partition decision");
    (env, truth)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_whole_topic_three_times_changes_no_count() {
    let (env, truth) = counted_topic("replay3x", 60_000, 11).await;
    let before = env.billing().await;
    for i in 0..3 {
        // The last replay alone writes every row: nothing of the live run's hides it.
        let emptied = i == 2;
        if emptied {
            env.empty_count_tables().await;
            assert!(env.billing().await.is_empty());
        }
        let out =
            run_to_end(&env, &format!("replay{i}"), &["replay", "--from", "earliest", "--to", "latest"], &[], 0).await;
        assert!(out.contains("replayed 60000 records"), "{out}");
        // The replay decides every click as the live run did: identical rows.
        assert!(out.contains(&format!("{} counted, {} duplicates", truth.clicks, truth.duplicates)), "{out}");
        assert_eq!(env.billing().await, before, "replay {i} (into emptied tables: {emptied}) changed a count");
    }
    env.assert_counts_exact(&truth.counts, "after the replays").await;
    // The replays re-rejected the bad records; their dead letters say so, and name the
    // same source positions as the live run's, so a consumer can tell copies apart.
    let bad = positions_of_keys(&env, |k| k.starts_with(b"bad-")).await;
    assert_eq!(bad.len() as u64, truth.malformed_total());
    let letters = read_dead_letters(&env, 4 * bad.len()).await;
    let from = |origin: &str| {
        let mut positions: Vec<(i32, i64)> =
            letters.iter().filter(|d| d.origin() == origin).map(|d| d.source()).collect();
        positions.sort();
        positions
    };
    assert_eq!(from("run"), bad.iter().copied().collect::<Vec<_>>(), "one letter per bad record from the live run");
    let thrice: Vec<(i32, i64)> = bad.iter().flat_map(|&p| [p; 3]).collect();
    assert_eq!(from("replay"), thrice, "one letter per bad record from each replay");
    assert_eq!(letters.len(), 4 * bad.len(), "no letter of another origin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_table_is_rebuilt_by_a_replay_with_and_without_the_dedup_keys() {
    // Redis database 15 is this test's alone, so FLUSHDB touches no other test.
    let mut url = url::Url::parse(&redis_url()).unwrap();
    url.set_path("/15");
    let redis = url.to_string();
    let mut env = TestEnv::new("rebuild").await;
    env.extra_env.push(("CLICKAGG__REDIS__URL".into(), redis.clone()));
    let mut client = redis::Client::open(redis.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHDB").query_async(&mut client).await.unwrap();

    let (records, truth) = env.plan(Spec { count: 60_000, seed: 12, cross_partition_ratio: 0.3, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    assert!(env.pin_count().await > 0, "the live run recorded no cross-partition decision");

    for flush_redis in [false, true] {
        // Every count table, and everything sealed from it (the pins and the batch size
        // stay).
        for table in [
            "ad_clicks_minute",
            "ad_clicks_sealed_hour",
            "ad_clicks_sealed_day",
            "clickagg_seals",
            "clickagg_touched",
            "clickagg_seal_progress",
        ] {
            env.sink().execute(&format!("DROP TABLE {table}")).await.unwrap();
        }
        env.sink().migrate().await.unwrap();
        assert!(env.billing().await.is_empty());
        if flush_redis {
            let _: () = redis::cmd("FLUSHDB").query_async(&mut client).await.unwrap();
        }
        run_to_end(&env, &format!("replay-flushdb-{flush_redis}"), &["replay", "--from", "earliest"], &[], 0).await;
        env.assert_counts_exact(&truth.counts, &format!("after replay (FLUSHDB: {flush_redis})")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_while_a_member_consumes_the_same_topic_counts_exactly() {
    let env = TestEnv::new("replaylive").await;
    let (records, truth) = env.plan(Spec { count: 120_000, seed: 13, cross_partition_ratio: 0.3, ..Spec::default() });
    // The first half is in the topic before anything runs; the rest arrives meanwhile.
    let (first, rest) = records.split_at(60_000);
    env.send(first, 4, None).await;
    let producer = env.spawn_producer(rest, 4, 15_000);
    let mut live = env.spawn_member("live");
    live.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    run_to_end(&env, "replay-a", &["replay"], &[], 0).await;
    run_to_end(&env, "replay-b", &["replay"], &[], 0).await;
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(live.terminate(Duration::from_secs(30)).await, 0);
    // What the replays beside the member decided is what a replay alone writes.
    assert!(env.pin_count().await > 0, "the live run recorded no cross-partition decision");
    env.empty_count_tables().await;
    run_to_end(&env, "replay-alone", &["replay"], &[], 0).await;
    env.assert_counts_exact(&truth.counts, "a replay into emptied tables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_starting_in_the_middle_of_a_batch_reduces_no_count() {
    let (env, truth) = counted_topic("midbatch", 40_000, 14).await;
    // Offsets in the middle of batches (batch_offsets = 1000), and a time in the middle.
    env.replay_checked("replay-offsets", "0:1500,1:2999,2:10,3:7777", &truth.counts).await;
    let mid = chrono::DateTime::from_timestamp_millis(
        clickagg::time::parse_time_ms(&chrono::Utc::now().to_rfc3339()).unwrap() - 5 * 60_000,
    )
    .unwrap()
    .to_rfc3339();
    env.replay_checked("replay-time", &mid, &truth.counts).await;
}

/// `verify` and `reconcile`: exit 0 on an exact match, 4 when the counts differ, 1
/// when they could not run; a script must be able to tell a wrong count from an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_and_verify_match_after_a_run_report_a_corrupted_row_and_tell_it_from_an_outage() {
    let (env, truth) = counted_topic("reconcile", 40_000, 15).await;
    // "exact match" says the recount equals the rows; the rows must equal the
    // generator's truth for that to say the recount is right.
    env.assert_counts_exact(&truth.counts, "before reconciling").await;
    let truth_file = env.log_dir.join("truth.csv");
    truth.write_csv(&truth_file).unwrap();
    let truth_arg = truth_file.display().to_string();
    let out = run_to_end(&env, "verify-ok", &["verify", "--expected", &truth_arg], &[], 0).await;
    assert!(out.contains("exact match"), "{out}");
    let (from, to) = window(&truth.counts);
    let out = run_to_end(&env, "reconcile-ok", &["reconcile", "--from", &from, "--to", &to], &[], 0).await;
    assert!(out.contains("exact match"), "{out}");
    assert!(out.contains(&format!("expected {} clicks", truth.clicks)), "the recount is the truth's: {out}");
    // A range in the middle: the recount first reads the window before it (without
    // counting) to know which clicks in it are repeats.
    // Records span the last ten minutes (late clicks reach back further): start three
    // minutes before the end, so the scan (which begins max_future_skew earlier) is
    // in the middle of the topic.
    let mid = clickagg::click::Minute::from_epoch_seconds(
        truth.counts.keys().map(|k| k.minute.epoch_seconds()).max().unwrap() - 3 * 60,
    );
    let in_range: u64 = truth.counts.iter().filter(|(k, _)| k.minute >= mid).map(|(_, c)| c).sum();
    let mid = mid.to_rfc3339();
    let args = ["reconcile", "--from", &mid, "--to", &to, "--scan-margin", "0s"];
    let out = run_to_end(&env, "reconcile-mid", &args, &[], 0).await;
    assert!(out.contains("exact match") && !out.contains(" 0 read before them"), "{out}");
    assert!(out.contains(&format!("expected {in_range} clicks")), "the recount is the truth's: {out}");

    // Corrupt one bucket: a row for a batch that never existed, with a huge version.
    let (key, clicks) = truth.counts.iter().next().map(|(k, c)| (*k, *c)).unwrap();
    let forged = BatchRow { key, partition: 0, batch_start: 999_999_000, clicks: 5, version: i64::MAX - 1 };
    env.sink().insert(&env.topic, &[forged], Writer::Member).await.unwrap();
    let out = run_to_end(&env, "reconcile-bad", &["reconcile", "--from", &from, "--to", &to], &[], 4).await;
    assert!(out.contains("1 ad-minutes differ"), "{out}");
    assert!(out.contains(&key.minute.to_rfc3339()) && out.contains(&format!("{}", clicks + 5)), "{out}");
    let out = run_to_end(&env, "verify-bad", &["verify", "--expected", &truth_arg], &[], 4).await;
    assert!(out.contains("1 ad-minutes differ"), "{out}");

    // Could not run: ClickHouse unreachable (nothing listens there), a truth file missing.
    let unreachable = format!("http://127.0.0.1:{}", crate::helpers::stack::free_port());
    let down = [("CLICKAGG__CLICKHOUSE__URL", unreachable.as_str())];
    let out = run_to_end(&env, "reconcile-down", &["reconcile", "--from", &from, "--to", &to], &down, 1).await;
    assert!(!out.contains("differ") && !out.contains("exact match"), "{out}");
    let out = run_to_end(&env, "verify-down", &["verify", "--expected", &truth_arg], &down, 1).await;
    assert!(!out.contains("differ") && !out.contains("exact match"), "{out}");
    let missing = env.log_dir.join("no-truth.csv").display().to_string();
    run_to_end(&env, "verify-no-file", &["verify", "--expected", &missing], &[], 1).await;
}

/// The smallest minute-aligned window holding every bucket, as RFC 3339 strings.
fn window(counts: &std::collections::BTreeMap<BucketKey, u64>) -> (String, String) {
    let min = counts.keys().map(|k| k.minute).min().unwrap();
    let max = counts.keys().map(|k| k.minute).max().unwrap();
    let to = clickagg::click::Minute::from_epoch_seconds(max.epoch_seconds() + 60);
    (min.to_rfc3339(), to.to_rfc3339())
}
