//! Seeing it work: a member's status page in a real browser against its `/metrics` and
//! `/status.json`, `clickagg status` with a member killed, and every metric the
//! dashboard and the alerts read exported by a running member.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use clickagg::produce::{self, Spec};
use serde_json::Value;

use crate::helpers::browser::{self, Page};
use crate::helpers::{http, metric_value, wait_until, Member, PrivateStack, TestEnv};

const SETTLE: Duration = Duration::from_secs(120);

/// `/status.json` of a member.
async fn status_json(addr: &str) -> Value {
    let (code, body) = http::http_get(addr, "/status.json").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status.json is not JSON ({e}): {body}"))
}

async fn metrics(addr: &str) -> String {
    http::http_get(addr, "/metrics").await.1
}

/// Records planned to be sent live, stamped with the wall clock they are sent at.
fn live(count: u64, seconds: u64, seed: u64) -> Vec<produce::Planned> {
    let now = chrono::Utc::now().timestamp_millis();
    produce::plan(&Spec { count, seed, start_ms: now, span: Duration::from_secs(seconds), ..Spec::default() }).0
}

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A member whose Redis the test can stop: the page shows its counters, partitions and
/// rates as `/metrics` and `/status.json` report them, then the outage with its reason.
/// Also takes the screenshot of the guide's status page (written to docs/status-page.png when
/// `CLICKAGG_UPDATE_SCREENSHOT=1`, see scripts/status-screenshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_what_the_metrics_say_and_an_outage_with_its_reason() {
    let stack = PrivateStack::start("statuspage", &["redis"]).await;
    let env = TestEnv::with_stack("statuspage", &stack).await;
    // A backlog stamped over the last 45 minutes gives the clicks-per-minute line a
    // history; live records keep the rates up while the screenshot is taken.
    let (backlog, _) = env.plan(Spec {
        count: 1_500,
        seed: 61,
        malformed_ratio: 0.02,
        span: Duration::from_secs(45 * 60),
        ..Spec::default()
    });
    env.send(&backlog, 8, None).await;
    let mut member = env.spawn_member("m");
    let addr = member.http_addr().await;
    let url = format!("http://{addr}/");
    wait_until("the member reads the backlog", SETTLE, || async {
        let s = status_json(&addr).await;
        match s["totals"]["records"].as_u64() {
            Some(n) if n >= backlog.len() as u64 => Ok(()),
            other => Err(format!("records {other:?}")),
        }
    })
    .await;
    let live_records = live(6_000, 20, 62);
    let producer = env.spawn_producer(&live_records, 8, 300);
    // The screenshot once the rate window (10 s) holds live records only and librdkafka
    // reported every partition's lag; nothing is asserted on the moving figures.
    wait_until("live records flow", SETTLE, || async {
        let s = status_json(&addr).await;
        let live_read = s["totals"]["records"].as_u64().unwrap_or(0).saturating_sub(backlog.len() as u64);
        let lags = s["partitions"].as_array().unwrap().iter().all(|p| p["lag"].is_number());
        if live_read >= 3_300 && lags {
            Ok(())
        } else {
            Err(format!("{live_read} live records read, lag of every partition: {lags}"))
        }
    })
    .await;
    let shot = env.log_dir.join("status-page.png");
    assert_eq!(browser::screenshot(&url, &shot, 1280, 900).await, (1280, 900));
    if std::env::var("CLICKAGG_UPDATE_SCREENSHOT").is_ok_and(|v| v == "1") {
        std::fs::copy(&shot, concat!(env!("CARGO_MANIFEST_DIR"), "/docs/status-page.png")).unwrap();
    }
    producer.finished().await;

    // Once everything is read, committed and reported (librdkafka's lag every 5 s),
    // the values stop moving and the page, the JSON and /metrics must agree exactly.
    let total = (backlog.len() + live_records.len()) as u64;
    let highs = env.high_watermarks().await;
    wait_until("the member is idle and its lag reported", SETTLE, || async {
        let s = status_json(&addr).await;
        let settled = s["totals"]["records"] == total
            && s["rates"]["records_per_second"] == 0.0
            && s["partitions"].as_array().unwrap().iter().all(|p| {
                let high = highs[&(p["partition"].as_i64().unwrap() as i32)];
                p["last_read_offset"] == high - 1
                    && p["committed_offset"].as_i64().is_some_and(|c| p["lag"] == high - c)
            });
        if settled {
            Ok(())
        } else {
            Err(s.to_string())
        }
    })
    .await;
    // The JSON is read before and after the page: the freshness window slides, so the
    // page must have seen the same JSON as the test.
    let (before, json, page, after) = wait_until("the page rendered the JSON it was read with", SETTLE, || async {
        let before = metrics(&addr).await;
        let json = status_json(&addr).await;
        let page = browser::page(&url).await;
        let json_after = status_json(&addr).await;
        let after = metrics(&addr).await;
        let same = |k: &str| json[k] == json_after[k];
        match (page.renders(), same("freshness") && same("totals") && same("clicks_per_minute")) {
            (0, _) => Err(format!("no render yet: {}", page.connection())),
            (_, false) => Err(format!("moved: {json} then {json_after}")),
            _ => Ok((before, json, page, after)),
        }
    })
    .await;
    assert_eq!(page.figure("connection").attr("data-state"), Some("ok"));
    assert_page_matches(&page, &json, &before, &after, env.batch_offsets as i64);

    // Redis goes away: within a probe interval the member is not ready, and says why.
    stack.down("redis").await;
    let page = wait_until("the page shows the member not ready", SETTLE, || async {
        let page = browser::page(&url).await;
        if page.figure("ready").value() == false {
            Ok(page)
        } else {
            Err("still ready".into())
        }
    })
    .await;
    let reasons = page.html.split("data-figure=\"not_ready_reasons\">").nth(1).and_then(|r| r.split("</ul>").next());
    assert!(
        reasons.is_some_and(|r| r.contains("<li>redis unreachable</li>")),
        "the banner gives the reason: {reasons:?}"
    );
    let json = status_json(&addr).await;
    assert_eq!(json["ready"], false);
    assert!(json["not_ready_reasons"].as_array().unwrap().contains(&"redis unreachable".into()), "{json}");
    assert_eq!(metric_value(&metrics(&addr).await, "clickagg_ready", &[]), 0.0);
    let (code, body) = http::http_get(&addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("redis unreachable"), "{body}");
    member.kill9().await;
}

