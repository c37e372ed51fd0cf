//! The Kafka side: client configuration (security settings passed through), turning
//! consumed messages into decoded [`Record`]s, and the admin look-ups (topics,
//! watermarks, offsets for times) that `run`, `produce` and `replay` share.
//!
//! Delivery guarantee: at-least-once. `enable.auto.commit` is off; the pipeline commits
//! explicit offsets, and only positions behind durable flushes. Everything after the
//! batch boundary at or below the committed offset may be read again, which the
//! decisions made from the log and the versioned rows make harmless.
//!
//! `record` turns a consumed message into a decoded [`Record`]; the rest of this file
//! is the clients and the look-ups.

mod record;

pub use record::decode;

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{KafkaSettings, Settings};
use crate::record::{Decoder, Record, RegistryError};

/// The high watermark of `partition` as the consumer last heard it from the broker (no
/// request is sent): whether a reader is caught up, cheaply.
pub fn cached_high_watermark<X: ConsumerContext>(
    consumer: &impl Consumer<X>,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    let topic = std::ffi::CString::new(topic).ok()?;
    let (mut low, mut high) = (-1i64, -1i64);
    // SAFETY: the client pointer is live as long as `consumer`; librdkafka only reads the
    // topic name and writes the two offsets.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_get_watermark_offsets(
            consumer.client().native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
}

/// Kafka errors that no retry can fix.
pub fn is_fatal_kafka(code: Option<RDKafkaErrorCode>) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        Some(
            C::Authentication
                | C::SaslAuthenticationFailed
                | C::TopicAuthorizationFailed
                | C::GroupAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::SSL
        )
    )
}

/// Consume errors of a record batch the client cannot decode: a compression codec it
/// was built without, compressed data that does not inflate, a CRC that does not match.
/// librdkafka reports the batch and skips it, and the error does not say which partition
/// it was in, so nothing read after it may be counted: its clicks would be lost.
pub fn is_undecodable(code: Option<RDKafkaErrorCode>) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        Some(C::BadMessage | C::BadCompression | C::NotImplemented | C::InvalidMessage | C::UnsupportedCompressionType)
    )
}

/// Settings common to every client: brokers, security and pass-through properties.
pub fn client_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &k.brokers);
    if let Some(v) = k.security_protocol {
        c.set("security.protocol", v.as_str());
    }
    if let Some(v) = k.sasl_mechanism {
        c.set("sasl.mechanism", v.as_str());
    }
    if let Some(v) = &k.sasl_username {
        c.set("sasl.username", v);
    }
    if let Some(v) = &k.sasl_password {
        c.set("sasl.password", v.expose());
    }
    if let Some(v) = &k.ssl_ca_location {
        c.set("ssl.ca.location", v.display().to_string());
    }
    if let Some(v) = &k.ssl_certificate_location {
        c.set("ssl.certificate.location", v.display().to_string());
    }
    if let Some(v) = &k.ssl_key_location {
        c.set("ssl.key.location", v.display().to_string());
    }
    if let Some(v) = &k.ssl_key_password {
        c.set("ssl.key.password", v.expose());
    }
    if let Some(url) = &k.oauth_token_endpoint_url {
        // librdkafka's own OIDC client (client credentials): it fetches the token and
        // fetches a new one at 80 % of its lifetime, re-authenticating its connections.
        c.set("sasl.oauthbearer.method", "oidc").set("sasl.oauthbearer.token.endpoint.url", url);
        if let Some(v) = &k.oauth_client_id {
            c.set("sasl.oauthbearer.client.id", v);
        }
        if let Some(v) = &k.oauth_client_secret {
            c.set("sasl.oauthbearer.client.secret", v.expose());
        }
        if let Some(v) = &k.oauth_scope {
            c.set("sasl.oauthbearer.scope", v);
        }
    }
    with_properties(c, k)
}

/// Applies the pass-through `kafka.properties` last, so an operator's explicit choice
/// wins over every default set here.
pub(crate) fn with_properties(mut c: ClientConfig, k: &KafkaSettings) -> ClientConfig {
    for (key, value) in &k.properties {
        c.set(key, value.expose());
    }
    c
}

