//! `clickagg query`: what it prints, in every format, equals the ground truth bucketed
//! here independently of the SQL — with nothing sealed, with the range crossing sealed
//! and unsealed hours, with everything sealed, and with hours written after their seal;
//! and a row replaced by a later version (a minute row or a seal) is never summed twice.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use clickagg::aggregate::{BatchRow, BucketKey};
use clickagg::click::Minute;
use clickagg::produce::{Spec, Truth};
use clickagg::query::{self, By, Format, QueryArgs};
use clickagg::sink::billing::FEW_ADS;
use clickagg::sink::Writer;
use clickagg::time;

use crate::helpers::{StoredRow, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);
const MINUTE: u32 = 60;
const HOUR: u32 = 3_600;
const DAY: u32 = 86_400;

/// One `clickagg query` invocation and the rows it must print.
struct Case {
    what: &'static str,
    from: u32,
    to: u32,
    ads: Vec<u64>,
    by: &'static str,
    top: Option<usize>,
}

/// (ad_id, bucket start in Unix seconds, clicks), in the order the command prints.
type Rows = Vec<(u64, u32, u64)>;

/// The rows `case` must print, from the ground truth alone: UTC buckets are plain
/// integer division, so this shares nothing with the SQL.
fn expected(truth: &BTreeMap<BucketKey, u64>, case: &Case) -> Rows {
    let width = match case.by {
        "minute" => MINUTE,
        "hour" => HOUR,
        "day" => DAY,
        other => panic!("unknown bucket {other}"),
    };
    let mut buckets: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    for (k, clicks) in truth {
        let m = k.minute.epoch_seconds();
        if m < case.from || m >= case.to || !(case.ads.is_empty() || case.ads.contains(&k.ad_id)) {
            continue;
        }
        *buckets.entry((k.ad_id, m - m % width)).or_default() += clicks;
    }
    let rows: Rows = buckets.into_iter().map(|((ad, bucket), clicks)| (ad, bucket, clicks)).collect();
    let Some(n) = case.top else { return rows };
    let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
    for (ad, _, clicks) in &rows {
        *totals.entry(*ad).or_default() += clicks;
    }
    let mut ranked: Vec<(u64, u64)> = totals.into_iter().collect();
    ranked.sort_by_key(|&(ad, total)| (std::cmp::Reverse(total), ad));
    ranked.truncate(n);
    let mut top_rows: Rows = Vec::new();
    for (ad, _) in ranked {
        top_rows.extend(rows.iter().filter(|r| r.0 == ad));
    }
    top_rows
}

fn rfc3339(secs: u32) -> String {
    Minute::from_epoch_seconds(secs).to_rfc3339()
}

fn parse_bucket(s: &str) -> u32 {
    chrono::DateTime::parse_from_rfc3339(s).unwrap_or_else(|e| panic!("bucket {s:?}: {e}")).timestamp() as u32
}

/// Runs `clickagg <args>` with this test's settings; its standard output, which must
/// end in success (`what` names the case in the failure).
fn stdout_of(env: &TestEnv, args: &[String], what: &str) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = env.command(&args, &[]).stdin(Stdio::null()).output().expect("run clickagg");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{what}: {:?}\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Runs `clickagg query` with this test's settings and returns its standard output.
fn run_query(env: &TestEnv, case: &Case, format: &str, extra: &[&str]) -> String {
    let mut args: Vec<String> =
        ["query", "--from", &rfc3339(case.from), "--to", &rfc3339(case.to), "--by", case.by, "--format", format]
            .map(String::from)
            .to_vec();
    for ad in &case.ads {
        args.extend(["--ad".to_string(), ad.to_string()]);
    }
    if let Some(n) = case.top {
        args.extend(["--top".to_string(), n.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    stdout_of(env, &args, case.what)
}

fn parse_json(out: &str) -> Rows {
    let items: Vec<serde_json::Value> = serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"));
    items
        .iter()
        .map(|v| {
            assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
            (v["ad_id"].as_u64().unwrap(), parse_bucket(v["bucket"].as_str().unwrap()), v["clicks"].as_u64().unwrap())
        })
        .collect()
}

fn parse_csv(out: &str) -> Rows {
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("ad_id,bucket,clicks"));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 3, "{l}");
            (f[0].parse().unwrap(), parse_bucket(f[1]), f[2].parse().unwrap())
        })
        .collect()
}

