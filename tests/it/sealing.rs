//! Sealed hours: the seal is exact through `kill -9` at every step of a round and
//! between a flush's minute rows and its markers, through sealers racing each other and
//! a member, through a replay that changes a sealed hour, and through a late click that
//! lands in a sealed hour; and reads through them equal the generator's ground truth.

use std::collections::BTreeMap;
use std::time::Duration;

use clickagg::aggregate::{BatchRow, BucketKey};
use clickagg::click::Minute;
use clickagg::produce::{Kind, Planned, Spec, Truth};
use clickagg::query::{self, By, Format, QueryArgs};
use clickagg::sink::Writer;
use clickagg::time;

use crate::helpers::{wait_until, Member, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);
const HOUR: u32 = 3_600;
const DAY: u32 = 86_400;

fn now() -> u32 {
    chrono::Utc::now().timestamp() as u32
}

fn rfc3339(secs: u32) -> String {
    Minute::from_epoch_seconds(secs).to_rfc3339()
}

/// The member settings of these tests: hours fall due 30 minutes after they end (the
/// generator's late clicks are at most 20 minutes late), and the sealer runs every
/// second.
fn sealing_member(env: &mut TestEnv) {
    for (k, v) in [("CLICKAGG__VALIDATION__MAX_LATENESS", "30m"), ("CLICKAGG__SEAL__INTERVAL", "1s")] {
        env.extra_env.push((k.into(), v.into()));
    }
}

/// A test environment whose member (`m1`, sealing as above) has counted 20 000 records
/// over 3 hours on 4 partitions, from `seed`: the environment, the member, the truth.
async fn counted_by_a_sealing_member(label: &str, seed: u64) -> (TestEnv, Member, Truth) {
    let mut env = TestEnv::new(label).await;
    sealing_member(&mut env);
    let (records, truth) =
        env.plan(Spec { count: 20_000, seed, span: Duration::from_secs(3 * 3600), ..Spec::default() });
    env.send(&records, 4, None).await;
    let m = env.spawn_member("m1");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    (env, m, truth)
}

/// Every ad's clicks per `by` bucket over `[from, to)` as `query` reads them (sealed
/// days and hours where current, minute rows for the rest), against the truth summed
/// the same way.
async fn assert_query_exact(env: &TestEnv, truth: &BTreeMap<BucketKey, u64>, from: u32, to: u32) {
    for by in [By::Hour, By::Day] {
        let args = QueryArgs {
            from: Some(time::parse_time(&rfc3339(from)).unwrap()),
            to: Some(time::parse_time(&rfc3339(to)).unwrap()),
            period: None,
            with_adjustments: false,
            ads: vec![],
            by,
            top: None,
            format: Format::Json,
            only_topic: Some(env.topic.clone()),
            print_sql: false,
        };
        let width = if by == By::Hour { HOUR } else { DAY };
        let mut want: BTreeMap<(u64, u32), u64> = BTreeMap::new();
        for (k, c) in truth {
            let m = k.minute.epoch_seconds();
            if m >= from && m < to {
                *want.entry((k.ad_id, m - m % width)).or_default() += c;
            }
        }
        let got: BTreeMap<(u64, u32), u64> = query::query(&env.sink(), &args)
            .await
            .unwrap()
            .into_iter()
            .filter(|r| r.clicks > 0)
            .map(|r| ((r.ad_id, r.bucket), r.clicks))
            .collect();
        assert_eq!(got.len(), want.len(), "{by:?}: buckets");
        let differ: Vec<_> = want.iter().filter(|(k, c)| got.get(k) != Some(c)).take(5).collect();
        assert!(differ.is_empty(), "{by:?}: query differs from the truth at {differ:?}");
    }
}

/// The range of the truth's minutes, widened to whole days.
fn days_of(truth: &BTreeMap<BucketKey, u64>) -> (u32, u32) {
    let first = truth.keys().map(|k| k.minute.epoch_seconds()).min().unwrap();
    let last = truth.keys().map(|k| k.minute.epoch_seconds()).max().unwrap();
    (first - first % DAY, last - last % DAY + DAY)
}

