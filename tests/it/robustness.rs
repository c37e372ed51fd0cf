//! Never stall, never leak: hostile records, ClickHouse errors that no retry fixes,
//! dead letters that cannot be written as they are, and secrets in service URLs.

use std::collections::BTreeMap;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::Minute;
use clickagg::produce::{Kind, Planned, Spec};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::bindings::{rd_kafka_header_add, rd_kafka_headers_t};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{BorrowedHeaders, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

use crate::helpers::{read_dead_letters, source_payload, wait_until, PrivateStack, TestEnv};

const CONVERGE: Duration = Duration::from_secs(120);

/// Produces one record exactly as given — up to 2 MB, with any headers — and returns
/// its offset. (The product's producer keeps to the click format and to 1 MB.)
async fn produce_raw(env: &TestEnv, partition: i32, key: &[u8], payload: &[u8], headers: OwnedHeaders) -> i64 {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.brokers)
        .set("message.max.bytes", "2000000")
        .create()
        .expect("a Kafka producer");
    let record = FutureRecord::to(&env.topic)
        .partition(partition)
        .key(key)
        .payload(payload)
        .headers(headers)
        .timestamp(chrono::Utc::now().timestamp_millis());
    let delivery = producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e).expect("produce");
    delivery.offset
}

/// Headers with one header whose key is `key`, bytes rdkafka's API cannot send (its
/// keys are `&str`), but any other producer can.
fn headers_with_raw_key(key: &[u8], value: &[u8]) -> OwnedHeaders {
    let headers = OwnedHeaders::new();
    // rdkafka's BorrowedHeaders is a zero-sized view placed at the address of the
    // librdkafka headers object; rdkafka reads it the same way.
    let native = headers.as_borrowed() as *const BorrowedHeaders as *mut rd_kafka_headers_t;
    let err = unsafe {
        rd_kafka_header_add(
            native,
            key.as_ptr().cast(),
            key.len() as isize,
            value.as_ptr().cast(),
            value.len() as isize,
        )
    };
    assert_eq!(err as i32, 0, "rd_kafka_header_add");
    headers
}

/// rdkafka's header accessor panics on a key that is not UTF-8; a member reading such a
/// record must still dead-letter it and keep counting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_record_whose_header_key_is_not_utf8_is_dead_lettered_and_counting_goes_on() {
    let mut env = TestEnv::new("hdrkey").await;
    env.batch_offsets = 10;
    let (records, truth) = env.plan(Spec { count: 200, malformed_ratio: 0.0, seed: 61, ..Spec::default() });
    env.send(&records[..100], 1, None).await;
    let offset = produce_raw(&env, 0, b"bad", b"not json", headers_with_raw_key(b"k\xff\xfe", b"v")).await;
    env.send(&records[100..], 1, None).await;

    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    let letters = read_dead_letters(&env, 1).await;
    assert_eq!(letters.len(), 1);
    let dl = &letters[0];
    assert_eq!(dl.headers["clickagg-reason"], "malformed_json");
    assert_eq!(dl.headers["clickagg-source-offset"], offset.to_string());
    // The key is carried as far as UTF-8 can carry it; the value as it was.
    assert_eq!(dl.headers["k\u{fffd}\u{fffd}"], "v", "{:?}", dl.headers);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// A backfill of 150 months read in one poll batch becomes one flush over 150 of the
