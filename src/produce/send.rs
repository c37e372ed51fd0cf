//! Sending the planned records to Kafka, again for those whose delivery failed, until
//! every one has reached the topic at least once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Message};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;

use super::{Kind, Planned};
use crate::config::KafkaSettings;
use crate::source;

/// Keeps the records whose delivery failed, to send them again: the ground truth holds
/// every planned record, so each must reach the topic at least once. A record that
/// timed out may have been written after all; sent again, it is one more producer
/// retry, which the pipeline deduplicates (a rejected record gets a second dead letter).
#[derive(Default, Clone)]
struct Deliveries {
    failed: Arc<std::sync::Mutex<Vec<Planned>>>,
    first_error: Arc<std::sync::Mutex<Option<String>>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, msg)) = result {
            self.first_error.lock().expect("not poisoned").get_or_insert_with(|| e.to_string());
            let again = Planned {
                key: String::from_utf8_lossy(msg.key().unwrap_or_default()).into_owned(),
                payload: msg.payload().unwrap_or_default().to_vec(),
                timestamp_ms: msg.timestamp().to_millis().unwrap_or_default(),
                kind: Kind::Click, // not read when sending
                partition: Some(msg.partition()),
            };
            self.failed.lock().expect("not poisoned").push(again);
        }
    }
}

/// How many times records whose delivery failed are sent again before `send` gives up.
const SEND_ROUNDS: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("{failed} records were not acknowledged by the broker (first error: {first}); the ground truth is void")]
    Undelivered { failed: u64, first: String },
}

/// Sends `records` to `topic` (created with `partitions` partitions if missing), at
/// most `rate` records per second when given. Returns once every record is acknowledged.
/// `records` may be a slice or a [`Generator`]: nothing is held after it is handed to
/// the producer. `progress` hears the number of records handed over so far.
pub async fn send<R: std::borrow::Borrow<Planned>>(
    k: &KafkaSettings,
    topic: &str,
    partitions: i32,
    records: impl IntoIterator<Item = R>,
    rate: Option<u64>,
    mut progress: impl FnMut(u64),
) -> Result<(), SendError> {
    source::ensure_topic(k, topic, partitions).await?;
    let deliveries = Deliveries::default();
    let mut config = source::producer_config(k);
    // A record librdkafka cannot deliver within a minute (a broker restart can strand a
    // few until this timeout) fails and is sent again, rather than holding the flush for
    // the default five minutes; `kafka.properties` may set another value.
    config.set("queue.buffering.max.messages", "500000").set("message.timeout.ms", "60000");
    let config = source::with_properties(config, k);
    let delivery_timeout = config
        .get("message.timeout.ms")
        .and_then(|ms| ms.parse::<u64>().ok())
        .map_or(Duration::from_secs(300), Duration::from_millis);
    let producer: ThreadedProducer<Deliveries> = config.create_with_context(deliveries.clone())?;
    let started = Instant::now();
    let mut sent = 0u64;
    for r in records {
        let r = r.borrow();
        if let Some(rate) = rate.filter(|r| *r > 0) {
            let due = started + Duration::from_secs_f64(sent as f64 / rate as f64);
            let now = Instant::now();
            if due > now {
                tokio::time::sleep(due - now).await;
            }
            // Paced like a live producer: not before its simulated send time, so that
            // with a start ahead of now (set before planning, which takes seconds) a
            // record's timestamp is when it was sent, which freshness is measured from.
            let ahead_ms = r.timestamp_ms - chrono::Utc::now().timestamp_millis();
            if ahead_ms > 0 {
                tokio::time::sleep(Duration::from_millis(ahead_ms as u64)).await;
            }
        }
        enqueue(&producer, topic, r).await?;
        if sent.is_multiple_of(10_000) {
            progress(sent);
        }
        sent += 1;
    }
    // Each round waits as long as librdkafka may still deliver (every record ends
    // acknowledged or failed within `message.timeout.ms`), then sends the failed again.
    for round in 1..=SEND_ROUNDS {
        let flush = producer.clone();
        tokio::task::spawn_blocking(move || flush.flush(delivery_timeout + Duration::from_secs(10)))
            .await
            .expect("flush task")?;
        let failed = std::mem::take(&mut *deliveries.failed.lock().expect("not poisoned"));
        if failed.is_empty() {
            progress(sent);
            return Ok(());
        }
        if round == SEND_ROUNDS {
            let first = deliveries.first_error.lock().expect("not poisoned").clone().unwrap_or_default();
            return Err(SendError::Undelivered { failed: failed.len() as u64, first });
        }
        tracing::warn!(records = failed.len(), round, "records not acknowledged; sending them again");
        for r in &failed {
            enqueue(&producer, topic, r).await?;
        }
    }
    unreachable!("the last round returns")
}

/// Hands one record to the producer, waiting while its queue is full.
async fn enqueue(producer: &ThreadedProducer<Deliveries>, topic: &str, r: &Planned) -> Result<(), SendError> {
    let mut record = BaseRecord::to(topic).key(r.key.as_bytes()).timestamp(r.timestamp_ms);
    if let Some(p) = r.partition {
        record = record.partition(p);
    }
    if !r.payload.is_empty() {
        record = record.payload(r.payload.as_slice());
    }
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err((e, _)) => return Err(e.into()),
        }
    }
}