/// The rows of a table and the number on its total line.
fn parse_table(out: &str) -> (Rows, u64) {
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), ["ad_id", "bucket", "clicks"], "{out}");
    let total_line: Vec<&str> = lines.last().unwrap().split_whitespace().collect();
    assert_eq!(total_line[0], "total", "{out}");
    let rows = lines[1..lines.len() - 1]
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "{l}");
            (f[0].parse().unwrap(), parse_bucket(f[1]), f[2].parse().unwrap())
        })
        .collect();
    // Columns are aligned: every line is as wide as the header.
    assert!(lines[..lines.len() - 1].iter().all(|l| l.len() == lines[0].len()), "{out}");
    (rows, total_line[1].parse().unwrap())
}

/// Fails with the first difference only: two dumps of hundreds of rows are unreadable.
fn assert_rows(actual: &Rows, want: &Rows, what: &str) {
    if actual == want {
        return;
    }
    let at = actual.iter().zip(want).position(|(a, w)| a != w).unwrap_or(actual.len().min(want.len()));
    let window = |rows: &Rows| rows[at.min(rows.len())..(at + 3).min(rows.len())].to_vec();
    panic!(
        "{what}: {} rows, expected {}; from row {at} got {:?}, expected {:?}",
        actual.len(),
        want.len(),
        window(actual),
        window(want)
    );
}

/// Every format of `case` prints exactly the expected rows.
fn assert_case(env: &TestEnv, truth: &BTreeMap<BucketKey, u64>, case: &Case) {
    let want = expected(truth, case);
    assert_rows(&parse_json(&run_query(env, case, "json", &[])), &want, &format!("{} as JSON", case.what));
    assert_rows(&parse_csv(&run_query(env, case, "csv", &[])), &want, &format!("{} as CSV", case.what));
    let (rows, total) = parse_table(&run_query(env, case, "table", &[]));
    assert_rows(&rows, &want, &format!("{} as a table", case.what));
    assert_eq!(total, want.iter().map(|r| r.2).sum::<u64>(), "{} table total", case.what);
}

/// The ads of `truth` by total clicks, largest first.
fn ads_by_popularity(truth: &Truth) -> Vec<u64> {
    let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
    for (k, c) in &truth.counts {
        *totals.entry(k.ad_id).or_default() += c;
    }
    let mut ads: Vec<(u64, u64)> = totals.into_iter().collect();
    ads.sort_by_key(|&(ad, total)| (std::cmp::Reverse(total), ad));
    ads.into_iter().map(|(ad, _)| ad).collect()
}

const SEALED: [(&str, &str); 2] = [("ad_clicks_sealed_hour", "hour"), ("ad_clicks_sealed_day", "day")];

/// What `--print-sql` reads from the sealed tables for `case`: (sealed days, sealed
/// hours) as the pairs it lists.
fn sealed_parts(env: &TestEnv, case: &Case) -> (usize, usize) {
    let sql = run_query(env, case, "table", &["--print-sql"]);
    let pairs = |name: &str| {
        // A part that reads nothing is left out of the SQL (`sink::billing::without_parts`).
        let Some(at) = sql.find(&format!("FROM {name} FINAL")) else { return 0 };
        let list = &sql[at..];
        let list = &list[list.find("arrayJoin(CAST([").unwrap() + 16..];
        list[..list.find(']').unwrap()].matches("toDateTime(").count()
    };
    (pairs("ad_clicks_sealed_day"), pairs("ad_clicks_sealed_hour"))
}