/// table's monthly partitions. Current ClickHouse refuses an INSERT over more than 100
/// (code 252) on every retry, so the flush must be split; 18.16 takes either, and the
/// counts must come out exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_over_150_months_is_written_and_counted() {
    let env = TestEnv::new("months").await;
    let mut records = Vec::new();
    let mut truth = BTreeMap::new();
    for m in 0..150u32 {
        let start = chrono::NaiveDate::from_ymd_opt(2012 + (m / 12) as i32, m % 12 + 1, 1).unwrap();
        // Mid-month, so the minute is in that month in every time zone's reading.
        let ts = start.and_hms_opt(0, 0, 0).unwrap().and_utc().timestamp_millis() + 14 * 86_400_000;
        for copy in 0..2 {
            let click_id = format!("month-{m}");
            let payload = format!(r#"{{"click_id":"{click_id}","ad_id":{m},"ts":{ts}}}"#).into_bytes();
            let kind = if copy == 0 { Kind::Click } else { Kind::Duplicate };
            records.push(Planned { key: click_id, payload, timestamp_ms: ts + copy, kind, partition: Some(0) });
        }
        let minute = Minute::from_millis(ts).unwrap();
        truth.insert(BucketKey { ad_id: u64::from(m), minute }, 1);
    }
    env.send(&records, 1, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// A record of about 1 MB is rejected as oversized; its dead letter would be the record
/// plus headers, over the producer's 1 MB `message.max.bytes`, and must still be
/// produced — without the payload, pointing back at the record — while counting goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_record_of_1_mb_is_dead_lettered_without_its_payload_and_counting_goes_on() {
    let mut env = TestEnv::new("dlbig").await;
    env.batch_offsets = 10;
    let (records, truth) = env.plan(Spec { count: 200, malformed_ratio: 0.0, seed: 62, ..Spec::default() });
    env.send(&records[..100], 1, None).await;
    let ts = chrono::Utc::now().timestamp_millis();
    let head = format!(r#"{{"click_id":"big","ad_id":1,"ts":{ts},"pad":""#);
    let payload = format!("{head}{}\"}}", "p".repeat(1_000_000 - head.len() - 2));
    assert_eq!(payload.len(), 1_000_000);
    let offset = produce_raw(&env, 0, b"big", payload.as_bytes(), OwnedHeaders::new()).await;
    env.send(&records[100..], 1, None).await;

    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    let letters = read_dead_letters(&env, 1).await;
    assert_eq!(letters.len(), 1);
    let dl = &letters[0];
    assert_eq!(dl.headers["clickagg-reason"], "oversized");
    assert_eq!(dl.payload, None, "the payload is left out");
    assert_eq!(dl.headers["clickagg-payload-omitted"], "1000000", "{:?}", dl.headers);
    // The source position leads back to the record, still in the topic.
    assert_eq!(dl.headers["clickagg-source-offset"], offset.to_string());
    assert_eq!(source_payload(&env, 0, offset).await.map(|p| p.len()), Some(1_000_000));
    wait_until("the commit passes the oversized record", Duration::from_secs(30), || async {
        match env.committed_offsets().await[&0] {
            c if c > offset => Ok(()),
            c => Err(format!("committed {c}")),
        }
    })
    .await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// A dead-letter topic the member may not write to is an operator's mistake no retry
/// fixes: the member stops, names the setting, and commits nothing past the bad record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_topic_without_write_permission_stops_the_member_naming_the_setting() {
    let stack = PrivateStack::start_configured("dlacl", &["kafka"], &[], &[("KAFKA_AUTHORIZER", "1")]).await;
    let mut env = TestEnv::with_stack("dlacl", &stack).await;
    env.batch_offsets = 10;
    let dlq = format!("{}.dlq", env.topic);
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &env.brokers).create().unwrap();
    let topic = NewTopic::new(&dlq, 1, TopicReplication::Fixed(1));
    admin.create_topics([&topic], &AdminOptions::new()).await.unwrap().pop().unwrap().unwrap();
    // Describe stays allowed, so the member starts; only writing is denied.
    stack
        .kafka_acls(&["--add", "--allow-principal", "User:ANONYMOUS", "--operation", "Describe", "--topic", &dlq])
        .await;
    stack.kafka_acls(&["--add", "--deny-principal", "User:ANONYMOUS", "--operation", "Write", "--topic", &dlq]).await;

    let (mut records, _) = env.plan(Spec { count: 100, malformed_ratio: 0.0, seed: 63, ..Spec::default() });
    let ts = records[50].timestamp_ms;
    let bad = Planned {
        key: "bad".into(),
        payload: b"not json".to_vec(),
        timestamp_ms: ts,
        kind: Kind::Malformed(clickagg::click::RejectReason::MalformedJson),
        partition: None,
    };
    records.insert(50, bad);
    env.send(&records, 1, None).await;

    let mut member = env.spawn_member("m");
    let code = member.wait(Duration::from_secs(120)).await;
    let out = member.output();
    assert_eq!(code, 1, "a dead-letter topic it may not write is fatal:\n{out}");
    assert!(out.contains("dead_letter.topic") && out.contains("WRITE"), "names the setting and the ACL:\n{out}");
    let committed = env.committed_offsets().await.get(&0).copied().unwrap_or(-1);
    assert!(committed <= 50, "committed {committed}, past the record that was not dead-lettered");
}

/// A dead-letter topic may hold letters to a smaller `max.message.bytes` than the
/// producer's: the letters the broker refuses go again without the record's parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_topic_with_a_smaller_size_limit_gets_the_letter_without_the_payload() {
    let mut env = TestEnv::new("dlsmall").await;
    env.batch_offsets = 10;
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &env.brokers).create().unwrap();
    let dlq = format!("{}.dlq", env.topic);
    let topic = NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)).set("max.message.bytes", "100000");
    admin.create_topics([&topic], &AdminOptions::new()).await.unwrap().pop().unwrap().unwrap();
    let (records, truth) = env.plan(Spec { count: 100, malformed_ratio: 0.0, seed: 64, ..Spec::default() });
    env.send(&records[..50], 1, None).await;
    // Random bytes: compression must not shrink the letter below the topic's limit.
    let payload: Vec<u8> = (0..200_000).map(|_| rand::random::<u8>()).collect();
    let offset = produce_raw(&env, 0, b"big", &payload, OwnedHeaders::new()).await;
    env.send(&records[50..], 1, None).await;

    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    let letters = read_dead_letters(&env, 1).await;
    assert_eq!(letters.len(), 1);
    let dl = &letters[0];
    assert_eq!(
        (dl.payload.as_ref(), dl.headers.get("clickagg-payload-omitted").map(String::as_str)),
        (None, Some("200000"))
    );
    assert_eq!(dl.headers["clickagg-source-offset"], offset.to_string());
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// Credentials and query parameters in `clickhouse.url` and `redis.url` reach their
/// services and nothing else: not `clickagg config`, not the logs or errors of
/// `migrate` and `run` (connecting or not), not `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_in_service_urls_never_appear_in_config_logs_errors_or_metrics() {
    let stack = PrivateStack::start("urlsecret", &["redis"]).await;
    let env = TestEnv::with_stack("urlsecret", &stack).await;
    // Markers: each may appear in no output at all.
    let redis_pw = format!("redis-url-pw-{:016x}", rand::random::<u64>());
    let query_marker = format!("query-marker-{:016x}", rand::random::<u64>());
    let ch_pw = "clickagg-local-password"; // the stack's ClickHouse user `clickagg`
    let markers = [redis_pw.as_str(), query_marker.as_str(), ch_pw];
    {
        // Redis's only user is an ACL user whose password is a marker.
        let mut c = env.redis().await;
        let acl = ["SETUSER", "clickagg", "on", &format!(">{redis_pw}"), "~*", "+@all"];
        let _: () = redis::cmd("ACL").arg(&acl[..]).query_async(&mut c).await.unwrap();
        let _: () = redis::cmd("ACL").arg(&["SETUSER", "default", "off"][..]).query_async(&mut c).await.unwrap();
    }
    let redis_hp = env.redis_url.trim_start_matches("redis://").trim_end_matches('/').to_string();
    let ch_hp = env.clickhouse_url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let redis_good = format!("redis://clickagg:{redis_pw}@{redis_hp}/?client_tag={query_marker}");
    let redis_bad = format!("redis://clickagg:wrong-{redis_pw}@{redis_hp}/");
    let ch_userinfo = format!("http://clickagg:{ch_pw}@{ch_hp}/");
    let ch_query = format!("http://{ch_hp}/?user=clickagg&password={ch_pw}");
    let ch_wrong = format!("http://{ch_hp}/?user=clickagg&password=wrong-{query_marker}");
    let ch_closed = format!("http://clickagg:{ch_pw}@127.0.0.1:1/");
    let ch_unsupported = format!("http://{ch_hp}/?user=clickagg&password={ch_pw}&max_threads={query_marker}");

    let run = |label: &str, args: &[&str], redis_url: &str, clickhouse_url: &str| {
        let extra = [("CLICKAGG__REDIS__URL", redis_url), ("CLICKAGG__CLICKHOUSE__URL", clickhouse_url)];
        env.spawn(label, args, &extra)
    };
    let assert_clean = |what: &str, output: &str| {
        for m in &markers {
            assert!(!output.contains(m), "{what} printed a secret from a URL:\n{output}");
        }
    };

    // The effective configuration shows where, never with what.
    let mut config = run("config", &["config"], &redis_good, &ch_query);
    assert_eq!(config.wait(Duration::from_secs(30)).await, 0, "{}", config.output());
    let printed = config.output();
    assert_clean("config", &printed);
    assert!(printed.contains("?user=[redacted]&password=[redacted]"), "{printed}");
    assert!(printed.contains(&redis_hp) && printed.contains(&ch_hp), "the hosts stay visible:\n{printed}");

    // migrate with credentials in the query and in the user info; a wrong password; no server.
    for (label, url, want) in [
        ("migrate-query", &ch_query, 0),
        ("migrate-userinfo", &ch_userinfo, 0),
        ("migrate-wrong", &ch_wrong, 1),
        ("migrate-closed", &ch_closed, 1),
    ] {
        let mut m = run(label, &["migrate"], &redis_good, url);
        assert_eq!(m.wait(Duration::from_secs(60)).await, want, "{label}:\n{}", m.output());
        assert_clean(label, &m.output());
    }
    let mut m = run("migrate-unsupported", &["migrate"], &redis_good, &ch_unsupported);
    assert_eq!(m.wait(Duration::from_secs(30)).await, 2, "{}", m.output());
    assert!(m.output().contains("max_threads"), "names the parameter:\n{}", m.output());
    assert_clean("migrate-unsupported", &m.output());

    // run: connecting with both URLs, its logs and metrics.
    let (records, truth) = env.plan(Spec { count: 2_000, seed: 65, ..Spec::default() });
    env.send(&records, 2, None).await;
    let mut member = run("run", &["run"], &redis_good, &ch_userinfo);
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    let (_, metrics) = member.http_get("/metrics").await;
    assert_clean("/metrics", &metrics);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
    assert_clean("run", &member.output());

    // run: refused by ClickHouse, and by Redis (at the first poll batch).
    let mut bad = run("run-wrong-clickhouse", &["run"], &redis_good, &ch_wrong);
    assert_eq!(bad.wait(Duration::from_secs(90)).await, 1, "{}", bad.output());
    assert_clean("run-wrong-clickhouse", &bad.output());
    let mut bad = run("run-wrong-redis", &["run"], &redis_bad, &ch_query);
    env.send(&records[..10], 2, None).await;
    assert_eq!(bad.wait(Duration::from_secs(90)).await, 1, "{}", bad.output());
    assert_clean("run-wrong-redis", &bad.output());
}

