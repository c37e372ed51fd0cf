//! Avro and Protobuf in the Confluent wire format, end to end: records under two
//! revisions of a schema (a field added mid-topic), records naming a schema ID nobody
//! has, and every other reject class of the format, counted exactly against the
//! generator's truth while members are killed with SIGKILL mid-stream; each bad record
//! gets a dead letter with its reason, none is lost. Schemas come from the schema
//! registry `scripts/stack up` runs (Apicurio Registry, its Confluent-compatible API),
//! registered as a producer's serializer would and named by the IDs it gave, or from
//! schema files by ID (`source.schema_files`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand::Rng;

use clickagg::aggregate::BucketKey;
use clickagg::click::{Known, RejectReason, WireFormat};
use clickagg::config::{SecretUrl, SourceSettings};
use clickagg::produce::{self, Encoding, Kind, Spec, UNKNOWN_SCHEMA_ID};
use clickagg::record::RegistryError;
use clickagg::retry::Stopped;
use clickagg::schema_registry::SchemaRegistry;
use tokio_util::sync::CancellationToken;

use crate::helpers::registry::{register, registry_url, require_registry};
use crate::helpers::{read_dead_letters, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);

/// Where the members read the schemas from.
#[derive(Clone, Copy)]
enum Schemas {
    /// The stack's registry: both revisions registered under the topic's subject
    /// (`<topic>-value`), the second as a new version with a new ID.
    Registry,
    /// Files `<id>.avsc` / `<id>.proto` with the IDs 11 and 12.
    Files,
}