/// How long librdkafka waits before fetching again for a partition once its prefetch
/// reached `queued.max.messages.kbytes` (default 1 s). A reader drains its prefetch in
/// well under a second, so with the default it then waited on Kafka for the rest of
/// the second: a member's loop 22-34 % of its time, its drain held at 109 000-111 000
/// clicks/s (137 000-199 000 with 50 ms), and a replay at 121 000-240 000 records/s
/// (425 000-564 000); docs/BENCHMARKS.md, 2026-12-04.
const FETCH_QUEUE_BACKOFF_MS: &str = "50";

/// Every fetched batch's CRC is checked (librdkafka's default is not to): a batch whose
/// bytes changed on the broker's disk or on the way is then an error the member stops
/// at (`is_undecodable`), not records it counts. CRC32C is done in hardware where the
/// CPU has it.
const CHECK_CRCS: &str = "true";

/// A group consumer for `clickagg run`.
pub fn group_consumer_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = client_config(k);
    c.set("group.id", &k.group)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        // Cooperative rebalancing moves only the partitions that change owner; the
        // others keep their open batches.
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", k.session_timeout.as_millis().to_string())
        .set("max.poll.interval.ms", k.max_poll_interval.as_millis().to_string())
        // Bounds librdkafka's prefetch: memory stays flat when ClickHouse is down and
        // consumption is paused.
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        .set("check.crcs", CHECK_CRCS)
        .set("statistics.interval.ms", "5000")
        .set("client.id", member_client_id(k));
    if let Some(id) = &k.group_instance_id {
        c.set("group.instance.id", id);
    }
    with_properties(c, k)
}

/// The `client.id` of a group member: `kafka.properties."client.id"` when set, else
/// `clickagg-<host name>-<pid>`. The group's description lists members by client ID,
/// so one per process lets `clickagg status` and `kafka-consumer-groups --describe`
/// name the process that owns each partition (in Kubernetes the host name is the pod's).
pub fn member_client_id(k: &KafkaSettings) -> String {
    if let Some(id) = k.properties.get("client.id") {
        return id.expose().to_string();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into());
    format!("clickagg-{host}-{}", std::process::id())
}

/// A consumer without a group protocol, for direct assignment (`replay`, `reconcile`).
pub fn assigned_consumer_config(k: &KafkaSettings, group: &str) -> ClientConfig {
    let mut c = client_config(k);
    c.set("group.id", group)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("queued.max.messages.kbytes", "65536")
        .set("fetch.message.max.bytes", "4194304")
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        .set("check.crcs", CHECK_CRCS)
        .set("client.id", "clickagg-replay");
    with_properties(c, k)
}

pub fn producer_config(k: &KafkaSettings) -> ClientConfig {
    let mut c = client_config(k);
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "lz4")
        .set("client.id", "clickagg-producer");
    with_properties(c, k)
}

/// Creates `topic` with `partitions` partitions unless it exists, replicated as the
/// brokers' `default.replication.factor` says (with their `min.insync.replicas`): on a
/// three-broker cluster with factor 3 and 2 in-sync replicas, the click and dead-letter
/// topics survive a broker's loss without losing an acknowledged record (the producers
/// use `acks=all`). A broker older than Kafka 2.4 cannot take "the default"; there the
/// topic gets one replica.
pub async fn ensure_topic(k: &KafkaSettings, topic: &str, partitions: i32) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = client_config(k).create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
    let mut results = admin.create_topics([&new], &opts).await?;
    match results.pop() {
        Some(Ok(_)) | None => Ok(()),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(()),
        Some(Err((_, RDKafkaErrorCode::InvalidReplicationFactor | RDKafkaErrorCode::InvalidRequest))) => {
            let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
            match admin.create_topics([&new], &opts).await?.pop() {
                Some(Err((_, code))) if code != RDKafkaErrorCode::TopicAlreadyExists => Err(KafkaError::AdminOp(code)),
                _ => Ok(()),
            }
        }
        Some(Err((_, code))) => Err(KafkaError::AdminOp(code)),
    }
}

/// The partitions of `topic`, from the broker's metadata.
pub fn partitions<X: ConsumerContext>(
    consumer: &impl Consumer<X>,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, KafkaError> {
    let md = consumer.fetch_metadata(Some(topic), timeout)?;
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or(KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopicOrPartition))?;
    if let Some(e) = t.error() {
        return Err(KafkaError::MetadataFetch(e.into()));
    }
    let mut ps: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
    ps.sort_unstable();
    if ps.is_empty() {
        return Err(KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopicOrPartition));
    }
    Ok(ps)
}

