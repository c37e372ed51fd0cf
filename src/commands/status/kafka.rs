//! What `clickagg status` asks Kafka: the group's description (members, client IDs,
//! the partitions each owns), committed offsets and log ends, and the timestamp of the
//! record at an offset. Every call blocks on the broker.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::KafkaSettings;
use crate::source;

/// A member as the group's description lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupMember {
    /// `clickagg-<host>-<pid>` for a clickagg member (`kafka.properties."client.id"` if set).
    pub client_id: String,
    pub member_id: String,
    pub host: String,
    pub partitions: Vec<i32>,
}

/// What Kafka says about one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offsets {
    pub committed: Option<i64>,
    pub log_start: i64,
    pub log_end: i64,
}

/// What Kafka says about the group and its topic.
#[derive(Debug, Clone)]
pub struct KafkaView {
    pub state: String,
    pub members: Vec<GroupMember>,
    pub partitions: BTreeMap<i32, Offsets>,
}

/// How long one broker look-up may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The group's description and the topic's offsets. Blocking.
pub fn kafka_view(k: &KafkaSettings, group: &str, topic: &str) -> Result<KafkaView, KafkaError> {
    let consumer = source::group_lookup_consumer(k, group)?;
    let partitions = source::partitions(&consumer, topic, TIMEOUT)?;
    let committed = source::group_committed(&consumer, topic, &partitions, TIMEOUT)?;
    let mut offsets = BTreeMap::new();
    for &p in &partitions {
        let (log_start, log_end) = consumer.fetch_watermarks(topic, p, TIMEOUT)?;
        offsets.insert(p, Offsets { committed: committed.get(&p).copied().flatten(), log_start, log_end });
    }
    let groups = consumer.fetch_group_list(Some(group), TIMEOUT)?;
    let (state, members) = match groups.groups().iter().find(|g| g.name() == group) {
        Some(g) => {
            let members = g
                .members()
                .iter()
                .map(|m| GroupMember {
                    client_id: m.client_id().to_string(),
                    member_id: m.id().to_string(),
                    host: m.client_host().to_string(),
                    partitions: m.assignment().and_then(|a| assigned_partitions(a, topic)).unwrap_or_default(),
                })
                .collect();
            (g.state().to_string(), members)
        }
        None => ("Dead".to_string(), Vec::new()),
    };
    Ok(KafkaView { state, members, partitions: offsets })
}

/// The partitions of `topic` in a member's assignment, as the consumer protocol encodes
/// it: version (int16), then an array (int32 count) of topic (int16-length string) and
/// partitions (int32 count, int32 each), then user data we do not need. `None` when
/// the bytes are not a consumer assignment.
pub fn assigned_partitions(bytes: &[u8], topic: &str) -> Option<Vec<i32>> {
    struct Reader<'a>(&'a [u8]);
    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
            self.0 = rest;
            Some(head)
        }
        fn i16(&mut self) -> Option<i16> {
            Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
        }
        fn i32(&mut self) -> Option<i32> {
            Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
        }
    }
    if bytes.is_empty() {
        return Some(Vec::new()); // a member between rebalances owns nothing yet
    }
    let mut r = Reader(bytes);
    let _version = r.i16()?;
    let mut out = Vec::new();
    for _ in 0..r.i32()?.max(0) {
        let len = usize::try_from(r.i16()?).ok()?;
        let name = std::str::from_utf8(r.take(len)?).ok()?.to_string();
        for _ in 0..r.i32()?.max(0) {
            let p = r.i32()?;
            if name == topic {
                out.push(p);
            }
        }
    }
    out.sort_unstable();
    Some(out)
}

/// The Kafka timestamp (ms) of the first record at or after each offset: how long the
/// first waiting record has waited. A partition whose records there are not readable
/// within the time limit (or turn out to be only transaction markers) is left out.
/// Blocking.
pub fn timestamps_at(
    k: &KafkaSettings,
    topic: &str,
    offsets: &BTreeMap<i32, i64>,
) -> Result<BTreeMap<i32, i64>, KafkaError> {
    let mut out = BTreeMap::new();
    if offsets.is_empty() {
        return Ok(out);
    }
    let mut config = source::client_config(k);
    config
        .set("group.id", "clickagg-status")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        // What the members can read: nothing of an open or aborted transaction.
        .set("isolation.level", "read_committed")
        // One record per partition is all it needs.
        .set("fetch.message.max.bytes", "65536")
        .set("queued.max.messages.kbytes", "4096");
    let consumer: BaseConsumer = config.create()?;
    let mut tpl = TopicPartitionList::new();
    for (&p, &o) in offsets {
        tpl.add_partition_offset(topic, p, Offset::Offset(o))?;
    }
    consumer.assign(&tpl)?;
    let mut open: Vec<i32> = offsets.keys().copied().collect();
    let deadline = Instant::now() + TIMEOUT;
    while !open.is_empty() && Instant::now() < deadline {
        let answered = match consumer.poll(Duration::from_millis(200)) {
            None => continue,
            Some(Ok(m)) => {
                if let Some(ts) = m.timestamp().to_millis() {
                    out.entry(m.partition()).or_insert(ts);
                }
                m.partition()
            }
            Some(Err(KafkaError::PartitionEOF(p))) => p,
            Some(Err(e)) if source::is_fatal_kafka(e.rdkafka_error_code()) => return Err(e),
            // Transient (a broker reconnecting): the deadline bounds the wait.
            Some(Err(_)) => continue,
        };
        if let Some(i) = open.iter().position(|&p| p == answered) {
            open.swap_remove(i);
            let mut done = TopicPartitionList::new();
            done.add_partition(topic, answered);
            let _ = consumer.pause(&done);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer-protocol assignment as a member sends it.
    fn assignment(topics: &[(&str, &[i32])]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(1i16.to_be_bytes());
        b.extend((topics.len() as i32).to_be_bytes());
        for (name, parts) in topics {
            b.extend((name.len() as i16).to_be_bytes());
            b.extend(name.as_bytes());
            b.extend((parts.len() as i32).to_be_bytes());
            for p in *parts {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((-1i32).to_be_bytes()); // no user data
        b
    }

    #[test]
    fn an_assignment_gives_the_partitions_of_our_topic_only() {
        let bytes = assignment(&[("other", &[0, 1]), ("clicks", &[3, 1])]);
        assert_eq!(assigned_partitions(&bytes, "clicks"), Some(vec![1, 3]));
        assert_eq!(assigned_partitions(&bytes, "none"), Some(vec![]));
        assert_eq!(assigned_partitions(&[], "clicks"), Some(vec![]));
        assert_eq!(assigned_partitions(&bytes[..9], "clicks"), None, "cut short");
    }
}
