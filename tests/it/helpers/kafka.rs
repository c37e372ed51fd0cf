//! Reading the topics back: the dead-letter topic, a record at a position, the
//! group's offsets. Every call here blocks on the broker, so it runs off the test's
//! runtime (`spawn_blocking`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use clickagg::dead_letter::{ORIGIN, SOURCE_OFFSET, SOURCE_PARTITION};

use super::env::TestEnv;

/// A dead letter as read back: raw payload and headers.
pub struct DeadLetter {
    pub payload: Option<Vec<u8>>,
    pub headers: BTreeMap<String, String>,
}

impl DeadLetter {
    /// The source record it names (`clickagg-source-partition`, `-offset`); a letter
    /// without them fails the test.
    pub fn source(&self) -> (i32, i64) {
        let get = |h: &str| self.headers.get(h).and_then(|v| v.parse::<i64>().ok());
        match (get(SOURCE_PARTITION), get(SOURCE_OFFSET)) {
            (Some(p), Some(o)) => (p as i32, o),
            _ => panic!("a dead letter without its source position: {:?}", self.headers),
        }
    }

    pub fn origin(&self) -> &str {
        self.headers.get(ORIGIN).map_or("", String::as_str)
    }
}

fn consumer(brokers: &str, group: &str) -> BaseConsumer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("a Kafka consumer")
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking Kafka call")
}

/// Every record of `topic` up to its end, per partition: (partition, offset, key,
/// payload, headers). The end is the high watermark once at least `at_least` records
/// are there (waiting up to a minute for them), read again after reaching it until it
/// stays put, so a record that lands while the others are read is seen too.
fn read_to_end(brokers: &str, group: &str, topic: &str, at_least: usize) -> Vec<RawRecord> {
    let c = consumer(brokers, group);
    let timeout = Duration::from_secs(10);
    let deadline = Instant::now() + Duration::from_secs(60);
    let ends = || -> BTreeMap<i32, (i64, i64)> {
        match clickagg::source::partitions(&c, topic, timeout) {
            Ok(parts) => parts.into_iter().map(|p| (p, c.fetch_watermarks(topic, p, timeout).unwrap())).collect(),
            Err(_) => BTreeMap::new(), // not created yet: nothing in it
        }
    };
    let mut marks = ends();
    while marks.values().map(|(lo, hi)| (hi - lo) as usize).sum::<usize>() < at_least {
        assert!(Instant::now() < deadline, "{topic}: fewer than {at_least} records within 60 s: {marks:?}");
        std::thread::sleep(Duration::from_millis(200));
        marks = ends();
    }
    let mut out: Vec<RawRecord> = Vec::new();
    // The next offset to read, per partition; reading stops once a fresh look at the
    // watermarks finds nothing past it.
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    loop {
        let todo: BTreeMap<i32, (i64, i64)> = marks
            .iter()
            .map(|(&p, &(lo, hi))| (p, (next.get(&p).copied().unwrap_or(lo), hi)))
            .filter(|(_, (from, hi))| from < hi)
            .collect();
        if todo.is_empty() {
            return out;
        }
        let mut tpl = TopicPartitionList::new();
        for (&p, &(from, _)) in &todo {
            tpl.add_partition_offset(topic, p, Offset::Offset(from)).unwrap();
            next.insert(p, from);
        }
        c.assign(&tpl).unwrap();
        while todo.iter().any(|(p, (_, hi))| next[p] < *hi) {
            assert!(Instant::now() < deadline + Duration::from_secs(60), "{topic}: not read to {todo:?} in time");
            let Some(m) = c.poll(Duration::from_millis(500)) else { continue };
            let m = m.unwrap_or_else(|e| panic!("reading {topic}: {e}"));
            let headers = m
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                        .collect()
                })
                .unwrap_or_default();
            next.insert(m.partition(), m.offset() + 1);
            out.push(RawRecord {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().map(<[u8]>::to_vec),
                headers,
            });
        }
        marks = ends();
    }
}

/// One record as read back by [`read_to_end`].
struct RawRecord {
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: BTreeMap<String, String>,
}

/// Every letter in the test's dead-letter topic, read to its end once at least
/// `at_least` are there. Callers compare the source positions they name with the
/// records they expect letters for: a count alone would not see a letter for the wrong
/// record, nor one too many.
pub async fn read_dead_letters(env: &TestEnv, at_least: usize) -> Vec<DeadLetter> {
    let (brokers, group, topic) = (env.brokers.clone(), format!("{}-reader", env.group), format!("{}.dlq", env.topic));
    let records = blocking(move || read_to_end(&brokers, &group, &topic, at_least)).await;
    records.into_iter().map(|r| DeadLetter { payload: r.payload, headers: r.headers }).collect()
}