/// For every partition, the first offset whose record timestamp is `>= ts_ms`
/// (`None` when no such record exists yet).
pub fn offsets_for_time<C: Consumer>(
    consumer: &C,
    topic: &str,
    partitions: &[i32],
    ts_ms: i64,
    timeout: Duration,
) -> Result<Vec<(i32, Option<i64>)>, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        tpl.add_partition_offset(topic, p, Offset::Offset(ts_ms))?;
    }
    let found = consumer.offsets_for_times(tpl, timeout)?;
    Ok(found
        .elements()
        .iter()
        .map(|e| {
            let o = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            (e.partition(), o)
        })
        .collect())
}

/// Where each partition's reader counts from: the batch boundary at or below the
/// requested offset (`None`: the log start; past retention, the first boundary after
/// it), with the partition's log start. Blocking: a broker round trip per partition.
pub fn boundaries<X: ConsumerContext>(
    consumer: &impl Consumer<X>,
    topic: &str,
    n: crate::position::BatchOffsets,
    requested: &BTreeMap<i32, Option<i64>>,
    timeout: Duration,
) -> Result<BTreeMap<i32, crate::position::Boundary>, KafkaError> {
    let mut out = BTreeMap::new();
    for (&p, &o) in requested {
        let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        out.insert(p, crate::position::Boundary { boundary: crate::position::boundary(n, low, high, o), low, high });
    }
    Ok(out)
}

/// The topic's ID (Kafka 2.8+ gives every topic a UUID at creation, base64 as the tools
/// print it), or `None` when the broker does not say. A topic deleted and recreated
/// under the same name gets another: its offsets start over, and rows or pins stored for
/// the old one must not be mistaken for its own. Blocking (DescribeTopics, up to
/// `timeout`).
pub fn topic_id(consumer: &BaseConsumer, topic: &str, timeout: Duration) -> Result<Option<String>, KafkaError> {
    topic_id_of(consumer, topic, timeout)
}

/// [`topic_id`] through any client.
pub fn topic_id_of<X: ConsumerContext>(
    consumer: &impl Consumer<X>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<String>, KafkaError> {
    use rdkafka::bindings as rd;
    let name = std::ffi::CString::new(topic).map_err(|_| KafkaError::AdminOp(RDKafkaErrorCode::InvalidTopic))?;
    let rk = consumer.client().native_ptr();
    // SAFETY: every librdkafka object made here is destroyed before returning, after its
    // last use; `rk` lives as long as `consumer`, and the names outlive the calls.
    unsafe {
        let queue = rd::rd_kafka_queue_new(rk);
        let options = rd::rd_kafka_AdminOptions_new(rk, rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS);
        // The request ends by itself within `timeout` (with an error event), so nothing is
        // left pending when the client is destroyed; the poll waits a little longer.
        let ms = timeout.as_millis().min(i32::MAX as u128 / 2) as i32;
        let mut errstr = [0 as std::ffi::c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(options, ms, errstr.as_mut_ptr(), errstr.len());
        let mut names = [name.as_ptr()];
        let topics = rd::rd_kafka_TopicCollection_of_topic_names(names.as_mut_ptr(), 1);
        rd::rd_kafka_DescribeTopics(rk, topics, options, queue);
        let event = rd::rd_kafka_queue_poll(queue, ms + 5_000);
        let answer = if event.is_null() {
            Err(KafkaError::AdminOp(RDKafkaErrorCode::RequestTimedOut))
        } else if rd::rd_kafka_event_error(event) != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            Err(KafkaError::AdminOp(rd::rd_kafka_event_error(event).into()))
        } else {
            let result = rd::rd_kafka_event_DescribeTopics_result(event);
            let mut count = 0usize;
            let descriptions = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
            let mut id = None;
            for i in 0..count {
                let d = *descriptions.add(i);
                if !rd::rd_kafka_TopicDescription_error(d).is_null() {
                    continue;
                }
                let uuid = rd::rd_kafka_TopicDescription_topic_id(d);
                if !uuid.is_null() {
                    let text = std::ffi::CStr::from_ptr(rd::rd_kafka_Uuid_base64str(uuid)).to_string_lossy();
                    // The all-zero UUID: a broker without topic IDs.
                    if text != "AAAAAAAAAAAAAAAAAAAAAA" {
                        id = Some(text.into_owned());
                    }
                }
            }
            Ok(id)
        };
        if !event.is_null() {
            rd::rd_kafka_event_destroy(event);
        }
        rd::rd_kafka_TopicCollection_destroy(topics);
        rd::rd_kafka_AdminOptions_destroy(options);
        rd::rd_kafka_queue_destroy(queue);
        answer
    }
}

/// The topic's configuration as the broker reports it (name -> value), empty for a
/// topic that does not exist yet. Bounded in time: a broker that cannot be reached (or
/// not trusted) leaves the admin request pending forever.
pub async fn topic_configs(k: &KafkaSettings, topic: &str) -> Result<BTreeMap<String, String>, KafkaError> {
    use rdkafka::admin::{ConfigResource, ResourceSpecifier};
    let admin: AdminClient<DefaultClientContext> = client_config(k).create()?;
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let resource = ResourceSpecifier::Topic(topic);
    let described = admin.describe_configs([&resource], &opts);
    let results = tokio::time::timeout(Duration::from_secs(15), described)
        .await
        .map_err(|_| KafkaError::AdminOp(RDKafkaErrorCode::RequestTimedOut))??;
    let resource: Option<ConfigResource> = results.into_iter().next().and_then(|r| r.ok());
    Ok(resource.map(|r| r.entries.into_iter().filter_map(|e| Some((e.name, e.value?))).collect()).unwrap_or_default())
}

/// A consumer that asks for `group`'s committed offsets without joining the group (an
/// offset fetch needs no membership), for readers beside the members: the sealer, the
/// status command, a replay following what the group has decided.
pub fn group_lookup_consumer(k: &KafkaSettings, group: &str) -> Result<BaseConsumer, KafkaError> {
    let mut config = client_config(k);
    config.set("group.id", group).set("enable.auto.commit", "false");
    config.create()
}

/// The consumer's group's committed offset of each of `partitions` of `topic` (`None`:
/// nothing committed). Blocking.
pub fn group_committed<X: ConsumerContext>(
    consumer: &impl Consumer<X>,
    topic: &str,
    partitions: &[i32],
    timeout: Duration,
) -> Result<BTreeMap<i32, Option<i64>>, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        tpl.add_partition(topic, p);
    }
    Ok(consumer
        .committed_offsets(tpl, timeout)?
        .elements()
        .iter()
        .map(|e| (e.partition(), if let Offset::Offset(o) = e.offset() { Some(o) } else { None }))
        .collect())
}