/// The page and `/status.json` of a member whose clicks took longer than the top
/// freshness bucket (5 minutes): the quantile is only known to be more than that, and
/// both say so ("> 5 min", `p99_more_than`) instead of showing the bound as a value.
/// The JSON is the real status board's, from a `/metrics` text with those observations;
/// the page is the real one, in Chromium.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freshness_quantile_beyond_the_top_bucket_shows_as_more_than_5_min() {
    let now = clickagg::status::unix_now();
    let freshness = |counts: [u64; 4]| {
        let [a, b, c, inf] = counts;
        format!(
            "clickagg_freshness_seconds_bucket{{le=\"1\"}} {a}\nclickagg_freshness_seconds_bucket{{le=\"2\"}} {b}\n\
             clickagg_freshness_seconds_bucket{{le=\"300\"}} {c}\nclickagg_freshness_seconds_bucket{{le=\"+Inf\"}} {inf}\n"
        )
    };
    let board = clickagg::status::StatusBoard::default();
    board.sample(&freshness([0, 0, 0, 0]), now - 10.0);
    // 70 % within a second, 30 % over five minutes: p50 is known, p99 only bounded below.
    let metrics = freshness([700, 700, 700, 1000]);
    let json = serde_json::to_value(board.snapshot(Ok(()), &metrics, now)).unwrap();
    let f = &json["freshness"];
    assert_eq!((f["p99_seconds"].as_f64(), f["p99_more_than"].as_bool()), (Some(300.0), Some(true)), "{f}");
    assert_eq!(f["p50_more_than"], false, "{f}");
    assert!(f["p50_seconds"].as_f64().is_some_and(|p| p < 1.0), "{f}");

    let url = serve_page_with(json.clone()).await;
    let page = wait_until("the page rendered the JSON", SETTLE, || async {
        let page = browser::page(&url).await;
        if page.renders() > 0 {
            Ok(page)
        } else {
            Err(page.connection())
        }
    })
    .await;
    let p99 = page.figure("freshness_p99_seconds");
    assert_eq!((p99.value().as_f64(), p99.attr("data-more-than")), (Some(300.0), Some("true")));
    assert_eq!(figure_text(&page, "freshness_p99_seconds"), "> 5 min");
    let p50 = page.figure("freshness_p50_seconds");
    assert_eq!((p50.value().as_f64(), p50.attr("data-more-than")), (f["p50_seconds"].as_f64(), Some("false")));
    assert!(!figure_text(&page, "freshness_p50_seconds").starts_with('>'));
}

