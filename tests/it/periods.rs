//! Billing periods: a closed period's totals stay put through replays; later changes to
//! its clicks become signed adjustments, exactly once through `kill -9` at every step
//! of a close and of an adjustment; a close refuses a period that is not sealed unless
//! forced, and a forced close turns the late clicks that follow into adjustments equal
//! to them, per ad.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::Minute;
use clickagg::produce::{self, Kind, Planned, Spec, Truth};

use crate::helpers::{wait_until, StoredRow, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);
const DAY: u32 = 86_400;

fn rfc3339(secs: u32) -> String {
    Minute::from_epoch_seconds(secs).to_rfc3339()
}

fn date(day: u32) -> String {
    rfc3339(day)[..10].to_string()
}

/// The start of the UTC day `days` before today.
fn day_before_today(days: u32) -> u32 {
    let now = chrono::Utc::now().timestamp() as u32;
    now - now % DAY - days * DAY
}

/// `clickagg <args>`: exit code and standard output.
fn run(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let out = env.command(args, &[]).stdin(Stdio::null()).output().expect("run clickagg");
    let stdout = String::from_utf8(out.stdout).unwrap();
    (out.status.code().unwrap_or(-1), stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `clickagg close --period day <day> --format json <extra>`, which must exit 0: its report.
fn close_day(env: &TestEnv, day: u32, extra: &[&str]) -> serde_json::Value {
    let d = date(day);
    let mut args = vec!["close", "--period", "day", d.as_str(), "--format", "json"];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = run(env, &args);
    assert_eq!(code, 0, "close {d}: {stdout}\n{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("close {d}: {e}: {stdout}"))
}

/// Per ad: closed total (`None`: not closed), sum of adjustments, current total.
type Sides = BTreeMap<u64, (Option<u64>, i64, u64)>;

/// `query --period <day> --with-adjustments --format json`: the view, and per ad its sides.
fn period_view(env: &TestEnv, day: u32) -> (serde_json::Value, Sides) {
    let d = date(day);
    let (code, stdout, stderr) =
        run(env, &["query", "--period", &d, "--with-adjustments", "--format", "json", "--only-topic", &env.topic]);
    assert_eq!(code, 0, "query --period {d}: {stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let ads = v["ads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let closed = a["closed"].as_u64();
            (a["ad_id"].as_u64().unwrap(), (closed, a["adjusted"].as_i64().unwrap(), a["current"].as_u64().unwrap()))
        })
        .collect();
    (v, ads)
}

/// Per ad, the truth's clicks in `[day, day + DAY)`.
fn totals_of_day(truth: &BTreeMap<BucketKey, u64>, day: u32) -> BTreeMap<u64, u64> {
    let mut out = BTreeMap::new();
    for (k, c) in truth {
        if (day..day + DAY).contains(&k.minute.epoch_seconds()) {
            *out.entry(k.ad_id).or_default() += c;
        }
    }
    out
}

/// A new click for `ad` stamped `event_s`, with `record_ms` as its Kafka timestamp, on
/// partition 0.
fn click(id: &str, ad: u64, event_s: u32, record_ms: i64) -> Planned {
    Planned {
        key: id.to_string(),
        payload: serde_json::json!({ "click_id": id, "ad_id": ad, "ts": i64::from(event_s) * 1000 })
            .to_string()
            .into_bytes(),
        timestamp_ms: record_ms,
        kind: Kind::Click,
        partition: Some(0),
    }
}

/// `clickagg <args>` killed with SIGKILL at `step` (`CLICKAGG_TEST_STOP_AT`): it must die there.
async fn killed_at(env: &TestEnv, args: &[&str], step: &str) {
    killed_at_with(env, args, step, &[]).await;
}

/// [`killed_at`] with more environment.
async fn killed_at_with(env: &TestEnv, args: &[&str], step: &str, extra: &[(&str, &str)]) {
    let label = format!("killed-{}", step.replace(':', "-"));
    let mut extra = extra.to_vec();
    extra.push(("CLICKAGG_TEST_STOP_AT", step));
    let mut p = env.spawn(&label, args, &extra);
    let code = p.wait(Duration::from_secs(120)).await;
    assert_eq!(code, -1, "{label} was to die at {step}, exited {code}:\n{}", p.output());
    assert!(p.output().contains("CLICKAGG_TEST_STOP_AT"), "{label}:\n{}", p.output());
}

/// Records over three hours of the day two days ago, counted by a replay; that day
/// sealed through its end. The environment, the truth and the day.
async fn a_counted_and_sealed_day(label: &str, seed: u64) -> (TestEnv, Truth, u32) {
    let env = TestEnv::new(label).await;
    let day = day_before_today(2);
    let spec = Spec {
        count: 20_000,
        seed,
        ads: 200,
        start_ms: i64::from(day + 9 * 3600) * 1000,
        span: Duration::from_secs(3 * 3600),
        ..Spec::default()
    };
    let (records, truth) = produce::plan(&spec);
    env.send(&records, 4, None).await;
    let out = env.replay_to_end("replay", "earliest").await;
    assert!(out.contains("replayed "), "{out}");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    let (code, stdout, stderr) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    (env, truth, day)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_day_stays_put_through_replays_and_a_late_click_is_adjusted_once_through_kills() {
    let (env, mut truth, day) = a_counted_and_sealed_day("closeday", 61).await;
    let want = totals_of_day(&truth.counts, day);
    let d = date(day);

    // A close killed at each of its steps, then completed: one close, of the truth.
    for step in ["close:before-totals", "close:after-totals"] {
        killed_at(&env, &["close", "--period", "day", &d], step).await;
        let (_, ads) = period_view(&env, day);
        assert!(ads.values().all(|a| a.0.is_none()), "a close killed at {step} closed nothing");
    }
    killed_at(&env, &["close", "--period", "day", &d], "close:after-record").await;
    let closed = close_day(&env, day, &[]);
    assert_eq!(closed["closed_now"], false, "the close killed after its record is complete: {closed}");
    assert_eq!(closed["clicks"], want.values().sum::<u64>(), "{closed}");
    assert_eq!(closed["ads"], want.len() as u64, "{closed}");
    assert_eq!(closed["forced"], false);
    assert_eq!(closed["positions"].as_object().unwrap().len(), 4, "a position per partition: {closed}");
    let again = close_day(&env, day, &[]);
    assert_eq!(again["close_id"], closed["close_id"], "closing twice reports the close");
    assert_eq!(again["closed_at"], closed["closed_at"]);
    let (_, ads) = period_view(&env, day);
    let closed_totals: BTreeMap<u64, u64> = ads.iter().map(|(&ad, a)| (ad, a.0.unwrap())).collect();
    assert_eq!(closed_totals, want, "the closed totals are the truth's");

    // A replay with the table kept changes nothing: no adjustment, closed totals as they were.
    env.replay_to_end("replay-again", "earliest").await;
    let (code, out, _) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0);
    assert!(!out.contains("adjustments"), "{out}");
    let (_, ads) = period_view(&env, day);
    assert!(ads.values().all(|&(closed, adjusted, current)| adjusted == 0 && closed == Some(current)), "{ads:?}");

    // A late click into the closed day (its event an hour before its record time, which
    // follows the topic's last records), counted by a replay: the sealer's next round
    // adjusts its ad by +1, once, through kills before and after the adjustment's rows.
    let ad = *want.keys().next().unwrap();
    let event = day + 11 * 3600;
    env.send(&[click("late-after-close", ad, event, i64::from(day + 12 * 3600 + 600) * 1000)], 4, None).await;
    *truth.counts.entry(BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(event) }).or_default() += 1;
    env.replay_to_end("replay-late", "earliest").await;
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    for step in ["adjust:before-rows", "adjust:after-rows"] {
        killed_at(&env, &["seal", "--through", &rfc3339(day + DAY)], step).await;
    }
    let (code, out, _) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0);
    let (_, out2, _) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert!(!out2.contains("adjustments"), "nothing more to adjust: {out} / {out2}");
    let (view, ads) = period_view(&env, day);
    for (&a, &(closed, adjusted, current)) in &ads {
        let want_adjusted = i64::from(a == ad);
        assert_eq!(adjusted, want_adjusted, "ad {a}: {view}");
        assert_eq!(closed, Some(want[&a]), "ad {a}: the closed total never changes");
        assert_eq!(closed.unwrap() as i64 + adjusted, current as i64, "ad {a}");
    }
    let rows = view["ads"].as_array().unwrap().iter().find(|a| a["ad_id"] == ad).unwrap()["adjustments"].clone();
    assert_eq!(rows.as_array().unwrap().len(), 1, "one adjustment, never two: {rows}");
    assert_eq!(rows[0]["delta"], 1);
    assert_eq!(rows[0]["seq"], 1);
    let moved: Vec<String> = serde_json::from_str(rows[0]["batches"].as_str().unwrap()).unwrap();
    assert!(moved.iter().any(|b| b.starts_with("0:")), "the batch of partition 0 that moved: {rows}");
    let table = run(&env, &["query", "--period", &d, "--with-adjustments", "--only-topic", &env.topic]).1;
    assert!(table.contains(&format!("day {d} of topic {}: closed at", env.topic)), "{table}");
    assert!(table.lines().last().unwrap().starts_with("total"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_closed_with_force_before_its_lateness_passed_is_adjusted_by_exactly_the_late_clicks() {
    let mut env = TestEnv::new("closeforce").await;
    // Hours fall due 48 hours after they end: yesterday is not sealed by the member
    // (and the dedup window covers that lateness, as the settings require).
    for (k, v) in [
        ("CLICKAGG__VALIDATION__MAX_LATENESS", "48h"),
        ("CLICKAGG__DEDUP__WINDOW", "50h"),
        ("CLICKAGG__SEAL__INTERVAL", "1s"),
    ] {
        env.extra_env.push((k.into(), v.into()));
    }
    let day = day_before_today(1);
    let spec = Spec {
        count: 10_000,
        seed: 62,
        ads: 100,
        start_ms: i64::from(day + 20 * 3600) * 1000,
        span: Duration::from_secs(2 * 3600),
        ..Spec::default()
    };
    let (records, mut truth) = produce::plan(&spec);
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;

    let d = date(day);
    let (code, stdout, stderr) = run(&env, &["close", "--period", "day", &d]);
    assert_eq!(code, 4, "a day not sealed is refused: {stdout}\n{stderr}");
    assert!(stderr.contains("not sealed") && stderr.contains("--force"), "{stderr}");
    let closed = close_day(&env, day, &["--force"]);
    assert_eq!((closed["closed_now"].clone(), closed["forced"].clone()), (true.into(), true.into()), "{closed}");
    let want = totals_of_day(&truth.counts, day);
    assert_eq!(closed["clicks"], want.values().sum::<u64>());

    // Late valid clicks into that day, stamped now (within max_lateness of their event
    // time), on several ads; and one into the day before, which is not closed.
    let now_ms = chrono::Utc::now().timestamp_millis();
    let mut added: BTreeMap<u64, i64> = BTreeMap::new();
    let mut late = Vec::new();
    for i in 0..30u32 {
        let ad = [3u64, 17, 42, 900_001][i as usize % 4];
        let event = day + 23 * 3600 + 60 * (i % 50);
        late.push(click(&format!("late-{i}"), ad, event, now_ms));
        *added.entry(ad).or_default() += 1;
        *truth.counts.entry(BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(event) }).or_default() += 1;
    }
    // Its last second: an hour earlier was more than max_lateness (48 h) behind a click
    // stamped after 23:00 UTC, rejected as too late (seen in a CI rehearsal at 23:52).
    let other_day = day - 1;
    late.push(click("late-other-day", 3, other_day, now_ms));
    *truth.counts.entry(BucketKey { ad_id: 3, minute: Minute::from_epoch_seconds(other_day) }).or_default() += 1;
    env.send(&late, 4, None).await;
    env.assert_counts_settle(&truth.counts, CONVERGE).await;

    wait_until("the member's sealer adjusts the closed day", CONVERGE, || async {
        let (_, ads) = period_view(&env, day);
        let got: BTreeMap<u64, i64> = ads.iter().filter(|(_, a)| a.1 != 0).map(|(&ad, a)| (ad, a.1)).collect();
        if got == added {
            Ok(ads)
        } else {
            Err(format!("adjustments {got:?}, want {added:?}"))
        }
    })
    .await;
    let (_, ads) = period_view(&env, day);
    for (ad, (closed, adjusted, current)) in ads {
        assert_eq!(closed.unwrap_or(0), want.get(&ad).copied().unwrap_or(0), "ad {ad}: closed totals never change");
        assert_eq!(closed.unwrap_or(0) as i64 + adjusted, current as i64, "ad {ad}");
    }
    assert!(member.metric("clickagg_adjustments_total", &[]).await >= added.len() as f64);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// Rows written as a wrong past flush would write them, with its markers: each replaces
/// the row of its bucket and batch with the highest version a member can write there
/// (cut at the batch's last offset), which no plain replay outranks.
async fn write_wrong_rows(env: &TestEnv, rows: &[StoredRow]) {
    let sink = env.sink();
    let topic = clickagg::sink::quote_literal(&env.topic);
    let values: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "({}, toDateTime({}, 'UTC'), {topic}, {}, {}, {}, {})",
                r.ad_id, r.minute, r.partition, r.batch_start, r.clicks, r.version
            )
        })
        .collect();
    sink.execute(&format!(
        "INSERT INTO ad_clicks_minute (ad_id, minute, topic, partition, batch_start, clicks, version) VALUES {}",
        values.join(", ")
    ))
    .await
    .expect("writing the wrong rows");
    let markers: Vec<String> = rows
        .iter()
        .map(|r| {
            format!("({topic}, toDateTime({}, 'UTC'), {}, {})", r.minute - r.minute % 3600, r.partition, r.version)
        })
        .collect();
    sink.execute(&format!(
        "INSERT INTO clickagg_touched (topic, hour, partition, version) VALUES {}",
        markers.join(", ")
    ))
    .await
    .expect("writing their markers");
}

