//! Reading the topics back: the dead-letter topic, a record at a position, the
//! group's offsets. Every call here blocks on the broker, so it runs off the test's
//! runtime (`spawn_blocking`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use super::env::TestEnv;

/// A dead letter as read back: raw payload and headers.
pub struct DeadLetter {
    pub payload: Option<Vec<u8>>,
    pub headers: BTreeMap<String, String>,
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

/// Reads the test's dead-letter topic until `want` records arrived (or a minute passed)
/// and returns what it read; the caller asserts the count.
pub async fn read_dead_letters(env: &TestEnv, want: usize) -> Vec<DeadLetter> {
    let (brokers, group, topic) = (env.brokers.clone(), format!("{}-reader", env.group), format!("{}.dlq", env.topic));
    blocking(move || {
        let c = consumer(&brokers, &group);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning).unwrap();
        c.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while out.len() < want && Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(500)) {
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(DeadLetter { payload: m.payload().map(<[u8]>::to_vec), headers });
            }
        }
        out
    })
    .await
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