async fn raw_and_final_sums(env: &TestEnv) -> (u64, u64) {
    let client = env.sink().client().clone();
    let raw = client.query("SELECT sum(clicks) FROM ad_clicks_minute").fetch_one::<u64>().await.unwrap();
    let fin = client.query("SELECT sum(clicks) FROM ad_clicks_minute FINAL").fetch_one::<u64>().await.unwrap();
    (raw, fin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_prints_the_ground_truth_in_every_format_bucketing_and_top_n() {
    let env = TestEnv::new("query").await;
    // Three hours of clicks across yesterday's UTC midnight, so that minute, hour and
    // day buckets all split the data (the local broker keeps old records: no retention).
    let now = chrono::Utc::now().timestamp() as u32;
    let midnight = now - now % DAY - DAY;
    let start = midnight - 90 * MINUTE;
    let spec = Spec {
        count: 40_000,
        ads: 200,
        seed: 21,
        start_ms: i64::from(start) * 1000,
        span: Duration::from_secs(3 * 3600),
        ..Spec::default()
    };
    let (records, truth) = clickagg::produce::plan(&spec);
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m0");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);

    let popular = ads_by_popularity(&truth);
    let minutes = || truth.counts.keys().map(|k| k.minute.epoch_seconds());
    let (first, last) = (minutes().min().unwrap(), minutes().max().unwrap());
    assert!(first < midnight && last >= midnight + HOUR, "the data crosses midnight and several hours");
    let some_ads = vec![popular[0], popular[2], popular[popular.len() - 1], 999_999_999];
    let cases = [
        Case {
            what: "minutes of some ads, mid-hour range",
            from: start + 17 * MINUTE,
            to: start + 97 * MINUTE,
            ads: some_ads.clone(),
            by: "minute",
            top: None,
        },
        Case {
            what: "hours of every ad",
            from: midnight - DAY,
            to: midnight + DAY,
            ads: vec![],
            by: "hour",
            top: None,
        },
        Case {
            what: "partial first and last hours",
            from: midnight - 45 * MINUTE,
            to: midnight + 70 * MINUTE,
            ads: some_ads.clone(),
            by: "hour",
            top: None,
        },
        Case {
            what: "days of every ad",
            from: midnight - DAY,
            to: midnight + 2 * DAY,
            ads: vec![],
            by: "day",
            top: None,
        },
        Case {
            what: "top 5 ads by hour",
            from: midnight - DAY,
            to: midnight + DAY,
            ads: vec![],
            by: "hour",
            top: Some(5),
        },
        Case {
            what: "top 3 of some ads by day",
            from: midnight - DAY,
            to: midnight + DAY,
            ads: popular[5..15].to_vec(),
            by: "day",
            top: Some(3),
        },
        Case {
            what: "top 1 ad in the first half hour by minute",
            from: start,
            to: start + 30 * MINUTE,
            ads: vec![],
            by: "minute",
            top: Some(1),
        },
        Case {
            what: "a range with no clicks",
            from: midnight + 5 * DAY,
            to: midnight + 6 * DAY,
            ads: vec![],
            by: "day",
            top: None,
        },
        Case {
            what: "more ads than a few, by hour",
            from: midnight - DAY,
            to: midnight + DAY,
            ads: popular[..FEW_ADS + 1].to_vec(),
            by: "hour",
            top: None,
        },
    ];
    // Nothing sealed: every bucket from the minute rows.
    for case in &cases {
        assert_case(&env, &truth.counts, case);
    }
    assert_eq!(sealed_parts(&env, &cases[3]), (0, 0));

    // Sealed through 01:00: yesterday's day and today's first hour come from the sealed
    // tables, the rest of the range from the minute rows.
    let report = env.seal_through(midnight + HOUR).await;
    assert_eq!((report.hours_sealed, report.days_sealed), (25, 1), "{report:?}");
    assert_eq!(sealed_parts(&env, &cases[3]), (1, 1), "days: yesterday sealed, today's 00:00 hour sealed");
    assert_eq!(sealed_parts(&env, &cases[1]), (0, 25), "hours: yesterday's 24 and today's first");
    assert_eq!(sealed_parts(&env, &cases[8]), (0, 25), "an ad list longer than a few reads the seals too");
    assert_eq!(sealed_parts(&env, &cases[2]), (0, 0), "a few ads: their minute rows alone, found by key");
    for case in &cases {
        assert_case(&env, &truth.counts, case);
    }

    // Everything sealed.
    env.assert_seals_agree().await;
    assert_eq!(sealed_parts(&env, &cases[3]).0, 2, "days: yesterday's and the day before");
    for case in &cases {
        assert_case(&env, &truth.counts, case);
    }

    // Rows of another topic count by default and are left out with --only-topic; it has
    // no seals, so its minute rows are read where the test's topic reads sealed ones.
    let other_minute = Minute::from_epoch_seconds(midnight + 10 * MINUTE);
    let other = BatchRow {
        key: BucketKey { ad_id: popular[0], minute: other_minute },
        partition: 0,
        batch_start: 0,
        clicks: 1_000,
        version: 5,
    };
    env.sink().insert("another-topic", &[other], Writer::Member).await.unwrap();
    let mut with_other = truth.counts.clone();
    *with_other.entry(BucketKey { ad_id: popular[0], minute: other_minute }).or_default() += 1_000;
    assert_case(&env, &with_other, &cases[3]);
    let only = parse_json(&run_query(&env, &cases[3], "json", &["--only-topic", &env.topic]));
    assert_rows(&only, &expected(&truth.counts, &cases[3]), "--only-topic leaves the other topic out");

    // Stale copies of stored rows, in the minute table and both sealed tables: a zombie's
    // lower-version write with a *larger* count (so neither a double sum nor max(clicks)
    // could hide) and an exact repeat. Merges are stopped so the copies stay in their
    // own parts and only FINAL can drop them. The minute copies mark their hours
    // written after their seal, so those hours are read from the minute rows again.
    let sink = env.sink();
    for table in ["ad_clicks_minute", SEALED[0].0, SEALED[1].0] {
        sink.execute(&format!("SYSTEM STOP MERGES {table}")).await.unwrap();
    }
    let stored: Vec<StoredRow> = sink
        .client()
        .query(&format!(
            "SELECT ad_id, toUInt32(minute) AS minute, partition, batch_start, clicks, version \
             FROM ad_clicks_minute FINAL WHERE topic = '{}' ORDER BY ad_id, minute LIMIT 50",
            env.topic
        ))
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(stored.len(), 50);
    let stale: Vec<BatchRow> = stored
        .iter()
        .flat_map(|r| {
            let key = BucketKey { ad_id: r.ad_id, minute: Minute::from_epoch_seconds(r.minute) };
            let row = |clicks, version| BatchRow {
                key,
                partition: r.partition as i32,
                batch_start: r.batch_start as i64,
                clicks,
                version,
            };
            // Stored versions are twice the offset plus the writer's rank (`sink::stored_version`).
            let offset = (r.version / 2) as i64;
            [row(r.clicks + 1_000, offset - 1), row(r.clicks, offset)]
        })
        .collect();
    sink.insert(&env.topic, &stale, Writer::Member).await.unwrap();
    for (table, time) in SEALED {
        sink.execute(&format!(
            "INSERT INTO {table} (topic, {time}, ad_id, clicks, version) \
             SELECT topic, {time}, ad_id, toUInt64(clicks + 1000), toUInt64(version - 1) FROM {table} FINAL WHERE topic = '{0}' \
             UNION ALL SELECT topic, {time}, ad_id, clicks, version FROM {table} FINAL WHERE topic = '{0}'",
            env.topic
        ))
        .await
        .unwrap();
    }
    let (raw, fin) = raw_and_final_sums(&env).await;
    assert!(raw > fin, "the stale rows are stored ({raw} without FINAL, {fin} with)");
    for case in &cases {
        assert_case(&env, &with_other, case);
    }
    // Sealed again, the hours the stale rows marked are read from the sealed tables.
    env.assert_seals_agree().await;
    for case in &cases {
        assert_case(&env, &with_other, case);
    }
    for table in ["ad_clicks_minute", SEALED[0].0, SEALED[1].0] {
        sink.execute(&format!("SYSTEM START MERGES {table}")).await.unwrap();
    }
}

/// Every ad on 2026-11-30, bucketed `by`: the day the version tests write.
fn nov_30(by: By) -> QueryArgs {
    QueryArgs {
        from: Some(time::parse_time("2026-11-30").unwrap()),
        to: Some(time::parse_time("2026-12-01").unwrap()),
        period: None,
        with_adjustments: false,
        ads: vec![],
        by,
        top: None,
        format: Format::Table,
        only_topic: None,
        print_sql: false,
    }
}

/// The clicks of ad 17 on 2026-11-30 by minute, hour and day, and of the top ad.
async fn ad_17_totals(sink: &clickagg::sink::Sink) -> Vec<u64> {
    let mut out = Vec::new();
    for (by, bucket) in
        [(By::Minute, "2026-11-30T08:00:00Z"), (By::Hour, "2026-11-30T08:00:00Z"), (By::Day, "2026-11-30T00:00:00Z")]
    {
        let rows = query::query(sink, &nov_30(by)).await.unwrap();
        assert_eq!(rows.len(), 1, "{by:?}: {rows:?}");
        assert_eq!((rows[0].ad_id, rows[0].bucket_rfc3339().as_str()), (17, bucket), "{by:?}");
        out.push(rows[0].clicks);
    }
    let top = query::query(sink, &QueryArgs { top: Some(1), ..nov_30(By::Day) }).await.unwrap();
    out.push(top.iter().map(|r| r.clicks).sum::<u64>());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_version_of_a_batch_row_or_a_seal_replaces_it_and_never_adds_to_it() {
    let env = TestEnv::new("queryversions").await;
    let sink = env.sink();
    for table in ["ad_clicks_minute", SEALED[0].0, SEALED[1].0] {
        sink.execute(&format!("SYSTEM STOP MERGES {table}")).await.unwrap();
    }
    let day = 1_795_996_800; // 2026-11-30T00:00:00Z
    let minute = Minute::from_epoch_seconds(day + 8 * HOUR);
    let key = BucketKey { ad_id: 17, minute };
    let row = |batch_start, clicks, version| BatchRow { key, partition: 0, batch_start, clicks, version };
    // Batch 0 flushed at offsets 5 and 9, then a zombie replays offset 7; batch 1000
    // holds 2 more clicks of the same minute. One insert each: one part each.
    for r in [row(0, 3, 5), row(0, 5, 9), row(0, 4, 7), row(1_000, 2, 1_500)] {
        sink.insert(&env.topic, &[r], Writer::Member).await.unwrap();
    }
    assert_eq!(raw_and_final_sums(&env).await, (14, 7));
    assert_eq!(ad_17_totals(&sink).await, [7, 7, 7, 7], "from the minute rows");

    // Sealed: the same from the sealed hour and day.
    let first = env.seal_through(day + DAY).await;
    assert_eq!((first.hours_sealed, first.days_sealed), (24, 1), "{first:?}");
    assert_eq!(ad_17_totals(&sink).await, [7, 7, 7, 7], "from the seals");

    // A later cut of batch 1000 (3 clicks at offset 1600): the hour is read from the
    // minute rows until it is sealed again, then from a seal with a higher version.
    sink.insert(&env.topic, &[row(1_000, 3, 1_600)], Writer::Member).await.unwrap();
    assert_eq!(ad_17_totals(&sink).await, [8, 8, 8, 8], "written after the seal");
    let version = |table: &'static str| {
        let client = sink.client().clone();
        async move { client.query(&format!("SELECT max(version) FROM {table} FINAL")).fetch_one::<u64>().await.unwrap() }
    };
    let (hour_before, day_before) = (version(SEALED[0].0).await, version(SEALED[1].0).await);
    let again = env.seal_through(day + DAY).await;
    assert_eq!((again.hours_resealed, again.days_resealed, again.hours_sealed), (1, 1, 0), "{again:?}");
    assert!(version(SEALED[0].0).await > hour_before && version(SEALED[1].0).await > day_before);
    assert_eq!(ad_17_totals(&sink).await, [8, 8, 8, 8], "from the new seals");
    // The seal computed before the late row, written again last (a slow sealer), loses.
    sink.execute(&format!(
        "INSERT INTO {} (topic, hour, ad_id, clicks, version) VALUES ('{}', toDateTime({}, 'UTC'), 17, 7, {hour_before})",
        SEALED[0].0,
        env.topic,
        day + 8 * HOUR
    ))
    .await
    .unwrap();
    assert_eq!(ad_17_totals(&sink).await, [8, 8, 8, 8], "an older seal written last");
    env.assert_seals_agree().await;
    for table in ["ad_clicks_minute", SEALED[0].0, SEALED[1].0] {
        sink.execute(&format!("SYSTEM START MERGES {table}")).await.unwrap();
    }
}

/// Minute rows written before the sealer existed (an upgrade: no markers) are sealed by
/// `clickagg seal` from the first day with rows; a second run finds nothing to do, and
/// `--recompute-from` computes them again without changing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clickagg_seal_seals_minute_rows_written_before_it_existed_once_and_idempotently() {
    let env = TestEnv::new("queryupgrade").await;
    let sink = env.sink();
    let day = 1_795_996_800; // 2026-11-30T00:00:00Z
                             // As an older clickagg wrote them: straight into the minute table, no markers. Two
                             // minutes of one hour in one batch (flushed twice, the second cut replacing the
                             // first), another hour, another batch, a stale copy a zombie wrote, and an ad on
                             // the next day but one (the day between has no rows).
    let rows = [
        (7, 8 * HOUR, 0, 2, 10),
        (7, 8 * HOUR, 0, 3, 20),
        (7, 8 * HOUR + 5 * MINUTE, 0, 4, 20),
        (7, 9 * HOUR, 0, 1, 30),
        (7, 8 * HOUR + 30 * MINUTE, 1_000, 6, 2_400),
        (7, 8 * HOUR + 30 * MINUTE, 1_000, 5, 2_200),
        (8, 23 * HOUR, 1_000, 9, 2_600),
        (8, 2 * DAY + 23 * HOUR, 2_000, 4, 4_001),
    ];
    for (ad, at, batch_start, clicks, version) in rows {
        sink.execute(&format!(
            "INSERT INTO ad_clicks_minute (ad_id, minute, topic, partition, batch_start, clicks, version) \
             VALUES ({ad}, toDateTime({}, 'UTC'), '{}', 0, {batch_start}, {clicks}, {version})",
            day + at,
            env.topic
        ))
        .await
        .unwrap();
    }
    let seal = |label: &str, extra: &[&str]| {
        let mut args = vec!["seal", "--through", "2026-12-03"];
        args.extend_from_slice(extra);
        let mut p = env.spawn(label, &args, &[]);
        async move {
            assert_eq!(p.wait(Duration::from_secs(120)).await, 0, "{}", p.output());
            p.lines().into_iter().find(|l| l.starts_with("sealed ")).unwrap_or_else(|| panic!("{}", p.output()))
        }
    };
    let out = seal("seal-1", &[]).await;
    // Nov 30 and Dec 2 whole; Dec 1 had no row and is skipped.
    assert!(out.starts_with("sealed 48 hours and 2 days; re-sealed 0 hours and 0 days"), "{out}");
    assert!(out.contains("sealed through 2026-12-03T00:00:00Z"), "{out}");
    let totals = |rows: Vec<query::BillingRow>| {
        let mut t: BTreeMap<u64, u64> = BTreeMap::new();
        for r in rows {
            *t.entry(r.ad_id).or_default() += r.clicks;
        }
        t
    };
    let days = |by| QueryArgs { to: Some(time::parse_time("2026-12-03").unwrap()), ..nov_30(by) };
    // ad 7: 3 + 4 + 1 (batch 0) + 6 (batch 1000); ad 8: 9 and 4.
    let want: BTreeMap<u64, u64> = [(7, 14), (8, 13)].into();
    for by in [By::Minute, By::Hour, By::Day] {
        assert_eq!(totals(query::query(&sink, &days(by)).await.unwrap()), want, "{by:?}");
    }
    let hours = query::query(&sink, &nov_30(By::Hour)).await.unwrap();
    let ad7: Vec<(String, u64)> =
        hours.iter().filter(|r| r.ad_id == 7).map(|r| (r.bucket_rfc3339(), r.clicks)).collect();
    assert_eq!(ad7, [("2026-11-30T08:00:00Z".to_string(), 13), ("2026-11-30T09:00:00Z".to_string(), 1)]);

    let out = seal("seal-2", &[]).await;
    assert!(out.starts_with("sealed 0 hours and 0 days; re-sealed 0 hours and 0 days (0 hours unchanged)"), "{out}");
    let out = seal("seal-recompute", &["--recompute-from", "2026-11-30"]).await;
    // Dec 1's hours are sealed (empty) now: a range asked for is computed whole.
    assert!(out.starts_with("sealed 24 hours and 1 days; re-sealed 0 hours and 0 days (48 hours unchanged)"), "{out}");
    for by in [By::Minute, By::Hour, By::Day] {
        assert_eq!(totals(query::query(&sink, &days(by)).await.unwrap()), want, "{by:?} after recomputing");
    }
    env.assert_seals_agree().await;
}

/// `clickagg explain --ad A --minute M <extra>` with the test's settings: its stdout.
fn run_explain(env: &TestEnv, ad: u64, minute: u32, extra: &[&str]) -> String {
    let mut args: Vec<String> =
        ["explain", "--ad", &ad.to_string(), "--minute", &rfc3339(minute)].map(String::from).to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    stdout_of(env, &args, &format!("explain {ad} {minute}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_lists_the_batches_whose_clicks_add_up_to_each_count() {
    let mut env = TestEnv::new("explain").await;
    env.batch_offsets = 500;
    let spec = Spec {
        count: 20_000,
        ads: 50,
        seed: 23,
        duplicate_ratio: 0.2,
        cross_partition_ratio: 0.3,
        span: Duration::from_secs(1800),
        ..Spec::default()
    };
    let (records, truth) = env.plan(spec);
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m0");
    env.assert_counts_settle(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);

    // 20 counts spread over the truth (every k-th bucket), and one that has no clicks.
    let keys: Vec<&BucketKey> = truth.counts.keys().collect();
    let step = keys.len() / 20;
    let mut batch_rows = 0;
    for key in keys.iter().step_by(step).take(20) {
        let (ad, minute) = (key.ad_id, key.minute.epoch_seconds());
        let json: serde_json::Value =
            serde_json::from_str(&run_explain(&env, ad, minute + 17, &["--format", "json"])).unwrap();
        let want = truth.counts[key];
        assert_eq!(json["clicks"], want, "ad {ad} minute {minute}: {json}");
        assert_eq!(json["minute"], rfc3339(minute), "a time inside the minute means the minute");
        let batches = json["batches"].as_array().unwrap();
        let sum: u64 = batches.iter().map(|b| b["clicks"].as_u64().unwrap()).sum();
        assert_eq!(sum, want, "the batches add up to the count: {json}");
        for b in batches {
            let (first, last) = (b["first_offset"].as_i64().unwrap(), b["last_offset"].as_i64().unwrap());
            assert!(b["partition"].as_u64().unwrap() < 4, "{b}");
            assert!(first % 500 == 0 && first <= last && last < first + 500, "an offset-aligned batch: {b}");
            assert_eq!(b["writer"], "member", "{b}");
            assert_eq!(b["topic"], env.topic.as_str());
        }
        batch_rows += batches.len();
        let table = run_explain(&env, ad, minute, &[]);
        let total = table.lines().last().unwrap().split_whitespace().last().unwrap().parse::<u64>().unwrap();
        assert_eq!(total, want, "{table}");
    }
    assert!(batch_rows > 20, "some counts span several batches: {batch_rows} rows for 20 counts");
    let absent = run_explain(&env, 999_999_999, keys[0].minute.epoch_seconds(), &[]);
    assert!(absent.contains(": 0 clicks from 0 batch rows"), "{absent}");

    // --records: the generator's click IDs per bucket (its retries and copies repeat
    // their original's ad and time here), against what the re-read decides.
    let mut ids_of: BTreeMap<BucketKey, std::collections::BTreeSet<String>> = BTreeMap::new();
    for r in &records {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&r.payload) else { continue };
        // The generator writes `ts` as epoch milliseconds or as RFC 3339 text.
        let ts = v["ts"].as_i64().or_else(|| {
            v["ts"].as_str().and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok()).map(|t| t.timestamp_millis())
        });
        let (Some(id), Some(ad), Some(ts)) = (v["click_id"].as_str(), v["ad_id"].as_u64(), ts) else {
            continue;
        };
        let key = BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds((ts / 1000) as u32) };
        ids_of.entry(key).or_default().insert(id.to_string());
    }
    let mut not_counted = 0;
    let checked: Vec<&BucketKey> = keys.iter().step_by(step).take(6).copied().collect();
    for key in &checked {
        let (ad, minute) = (key.ad_id, key.minute.epoch_seconds());
        let json: serde_json::Value =
            serde_json::from_str(&run_explain(&env, ad, minute, &["--records", "--format", "json"])).unwrap();
        let want = truth.counts[key];
        assert_eq!(json["records_counted"], want, "the records that count add up to the count: {json}");
        let listed: Vec<&serde_json::Value> =
            json["batches"].as_array().unwrap().iter().flat_map(|b| b["records"].as_array().unwrap()).collect();
        let counted: std::collections::BTreeSet<&str> =
            listed.iter().filter(|r| r["counted"] == true).map(|r| r["click_id"].as_str().unwrap()).collect();
        assert_eq!(counted.len() as u64, want, "each counted click ID once: {json}");
        assert!(counted.iter().all(|id| ids_of[key].contains(*id)), "only clicks of this ad and minute: {json}");
        for r in listed.iter().filter(|r| r["counted"] == false) {
            let id = r["click_id"].as_str().unwrap();
            assert!(counted.contains(id), "a click not counted here counted in another of the batches: {r}");
            let reason = r["reason"].as_str().unwrap();
            assert!(reason.starts_with("duplicate") || reason.starts_with("copy of a click"), "{r}");
            not_counted += 1;
        }
        for b in json["batches"].as_array().unwrap() {
            let offsets: Vec<i64> =
                b["records"].as_array().unwrap().iter().map(|r| r["offset"].as_i64().unwrap()).collect();
            let (first, last) = (b["first_offset"].as_i64().unwrap(), b["last_offset"].as_i64().unwrap());
            assert!(offsets.iter().all(|o| (first..=last).contains(o)), "only the batch's own offsets: {b}");
        }
    }
    assert!(not_counted > 0, "retries and copies among the records listed");
    let key = checked[0];
    let table = run_explain(&env, key.ad_id, key.minute.epoch_seconds(), &["--records"]);
    let want = truth.counts[key];
    assert!(table.contains(&format!("records counted: {want} (the count: {want})")), "{table}");

    // Retention deletes a partition's records: the batches there say so, the others are read.
    let json: serde_json::Value =
        serde_json::from_str(&run_explain(&env, key.ad_id, key.minute.epoch_seconds(), &["--format", "json"])).unwrap();
    let gone = json["batches"][0]["partition"].as_i64().unwrap() as i32;
    env.delete_records_before(gone, json["batches"][0]["last_offset"].as_i64().unwrap() + 1).await;
    let json: serde_json::Value = serde_json::from_str(&run_explain(
        &env,
        key.ad_id,
        key.minute.epoch_seconds(),
        &["--records", "--format", "json"],
    ))
    .unwrap();
    let mut read = 0;
    for b in json["batches"].as_array().unwrap() {
        if b["partition"].as_i64().unwrap() as i32 == gone && b["first_offset"] == json["batches"][0]["first_offset"] {
            assert!(b["records_missing"].as_str().unwrap().contains("retention deleted them"), "{b}");
            assert!(b.get("records").is_none(), "{b}");
        } else {
            read += b["records"].as_array().unwrap().iter().filter(|r| r["counted"] == true).count() as u64;
            assert!(b.get("records_missing").is_none(), "{b}");
        }
    }
    assert_eq!(json["records_counted"], read, "{json}");
}