/// The positions of the test's click topic whose record key satisfies `wanted`, read to
/// the topic's end: where the records a test planted (such as the invalid ones) landed.
pub async fn positions_of_keys(env: &TestEnv, wanted: impl Fn(&[u8]) -> bool) -> BTreeSet<(i32, i64)> {
    let (brokers, group, topic) = (env.brokers.clone(), format!("{}-reader", env.group), env.topic.clone());
    let records = blocking(move || read_to_end(&brokers, &group, &topic, 1)).await;
    records.into_iter().filter(|r| r.key.as_deref().is_some_and(&wanted)).map(|r| (r.partition, r.offset)).collect()
}

/// The payload stored at a position of the test's click topic.
pub async fn source_payload(env: &TestEnv, partition: i32, offset: i64) -> Option<Vec<u8>> {
    let (brokers, group, topic) = (env.brokers.clone(), format!("{}-reader", env.group), env.topic.clone());
    blocking(move || {
        let c = consumer(&brokers, &group);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, partition, Offset::Offset(offset)).unwrap();
        c.assign(&tpl).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < deadline, "no record at {topic}/{partition}/{offset} within 60 s");
            if let Some(m) = c.poll(Duration::from_secs(1)) {
                let m = m.unwrap();
                assert_eq!(m.offset(), offset);
                return m.payload().map(<[u8]>::to_vec);
            }
        }
    })
    .await
}

impl TestEnv {
    /// Commits `to` for every partition of the topic in this test's group (no member may
    /// be running): what `kafka-consumer-groups --reset-offsets` does.
    pub async fn reset_group_offsets(&self, to: Offset) {
        let (brokers, group, topic) = (self.brokers.clone(), self.group.clone(), self.topic.clone());
        blocking(move || {
            let c = consumer(&brokers, &group);
            let parts = clickagg::source::partitions(&c, &topic, Duration::from_secs(10)).unwrap();
            let mut tpl = TopicPartitionList::new();
            for p in parts {
                let (low, high) = c.fetch_watermarks(&topic, p, Duration::from_secs(10)).unwrap();
                let o = match to {
                    Offset::Beginning => low,
                    Offset::End => high,
                    Offset::Offset(o) => o,
                    other => panic!("unsupported {other:?}"),
                };
                tpl.add_partition_offset(&topic, p, Offset::Offset(o)).unwrap();
            }
            c.commit(&tpl, CommitMode::Sync).expect("commit reset offsets");
        })
        .await
    }

    /// Runs Kafka's standard `kafka-consumer-groups` tool on this test's group and
    /// topic (`scripts/stack consumer-groups`), as an operator would; asserts success.
    pub async fn consumer_groups(&self, args: &[&str]) {
        let port = self.brokers.rsplit(':').next().expect("host:port").to_string();
        let mut cmd = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"));
        cmd.args(["consumer-groups", "--group", &self.group, "--topic", &self.topic])
            .args(args)
            .env("KAFKA_PORT", port);
        let out = blocking(move || cmd.output().expect("run kafka-consumer-groups")).await;
        assert!(
            out.status.success(),
            "kafka-consumer-groups {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Waits until the group's committed offsets are `want` (every partition of it).
    pub async fn wait_committed(&self, what: &str, want: &BTreeMap<i32, i64>, timeout: Duration) {
        super::wait_until(what, timeout, || async { super::equals(self.committed_offsets().await, want.clone()) })
            .await;
    }

    /// Committed offsets of this test's group, per partition (-1: none).
    pub async fn committed_offsets(&self) -> BTreeMap<i32, i64> {
        let (brokers, group, topic) = (self.brokers.clone(), self.group.clone(), self.topic.clone());
        blocking(move || {
            let c = consumer(&brokers, &group);
            let parts = clickagg::source::partitions(&c, &topic, Duration::from_secs(10)).unwrap();
            let mut tpl = TopicPartitionList::new();
            for p in &parts {
                tpl.add_partition(&topic, *p);
            }
            let committed = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
            committed
                .elements()
                .iter()
                .map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { o } else { -1 }))
                .collect()
        })
        .await
    }

    /// Deletes the records of `partition` below `before`, as retention would.
    pub async fn delete_records_before(&self, partition: i32, before: i64) {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &self.brokers).create().unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(before)).unwrap();
        let deleted = admin.delete_records(&tpl, &AdminOptions::new()).await.expect("delete records");
        for e in deleted.elements() {
            assert!(e.error().is_ok(), "deleting records of partition {partition}: {:?}", e.error());
        }
    }

    /// Partition → high watermark of the topic.
    pub async fn high_watermarks(&self) -> BTreeMap<i32, i64> {
        let (brokers, topic) = (self.brokers.clone(), self.topic.clone());
        blocking(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
            let parts = clickagg::source::partitions(&c, &topic, Duration::from_secs(10)).unwrap();
            parts.into_iter().map(|p| (p, c.fetch_watermarks(&topic, p, Duration::from_secs(10)).unwrap().1)).collect()
        })
        .await
    }
}
