//! Every rejected record reaches the dead-letter topic with its raw bytes and headers
//! naming the reason and its source position; its partition keeps moving and the valid
//! clicks around it are counted exactly. One test per bad-input class.

use std::time::Duration;

use clickagg::click::RejectReason;
use clickagg::produce::{Planned, Spec};

use crate::helpers::{positions_of_keys, read_dead_letters, source_payload, wait_until, TestEnv};

/// Sends valid clicks with three bad records of one class among them, runs a member,
/// and checks the dead letters, the counts and the committed offsets.
async fn rejects(name: &str, reason: RejectReason, bad: impl Fn(i64) -> Vec<u8>) {
    let mut env = TestEnv::new(name).await;
    env.batch_offsets = 10; // small batches, so commits move past the bad records
    let (mut records, truth) = env.plan(Spec { count: 400, malformed_ratio: 0.0, seed: 21, ..Spec::default() });
    for (i, at) in [40usize, 120, 200].into_iter().enumerate() {
        let ts = records[at].timestamp_ms;
        let payload = bad(ts);
        records.insert(
            at,
            Planned {
                key: format!("bad-{i}"),
                payload,
                timestamp_ms: ts,
                kind: clickagg::produce::Kind::Malformed(reason),
                partition: None,
            },
        );
    }
    env.send(&records, 2, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, Duration::from_secs(120)).await;

    // One letter for each bad record, naming it: read to the end of the topic, so that
    // a letter too many, or one for the wrong record, fails as well as one missing.
    let bad = positions_of_keys(&env, |k| k.starts_with(b"bad-")).await;
    assert_eq!(bad.len(), 3, "the bad records in the topic");
    let letters = read_dead_letters(&env, 3).await;
    let mut named: Vec<(i32, i64)> = letters.iter().map(|d| d.source()).collect();
    named.sort();
    assert_eq!(named, bad.into_iter().collect::<Vec<_>>(), "dead letters of {reason}");
    for dl in &letters {
        assert_eq!(dl.headers["clickagg-reason"], reason.as_str(), "{:?}", dl.headers);
        assert_eq!(dl.headers["clickagg-source-topic"], env.topic);
        assert_eq!(dl.headers["clickagg-origin"], "run");
        assert!(!dl.headers["clickagg-detail"].is_empty());
        let partition: i32 = dl.headers["clickagg-source-partition"].parse().unwrap();
        let offset: i64 = dl.headers["clickagg-source-offset"].parse().unwrap();
        // The headers point at the very record, and the raw bytes are kept as they were.
        assert_eq!(source_payload(&env, partition, offset).await, dl.payload, "{reason} at {partition}/{offset}");
        // Its partition kept moving: the commit passes the poison record.
        wait_until(
            &format!("partition {partition} commits past the {reason} record {offset}"),
            Duration::from_secs(30),
            || async {
                match env.committed_offsets().await[&partition] {
                    c if c > offset => Ok(()),
                    c => Err(format!("committed {c}")),
                }
            },
        )
        .await;
    }
    assert_eq!(member.metric("clickagg_invalid_records_total", &[&format!("reason=\"{reason}\"")]).await, 3.0);
    assert_eq!(member.metric("clickagg_dead_letters_produced_total", &[]).await, 3.0);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_is_dead_lettered() {
    rejects("dl_json", RejectReason::MalformedJson, |_| br#"{"click_id":"x","ad_id":"#.to_vec()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_of_the_wrong_type_is_dead_lettered() {
    rejects("dl_type", RejectReason::WrongType, |ts| {
        format!(r#"{{"click_id":"x","ad_id":"seven","ts":{ts}}}"#).into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_field_is_dead_lettered() {
    rejects("dl_missing", RejectReason::MissingField, |ts| format!(r#"{{"ad_id":7,"ts":{ts}}}"#).into_bytes()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_payload_is_dead_lettered() {
    rejects("dl_big", RejectReason::Oversized, |ts| {
        format!(r#"{{"click_id":"x","ad_id":7,"ts":{ts},"pad":"{}"}}"#, "p".repeat(70 * 1024)).into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_click_id_is_dead_lettered() {
    rejects("dl_emptyid", RejectReason::EmptyClickId, |ts| {
        format!(r#"{{"click_id":"","ad_id":7,"ts":{ts}}}"#).into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_click_id_is_dead_lettered() {
    rejects("dl_longid", RejectReason::ClickIdTooLong, |ts| {
        format!(r#"{{"click_id":"{}","ad_id":7,"ts":{ts}}}"#, "y".repeat(129)).into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timestamp_too_far_ahead_of_the_record_is_dead_lettered() {
    rejects("dl_ahead", RejectReason::TimestampAhead, |ts| {
        format!(r#"{{"click_id":"x","ad_id":7,"ts":{}}}"#, ts + 3_600_000).into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timestamp_too_far_behind_the_record_is_dead_lettered() {
    rejects("dl_behind", RejectReason::TimestampBehind, |ts| {
        format!(
            r#"{{"click_id":"x","ad_id":7,"ts":"{}"}}"#,
            chrono::DateTime::from_timestamp_millis(ts - 7 * 3_600_000).unwrap().to_rfc3339()
        )
        .into_bytes()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_is_not_utf8_is_dead_lettered() {
    rejects("dl_utf8", RejectReason::NotUtf8, |ts| {
        let mut b = b"{\"click_id\":\"\xc3\x28\",\"ad_id\":7,\"ts\":".to_vec();
        b.extend_from_slice(format!("{ts}}}").as_bytes());
        b
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_payload_is_dead_lettered() {
    rejects("dl_empty", RejectReason::EmptyPayload, |_| Vec::new()).await;
}
