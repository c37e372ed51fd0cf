//! Never stall, never leak: hostile records, ClickHouse errors that no retry fixes,
//! dead letters that cannot be written as they are, and secrets in service URLs.

use std::collections::BTreeMap;
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::Minute;
use clickagg::produce::{Kind, Planned, Spec};
use rdkafka::bindings::{rd_kafka_header_add, rd_kafka_headers_t};
use rdkafka::message::{BorrowedHeaders, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

use crate::helpers::{read_dead_letters, TestEnv};

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