/// Serves `assets/status.html` at `/` and `json` at `/status.json` on a free port of
/// 127.0.0.1 for the rest of the test; the page's URL.
async fn serve_page_with(json: Value) -> String {
    use axum::routing::get;
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/status.html")).unwrap();
    let app = axum::Router::new().route("/", get(move || async move { axum::response::Html(page) })).route(
        "/status.json",
        get(move || async move { ([(axum::http::header::CONTENT_TYPE, "application/json")], json.to_string()) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/")
}

/// The text of the element with `data-figure="name"`, as the page shows it.
fn figure_text(page: &Page, name: &str) -> String {
    let at = page.html.find(&format!("data-figure=\"{name}\"")).unwrap_or_else(|| panic!("no {name}"));
    let after = &page.html[at..];
    let text = &after[after.find('>').unwrap() + 1..];
    text[..text.find('<').unwrap()].replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&")
}

/// The page against `/status.json` (taken just before it) and `/metrics` (taken just
/// before and after it), on an idle member.
fn assert_page_matches(page: &Page, json: &Value, before: &str, after: &str, batch: i64) {
    let metric = |name: &str, labels: &[&str]| {
        let (b, a) = (metric_value(before, name, labels), metric_value(after, name, labels));
        assert_eq!(b, a, "{name}{labels:?} moved while the member was idle");
        b
    };
    for k in ["client_id", "group", "topic", "version"] {
        assert_eq!(page.figure(k).value(), json["member"][k], "{k}");
    }
    assert_eq!(page.figure("ready").value(), true);
    assert_eq!(metric("clickagg_ready", &[]), 1.0);

    // Partitions: the same rows, the same values, and the ones /metrics has.
    let rows = page.partitions();
    let parts = json["partitions"].as_array().unwrap();
    assert_eq!(rows.len(), parts.len());
    assert_eq!(rows.len() as f64, metric("clickagg_assigned_partitions", &[]));
    assert_eq!(page.figure("assigned_partitions").value(), parts.len());
    for p in parts {
        let n = p["partition"].as_i64().unwrap();
        let row = &rows[&n];
        let label = format!("partition=\"{n}\"");
        for field in ["partition", "scope", "committed_offset", "lag", "open_batch_start", "last_read_offset"] {
            assert_eq!(row[field].value(), p[field], "partition {n}: {field}");
        }
        assert_eq!(f64_of(&p["committed_offset"]), metric("clickagg_committed_offset", &[&label]), "partition {n}");
        assert_eq!(f64_of(&p["lag"]), metric("clickagg_consumer_lag", &[&label]), "partition {n}");
        // Idle: everything read is flushed and committed, and the open batch is the
        // offset-aligned one the next record falls in, which may already be part-flushed.
        let committed = p["committed_offset"].as_i64().unwrap();
        assert_eq!(p["open_batch_start"], committed - committed % batch, "partition {n}: idle, open batch");
        assert_eq!(p["scope"], "shared");
        // Flushes go on every interval while idle: the page's lies between the two reads.
        let at: f64 = serde_json::from_str(row["last_flush_age_seconds"].attr("data-at").unwrap()).unwrap();
        let label = [label.as_str()];
        let (b, a) = (
            metric_value(before, "clickagg_last_flush_timestamp_seconds", &label),
            metric_value(after, "clickagg_last_flush_timestamp_seconds", &label),
        );
        assert!(b <= at && at <= a, "partition {n}: last flush at {at}, /metrics said {b} then {a}");
    }
    let lag: f64 = parts.iter().map(|p| f64_of(&p["lag"])).sum();
    assert_eq!(f64_of(&page.figure("total_lag").value()), lag);

    // Counters: totals are /metrics' counters; an idle member's rates are 0.
    for (figure, name) in [
        ("records", "clickagg_records_consumed_total"),
        ("counted", "clickagg_clicks_counted_total"),
        ("duplicates", "clickagg_duplicates_dropped_total"),
    ] {
        assert_eq!(page.figure(&format!("{figure}_total")).value(), json["totals"][figure], "{figure}");
        assert_eq!(f64_of(&json["totals"][figure]), metric(name, &[]), "{figure}");
        assert_eq!(f64_of(&page.figure(&format!("{figure}_per_second")).value()), 0.0, "{figure}");
    }
    let dead_letters = metric("clickagg_dead_letters_produced_total", &[]);
    assert!(dead_letters > 0.0, "the backlog has rejected records");
    assert_eq!(f64_of(&page.figure("dead_letters_total").value()), dead_letters);
    let shown: BTreeMap<String, f64> = page
        .elements
        .iter()
        .filter(|e| e.attr("data-figure") == Some("dead_letters_per_second") && e.attr("data-reason").is_some())
        .map(|e| (e.attr("data-reason").unwrap().to_string(), e.attr("data-total").unwrap().parse().unwrap()))
        .collect();
    let seen: BTreeMap<String, f64> = clickagg::click::RejectReason::ALL
        .iter()
        .map(|r| {
            (r.as_str().to_string(), metric("clickagg_dead_letters_produced_total", &[&format!("reason=\"{r}\"")]))
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    assert_eq!(shown, seen, "every reason with dead letters, with its count");

    // Freshness and the clicks per minute: the JSON's, and every counted click durable
    // in the minute of its record timestamp (all within the last hour).
    for q in ["p50", "p99"] {
        let figure = page.figure(&format!("freshness_{q}_seconds"));
        assert_eq!(f64_of(&figure.value()), f64_of(&json["freshness"][format!("{q}_seconds")]), "freshness {q}");
        let more_than = json["freshness"][format!("{q}_more_than")].as_bool().unwrap();
        assert_eq!(figure.attr("data-more-than"), Some(if more_than { "true" } else { "false" }), "freshness {q}");
        let text = figure_text(page, &format!("freshness_{q}_seconds"));
        assert_eq!(text.starts_with("> "), more_than, "freshness {q}: {text}");
    }
    let minutes = json["clicks_per_minute"].as_array().unwrap();
    let spark = page.figure("clicks_per_minute");
    assert_eq!(spark.attr("data-points").unwrap(), minutes.len().to_string());
    let drawn: Vec<(String, u64)> = page
        .elements
        .iter()
        .filter(|e| e.tag == "rect" && e.attr("data-minute").is_some())
        .map(|e| (e.attr("data-minute").unwrap().to_string(), e.attr("data-clicks").unwrap().parse().unwrap()))
        .collect();
    let listed: Vec<(String, u64)> =
        minutes.iter().map(|m| (m["minute"].as_str().unwrap().to_string(), m["clicks"].as_u64().unwrap())).collect();
    assert_eq!(drawn, listed);
    assert!(listed.len() >= 40, "45 minutes of record time: {}", listed.len());
    assert_eq!(listed.iter().map(|m| m.1).sum::<u64>() as f64, metric("clickagg_clicks_counted_total", &[]));
}

/// `clickagg status` with this test's settings: (exit code, stdout).
async fn group_status(env: &TestEnv, args: &[&str]) -> (i32, String) {
    let mut cmd = env.command(&[&["status"], args].concat(), &[]);
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run clickagg status")).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        matches!(out.status.code(), Some(0 | 4)),
        "clickagg status failed: {:?}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap(), stdout)
}

async fn group_status_json(env: &TestEnv, stall_after: &str) -> (i32, Value) {
    let (code, out) = group_status(env, &["--format", "json", "--stall-after", stall_after]).await;
    (code, serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}")))
}

/// The partitions the group's description gives `client_id`.
fn owned_by(status: &Value, client_id: &str) -> BTreeSet<i64> {
    status["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["owner"] == client_id)
        .map(|p| p["partition"].as_i64().unwrap())
        .collect()
}

async fn client_id(member: &Member) -> String {
    let s = status_json(&member.http_addr().await).await;
    s["member"]["client_id"].as_str().unwrap().to_string()
}

/// Two members share the partitions and everything moves (exit 0); one is killed with
/// SIGKILL and, while the group still lists it (its session has not timed out), its
/// partitions stop moving: `clickagg status` names it as their owner, calls them
/// stalled and exits 4, while the other member's keep moving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clickagg_status_shows_a_killed_members_partitions_stalled_and_the_others_moving() {
    let env = TestEnv::new("groupstatus").await;
    let producer = env.spawn_producer(&live(9_000, 90, 63), 4, 100);
    // A long session: the group keeps the killed member and its partitions for 2 minutes.
    let mut a = env.spawn("a", &["run"], &[("CLICKAGG__KAFKA__SESSION_TIMEOUT", "120s")]);
    a.wait_for_line("partitions assigned", 0, SETTLE).await;
    let mut b = env.spawn_member("b");
    let (a_id, b_id) = (client_id(&a).await, client_id(&b).await);
    assert_ne!(a_id, b_id, "client IDs name the process");

    let healthy = wait_until("both members own partitions and none stalled", SETTLE, || async {
        let (code, s) = group_status_json(&env, "5s").await;
        let (a_parts, b_parts) = (owned_by(&s, &a_id), owned_by(&s, &b_id));
        let everything_moves = s["partitions"].as_array().unwrap().iter().all(|p| p["state"] != "stalled");
        if code == 0
            && everything_moves
            && !a_parts.is_empty()
            && !b_parts.is_empty()
            && a_parts.len() + b_parts.len() == 4
        {
            Ok((a_parts, b_parts))
        } else {
            Err(format!("exit {code}: {s}"))
        }
    })
    .await;
    let (a_parts, b_parts) = healthy;

    a.kill9().await;
    let stalled = wait_until("the killed member's partitions stall", SETTLE, || async {
        let (code, s) = group_status_json(&env, "5s").await;
        let stalled: BTreeSet<i64> = s["stalled"].as_array().unwrap().iter().map(|p| p.as_i64().unwrap()).collect();
        if code == 4 && stalled == a_parts && owned_by(&s, &a_id) == a_parts {
            Ok(s)
        } else {
            Err(format!("exit {code}, stalled {stalled:?}, want {a_parts:?}: {s}"))
        }
    })
    .await;
    for p in stalled["partitions"].as_array().unwrap() {
        let n = p["partition"].as_i64().unwrap();
        if b_parts.contains(&n) {
            assert_eq!(p["owner"], b_id.as_str());
            assert_ne!(p["state"], "stalled", "the live member's partitions keep moving: {p}");
        } else {
            assert!(p["waiting_records"].as_i64().unwrap() > 0, "{p}");
            assert!(p["last_flush_age_seconds"].as_u64().is_none_or(|a| a > 5), "{p}");
        }
    }
    assert!(stalled["members"].as_array().unwrap().iter().any(|m| m["client_id"] == a_id.as_str()));

    // The table a person reads says the same.
    let (code, table) = group_status(&env, &["--stall-after", "5s"]).await;
    assert_eq!(code, 4, "{table}");
    for line in table.lines().filter(|l| l.contains(&a_id) && l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
    {
        assert!(line.ends_with("STALLED"), "{line}\n{table}");
    }
    assert!(table.contains(&format!("{} partition", a_parts.len())) && table.contains("stalled:"), "{table}");
    println!("clickagg status with member {a_id} killed:\n{table}");
    producer.abort();
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
}

/// Every metric name the Grafana dashboard and the alerts use (`scripts/metric-names`)
/// is in a member's `/metrics`: a renamed or never-registered metric would leave an
/// empty panel or an alert that can never fire. Error counters must be there before
/// any error, at 0. And every one has the help text, build info and process metrics
/// a Prometheus user expects of a service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_use_is_exported_by_a_member_with_help_text() {
    let out = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/metric-names"))
        .output()
        .expect("run scripts/metric-names");
    assert!(out.status.success());
    let names: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();
    assert!(names.len() >= 20 && names.contains(&"clickagg_ready".to_string()), "{names:?}");

    let env = TestEnv::new("metricnames").await;
    let (records, _) = env.plan(Spec { count: 2_000, seed: 64, ..Spec::default() });
    env.send(&records, 2, None).await;
    let mut member = env.spawn_member("m");
    // Per-partition series come with partitions, flushes and librdkafka's statistics.
    wait_until("every name is exported", SETTLE, || async {
        let text = member.http_get("/metrics").await.1;
        let exported = |name: &str| {
            text.lines()
                .any(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        };
        let missing: Vec<&String> = names.iter().filter(|n| !exported(n)).collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("missing {missing:?}"))
        }
    })
    .await;
    let text = member.http_get("/metrics").await.1;
    for op in ["client", "consume", "commit", "dead_letter"] {
        assert!(text.contains(&format!("clickagg_kafka_errors_total{{op=\"{op}\"}}")), "op {op}");
    }
    assert_fits_prometheus(&text);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// `/metrics` as Prometheus expects it of a service: every `clickagg_` metric family
/// (a histogram's `_bucket`, `_sum` and `_count` are one) with `# HELP` text and a
/// `# TYPE`, `clickagg_build_info` = 1 with the version, and the standard process
/// metrics.
fn assert_fits_prometheus(text: &str) {
    let comments = |kind: &str| -> BTreeSet<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("# {kind} ")))
            .filter_map(|l| {
                let (name, rest) = l.split_once(' ')?;
                (!rest.trim().is_empty()).then(|| name.to_string())
            })
            .collect()
    };
    let (helped, typed) = (comments("HELP"), comments("TYPE"));
    let families: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with("clickagg_"))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|name| {
            let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s));
            match family {
                Some(f) if typed.contains(f) && !typed.contains(name) => f.to_string(),
                _ => name.to_string(),
            }
        })
        .collect();
    assert!(families.len() >= 30, "{families:?}");
    let unhelped: Vec<&String> = families.iter().filter(|f| !helped.contains(*f)).collect();
    assert!(unhelped.is_empty(), "no # HELP for {unhelped:?}");
    let untyped: Vec<&String> = families.iter().filter(|f| !typed.contains(*f)).collect();
    assert!(untyped.is_empty(), "no # TYPE for {untyped:?}");

    let build = text.lines().find(|l| l.starts_with("clickagg_build_info{")).expect("clickagg_build_info");
    assert!(build.ends_with(" 1"), "{build}");
    assert!(build.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))), "{build}");
    assert!(build.contains("rustc=\"1."), "the compiler's version: {build}");

    for name in
        ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "process_start_time_seconds"]
    {
        let value = crate::helpers::metric_value(text, name, &[]);
        assert!(helped.contains(name), "no # HELP for {name}");
        match name {
            "process_resident_memory_bytes" => assert!(value > 1e6, "{name} {value}"),
            "process_open_fds" => assert!(value >= 3.0, "{name} {value}"),
            // Started within the last hour, by the wall clock.
            "process_start_time_seconds" => {
                let now = chrono::Utc::now().timestamp() as f64;
                assert!(value <= now && value > now - 3600.0, "{name} {value}")
            }
            _ => assert!(value >= 0.0, "{name} {value}"),
        }
    }
}