/// A click of its own ID for `ad`, stamped `event` in its payload and `record` as its
/// Kafka timestamp (ms), on partition 0.
fn click(id: &str, ad: u64, event_ms: i64, record_ms: i64) -> Planned {
    Planned {
        key: id.to_string(),
        payload: serde_json::json!({ "click_id": id, "ad_id": ad, "ts": event_ms }).to_string().into_bytes(),
        timestamp_ms: record_ms,
        kind: Kind::Click,
        partition: Some(0),
    }
}

/// `clickagg seal --through through`, killed with SIGKILL at `step`
/// (`CLICKAGG_TEST_STOP_AT`, a test hook: `src/test_hooks.rs`): it must die there.
async fn seal_killed_at(env: &TestEnv, step: &str, through: u32) {
    let label = format!("seal-killed-{}", step.replace(':', "-"));
    let mut p = env.spawn(&label, &["seal", "--through", &rfc3339(through)], &[("CLICKAGG_TEST_STOP_AT", step)]);
    let code = p.wait(Duration::from_secs(120)).await;
    assert_eq!(code, -1, "{label} was to die at {step}, exited {code}:\n{}", p.output());
    assert!(p.output().contains("CLICKAGG_TEST_STOP_AT"), "{label}:\n{}", p.output());
}