/// Produces `count` records under schema revision 1 and then as many under revision 2
/// (another ID) while members are killed with SIGKILL `kills` times, and checks the
/// counts and the dead letters.
async fn counts_exactly_through_kills_and_an_evolution(
    name: &str,
    format: &str,
    encoding: fn(u32, u8) -> Encoding,
    schemas: Schemas,
    count: u64,
    kills: usize,
) {
    let mut env = TestEnv::new(name).await;
    env.extra_env.push(("CLICKAGG__SOURCE__FORMAT".to_string(), format.to_string()));
    let (v1, v2) = match schemas {
        Schemas::Registry => {
            require_registry();
            let subject = format!("{}-value", env.topic);
            let first = register(&subject, encoding(0, 1)).await;
            let second = register(&subject, encoding(0, 2)).await;
            assert_ne!(first, second, "a field added is a new schema, with a new ID");
            env.extra_env.push(("CLICKAGG__SOURCE__SCHEMA_REGISTRY__URL".to_string(), registry_url()));
            (encoding(first, 1), encoding(second, 2))
        }
        Schemas::Files => {
            let dir = env.log_dir.join("schemas");
            let (v1, v2) = (encoding(11, 1), encoding(12, 2));
            produce::write_schema_file(&dir, v1).unwrap();
            produce::write_schema_file(&dir, v2).unwrap();
            env.extra_env.push(("CLICKAGG__SOURCE__SCHEMA_FILES".to_string(), dir.display().to_string()));
            (v1, v2)
        }
    };

    let base = Spec { count, duplicate_ratio: 0.1, retry_drift_ratio: 0.3, malformed_ratio: 0.01, ..Spec::default() };
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
    for round in 0..kills {
        let mut member = env.spawn(&format!("m{round}"), &["run"], &extra);
        member.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
        let ms = rand::rng().random_range(300..2_000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        member.kill9().await;
    }
    let mut last = env.spawn("last", &["run"], &extra);
    producer.finished().await;
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
async fn avro_through_the_registry_counts_exactly_through_sigkill_a_schema_evolution_and_unknown_schema_ids() {
    counts_exactly_through_kills_and_an_evolution(
        "fmt_avro",
        "avro",
        |id, revision| Encoding::Avro { id, revision },
        Schemas::Registry,
        30_000,
        3,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_from_schema_files_counts_exactly_through_sigkill_a_schema_evolution_and_unknown_schema_ids() {
    counts_exactly_through_kills_and_an_evolution(
        "fmt_proto",
        "protobuf",
        |id, revision| Encoding::Protobuf { id, revision },
        Schemas::Files,
        30_000,
        3,
    )
    .await;
}

/// Protobuf through the registry as well (its `schemaType`, its message indexes), at a
/// smaller size: the kills and the volume are the test above's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_through_the_registry_counts_exactly_through_a_schema_evolution_and_unknown_schema_ids() {
    counts_exactly_through_kills_and_an_evolution(
        "fmt_proto_registry",
        "protobuf",
        |id, revision| Encoding::Protobuf { id, revision },
        Schemas::Registry,
        4_000,
        1,
    )
    .await;
}

/// The client itself against the real registry: a registered ID compiles and is kept,
/// an ID the registry does not have and a schema of the other format are the records'
/// fault (`unknown_schema`), and a registry nobody answers at is an outage, waited out
/// (never a verdict on the records) until shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_client_fetches_and_keeps_schemas_and_waits_out_an_unreachable_registry() {
    require_registry();
    let subject = format!("fmt_client_{}-value", std::process::id());
    let avro = register(&subject, Encoding::Avro { id: 0, revision: 1 }).await;
    let source = |url: String| {
        let mut s = SourceSettings::default();
        s.schema_registry.url = Some(SecretUrl::new(url));
        s.schema_registry.timeout = Duration::from_secs(5);
        s
    };
    let never = CancellationToken::new();
    let no_outage = |e: Option<&RegistryError>| panic!("the registry is up, yet: {e:?}");

    let registry = SchemaRegistry::new(&source(registry_url()), WireFormat::Avro).unwrap();
    assert!(registry.known(avro).is_none(), "nothing is asked before it is needed");
    registry.resolve([avro, UNKNOWN_SCHEMA_ID, avro], Duration::from_secs(1), &never, no_outage).await.unwrap();
    assert!(matches!(registry.known(avro), Some(Known::Schema(_))), "ID {avro} compiles");
    match registry.known(UNKNOWN_SCHEMA_ID) {
        Some(Known::Unusable(why)) => assert!(why.contains("no schema with this ID"), "{why}"),
        _ => panic!("an ID the registry does not have is unusable"),
    }
    // Kept: asking again, with shutdown already requested, answers from what it holds.
    let stopped = CancellationToken::new();
    stopped.cancel();
    registry.resolve([avro, UNKNOWN_SCHEMA_ID], Duration::from_secs(1), &stopped, no_outage).await.unwrap();

    // A Protobuf topic given an Avro schema's ID: the registry's schemaType decides.
    let protobuf = SchemaRegistry::new(&source(registry_url()), WireFormat::Protobuf).unwrap();
    protobuf.resolve([avro], Duration::from_secs(1), &never, no_outage).await.unwrap();
    match protobuf.known(avro) {
        Some(Known::Unusable(why)) => assert!(why.contains("AVRO"), "{why}"),
        _ => panic!("an Avro schema is unusable for a Protobuf topic"),
    }

    // Nobody listening: an outage (retried with backoff) until the shutdown, no verdict.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let down =
        SchemaRegistry::new(&source(format!("http://127.0.0.1:{port}/apis/ccompat/v7")), WireFormat::Avro).unwrap();
    let shutdown = CancellationToken::new();
    let mut outages = Vec::new();
    let result = down
        .resolve([avro], Duration::from_millis(200), &shutdown, |e| {
            outages.push(e.map(ToString::to_string));
            if outages.len() == 3 {
                shutdown.cancel();
            }
        })
        .await;
    assert!(matches!(result, Err(Stopped::ShutDown)), "stopped by the shutdown alone: {result:?}");
    assert_eq!(outages.len(), 3, "{outages:?}");
    for o in &outages {
        let o = o.as_deref().expect("an outage, not its end");
        assert!(o.contains("unavailable"), "{o}");
    }
    assert!(down.known(avro).is_none(), "an outage says nothing about the ID");
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
