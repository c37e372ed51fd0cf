//! Dedup decisions are a function of the log (guide, "What counts"): every re-read —
//! a backfill after the dedup keys are gone, a replay of the middle of the topic, a
//! group reset to any offset — writes the rows the first read wrote. Each test starts
//! from an exact live run with copies of clicks on other partitions (whose recorded
//! decisions, `clickagg_pins`, a re-read must honour) and checks the ground truth
//! after every re-read, also with the rows the re-read rewrites deleted first: over the
//! live rows alone a re-read proves nothing, since a member's row outranks a replay's
//! at the same offset, and an under-count or an ignored decision would stay hidden.

use std::collections::BTreeMap;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::Minute;
use clickagg::produce::{Kind, Planned, Spec};

use crate::helpers::TestEnv;

const CONVERGE: Duration = Duration::from_secs(180);

/// Counts `expected` with one live member until exact, then stops it.
async fn count_live(env: &TestEnv, expected: &BTreeMap<BucketKey, u64>) {
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(expected, CONVERGE).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
}

/// A generated topic, counted exactly by a live member that then stopped; its copies
/// on other partitions left recorded decisions.
async fn counted_topic(name: &str, spec: Spec) -> (TestEnv, clickagg::produce::Truth) {
    assert!(spec.cross_partition_ratio > 0.0, "a re-read must meet recorded cross-partition decisions");
    let env = TestEnv::new(name).await;
    let (records, truth) = env.plan(spec);
    env.send(&records, 4, None).await;
    count_live(&env, &truth.counts).await;
    assert!(env.pin_count().await > 0, "the live run recorded no cross-partition decision");
    (env, truth)
}

/// Counts `copies` with a live member first, then `records`, then stops it. The copies
/// are counted before anything else, so the live run records the sightings of the same
/// clicks in `records` as duplicates of copies on another partition (pins), which every
/// re-read of those partitions must honour.
async fn count_live_copies_first(
    env: &TestEnv,
    partitions: i32,
    copies: &[Planned],
    records: &[Planned],
    expected: &BTreeMap<BucketKey, u64>,
) {
    env.send(copies, partitions, None).await;
    let mut m = env.spawn_member("live");
    env.assert_counts_converge(&recount(copies), CONVERGE).await;
    env.send(records, partitions, None).await;
    env.assert_counts_converge(expected, CONVERGE).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    assert!(env.pin_count().await > 0, "the live run recorded no cross-partition decision");
}

