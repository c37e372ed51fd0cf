//! Dedup decisions are a function of the log (README, "What counts"): every re-read —
//! a backfill after the dedup keys are gone, a replay of the middle of the topic, a
//! group reset to any offset — writes the rows the first read wrote. Each test starts
//! from an exact live run and checks the ground truth afterwards.

use std::collections::BTreeMap;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::Minute;
use clickagg::produce::{Kind, Planned, Spec};

use crate::helpers::{equals, wait_until, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);
const EXIT: Duration = Duration::from_secs(300);

/// Runs `clickagg <args>` to completion, asserts its exit code, returns its output.
async fn run_to_end(env: &TestEnv, label: &str, args: &[&str], expect: i32) -> String {
    let mut p = env.spawn(label, args, &[]);
    let code = p.wait(EXIT).await;
    assert_eq!(code, expect, "{label} exited {code}:\n{}", p.output());
    p.output()
}

/// Counts `expected` with one live member until exact, then stops it.
async fn count_live(env: &TestEnv, expected: &BTreeMap<BucketKey, u64>) {
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(expected, CONVERGE).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
}

/// A generated topic, counted exactly by a live member that then stopped.
async fn counted_topic(name: &str, spec: Spec) -> (TestEnv, clickagg::produce::Truth) {
    let env = TestEnv::new(name).await;
    let (records, truth) = env.plan(spec);
    env.send(&records, 4, None).await;
    count_live(&env, &truth.counts).await;
    (env, truth)
}

