//! Avro and Protobuf in the Confluent wire format, end to end: records under two
//! revisions of a schema (a field added mid-topic), records naming a schema ID nobody
//! has, and every other reject class of the format, counted exactly against the
//! generator's truth while members are killed with SIGKILL mid-stream; each bad record
//! gets a dead letter with its reason, none is lost. Schemas come from schema files by
//! ID (`source.schema_files`), the schema source this machine can run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand::Rng;

use clickagg::aggregate::BucketKey;
use clickagg::click::RejectReason;
use clickagg::produce::{self, Encoding, Kind, Spec};

use crate::helpers::{read_dead_letters, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);

/// Produces `before` records under schema revision 1 and then `after` under revision
/// 2 (another ID) while members are killed with SIGKILL, and checks the counts and the
/// dead letters.
async fn counts_exactly_through_kills_and_an_evolution(name: &str, format: &str, encoding: fn(u32, u8) -> Encoding) {
    let mut env = TestEnv::new(name).await;
    let schemas = env.log_dir.join("schemas");
    let (v1, v2) = (encoding(11, 1), encoding(12, 2));
    produce::write_schema_file(&schemas, v1).unwrap();
    produce::write_schema_file(&schemas, v2).unwrap();
    env.extra_env.extend([
        ("CLICKAGG__SOURCE__FORMAT".to_string(), format.to_string()),
        ("CLICKAGG__SOURCE__SCHEMA_FILES".to_string(), schemas.display().to_string()),
    ]);

    let base =
        Spec { count: 30_000, duplicate_ratio: 0.1, retry_drift_ratio: 0.3, malformed_ratio: 0.01, ..Spec::default() };
    let (mut records, first) = env.plan(Spec { seed: 31, encoding: v1, ..base.clone() });
    let (later, second) = env.plan(Spec { seed: 32, encoding: v2, ..base });
    records.extend(later);
    let mut truth: BTreeMap<BucketKey, u64> = first.counts.clone();
    for (k, n) in &second.counts {
        *truth.entry(*k).or_default() += n;
    }
    let mut malformed = first.malformed.clone();
    for (r, n) in &second.malformed {
        *malformed.entry(*r).or_default() += n;
    }
    assert!(malformed[&RejectReason::UnknownSchema] > 0, "records naming an unknown schema ID: {malformed:?}");

    // Produce while the members consume, so every kill lands mid-stream; static
    // membership gives a restarted member its partitions back at once.
    let producer = env.spawn_producer(&records, 4, 5_000);
    let extra = [("CLICKAGG__KAFKA__GROUP_INSTANCE_ID", "member-0")];
    for round in 0..3 {
        let mut member = env.spawn(&format!("m{round}"), &["run"], &extra);
        member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
        let ms = rand::rng().random_range(300..2_000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        member.kill9().await;
    }
    let mut last = env.spawn("last", &["run"], &extra);
    producer.await.unwrap();
    env.assert_counts_converge(&truth, CONVERGE).await;

    // Every bad record has a letter with its reason (a killed member may have sent one
    // twice: letters are told apart by the source position they name).
    let bad: usize = malformed.values().map(|&n| n as usize).sum();
    let letters = read_dead_letters(&env, bad).await;
    let mut by_reason: BTreeMap<String, BTreeSet<(i32, i64)>> = BTreeMap::new();
    for dl in &letters {
        by_reason.entry(dl.headers["clickagg-reason"].clone()).or_default().insert(dl.source());
    }
    let got: BTreeMap<String, u64> = by_reason.iter().map(|(r, s)| (r.clone(), s.len() as u64)).collect();
    let want: BTreeMap<String, u64> = malformed.iter().map(|(r, n)| (r.as_str().to_string(), *n)).collect();
    assert_eq!(got, want, "one dead letter per bad record, with its reason");
    assert!(records.iter().filter(|r| matches!(r.kind, Kind::Malformed(_))).count() == bad);
    assert!(last.metric("clickagg_schemas_fetched_total", &[]).await >= 2.0, "both schema IDs (and the unknown one)");
    assert_eq!(last.terminate(Duration::from_secs(30)).await, 0);

    // A replay decides every record again the same way, from the schemas alone.
    env.replay_checked("replay", "earliest", &truth).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_counts_exactly_through_sigkill_a_schema_evolution_and_unknown_schema_ids() {
    counts_exactly_through_kills_and_an_evolution("fmt_avro", "avro", |id, revision| Encoding::Avro { id, revision })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_counts_exactly_through_sigkill_a_schema_evolution_and_unknown_schema_ids() {
    counts_exactly_through_kills_and_an_evolution("fmt_proto", "protobuf", |id, revision| Encoding::Protobuf {
        id,
        revision,
    })
    .await;
}

/// JSON as ad servers send it: nested fields, ad IDs as strings, epoch seconds read by
/// `auto`, counted as the flat form would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_json_with_string_ad_ids_and_epoch_seconds_counts_exactly() {
    let mut env = TestEnv::new("fmt_json_paths").await;
    env.extra_env.extend(
        [
            ("CLICKAGG__VALIDATION__FIELDS__CLICK_ID", "event.id"),
            ("CLICKAGG__VALIDATION__FIELDS__AD_ID", "ad.id"),
            ("CLICKAGG__VALIDATION__FIELDS__TS", "event.time"),
            ("CLICKAGG__VALIDATION__TS_UNIT", "auto"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let (mut records, truth) = env.plan(Spec { count: 5_000, malformed_ratio: 0.0, seed: 33, ..Spec::default() });
    for r in &mut records {
        let c = clickagg::click::decode(Some(&r.payload), Some(r.timestamp_ms), &Default::default()).unwrap();
        // Whole seconds: the event time as a producer stamping seconds sends it.
        let secs = c.ts_ms.div_euclid(1000);
        r.payload = format!(
            r#"{{"event":{{"id":"{}","time":{secs},"kind":"click"}},"ad":{{"id":"{}"}},"click_id":"ignored"}}"#,
            c.click_id, c.ad_id
        )
        .into_bytes();
    }
    // The truth of the re-stamped records: the first sighting of each click ID counts.
    let mut seen = std::collections::HashSet::new();
    let mut counts: BTreeMap<BucketKey, u64> = BTreeMap::new();
    let limits = clickagg::click::Limits {
        fields: clickagg::click::Fields {
            click_id: clickagg::click::FieldPath::parse("event.id").unwrap(),
            ad_id: clickagg::click::FieldPath::parse("ad.id").unwrap(),
            ts: clickagg::click::FieldPath::parse("event.time").unwrap(),
        },
        ts_unit: clickagg::click::TsUnit::Auto,
        ..Default::default()
    };
    for r in &records {
        let c = clickagg::click::decode(Some(&r.payload), Some(r.timestamp_ms), &limits).unwrap();
        if seen.insert(c.click_id.clone()) {
            *counts.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
        }
    }
    assert_eq!(counts.values().sum::<u64>(), truth.clicks, "every click still counts once");
    env.send(&records, 2, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&counts, CONVERGE).await;
    assert_eq!(member.metric("clickagg_dead_letters_produced_total", &[]).await, 0.0);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}
