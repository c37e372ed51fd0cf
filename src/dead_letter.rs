//! The dead-letter topic: every rejected record, with its raw key, value and headers,
//! plus headers naming why and where it came from. A dead letter is produced and
//! acknowledged *before* the source offset can be committed, so a bad record is never
//! lost, and it never stalls its partition.
//!
//! Headers added (the source position makes a replay's copy recognisable; a consumer
//! of the dead-letter topic can deduplicate on it):
//!
//! | header | value |
//! |---|---|
//! | `clickagg-reason` | the [`RejectReason`](crate::click::RejectReason), e.g. `malformed_json` |
//! | `clickagg-detail` | a human explanation |
//! | `clickagg-source-topic` / `-partition` / `-offset` | the record's position |
//! | `clickagg-source-timestamp` | the record's Kafka timestamp (ms), if any |
//! | `clickagg-origin` | `run` or `replay` |

use std::time::Duration;

use futures_util::future::join_all;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaSettings;
use crate::source::{producer_config, Record};

pub const REASON: &str = "clickagg-reason";
pub const DETAIL: &str = "clickagg-detail";
pub const SOURCE_TOPIC: &str = "clickagg-source-topic";
pub const SOURCE_PARTITION: &str = "clickagg-source-partition";
pub const SOURCE_OFFSET: &str = "clickagg-source-offset";
pub const SOURCE_TIMESTAMP: &str = "clickagg-source-timestamp";
pub const ORIGIN: &str = "clickagg-origin";

/// How long one dead letter may wait for its acknowledgement before the send fails.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct DeadLetters {
    producer: FutureProducer,
    /// Kept to build a fresh producer when one stops delivering (see [`renew`](Self::renew)).
    config: ClientConfig,
    topic: String,
    source_topic: String,
    origin: &'static str,
}

impl DeadLetters {
    pub fn new(k: &KafkaSettings, topic: String, origin: &'static str) -> Result<DeadLetters, KafkaError> {
        let mut config = producer_config(k);
        // A dead letter may be produced twice anyway (a re-read produces it again; the
        // source-position headers identify copies), so idempotence buys nothing here,
        // while its producer-ID state can keep a producer from delivering after a broker
        // restart. A bounded delivery time turns any stall into an error we retry.
        config
            .set("linger.ms", "0")
            .set("enable.idempotence", "false")
            .set("message.timeout.ms", DELIVERY_TIMEOUT.as_millis().to_string());
        let producer: FutureProducer = config.create()?;
        Ok(DeadLetters { producer, config, topic, source_topic: k.topic.clone(), origin })
    }

    /// Replaces the producer after a failed send, so a producer wedged by a broker
    /// restart cannot stall its partition.
    pub fn renew(&mut self) -> Result<(), KafkaError> {
        self.producer = self.config.create()?;
        Ok(())
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Produces a dead letter for every rejected record in `records` and waits for all
    /// acknowledgements. Returns how many were produced; an error means some were not,
    /// and the caller retries the whole set (a retry may duplicate a dead letter, which
    /// its source-position headers identify).
    pub async fn send(&self, records: &[&Record]) -> Result<usize, KafkaError> {
        let mut deliveries = Vec::new();
        for r in records {
            let Err(rejected) = &r.outcome else { continue };
            let partition = r.partition.to_string();
            let offset = r.offset.to_string();
            let timestamp = r.timestamp_ms.map(|t| t.to_string());
            let mut headers = OwnedHeaders::new_with_capacity(rejected.headers.len() + 7);
            for (k, v) in &rejected.headers {
                headers = headers.insert(Header { key: k, value: Some(v) });
            }
            headers = headers
                .insert(Header { key: REASON, value: Some(rejected.rejection.reason.as_str()) })
                .insert(Header { key: DETAIL, value: Some(&rejected.rejection.detail) })
                .insert(Header { key: SOURCE_TOPIC, value: Some(&self.source_topic) })
                .insert(Header { key: SOURCE_PARTITION, value: Some(&partition) })
                .insert(Header { key: SOURCE_OFFSET, value: Some(&offset) })
                .insert(Header { key: ORIGIN, value: Some(self.origin) });
            if let Some(ts) = &timestamp {
                headers = headers.insert(Header { key: SOURCE_TIMESTAMP, value: Some(ts) });
            }
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic).headers(headers);
            if let Some(key) = &rejected.key {
                record = record.key(key.as_slice());
            }
            if let Some(payload) = &rejected.payload {
                record = record.payload(payload.as_slice());
            }
            // Keep the source timestamp: a dead letter says when the bad record was written.
            if let Some(ts) = r.timestamp_ms {
                record = record.timestamp(ts);
            }
            deliveries.push(self.producer.send(record, Duration::from_secs(30)));
        }
        let n = deliveries.len();
        // librdkafka fails each delivery after `message.timeout.ms`; this outer bound
        // only guards against an acknowledgement that never comes at all.
        let results = tokio::time::timeout(DELIVERY_TIMEOUT + Duration::from_secs(5), join_all(deliveries))
            .await
            .map_err(|_| KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut))?;
        for result in results {
            result.map_err(|(e, _)| e)?;
        }
        Ok(n)
    }
}