/// A throwaway consumer for metadata and watermark look-ups.
pub fn lookup_consumer(k: &KafkaSettings) -> Result<BaseConsumer, KafkaError> {
    let mut c = client_config(k);
    c.set("group.id", "clickagg-lookup").set("enable.auto.commit", "false");
    c.create()
}

/// Offset ranges to read by direct assignment: `[start, end)` per partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ranges {
    pub partitions: std::collections::BTreeMap<i32, (i64, i64)>,
}

impl Ranges {
    pub fn records(&self) -> u64 {
        self.partitions.values().map(|(s, e)| (e - s).max(0) as u64).sum()
    }
}

/// The longest wait between two tries of a schema registry that is away, for readers
/// that have no `pipeline.max_backoff` at hand.
const RESOLVE_BACKOFF: Duration = Duration::from_secs(5);

/// Why a [`RangeReader`] could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Schemas(RegistryError),
}

/// Reads [`Ranges`] with a directly assigned consumer (no group membership, no
/// commits) and yields decoded poll batches until every partition reached its end.
pub struct RangeReader {
    consumer: rdkafka::consumer::StreamConsumer,
    topic: String,
    /// Partition → (next offset expected, end). Removed when done.
    open: std::collections::BTreeMap<i32, (i64, i64)>,
    decoder: Decoder,
    max_records: usize,
    /// The click IDs (as text) of the records read within these ranges, kept for
    /// `explain --records`; the pipeline itself keeps only fingerprints.
    ids: Option<(Ranges, ClickIds)>,
}

/// Click IDs by (partition, offset).
pub type ClickIds = std::collections::BTreeMap<(i32, i64), String>;

impl RangeReader {
    /// A reader of `ranges` for a process of `role` (`replay`, `reconcile`): a group name
    /// of its own (it commits nothing), the settings' decoder and poll size.
    pub fn for_settings(s: &Settings, role: &str, ranges: &Ranges, decoder: Decoder) -> Result<RangeReader, ReadError> {
        let group = format!("{}-{role}", s.kafka.group);
        Ok(RangeReader::new(&s.kafka, &group, ranges, decoder, s.pipeline.max_poll_records)?)
    }