/// `clickagg seal --through through`, which must exit 0; its summary line.
async fn seal(env: &TestEnv, label: &str, through: u32) -> String {
    let mut p = env.spawn(label, &["seal", "--through", &rfc3339(through)], &[]);
    let code = p.wait(Duration::from_secs(120)).await;
    assert_eq!(code, 0, "{label} exited {code}:\n{}", p.output());
    p.lines().into_iter().find(|l| l.starts_with("sealed ")).unwrap_or_else(|| panic!("{label}:\n{}", p.output()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seal_killed_at_every_step_is_completed_by_the_next_round_exactly() {
    let env = TestEnv::new("sealkill").await;
    let (records, mut truth) =
        env.plan(Spec { count: 20_000, seed: 31, span: Duration::from_secs(3 * 3600), ..Spec::default() });
    env.send(&records, 4, None).await;
    let out = env.replay_to_end("replay", "earliest").await;
    assert!(out.contains("replayed "), "{out}");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    let (from, to) = days_of(&truth.counts);
    // Through the end of the last day: every step of a round is reached, the day's too.
    let through = to;

    // Each step killed once; before each kill a new batch of rows lands in a sealed hour,
    // so that the round has its hour and day to seal again.
    let steps = [
        "seal:before-hour-rows",
        "seal:after-hour-rows",
        "seal:after-hour-records",
        "seal:after-day-rows",
        "seal:after-day-record",
    ];
    let hour = truth.counts.keys().map(|k| k.minute.epoch_seconds()).max().unwrap() / HOUR * HOUR;
    for (i, step) in steps.iter().enumerate() {
        if i > 0 {
            let key = BucketKey { ad_id: 777_000 + i as u64, minute: Minute::from_epoch_seconds(hour + 60 * i as u32) };
            let row = BatchRow {
                key,
                partition: 9,
                batch_start: 1_000_000 * i as i64,
                clicks: i as u64,
                version: 1_000_000 * i as i64 + 5,
            };
            env.sink().insert(&env.topic, &[row], Writer::Member).await.unwrap();
            *truth.counts.entry(key).or_default() += i as u64;
        }
        seal_killed_at(&env, step, through).await;
        let out = seal(&env, &format!("seal-after-{i}"), through).await;
        let found = clickagg::seal::check::agreement(&env.sink(), &env.topic).await.unwrap();
        assert!(found.problems.is_empty(), "after the kill at {step} and `{out}`: {:?}", found.problems);
        assert!(found.hours >= 24 && found.days >= 1, "after the kill at {step}: {found:?}");
        env.assert_counts_exact(&truth.counts, &format!("after the kill at {step}")).await;
        assert_query_exact(&env, &truth.counts, from, to).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_killed_between_its_minute_rows_and_their_markers_leaves_no_seal_behind() {
    let (env, mut m, mut truth) = counted_by_a_sealing_member("sealmarker", 32).await;
    let h = truth.counts.keys().map(|k| k.minute.epoch_seconds()).min().unwrap() / HOUR * HOUR + HOUR;
    wait_until("the member seals the first hours", CONVERGE, || async {
        let n = m.metric("clickagg_seals_total", &["grain=\"hour\""]).await;
        if n >= 2.0 {
            Ok(())
        } else {
            Err(format!("{n} hours sealed"))
        }
    })
    .await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);

    // A late click into a sealed hour, read by a member that dies right after writing
    // its minute rows, before their markers: its flush never completed, so nothing was
    // committed; the next member reads the batch again and marks what it writes.
    let late = click("late-into-sealed", 424_242, i64::from(h + 20 * 60) * 1000, i64::from(h + 40 * 60) * 1000);
    env.send(&[late], 4, None).await;
    *truth.counts.entry(BucketKey { ad_id: 424_242, minute: Minute::from_epoch_seconds(h + 20 * 60) }).or_default() +=
        1;
    let mut dying = env.spawn("m2-dies", &["run"], &[("CLICKAGG_TEST_STOP_AT", "flush:after-minute-rows")]);
    assert_eq!(dying.wait(CONVERGE).await, -1, "{}", dying.output());
    let mut m = env.spawn_member("m3");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    wait_until("the member re-seals the hour", CONVERGE, || async {
        let n = m.metric("clickagg_reseals_total", &["grain=\"hour\""]).await;
        if n >= 1.0 {
            Ok(())
        } else {
            Err(format!("{n} hours re-sealed"))
        }
    })
    .await;
    let (from, to) = days_of(&truth.counts);
    assert_query_exact(&env, &truth.counts, from, to).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    env.assert_seals_agree().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealers_racing_each_other_and_a_member_seal_exactly() {
    let mut env = TestEnv::new("sealrace").await;
    sealing_member(&mut env);
    let (first, mut truth) =
        env.plan(Spec { count: 30_000, seed: 33, span: Duration::from_secs(4 * 3600), ..Spec::default() });
    env.send(&first, 4, None).await;
    let mut m = env.spawn_member("m1");
    wait_until("the member seals hours", CONVERGE, || async {
        let n = m.metric("clickagg_seals_total", &["grain=\"hour\""]).await;
        if n >= 2.0 {
            Ok(())
        } else {
            Err(format!("{n} hours sealed"))
        }
    })
    .await;
    // More clicks, some into the sealed hours (stamped back then, as a lagging producer
    // sends them), while two `clickagg seal` race each other and the member's sealer,
    // three times over, sealing through the end of the current hour.
    let (second, more) = clickagg::produce::plan(&Spec {
        count: 20_000,
        seed: 34,
        start_ms: i64::from(now() - 4 * HOUR) * 1000,
        span: Duration::from_secs(4 * 3600),
        ..Spec::default()
    });
    for (k, c) in more.counts {
        *truth.counts.entry(k).or_default() += c;
    }
    let producer = env.spawn_producer(&second, 4, 4_000);
    for round in 0..3 {
        let through = rfc3339(now() - now() % HOUR + HOUR);
        let mut racing: Vec<_> =
            (0..2).map(|i| env.spawn(&format!("seal-{round}-{i}"), &["seal", "--through", &through], &[])).collect();
        for p in &mut racing {
            let code = p.wait(Duration::from_secs(120)).await;
            assert_eq!(code, 0, "{} exited {code}:\n{}", p.label, p.output());
        }
    }
    producer.finished().await;
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    // The member's sealer has caught up with what the racing sealers and the late
    // clicks left: every hour current, every seal equal to the minute rows.
    let (from, to) = days_of(&truth.counts);
    wait_until("the seals agree with the minute rows", CONVERGE, || async {
        let found = clickagg::seal::check::agreement(&env.sink(), &env.topic).await.map_err(|e| e.to_string())?;
        if found.problems.is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", found.problems))
        }
    })
    .await;
    assert_query_exact(&env, &truth.counts, from, to).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    env.assert_seals_agree().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_changes_a_sealed_hour_reseals_it_with_a_higher_version() {
    let env = TestEnv::new("sealreplay").await;
    let start = now() - 6 * HOUR;
    let spec = |seed| Spec {
        count: 15_000,
        seed,
        start_ms: i64::from(start) * 1000,
        span: Duration::from_secs(2 * 3600),
        ..Spec::default()
    };
    let (first, mut truth) = clickagg::produce::plan(&spec(35));
    env.send(&first, 4, None).await;
    env.replay_to_end("replay-1", "earliest").await;
    let sealed = seal(&env, "seal-1", now()).await;
    assert!(!sealed.starts_with("sealed 0 hours"), "{sealed}");
    let versions = |sink: clickagg::sink::Sink| async move {
        let rows: Vec<(u32, u64)> = sink
            .client()
            .query("SELECT toUInt32(bucket), max(version) FROM clickagg_seals WHERE grain = 'hour' GROUP BY bucket")
            .fetch_all()
            .await
            .unwrap();
        rows.into_iter().collect::<BTreeMap<u32, u64>>()
    };
    let before = versions(env.sink()).await;
    env.assert_counts_exact(&truth.counts, "first replay, sealed").await;

    // More clicks of the same hours reach the topic (another producer, late), and a
    // replay with the tables kept writes them: the hours they land in are sealed again
    // with higher versions.
    let (second, more) = clickagg::produce::plan(&spec(36));
    env.send(&second, 4, None).await;
    for (k, c) in &more.counts {
        *truth.counts.entry(*k).or_default() += c;
    }
    env.replay_to_end("replay-2", "earliest").await;
    let resealed = seal(&env, "seal-2", now()).await;
    assert!(resealed.contains("re-sealed ") && !resealed.contains("re-sealed 0 hours"), "{resealed}");
    let after = versions(env.sink()).await;
    let touched: std::collections::BTreeSet<u32> =
        more.counts.keys().map(|k| k.minute.epoch_seconds() / HOUR * HOUR).collect();
    assert!(!touched.is_empty());
    for hour in &touched {
        let v = before[hour];
        assert!(after[hour] > v, "hour {} was written again: version {v} -> {}", rfc3339(*hour), after[hour]);
    }
    env.assert_counts_exact(&truth.counts, "second replay, re-sealed").await;
    let (from, to) = days_of(&truth.counts);
    assert_query_exact(&env, &truth.counts, from, to).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_click_into_a_sealed_hour_is_resealed_by_the_member() {
    let (env, mut m, mut truth) = counted_by_a_sealing_member("seallate", 37).await;
    let h = truth.counts.keys().map(|k| k.minute.epoch_seconds()).min().unwrap() / HOUR * HOUR + HOUR;
    let sealed_h = || async {
        let sql = format!(
            "SELECT count() FROM clickagg_seals WHERE topic = '{}' AND grain = 'hour' AND bucket = toDateTime({h}, 'UTC')",
            env.topic
        );
        env.sink().client().query(&sql).fetch_one::<u64>().await.map_err(|e| e.to_string())
    };
    wait_until("the member seals the hour", CONVERGE, || async {
        if sealed_h().await? > 0 {
            Ok(())
        } else {
            Err("not sealed".into())
        }
    })
    .await;
    let reseals = m.metric("clickagg_reseals_total", &["grain=\"hour\""]).await;

    // A click of that hour, 20 minutes behind its own record timestamp (within the 30
    // minutes of lateness), from a producer whose clock lags: counted into the sealed
    // hour, which the member seals again.
    let late = click("late-into-sealed", 424_242, i64::from(h + 20 * 60) * 1000, i64::from(h + 40 * 60) * 1000);
    env.send(&[late], 4, None).await;
    *truth.counts.entry(BucketKey { ad_id: 424_242, minute: Minute::from_epoch_seconds(h + 20 * 60) }).or_default() +=
        1;
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    let (from, to) = days_of(&truth.counts);
    // Read at once: the hour is written after its seal, so read from its minute rows.
    assert_query_exact(&env, &truth.counts, from, to).await;
    wait_until("the member re-seals the hour", CONVERGE, || async {
        let n = m.metric("clickagg_reseals_total", &["grain=\"hour\""]).await;
        if n > reseals {
            Ok(())
        } else {
            Err(format!("{n} re-seals"))
        }
    })
    .await;
    let sql = format!(
        "SELECT clicks FROM ad_clicks_sealed_hour FINAL WHERE topic = '{}' AND hour = toDateTime({h}, 'UTC') AND ad_id = 424242",
        env.topic
    );
    wait_until("the late click is in the sealed hour", CONVERGE, || async {
        let c: Vec<u64> = env.sink().client().query(&sql).fetch_all().await.map_err(|e| e.to_string())?;
        if c == [1] {
            Ok(())
        } else {
            Err(format!("{c:?}"))
        }
    })
    .await;
    assert_query_exact(&env, &truth.counts, from, to).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    env.assert_seals_agree().await;
}

/// How `query` would split a top 10 by day over `[from, to)` of the test's topic.
async fn split_of(env: &TestEnv, from: u32, to: u32) -> clickagg::sealing::split::Split {
    let r = clickagg::sink::billing::BillingRequest {
        from,
        to,
        by: clickagg::sealing::Grain::Day,
        ads: vec![],
        topic: Some(env.topic.clone()),
        top: Some(10),
    };
    env.sink().billing_split(&r).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_starting_weeks_before_the_data_reads_no_minute_rows_until_a_write_lands_there() {
    let (env, mut m, mut truth) = counted_by_a_sealing_member("sealempty", 41).await;
    let (first_day, to) = days_of(&truth.counts);
    let out = seal(&env, "seal-through", to).await;
    // 30 days: 28 before the data, which the sealer's frontier passed as empty.
    let from = first_day - 28 * DAY;
    let split = split_of(&env, from, to).await;
    assert_eq!(split.minutes, (0, 0), "after `{out}`, every hour is sealed or known empty: {split:?}");
    assert_query_exact(&env, &truth.counts, from, to).await;

    // A producer sends clicks stamped 20 days back (record and event time): the hour
    // gets a marker, so it is read from the minute rows until it is sealed.
    let old = first_day - 20 * DAY + 3 * HOUR;
    let late: Vec<Planned> = (0..3)
        .map(|i| click(&format!("old-{i}"), 515_151, i64::from(old + 600) * 1000, i64::from(old + 600) * 1000))
        .collect();
    env.send(&late, 4, None).await;
    *truth.counts.entry(BucketKey { ad_id: 515_151, minute: Minute::from_epoch_seconds(old + 600) }).or_default() += 3;
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    assert_query_exact(&env, &truth.counts, from, to).await;
    wait_until("the member seals the written hour", CONVERGE, || async {
        let s = split_of(&env, from, to).await;
        let read_sealed =
            s.hours.contains(&(env.topic.clone(), old)) || s.days.contains(&(env.topic.clone(), old - old % DAY));
        if s.minutes == (0, 0) && read_sealed {
            Ok(())
        } else {
            Err(format!("minutes {:?}, {} sealed hours read", s.minutes, s.hours.len()))
        }
    })
    .await;
    assert_query_exact(&env, &truth.counts, from, to).await;
    assert_eq!(m.terminate(Duration::from_secs(30)).await, 0);
    env.assert_seals_agree().await;
}