// Regression (issue 35): ClickHouse 18.16 answers a query that fails after its first
// block went out (past its 1 MiB response buffer) with HTTP 200, the rows, and then the
// exception as plain text. The client recognises only current servers' endings, and
// RowBinary without validation decoded the text as rows: a read returned Ok with a
// made-up tail (a seal could record hours as empty). Both servers must answer an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_that_fails_after_its_first_block_is_an_error_on_18_16_and_on_the_current_server() {
    let stack = PrivateStack::start("late18", &["clickhouse18"]).await;
    let servers = [("18.16", stack.clickhouse_url().unwrap()), ("current", crate::helpers::env::clickhouse_url())];
    // 3 MB of one-byte rows before the failure, in blocks of 64 Ki: well past the first
    // buffer; every byte of an exception text then decodes as a row.
    let sql = "SELECT throwIf(number = 3000000) FROM system.numbers LIMIT 6000000 SETTINGS max_block_size = 65536";
    for (server, url) in servers {
        let settings = clickagg::config::ClickHouseSettings {
            url: clickagg::secrets::SecretUrl::new(url),
            database: "system".into(),
            ..Default::default()
        };
        let sink = clickagg::sink::Sink::new(&settings);
        match sink.client().query(sql).fetch_all::<u8>().await {
            Ok(rows) => panic!("{server}: a failed query read as {} rows", rows.len()),
            Err(e) => assert!(e.to_string().contains("Code: 395"), "{server}: the server's exception: {e}"),
        }
    }
}