    pub fn new(
        k: &KafkaSettings,
        group: &str,
        ranges: &Ranges,
        decoder: Decoder,
        max_records: usize,
    ) -> Result<RangeReader, KafkaError> {
        let mut config = assigned_consumer_config(k, group);
        // End-of-partition events tell a range whose last offsets are transaction
        // markers (never delivered) that it is done.
        config.set("enable.partition.eof", "true");
        let consumer: rdkafka::consumer::StreamConsumer = config.create()?;
        let mut tpl = TopicPartitionList::new();
        let mut open = std::collections::BTreeMap::new();
        for (&p, &(start, end)) in &ranges.partitions {
            if start < end {
                tpl.add_partition_offset(&k.topic, p, Offset::Offset(start))?;
                open.insert(p, (start, end));
            }
        }
        if tpl.count() > 0 {
            consumer.assign(&tpl)?;
        }
        Ok(RangeReader { consumer, topic: k.topic.clone(), open, decoder, max_records, ids: None })
    }

    /// Keeps the click ID of every valid record read within `within`, for
    /// [`RangeReader::take_click_ids`].
    pub fn keep_click_ids(&mut self, within: Ranges) {
        self.ids = Some((within, ClickIds::new()));
    }

    /// The click IDs kept since the last call.
    pub fn take_click_ids(&mut self) -> ClickIds {
        self.ids.as_mut().map(|(_, ids)| std::mem::take(ids)).unwrap_or_default()
    }

    pub fn consumer(&self) -> &rdkafka::consumer::StreamConsumer {
        &self.consumer
    }