/// The counts of hand-built records whose click IDs are all distinct.
fn recount(records: &[Planned]) -> BTreeMap<BucketKey, u64> {
    let mut counts = BTreeMap::new();
    for r in records {
        let c = clickagg::click::decode(Some(&r.payload), Some(r.timestamp_ms), &Default::default()).unwrap();
        *counts.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
    }
    counts
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
    let spec = Spec { count: 40_000, seed: 71, cross_partition_ratio: 0.3, ..Spec::default() };
    let (env, truth) = counted_topic("expiredkeys", spec).await;
    // What the dedup window does to the keys, without waiting a day.
    assert!(env.delete_dedup_keys().await > 0, "the live run kept dedup state in Redis");
    env.replay_checked("backfill-without-keys", "earliest", &truth.counts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_the_middle_of_the_topic_without_dedup_keys_counts_exactly() {
    let spec = Spec { count: 40_000, seed: 72, cross_partition_ratio: 0.3, ..Spec::default() };
    let (env, truth) = counted_topic("expiredmid", spec).await;
    env.delete_dedup_keys().await;
    // The generated event times span the last ten minutes: start in the middle.
    env.replay_checked("replay-mid", &ago(5 * 60), &truth.counts).await;
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
    // Copies on partition 1 of the fillers in the replayed batch (offsets 200–250),
    // counted first: their sightings on partition 0 are recorded duplicates.
    let copies: Vec<Planned> = (199..250).map(|i| click(&format!("filler-{i}"), 8, t0 + 1_000 + i, 1)).collect();
    let expected = BTreeMap::from([(bucket(7, t0), 1), (bucket(8, t0 + 1_000), 250)]);
    count_live_copies_first(&env, 2, &copies, &records, &expected).await;

    // Without and with the dedup keys, a replay starting after the original (its batch
    // begins at 200) must recognise the duplicate at 251, and the copies counted on
    // partition 1.
    for delete_keys in [false, true] {
        if delete_keys {
            env.delete_dedup_keys().await;
        }
        env.replay_checked(&format!("replay-deleted-{delete_keys}"), "0:230", &expected).await;
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
    let mut copies = Vec::new();
    for (i, dt) in [0, 50_000, 100_000, 200_000].into_iter().enumerate() {
        records.push(click("repeated", 5, t0 + dt, 0));
        records.extend((0..15).map(|j| click(&format!("other-{i}-{j}"), 6, t0 + dt + 100 + j, 0)));
        // Copies of a few of the others on partition 1, counted first.
        copies.extend((0..5).map(|j| click(&format!("other-{i}-{j}"), 6, t0 + dt + 100 + j, 1)));
    }
    // Buckets built from several timestamps may be the same minute: add them up.
    let mut merged: BTreeMap<BucketKey, u64> = BTreeMap::new();
    for dt in [0, 50_000, 100_000, 200_000] {
        *merged.entry(bucket(6, t0 + dt)).or_default() += 15;
    }
    for dt in [0, 200_000] {
        *merged.entry(bucket(5, t0 + dt)).or_default() += 1;
    }
    count_live_copies_first(&env, 2, &copies, &records, &merged).await;
    for delete_keys in [false, true] {
        if delete_keys {
            env.delete_dedup_keys().await;
        }
        env.replay_checked(&format!("replay-deleted-{delete_keys}"), "earliest", &merged).await;
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

    // A replay without keys must honour the recorded cross-partition decisions.
    env.delete_dedup_keys().await;
    env.replay_checked("replay-without-keys", "earliest", &truth.counts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_reset_by_the_standard_tool_to_a_time_or_a_shift_mid_batch_then_run_counts_exactly() {
    let spec = Spec { count: 60_000, seed: 74, cross_partition_ratio: 0.3, ..Spec::default() };
    let (env, truth) = counted_topic("toolreset", spec).await;
    let n = env.batch_offsets as i64;
    let done = env.committed_offsets().await;
    let high = env.high_watermarks().await;
    let datetime = format!("{}Z", &ago(6 * 60)[..23]);
    let resets: [&[&str]; 2] = [&["--to-datetime", &datetime], &["--shift-by", "-1234"]];
    for (i, target) in resets.into_iter().enumerate() {
        env.consumer_groups(&[&["--reset-offsets"], target, &["--execute"]].concat()).await;
        let reset = env.committed_offsets().await;
        assert!(reset.values().any(|o| o % n != 0), "the reset lands mid-batch: {reset:?}");
        // The member re-reads from the boundary at or below each reset offset: the rows
        // of those batches are then its alone.
        let rewritten = reset.iter().map(|(&p, &o)| (p, (o - o % n, high[&p]))).collect();
        env.empty_count_batches(&rewritten).await;
        let mut m = env.spawn_member(&format!("after-reset-{i}"));
        // Once the member has committed its way back to where the live run ended, it
        // has re-read everything after the reset.
        env.wait_committed("the member re-reads to the end", &done, CONVERGE).await;
        env.assert_counts_converge(&truth.counts, CONVERGE).await;
        assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_old_history_leaves_no_more_dedup_keys_than_it_found() {
    let spec = Spec { count: 30_000, seed: 75, cross_partition_ratio: 0.3, ..Spec::default() };
    let (env, truth) = counted_topic("oldhistory", spec).await;
    // The live keys are gone, as they are once a backfill is older than the window.
    env.delete_dedup_keys().await;
    env.replay_checked("replay", "earliest", &truth.counts).await;
    assert_eq!(env.dedup_key_count().await, 0, "the replays left their dedup state in Redis");
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