/// `clickagg replay --supersede --from earliest --to <to>`, which must exit 0: its output.
async fn supersede(env: &TestEnv, label: &str, to: &str) -> String {
    let mut p = env.spawn(label, &["replay", "--supersede", "--from", "earliest", "--to", to], &[]);
    let code = p.wait(Duration::from_secs(300)).await;
    assert_eq!(code, 0, "{label} exited {code}:\n{}", p.output());
    p.output()
}

/// A past day's clicks (`spec`) on 4 partitions, then today's over three batches per
/// partition so that every batch of that day is finished and committed; a member counts
/// both. Returns the truth of both days and the member.
async fn a_past_day_then_today(env: &TestEnv, spec: &Spec, today_seed: u64) -> (Truth, crate::helpers::Member) {
    let (records, mut truth) = produce::plan(spec);
    let now_ms = chrono::Utc::now().timestamp_millis();
    let today = Spec {
        count: 3 * 4 * env.batch_offsets,
        seed: today_seed,
        ads: spec.ads,
        start_ms: now_ms - 3_600_000,
        ..Spec::default()
    };
    let (after, after_truth) = produce::plan(&today);
    for (k, c) in after_truth.counts {
        *truth.counts.entry(k).or_default() += c;
    }
    env.send(&records, 4, None).await;
    env.send(&after, 4, None).await;
    let member = env.spawn_member("m");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    (truth, member)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseding_replay_repairs_wrong_rows_and_adjusts_the_closed_day_by_the_corrections() {
    let env = TestEnv::new("supersede").await;
    let n = env.batch_offsets;
    let day = day_before_today(2);
    let spec = Spec {
        count: 12_000,
        seed: 63,
        ads: 100,
        start_ms: i64::from(day + 9 * 3600) * 1000,
        span: Duration::from_secs(3 * 3600),
        ..Spec::default()
    };
    let (truth, mut member) = a_past_day_then_today(&env, &spec, 64).await;
    let want = totals_of_day(&truth.counts, day);

    // Wrong rows in that day's batches, as a past flush that miscounted (a cache lost
    // mid-run, say) would have left them: over- and under-counts of member rows, and a
    // bucket no click of the log is in. Each in an ad-minute of its own (`LIMIT 1 BY`):
    // two wrong rows of one ad-minute (two partitions' rows) would show as one
    // mismatch, or none if their errors cancel, and the hash order that picks them
    // changes with the day the test runs.
    let (from, to) = (day, day + DAY);
    let written: Vec<StoredRow> = env
        .sink()
        .client()
        .query(
            "SELECT ad_id, toUInt32(minute) AS minute, partition, batch_start, argMax(clicks, version) AS last_clicks, \
             max(version) AS last_version FROM ad_clicks_minute WHERE topic = ? AND minute >= toDateTime(?, 'UTC') \
             AND minute < toDateTime(?, 'UTC') GROUP BY ad_id, minute, partition, batch_start \
             HAVING last_clicks > 1 ORDER BY cityHash64(ad_id, minute, partition) \
             LIMIT 1 BY ad_id, minute LIMIT 12",
        )
        .bind(&env.topic)
        .bind(from)
        .bind(to)
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(written.len(), 12, "rows to make wrong, each in an ad-minute of its own: {written:?}");
    let last_in_batch = |batch_start: u64| 2 * (batch_start + n - 1) + 1;
    let mut wrong: Vec<StoredRow> = written
        .iter()
        .enumerate()
        .map(|(i, r)| StoredRow {
            clicks: if i % 2 == 0 { r.clicks + 3 } else { r.clicks - 1 },
            version: last_in_batch(r.batch_start),
            ..*r
        })
        .collect();
    wrong.push(StoredRow {
        ad_id: 999_999,
        minute: day + 10 * 3600,
        partition: 0,
        batch_start: 0,
        clicks: 5,
        version: last_in_batch(0),
    });
    let mut corrections: BTreeMap<u64, i64> = BTreeMap::new();
    for (w, r) in wrong.iter().zip(written.iter().map(Some).chain([None])) {
        *corrections.entry(w.ad_id).or_default() += r.map_or(0, |r| r.clicks as i64) - w.clicks as i64;
    }
    corrections.retain(|_, d| *d != 0);
    write_wrong_rows(&env, &wrong).await;
    let (code, stdout, stderr) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let closed = close_day(&env, day, &["--force"]);
    let (_, ads) = period_view(&env, day);
    for (ad, &(closed_total, _, _)) in &ads {
        let wrong_total = want.get(ad).copied().unwrap_or(0) as i64 - corrections.get(ad).copied().unwrap_or(0);
        assert_eq!(closed_total.unwrap_or(0) as i64, wrong_total, "ad {ad}: closed with the wrong rows: {closed}");
    }

    // A replay that does not supersede cannot repair them: the member's rows outrank it.
    env.replay_to_end("plain-replay", "earliest").await;
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert_eq!(d.mismatches.len(), wrong.len(), "a plain replay leaves the wrong rows: {}", d.report(20));

    // Refused where the member has not finished a batch: the end of the log.
    let (code, _, stderr) = run(&env, &["replay", "--supersede", "--from", "earliest"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("not finished by the group"), "{stderr}");

    // Killed after its first rows: every batch is rewritten whole or not at all, so no
    // count is short meanwhile; only buckets with wrong rows can still differ, by at
    // most what was made wrong in them.
    let to = rfc3339(day + DAY);
    // Small poll batches and a flush after each: a cut in the middle of batches.
    let mid_batch = [("CLICKAGG__PIPELINE__MAX_POLL_RECORDS", "50"), ("CLICKAGG__PIPELINE__FLUSH_INTERVAL", "1ms")];
    let args = ["replay", "--supersede", "--from", "earliest", "--to", &to];
    killed_at_with(&env, &args, "flush:after-minute-rows", &mid_batch).await;
    let mut made_wrong: BTreeMap<BucketKey, u64> = BTreeMap::new();
    for (w, r) in wrong.iter().zip(written.iter().map(Some).chain([None])) {
        let off = (w.clicks as i64 - r.map_or(0, |r| r.clicks as i64)).unsigned_abs();
        *made_wrong.entry(BucketKey { ad_id: w.ad_id, minute: Minute::from_epoch_seconds(w.minute) }).or_default() +=
            off;
    }
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    for m in &d.mismatches {
        let off = made_wrong.get(&m.key).copied();
        assert!(
            off.is_some_and(|off| m.actual.abs_diff(m.expected) <= off),
            "a supersede killed part-way left a count wrong that was right: {m:?}\n{}",
            d.report(20)
        );
    }

    // Killed before it zeroes the bucket no click is in: every other row is repaired;
    // run again (a new generation), it completes.
    killed_at(&env, &["replay", "--supersede", "--from", "earliest", "--to", &to], "supersede:before-zeros").await;
    let d = clickagg::verify::diff(&truth.counts, &env.billing().await);
    assert_eq!(d.mismatches.len(), 1, "only the bucket with no click is left: {}", d.report(20));
    assert_eq!((d.mismatches[0].key.ad_id, d.mismatches[0].actual), (999_999, 5));
    let out = supersede(&env, "supersede", &to).await;
    assert!(out.contains("superseded every earlier row of its batches (generation 3, 1 buckets found empty"), "{out}");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;

    // The closed day keeps its totals; the sealer's next round adjusts it by the
    // corrections, per ad, once.
    let (code, stdout, stderr) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let check = |ads: &Sides| -> Result<(), String> {
        let got: BTreeMap<u64, i64> = ads.iter().filter(|(_, a)| a.1 != 0).map(|(&ad, a)| (ad, a.1)).collect();
        if got != corrections {
            return Err(format!("adjustments {got:?}, want the corrections {corrections:?}"));
        }
        for (ad, &(closed, adjusted, current)) in ads {
            if closed.unwrap_or(0) as i64 + adjusted != current as i64 || current != want.get(ad).copied().unwrap_or(0)
            {
                return Err(format!("ad {ad}: closed {closed:?} + {adjusted} vs current {current}"));
            }
        }
        Ok(())
    };
    let (view, ads) = period_view(&env, day);
    check(&ads).unwrap_or_else(|e| panic!("{e}: {view}"));

    // Superseding again changes nothing: same counts, no further adjustment.
    let out = supersede(&env, "supersede-again", &to).await;
    assert!(out.contains("(generation 4, "), "{out}");
    env.assert_counts_exact(&truth.counts, "superseded twice").await;
    run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    let (view, ads) = period_view(&env, day);
    check(&ads).unwrap_or_else(|e| panic!("after a second supersede: {e}: {view}"));
    for a in view["ads"].as_array().unwrap() {
        assert!(a["adjustments"].as_array().is_none_or(|rows| rows.len() <= 1), "one adjustment per ad: {a}");
    }

    // explain names the superseding rows and their generation.
    let r = &written[0];
    let (code, stdout, _) =
        run(&env, &["explain", "--ad", &r.ad_id.to_string(), "--minute", &rfc3339(r.minute), "--format", "json"]);
    assert_eq!(code, 0);
    let e: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let key = BucketKey { ad_id: r.ad_id, minute: Minute::from_epoch_seconds(r.minute) };
    assert_eq!(e["clicks"], truth.counts[&key], "{e}");
    assert!(e["batches"].as_array().unwrap().iter().all(|b| b["writer"] == "supersede" && b["generation"] == 4), "{e}");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

// Regression (issue 35): SIGTERM or Ctrl-C during `replay --supersede` ended the run with
// the ordinary cut, which wrote the batches it was in the middle of. A superseding row
// outranks the member's complete row of its batch whatever its offset (generation
// versions), so those counts read short until a supersede completed, and the member's
// sealing rounds adjusted the closed day down, then up again. The kill tests stopped at
// named points only, where every cut was whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supersede_stopped_by_sigterm_leaves_no_count_short_and_adjusts_no_closed_day() {
    let mut env = TestEnv::new("supersedeterm").await;
    // The member seals every second: its rounds see whatever a stopped supersede left.
    env.extra_env.push(("CLICKAGG__SEAL__INTERVAL".into(), "1s".into()));
    let n = env.batch_offsets;
    let day = day_before_today(2);
    // Few ads over half an hour: a bucket (ad, minute) gets many clicks of each batch, so
    // a batch cut part-way is short in the minute it stops in, wherever that is.
    let spec = Spec {
        count: 20_000,
        seed: 65,
        ads: 10,
        start_ms: i64::from(day + 10 * 3600) * 1000,
        span: Duration::from_secs(1800),
        ..Spec::default()
    };
    let (truth, mut member) = a_past_day_then_today(&env, &spec, 66).await;
    let (code, stdout, stderr) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    close_day(&env, day, &["--force"]);

    let to = rfc3339(day + DAY);
    let args = ["replay", "--supersede", "--from", "earliest", "--to", &to];
    // Small poll batches and a flush after each: the replay is always in the middle of a
    // batch, and slow enough to be stopped part-way.
    let mid_batch = [("CLICKAGG__PIPELINE__MAX_POLL_RECORDS", "50"), ("CLICKAGG__PIPELINE__FLUSH_INTERVAL", "1ms")];
    let superseded =
        format!("SELECT count() FROM ad_clicks_minute WHERE topic = ? AND {} >= ?", clickagg::sink::generation_sql(n));
    let short = |billing: &BTreeMap<BucketKey, u64>| -> Vec<String> {
        clickagg::verify::diff(&truth.counts, billing)
            .mismatches
            .iter()
            .filter(|m| m.actual < m.expected)
            .map(|m| format!("{:?}: {} of {}", m.key, m.actual, m.expected))
            .collect()
    };
    for generation in 1..=2u64 {
        let label = format!("supersede-term-{generation}");
        let mut p = env.spawn(&label, &args, &mid_batch);
        // Stopped once its first rows are written, while it reads on; the counts are
        // read all along, and none may be short.
        let stopped = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let written: u64 =
                env.sink().client().query(&superseded).bind(&env.topic).bind(generation).fetch_one().await.unwrap();
            let billing = env.billing().await;
            assert!(short(&billing).is_empty(), "{label}: counts read short while it ran: {:?}", short(&billing));
            if written > 0 {
                break;
            }
            assert!(tokio::time::Instant::now() < stopped, "{label} wrote nothing:\n{}", p.output());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let code = p.terminate(Duration::from_secs(60)).await;
        assert!(!p.output().contains("superseded every earlier row"), "{label} ran to its end: raise the count");
        assert_eq!(code, 130, "{label} was stopped part-way, and says so:\n{}", p.output());
        let billing = env.billing().await;
        assert!(short(&billing).is_empty(), "{label}: counts short after SIGTERM: {:?}", short(&billing));
        // Whole batches of the same clicks: every count is the truth.
        let d = clickagg::verify::diff(&truth.counts, &billing);
        assert!(d.is_exact(), "after {label}:\n{}", d.report(20));
        // The member's sealing rounds meanwhile (every second) find nothing to adjust.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // The member's rounds, and one more after them: nothing changed the closed day.
    let (code, stdout, stderr) = run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(!stdout.contains("adjustments"), "{stdout}");
    let (view, ads) = period_view(&env, day);
    for a in view["ads"].as_array().unwrap() {
        assert!(a["adjustments"].as_array().is_none_or(|rows| rows.is_empty()), "no adjustment row: {a}");
    }
    assert!(ads.values().all(|&(closed, adjusted, current)| adjusted == 0 && closed == Some(current)), "{ads:?}");

    // Run to its end, it writes the same counts, and still adjusts nothing.
    let out = supersede(&env, "supersede-whole", &to).await;
    assert!(out.contains("(generation 3, "), "{out}");
    env.assert_counts_exact(&truth.counts, "superseded whole").await;
    run(&env, &["seal", "--through", &rfc3339(day + DAY)]);
    let (_, ads) = period_view(&env, day);
    assert!(ads.values().all(|&(closed, adjusted, current)| adjusted == 0 && closed == Some(current)), "{ads:?}");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// Issue 35, defect 6: `replay --supersede --to T` over a partition that got no record
/// after `T` (idle since, its log ending inside a batch). Its range ends at its log end,
/// and the end rounded up to the end of that batch was never committed by the group:
/// refused ("not finished by the group") for as long as the partition stayed idle,
/// waiting did not help. Now its complete batches are superseded (a wrong row in one is
/// repaired), and the batch open at its log end is named and left to the members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supersede_to_a_time_a_partition_got_no_record_after_rewrites_its_complete_batches() {
    let env = TestEnv::new("supersedeidle").await;
    let n = env.batch_offsets;
    let day = day_before_today(2);
    let spec = Spec {
        count: 12_000,
        seed: 67,
        ads: 100,
        start_ms: i64::from(day + 9 * 3600) * 1000,
        span: Duration::from_secs(3 * 3600),
        ..Spec::default()
    };
    let (records, mut truth) = produce::plan(&spec);
    env.send(&records, 4, None).await;
    // The partition that gets nothing after that day: one whose log ends inside a batch.
    let ends = env.high_watermarks().await;
    let (&idle, &idle_end) =
        ends.iter().find(|(_, &h)| h % n as i64 != 0 && h > n as i64).expect("a log end past a batch, inside one");
    // Today's clicks on the other partitions (each key on one of them, so that a retry
    // stays with its click), over more than a batch each: their batches of that day are
    // finished and committed.
    let others: Vec<i32> = ends.keys().copied().filter(|&p| p != idle).collect();
    let now_ms = chrono::Utc::now().timestamp_millis();
    let today = Spec { count: 3 * 4 * n, seed: 68, ads: 100, start_ms: now_ms - 3_600_000, ..Spec::default() };
    let (after, after_truth) = produce::plan(&today);
    let after: Vec<Planned> = after
        .into_iter()
        .map(|r| {
            let h = r.key.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
            Planned { partition: Some(others[(h % others.len() as u64) as usize]), ..r }
        })
        .collect();
    for (k, c) in after_truth.counts {
        *truth.counts.entry(k).or_default() += c;
    }
    env.send(&after, 4, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    let ends_now = env.high_watermarks().await;
    assert_eq!(ends_now[&idle], idle_end, "partition {idle} got nothing after that day");
    env.wait_committed("every partition committed to its end", &ends_now, CONVERGE).await;

    // A wrong row in the idle partition's first batch, as a past flush that miscounted
    // would have left it.
    let written: Vec<StoredRow> = env
        .sink()
        .client()
        .query(
            "SELECT ad_id, toUInt32(minute) AS minute, partition, batch_start, argMax(clicks, version) AS last_clicks, \
             max(version) AS last_version FROM ad_clicks_minute WHERE topic = ? AND partition = ? AND batch_start = 0 \
             GROUP BY ad_id, minute, partition, batch_start ORDER BY last_clicks DESC LIMIT 1",
        )
        .bind(&env.topic)
        .bind(idle as u32)
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(written.len(), 1, "a row of partition {idle}'s first batch");
    let wrong = StoredRow { clicks: written[0].clicks + 3, version: 2 * (n - 1) + 1, ..written[0] };
    write_wrong_rows(&env, &[wrong]).await;
    assert!(!clickagg::verify::diff(&truth.counts, &env.billing().await).is_exact(), "the wrong row shows");

    // Superseding that day: its complete batches rewritten on every partition, the wrong
    // row repaired; the idle partition's open batch named and left as the members wrote it.
    let out = supersede(&env, "supersede-idle", &rfc3339(day + DAY)).await;
    assert!(out.contains("superseded every earlier row of its batches (generation 1"), "{out}");
    let open_from = idle_end - idle_end % n as i64;
    assert!(
        out.contains(&format!("partition {idle} has no record at or after --to: offsets [{open_from}, {idle_end})")),
        "{out}"
    );
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    // Its complete batches carry the supersede's generation; the open one does not.
    let generations: Vec<(u64, u64)> = env
        .sink()
        .client()
        .query(
            "SELECT batch_start, max(version) FROM ad_clicks_minute WHERE topic = ? AND partition = ? \
             GROUP BY batch_start ORDER BY batch_start",
        )
        .bind(&env.topic)
        .bind(idle as u32)
        .fetch_all()
        .await
        .unwrap();
    for (start, version) in generations {
        let generation = clickagg::sink::generation_of(version, start, n);
        let want = u64::from((start as i64) < open_from);
        assert_eq!(generation, want, "partition {idle}, batch {start}: version {version}");
    }
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}