/// A valid click record, placed on `partition`, stamped `ts_ms` (event and record time).
fn click(id: &str, ad_id: u64, ts_ms: i64, partition: i32) -> Planned {
    Planned {
        key: id.to_string(),
        payload: format!(r#"{{"click_id":"{id}","ad_id":{ad_id},"ts":{ts_ms}}}"#).into_bytes(),
        timestamp_ms: ts_ms,
        kind: Kind::Click,
        partition: Some(partition),
    }
}

fn bucket(ad_id: u64, ts_ms: i64) -> BucketKey {
    BucketKey { ad_id, minute: Minute::from_millis(ts_ms).unwrap() }
}

/// An RFC 3339 time `secs` before now.
fn ago(secs: i64) -> String {
    (chrono::Utc::now() - chrono::Duration::seconds(secs)).to_rfc3339()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_after_the_dedup_keys_expired_counts_exactly() {
    let (env, truth) = counted_topic("expiredkeys", Spec { count: 40_000, seed: 71, ..Spec::default() }).await;
    // What the dedup window does to the keys, without waiting a day.
    assert!(env.delete_dedup_keys().await > 0, "the live run kept dedup state in Redis");
    run_to_end(&env, "replay", &["replay", "--from", "earliest"], 0).await;
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert!(d.is_exact(), "a backfill without dedup keys changed the counts:\n{}", d.report(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_the_middle_of_the_topic_without_dedup_keys_counts_exactly() {
    let (env, truth) = counted_topic("expiredmid", Spec { count: 40_000, seed: 72, ..Spec::default() }).await;
    env.delete_dedup_keys().await;
    // The generated event times span the last ten minutes: start in the middle.
    run_to_end(&env, "replay-mid", &["replay", "--from", &ago(5 * 60)], 0).await;
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert!(d.is_exact(), "a replay from the middle changed the counts:\n{}", d.report(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_whose_original_lies_before_the_replayed_range_is_not_counted_again() {
    let mut env = TestEnv::new("origbefore").await;
    env.batch_offsets = 100;
    // At a minute's start: the fillers, 1.0–1.25 s after it, share its minute whatever
    // the wall clock says (unaligned, 18 of them once fell into the next minute).
    let t0 = minute_start_ago(10 * 60);
    // Partition 0: the original at offset 0, 250 other clicks, then its duplicate at 251.
    let mut records = vec![click("original", 7, t0, 0)];
    records.extend((0..250).map(|i| click(&format!("filler-{i}"), 8, t0 + 1_000 + i, 0)));
    records.push(click("original", 7, t0 + 60_000, 0));
    env.send(&records, 1, None).await;
    let expected = BTreeMap::from([(bucket(7, t0), 1), (bucket(8, t0 + 1_000), 250)]);
    count_live(&env, &expected).await;

    // Without and with the dedup keys, a replay starting after the original (its batch
    // begins at 200) must recognise the duplicate at 251.
    for delete_keys in [false, true] {
        if delete_keys {
            env.delete_dedup_keys().await;
        }
        run_to_end(&env, &format!("replay-deleted-{delete_keys}"), &["replay", "--from", "0:230"], 0).await;
        let d = clickagg::verify::diff(&expected, &env.billing().await);
        assert!(d.is_exact(), "replay after the original (keys deleted: {delete_keys}):\n{}", d.report(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_after_the_window_counts_identically_live_and_on_replay() {
    let mut env = TestEnv::new("afterwindow").await;
    env.batch_offsets = 10;
    env.extra_env.extend([
        ("CLICKAGG__DEDUP__WINDOW".to_string(), "60s".to_string()),
        ("CLICKAGG__VALIDATION__MAX_LATENESS".to_string(), "30s".to_string()),
    ]);
    // At a minute's start, so that each sighting's fillers (+100..+114 ms) share its minute.
    let t0 = minute_start_ago(20 * 60);
    // One click ID seen at t0, +50 s, +100 s and +200 s, between other clicks. Within a
    // partition a record counts if no earlier record with its ID lies within the window
    // (60 s) before it: t0 counts, +50 s and +100 s do not (each is 50 s after the last
    // sighting), +200 s counts again (100 s after the last sighting).
    let mut records = Vec::new();
    for (i, dt) in [0, 50_000, 100_000, 200_000].into_iter().enumerate() {
        records.push(click("repeated", 5, t0 + dt, 0));
        records.extend((0..15).map(|j| click(&format!("other-{i}-{j}"), 6, t0 + dt + 100 + j, 0)));
    }
    env.send(&records, 1, None).await;
    // Buckets built from several timestamps may be the same minute: add them up.
    let mut merged: BTreeMap<BucketKey, u64> = BTreeMap::new();
    for dt in [0, 50_000, 100_000, 200_000] {
        *merged.entry(bucket(6, t0 + dt)).or_default() += 15;
    }
    for dt in [0, 200_000] {
        *merged.entry(bucket(5, t0 + dt)).or_default() += 1;
    }
    count_live(&env, &merged).await;
    for delete_keys in [false, true] {
        if delete_keys {
            env.delete_dedup_keys().await;
        }
        run_to_end(&env, &format!("replay-deleted-{delete_keys}"), &["replay", "--from", "earliest"], 0).await;
        let d = clickagg::verify::diff(&merged, &env.billing().await);
        assert!(d.is_exact(), "replay (keys deleted: {delete_keys}):\n{}", d.report(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_on_other_partitions_are_deduplicated_live_and_on_a_replay_without_keys() {
    let spec = Spec { count: 40_000, seed: 73, duplicate_ratio: 0.2, cross_partition_ratio: 0.5, ..Spec::default() };
    let env = TestEnv::new("crosspart").await;
    let (records, truth) = env.plan(spec);
    assert!(records.iter().filter(|r| r.key.contains("#copy")).count() > 2_000);
    env.send(&records, 4, None).await;
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(m.metric("clickagg_cross_partition_duplicates_total", &[]).await > 1_000.0);
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);

    env.delete_dedup_keys().await;
    run_to_end(&env, "replay", &["replay", "--from", "earliest"], 0).await;
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert!(
        d.is_exact(),
        "a replay without keys must honour the recorded cross-partition decisions:\n{}",
        d.report(20)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_reset_by_the_standard_tool_to_a_time_or_a_shift_mid_batch_then_run_counts_exactly() {
    let (env, truth) = counted_topic("toolreset", Spec { count: 60_000, seed: 74, ..Spec::default() }).await;
    let n = env.batch_offsets as i64;
    let done = env.committed_offsets().await;
    let datetime = format!("{}Z", &ago(6 * 60)[..23]);
    let resets: [&[&str]; 2] = [&["--to-datetime", &datetime], &["--shift-by", "-1234"]];
    for (i, target) in resets.into_iter().enumerate() {
        env.consumer_groups(&[&["--reset-offsets"], target, &["--execute"]].concat()).await;
        let reset = env.committed_offsets().await;
        assert!(reset.values().any(|o| o % n != 0), "the reset lands mid-batch: {reset:?}");
        let mut m = env.spawn_member(&format!("after-reset-{i}"));
        // Once the member has committed its way back to where the live run ended, it
        // has re-read and re-flushed everything after the reset.
        wait_until("the member re-reads to the end", CONVERGE, || async {
            equals(env.committed_offsets().await, done.clone())
        })
        .await;
        let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
        assert!(d.is_exact(), "after the reset {target:?}:\n{}", d.report(20));
        assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_old_history_leaves_no_more_dedup_keys_than_it_found() {
    let (env, truth) = counted_topic("oldhistory", Spec { count: 30_000, seed: 75, ..Spec::default() }).await;
    // The live keys are gone, as they are once a backfill is older than the window.
    env.delete_dedup_keys().await;
    run_to_end(&env, "replay", &["replay", "--from", "earliest"], 0).await;
    assert_eq!(env.dedup_key_count().await, 0, "the replay left its dedup state in Redis");
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert!(d.is_exact(), "{}", d.report(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_lagging_beyond_max_record_lag_stays_on_the_cache_which_keeps_what_it_needs() {
    let mut env = TestEnv::new("laggard").await;
    // Record times 10 to 40 minutes old, a window of 5 minutes and 1 minute of lag
    // allowed by the wall-clock sweep: left alone, the sweeper would delete every sighting
    // the member writes as soon as it wrote it. It must keep what the lagging member still
    // needs, and the member must decide through the cache (copies on other partitions
    // included), not fall back.
    env.extra_env.extend([
        ("CLICKAGG__DEDUP__WINDOW".to_string(), "5m".to_string()),
        ("CLICKAGG__VALIDATION__MAX_LATENESS".to_string(), "4m".to_string()),
        ("CLICKAGG__DEDUP__MAX_RECORD_LAG".to_string(), "1m".to_string()),
    ]);
    let spec = Spec {
        count: 60_000,
        seed: 76,
        start_ms: ago_ms(40 * 60),
        span: Duration::from_secs(30 * 60),
        late_ratio: 0.0,
        duplicate_ratio: 0.2,
        cross_partition_ratio: 0.3,
        ..Spec::default()
    };
    let (records, truth) = clickagg::produce::plan(&spec);
    env.send(&records, 4, None).await;
    let mut m = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(m.output().contains("the dedup cache keeps the sightings they still need"), "the lag was noticed");
    assert_eq!(m.metric("clickagg_dedup_rebuilds_total", &[]).await, 0.0, "no partition fell back to the log");
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
}

/// The start of the minute `secs` ago, in milliseconds.
fn minute_start_ago(secs: i64) -> i64 {
    ago_ms(secs).div_euclid(60_000) * 60_000
}

fn ago_ms(secs: i64) -> i64 {
    chrono::Utc::now().timestamp_millis() - secs * 1000
}