    /// Partition → next offset to read, for partitions not finished.
    pub fn positions(&self) -> impl Iterator<Item = (i32, i64)> + '_ {
        self.open.iter().map(|(&p, &(next, _))| (p, next))
    }

    /// The next poll batch, or `None` when every range is read. Records past a
    /// partition's end are dropped (and that partition is then done). A schema registry
    /// outage is waited out (the caller's shutdown drops this future).
    pub async fn next_batch(&mut self) -> Result<Option<Vec<Record>>, ReadError> {
        use futures_util::{FutureExt, StreamExt};
        let RangeReader { consumer, topic, open, decoder, max_records, ids: kept_ids } = self;
        let finish = |open: &mut std::collections::BTreeMap<i32, (i64, i64)>, p: i32| {
            if open.remove(&p).is_some() {
                let mut tpl = TopicPartitionList::new();
                let _ = tpl.add_partition(topic, p);
                // Stop fetching a finished partition; the others keep going.
                let _ = consumer.pause(&tpl);
            }
        };
        let mut stream = consumer.stream();
        let mut out = Vec::new();
        while !open.is_empty() {
            let next = if out.is_empty() {
                // Wait for the first record, but not forever: a quiet log still emits EOF.
                match tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
                    Ok(n) => n,
                    Err(_) => return Err(KafkaError::MessageConsumption(RDKafkaErrorCode::RequestTimedOut).into()),
                }
            } else {
                match stream.next().now_or_never() {
                    Some(n) => n,
                    None => break,
                }
            };
            match next {
                Some(Ok(msg)) => {
                    let p = msg.partition();
                    let Some(&(_, end)) = open.get(&p) else { continue };
                    if msg.offset() >= end {
                        finish(open, p);
                        continue;
                    }
                    let never = tokio_util::sync::CancellationToken::new();
                    let ids = decoder.schema_ids([msg.payload()]);
                    decoder.resolve(ids, RESOLVE_BACKOFF, &never, |_| {}).await.map_err(|stopped| match stopped {
                        crate::retry::Stopped::Fatal(e) => ReadError::Schemas(e),
                        crate::retry::Stopped::ShutDown => unreachable!("never cancelled"),
                    })?;
                    out.push(decode(&msg, decoder));
                    if let Some((within, kept)) = kept_ids {
                        let (p, o) = (msg.partition(), msg.offset());
                        if within.partitions.get(&p).is_some_and(|&(start, end)| (start..end).contains(&o)) {
                            let timestamp = msg.timestamp().to_millis();
                            if let Ok(click) = decoder.decode(msg.payload(), timestamp, |id| id.to_owned()) {
                                kept.insert((p, o), click.click_id);
                            }
                        }
                    }
                    if msg.offset() + 1 >= end {
                        finish(open, p);
                    } else {
                        open.insert(p, (msg.offset() + 1, end));
                    }
                    if out.len() >= *max_records {
                        break;
                    }
                }
                Some(Err(KafkaError::PartitionEOF(p))) => {
                    // End of the log as of now: every existing offset below our end
                    // (which is at most the high watermark) was delivered, including
                    // ranges whose last offsets are transaction markers.
                    finish(open, p);
                    if !out.is_empty() {
                        break;
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => break,
            }
        }
        drop(stream);
        if out.is_empty() && open.is_empty() {
            return Ok(None);
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn security_settings_reach_librdkafka_and_explicit_properties_win() {
        let mut k = KafkaSettings {
            security_protocol: Some(crate::config::SecurityProtocol::SaslSsl),
            sasl_mechanism: Some(crate::config::SaslMechanism::ScramSha512),
            sasl_username: Some("svc".into()),
            sasl_password: Some(Secret::new("pw")),
            ssl_ca_location: Some("/etc/ca.pem".into()),
            ..KafkaSettings::default()
        };
        k.properties.insert("client.id".into(), Secret::new("mine"));
        for c in [group_consumer_config(&k), assigned_consumer_config(&k, "g"), producer_config(&k)] {
            assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
            assert_eq!(c.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
            assert_eq!(c.get("sasl.username"), Some("svc"));
            assert_eq!(c.get("sasl.password"), Some("pw"));
            assert_eq!(c.get("ssl.ca.location"), Some("/etc/ca.pem"));
            assert_eq!(c.get("client.id"), Some("mine"));
        }
        let g = group_consumer_config(&k);
        assert_eq!(g.get("enable.auto.commit"), Some("false"));
        // The prefetch stays bounded, and a full one is fetched again after 50 ms, not
        // librdkafka's default second (a member waited on Kafka a third of its time).
        assert_eq!(g.get("queued.max.messages.kbytes"), Some("16384"));
        assert_eq!(g.get("fetch.queue.backoff.ms"), Some("50"));
        assert_eq!(g.get("check.crcs"), Some("true"));
        assert_eq!(assigned_consumer_config(&k, "g").get("check.crcs"), Some("true"));
        assert_eq!(assigned_consumer_config(&k, "g").get("fetch.queue.backoff.ms"), Some("50"));
        k.properties.insert("fetch.queue.backoff.ms".into(), Secret::new("200"));
        assert_eq!(group_consumer_config(&k).get("fetch.queue.backoff.ms"), Some("200"), "an operator's choice wins");
        assert_eq!(member_client_id(&k), "mine");
        assert_eq!(g.get("partition.assignment.strategy"), Some("cooperative-sticky"));
    }

    #[test]
    fn a_member_without_a_client_id_property_is_named_after_its_host_and_process() {
        let id = member_client_id(&KafkaSettings::default());
        assert!(id.starts_with("clickagg-"), "{id}");
        assert!(id.ends_with(&format!("-{}", std::process::id())), "{id}");
        assert_eq!(group_consumer_config(&KafkaSettings::default()).get("client.id"), Some(id.as_str()));
    }

    #[test]
    fn header_keys_that_are_not_utf8_are_read_lossily_and_null_values_as_empty() {
        use rdkafka::bindings::{rd_kafka_header_add, rd_kafka_headers_destroy, rd_kafka_headers_new};
        let add = |h, key: &[u8], value: Option<&[u8]>| {
            let (v, len) = value.map_or((std::ptr::null(), 0), |v| (v.as_ptr().cast(), v.len() as isize));
            // SAFETY: `h` is the live headers object made below; librdkafka copies the bytes.
            unsafe { rd_kafka_header_add(h, key.as_ptr().cast(), key.len() as isize, v, len) };
        };
        // SAFETY: created, read and destroyed here.
        let pairs = unsafe {
            let h = rd_kafka_headers_new(3);
            add(h, b"plain", Some(b"v1"));
            add(h, b"k\xff\xfe", Some(b"\xff"));
            add(h, b"none", None);
            let pairs = record::header_pairs(h);
            rd_kafka_headers_destroy(h);
            pairs
        };
        let want: Vec<(String, Vec<u8>)> = vec![
            ("plain".into(), b"v1".to_vec()),
            ("k\u{fffd}\u{fffd}".into(), b"\xff".to_vec()),
            ("none".into(), Vec::new()),
        ];
        assert_eq!(pairs, want);
    }
}
