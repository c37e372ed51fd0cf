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
//! | `clickagg-detail` | a human explanation (at most 256 bytes) |
//! | `clickagg-source-topic` / `-partition` / `-offset` | the record's position |
//! | `clickagg-source-timestamp` | the record's Kafka timestamp (ms), if any |
//! | `clickagg-original-timestamp` | the record's Kafka timestamp (ms), when the dead-letter topic refused it (see below) |
//! | `clickagg-origin` | `run` or `replay` |
//! | `clickagg-payload-omitted` / `-headers-omitted` / `-key-omitted` | the size in bytes of a part of the record left out |
//!
//! **Size.** A dead letter never exceeds the producer's `message.max.bytes` (librdkafka's
//! default 1 000 000, or `kafka.properties."message.max.bytes"`): when the record with
//! the headers above would, the record's payload is left out, then its headers, then
//! its key, each named in an `-omitted` header. The record itself is still in the source
//! topic at the position the headers give (until retention deletes it). Should the
//! broker hold the dead-letter topic to a smaller `max.message.bytes`, the letters it
//! refuses are sent again with none of the record's parts.
//!
//! **Timestamps.** A dead letter keeps the record's Kafka timestamp. A topic refuses
//! timestamps too far ahead of the broker's clock (Kafka 4's
//! `message.timestamp.after.max.ms`, one hour by default) or behind it, while the
//! source topic may have accepted them: a letter refused with `InvalidTimestamp` (or
//! `InvalidRecord`, which Kafka 4.1 also answered for such letters) is sent
//! again stamped with the current time, the original in `clickagg-original-timestamp`.
//! A record stamped in the year 2100 gets its dead letter like any other.
//!
//! **Errors.** A send that no retry can fix — no WRITE permission on the topic, failed
//! authentication, an untrusted broker, a letter the broker refuses even without the
//! record's parts — is [fatal](DeadLetterError::is_fatal), with the setting to change;
//! anything else (a broker restarting, timeouts) is retried by the caller.

use std::time::Duration;

use futures_util::future::join_all;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

use crate::record::{Record, Rejected};

pub const REASON: &str = "clickagg-reason";
pub const DETAIL: &str = "clickagg-detail";
pub const SOURCE_TOPIC: &str = "clickagg-source-topic";
pub const SOURCE_PARTITION: &str = "clickagg-source-partition";
pub const SOURCE_OFFSET: &str = "clickagg-source-offset";
pub const SOURCE_TIMESTAMP: &str = "clickagg-source-timestamp";
pub const ORIGIN: &str = "clickagg-origin";
pub const PAYLOAD_OMITTED: &str = "clickagg-payload-omitted";
pub const HEADERS_OMITTED: &str = "clickagg-headers-omitted";
pub const KEY_OMITTED: &str = "clickagg-key-omitted";
pub const ORIGINAL_TIMESTAMP: &str = "clickagg-original-timestamp";

/// How long one dead letter may wait for its acknowledgement before the send fails.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(20);

/// librdkafka's `message.max.bytes` when `kafka.properties` does not set it.
const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

/// A dead letter that could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    /// The broker is unreachable, slow or restarting: retry, with a fresh producer.
    #[error("producing dead letters to {topic:?} failed: {error}")]
    Transient { topic: String, error: KafkaError },
    /// No retry can succeed until an operator acts: `fix` says what to change.
    #[error("dead letters cannot be produced to dead_letter.topic {topic:?}: {error}; {fix}")]
    Fatal { topic: String, error: KafkaError, fix: &'static str },
}

impl DeadLetterError {
    pub fn is_fatal(&self) -> bool {
        matches!(self, DeadLetterError::Fatal { .. })
    }

    /// Fatal when [`fix_for`] knows what an operator must change, transient otherwise.
    fn classify(topic: &str, error: KafkaError) -> DeadLetterError {
        let topic = topic.to_string();
        match error.rdkafka_error_code().and_then(fix_for) {
            Some(fix) => DeadLetterError::Fatal { topic, error, fix },
            None => DeadLetterError::Transient { topic, error },
        }
    }
}

/// The send errors no retry can fix, and what to change. Every other error (timeouts,
/// a broker restarting, a leader moving, a full local queue) is transient.
pub fn fix_for(code: RDKafkaErrorCode) -> Option<&'static str> {
    use RDKafkaErrorCode as C;
    Some(match code {
        C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed => {
            "grant this client's principal WRITE (and DESCRIBE) on the topic with a Kafka ACL, \
             or set dead_letter.topic to a topic it may write"
        }
        C::Authentication | C::SaslAuthenticationFailed => "check kafka.sasl_username and kafka.sasl_password",
        C::SSL => "set kafka.ssl_ca_location to the CA that signed the broker certificate",
        // Dead letters fit the producer's limit and are resent without the record's parts
        // when the broker refuses them, so only a topic limit below that can be left.
        C::MessageSizeTooLarge | C::MessageBatchTooLarge => {
            "the broker refuses even a dead letter without the record's payload, key and headers: \
             raise max.message.bytes of the topic"
        }
        C::InvalidTopic => "dead_letter.topic is not a valid topic name",
        // A compacted topic refuses a record without a key.
        C::InvalidRecord => "the topic refuses the record: use a topic with cleanup.policy=delete",
        _ => return None,
    })
}

pub struct DeadLetters {
    producer: FutureProducer,
    /// Kept to build a fresh producer when one stops delivering (see [`renew`](Self::renew)).
    config: ClientConfig,
    topic: String,
    source_topic: String,
    origin: &'static str,
    /// The producer's `message.max.bytes`: no dead letter may weigh more.
    max_bytes: usize,
}

impl DeadLetters {
    /// A producer of dead letters to `topic` for the records of `source_topic`, built
    /// from `config` (the Kafka client settings, `source::producer_config`).
    pub fn new(
        mut config: ClientConfig,
        source_topic: &str,
        topic: String,
        origin: &'static str,
    ) -> Result<DeadLetters, KafkaError> {
        // A dead letter may be produced twice anyway (a re-read produces it again; the
        // source-position headers identify copies), so idempotence buys nothing here,
        // while its producer-ID state can keep a producer from delivering after a broker
        // restart. A bounded delivery time turns any stall into an error we retry.
        config
            .set("linger.ms", "0")
            .set("enable.idempotence", "false")
            .set("message.timeout.ms", DELIVERY_TIMEOUT.as_millis().to_string());
        let max_bytes = max_message_bytes(&config);
        let producer: FutureProducer = config.create()?;
        Ok(DeadLetters { producer, config, topic, source_topic: source_topic.to_string(), origin, max_bytes })
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

    /// Produces a dead letter for every rejected record in `records`, waits for all
    /// acknowledgements and counts them per reason. Returns how many were produced; an
    /// error means some were not, and the caller retries the whole set if it is
    /// transient (a retry may duplicate a dead letter, which its source-position headers
    /// identify) and stops if fatal.
    pub async fn send(&self, records: &[&Record]) -> Result<usize, DeadLetterError> {
        let rejected: Vec<(&Record, &Rejected)> =
            records.iter().filter_map(|r| r.outcome.as_ref().err().map(|x| (*r, &**x))).collect();
        // Each letter first whole and with its record's timestamp; then, for those the
        // broker refused, without the record's parts (a topic limit below the producer's)
        // or stamped now (a timestamp the topic does not accept).
        let mut pending: Vec<((&Record, &Rejected), Form)> =
            rejected.iter().map(|&item| (item, Form { budget: self.max_bytes, restamp: false })).collect();
        while !pending.is_empty() {
            let now_ms = chrono::Utc::now().timestamp_millis();
            let letters: Vec<Letter> = pending
                .iter()
                .map(|((r, x), form)| {
                    let mut l = Letter::new(r, x, &self.source_topic, self.origin, form.budget);
                    if form.restamp {
                        l.restamp(now_ms);
                    }
                    l
                })
                .collect();
            let deliveries = letters.iter().map(|l| self.producer.send(l.record(&self.topic), DELIVERY_TIMEOUT));
            // librdkafka fails each delivery after `message.timeout.ms`; this outer bound
            // only guards against an acknowledgement that never comes at all.
            let results = tokio::time::timeout(DELIVERY_TIMEOUT + Duration::from_secs(5), join_all(deliveries))
                .await
                .map_err(|_| {
                DeadLetterError::classify(&self.topic, KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut))
            })?;
            let mut again = Vec::new();
            for ((item, form), result) in pending.iter().zip(results) {
                match result.map_err(|(e, _)| e) {
                    Ok(_) => {}
                    Err(e) => match e.rdkafka_error_code().and_then(|code| form.after_refusal(code)) {
                        Some(next) => again.push((*item, next)),
                        None => return Err(DeadLetterError::classify(&self.topic, e)),
                    },
                }
            }
            if !again.is_empty() {
                tracing::warn!(
                    letters = again.len(),
                    topic = %self.topic,
                    "the broker refused dead letters (too large, or a timestamp the topic does not accept); \
                     sending them without the records' parts or stamped now"
                );
            }
            pending = again;
        }
        // Counted here, once all are acknowledged: a set retried after an error is
        // counted when it finally goes through.
        for (_, x) in &rejected {
            metrics::counter!(crate::telemetry::DEAD_LETTERS, "reason" => x.rejection.reason.as_str()).increment(1);
        }
        Ok(rejected.len())
    }
}

/// How a dead letter is sent: its size budget, and whether it is stamped now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Form {
    budget: usize,
    restamp: bool,
}

impl Form {
    /// How to send a letter again after the broker refused it with `code`, or `None`
    /// when nothing clickagg can change would help (the error is then classified).
    ///
    /// A refused timestamp is resent stamped now. Kafka 4.1 usually reports it as
    /// `InvalidTimestamp`, but the chaos run also saw `InvalidRecord` for two letters
    /// stamped in 2100; so `InvalidRecord` also earns one restamped try, and a topic
    /// that still refuses the letter (a compacted one, which refuses records without a
    /// key) is then fatal. A letter failed only because it shared a batch with a refused
    /// one (librdkafka's `InvalidDifferentRecord`) is resent as it was.
    fn after_refusal(self, code: RDKafkaErrorCode) -> Option<Form> {
        match code {
            RDKafkaErrorCode::InvalidDifferentRecord => Some(self),
            RDKafkaErrorCode::MessageSizeTooLarge if self.budget > 0 => Some(Form { budget: 0, ..self }),
            RDKafkaErrorCode::InvalidTimestamp | RDKafkaErrorCode::InvalidRecord if !self.restamp => {
                Some(Form { restamp: true, ..self })
            }
            _ => None,
        }
    }
}

/// The producer's `message.max.bytes`, the most a dead letter may weigh.
fn max_message_bytes(producer: &ClientConfig) -> usize {
    producer.get("message.max.bytes").and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_MAX_MESSAGE_BYTES)
}

/// One dead letter: what it carries of the source record, and the headers clickagg adds.
struct Letter<'a> {
    key: Option<&'a [u8]>,
    payload: Option<&'a [u8]>,
    source_headers: &'a [(String, Vec<u8>)],
    headers: Vec<(String, Vec<u8>)>,
    timestamp_ms: Option<i64>,
}

impl<'a> Letter<'a> {
    /// The dead letter of one rejected record, weighing at most `budget` bytes as far as
    /// leaving out the record's payload, headers and key (in that order) can make it.
    fn new(r: &Record, rejected: &'a Rejected, source_topic: &str, origin: &str, budget: usize) -> Letter<'a> {
        let headers = [
            (REASON, rejected.rejection.reason.as_str().to_string()),
            (DETAIL, rejected.rejection.detail.clone()),
            (SOURCE_TOPIC, source_topic.to_string()),
            (SOURCE_PARTITION, r.partition.to_string()),
            (SOURCE_OFFSET, r.offset.to_string()),
            (ORIGIN, origin.to_string()),
        ]
        .into_iter()
        .chain(r.timestamp_ms.map(|ts| (SOURCE_TIMESTAMP, ts.to_string())))
        .map(|(k, v)| (k.to_string(), v.into_bytes()))
        .collect();
        let mut l = Letter {
            key: rejected.key.as_deref(),
            payload: rejected.payload.as_deref(),
            source_headers: &rejected.headers,
            headers,
            timestamp_ms: r.timestamp_ms,
        };
        if l.size() > budget {
            if let Some(p) = l.payload.take() {
                l.omitted(PAYLOAD_OMITTED, p.len());
            }
        }
        if l.size() > budget && !l.source_headers.is_empty() {
            l.omitted(HEADERS_OMITTED, l.source_headers.iter().map(|(k, v)| k.len() + v.len()).sum());
            l.source_headers = &[];
        }
        if l.size() > budget {
            if let Some(k) = l.key.take() {
                l.omitted(KEY_OMITTED, k.len());
            }
        }
        l
    }

    /// Stamps the letter `now_ms`, keeping the record's own timestamp in a header.
    fn restamp(&mut self, now_ms: i64) {
        if let Some(ts) = self.timestamp_ms.replace(now_ms) {
            self.headers.push((ORIGINAL_TIMESTAMP.to_string(), ts.to_string().into_bytes()));
        }
    }

    /// Says in a header that a part of the record of `bytes` bytes was left out.
    fn omitted(&mut self, header: &str, bytes: usize) {
        self.headers.push((header.to_string(), bytes.to_string().into_bytes()));
    }

    /// What librdkafka weighs against `message.max.bytes` (`rd_kafka_msg_max_wire_size`),
    /// rounded up: key, value, each header's name and value with two length varints, and
    /// the record's own framing.
    fn size(&self) -> usize {
        const RECORD_FRAMING: usize = 64; // librdkafka counts at most 40
        self.key.map_or(0, <[u8]>::len)
            + self.payload.map_or(0, <[u8]>::len)
            + headers_size(self.source_headers)
            + headers_size(&self.headers)
            + RECORD_FRAMING
    }

    fn record<'t>(&'t self, topic: &'t str) -> FutureRecord<'t, [u8], [u8]> {
        let mut headers = OwnedHeaders::new_with_capacity(self.source_headers.len() + self.headers.len());
        for (k, v) in self.source_headers.iter().chain(&self.headers) {
            headers = headers.insert(Header { key: k, value: Some(v) });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(key) = self.key {
            record = record.key(key);
        }
        if let Some(payload) = self.payload {
            record = record.payload(payload);
        }
        // Keep the source timestamp: a dead letter says when the bad record was written.
        if let Some(ts) = self.timestamp_ms {
            record = record.timestamp(ts);
        }
        record
    }
}

/// Bytes of headers on the wire, rounded up: name, value and two varints of at most 5.
fn headers_size(headers: &[(String, Vec<u8>)]) -> usize {
    headers.iter().map(|(k, v)| k.len() + v.len() + 10).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::click::{RejectReason, Rejection};

    const LIMIT: usize = 1_000_000;

    fn rejected(key: usize, payload: usize, header: usize) -> (Record, Rejected) {
        let rejected = Rejected {
            rejection: Rejection { reason: RejectReason::Oversized, detail: "too big".into() },
            payload: Some(vec![b'p'; payload]),
            key: Some(vec![b'k'; key]),
            headers: vec![("h".into(), vec![b'h'; header])],
        };
        let record =
            Record { partition: 3, offset: 42, timestamp_ms: Some(7), outcome: Err(Box::new(rejected.clone())) };
        (record, rejected)
    }

    fn letter<'a>(r: &Record, x: &'a Rejected, budget: usize) -> Letter<'a> {
        Letter::new(r, x, "clicks", "run", budget)
    }

    fn header<'a>(l: &'a Letter<'_>, name: &str) -> Option<&'a str> {
        l.headers.iter().find(|(k, _)| k == name).map(|(_, v)| std::str::from_utf8(v).unwrap())
    }

    #[test]
    fn a_refused_timestamp_is_resent_stamped_now_whichever_code_the_broker_uses_and_only_once() {
        let first = Form { budget: LIMIT, restamp: false };
        let restamped = Form { budget: LIMIT, restamp: true };
        assert_eq!(first.after_refusal(RDKafkaErrorCode::InvalidTimestamp), Some(restamped));
        assert_eq!(first.after_refusal(RDKafkaErrorCode::InvalidRecord), Some(restamped));
        // Refused again once stamped now: nothing left to change (a compacted topic).
        assert_eq!(restamped.after_refusal(RDKafkaErrorCode::InvalidRecord), None);
        assert_eq!(restamped.after_refusal(RDKafkaErrorCode::InvalidTimestamp), None);
        // Too large: once without the record's parts, then fatal.
        assert_eq!(
            first.after_refusal(RDKafkaErrorCode::MessageSizeTooLarge),
            Some(Form { budget: 0, restamp: false })
        );
        assert_eq!(Form { budget: 0, restamp: false }.after_refusal(RDKafkaErrorCode::MessageSizeTooLarge), None);
        assert_eq!(first.after_refusal(RDKafkaErrorCode::TopicAuthorizationFailed), None);
        // A batch-mate of a refused letter goes again as it was.
        assert_eq!(restamped.after_refusal(RDKafkaErrorCode::InvalidDifferentRecord), Some(restamped));
    }

    #[test]
    fn a_letter_within_the_limit_carries_the_whole_record() {
        let (r, x) = rejected(10, 900_000, 10);
        let l = letter(&r, &x, LIMIT);
        assert_eq!(
            (l.key.map(<[u8]>::len), l.payload.map(<[u8]>::len), l.source_headers.len()),
            (Some(10), Some(900_000), 1)
        );
        assert_eq!((header(&l, SOURCE_OFFSET), header(&l, PAYLOAD_OMITTED)), (Some("42"), None));
    }

    #[test]
    fn a_letter_over_the_limit_leaves_out_the_payload_then_the_headers_then_the_key() {
        let (r, x) = rejected(10, 999_900, 10);
        let l = letter(&r, &x, LIMIT);
        assert!(l.payload.is_none() && l.key.is_some() && !l.source_headers.is_empty());
        assert_eq!(header(&l, PAYLOAD_OMITTED), Some("999900"));
        assert!(l.size() <= LIMIT);

        let (r, x) = rejected(10, 10, 999_900);
        let l = letter(&r, &x, LIMIT);
        assert!(l.payload.is_none() && l.source_headers.is_empty() && l.key.is_some());
        assert_eq!(header(&l, HEADERS_OMITTED), Some("999901"));

        let (r, x) = rejected(999_900, 10, 10);
        let l = letter(&r, &x, LIMIT);
        assert!(l.payload.is_none() && l.source_headers.is_empty() && l.key.is_none());
        assert_eq!(header(&l, KEY_OMITTED), Some("999900"));
        assert!(l.size() <= LIMIT);
        // The position always stays: the record can be found in the source topic.
        assert_eq!((header(&l, SOURCE_PARTITION), header(&l, SOURCE_OFFSET)), (Some("3"), Some("42")));
    }

    #[test]
    fn a_letter_of_budget_zero_carries_only_the_headers_clickagg_adds() {
        let (r, x) = rejected(1, 1, 1);
        let l = letter(&r, &x, 0);
        assert!(l.payload.is_none() && l.key.is_none() && l.source_headers.is_empty());
        assert_eq!(header(&l, REASON), Some("oversized"));
    }

    #[test]
    fn a_restamped_letter_carries_the_time_now_and_the_original_in_a_header() {
        let (r, x) = rejected(1, 1, 1);
        let mut l = letter(&r, &x, LIMIT);
        l.restamp(1_000_000);
        assert_eq!((l.timestamp_ms, header(&l, ORIGINAL_TIMESTAMP)), (Some(1_000_000), Some("7")));
    }

    #[test]
    fn the_limit_is_the_producers_message_max_bytes() {
        use crate::config::KafkaSettings;
        use crate::source::producer_config;
        let mut k = KafkaSettings::default();
        assert_eq!(max_message_bytes(&producer_config(&k)), 1_000_000);
        k.properties.insert("message.max.bytes".into(), crate::config::Secret::new("2000000"));
        assert_eq!(max_message_bytes(&producer_config(&k)), 2_000_000);
    }

    #[test]
    fn only_errors_an_operator_must_fix_are_fatal() {
        use RDKafkaErrorCode as C;
        let classify = |code| DeadLetterError::classify("t.dlq", KafkaError::MessageProduction(code));
        for code in [
            C::TopicAuthorizationFailed,
            C::ClusterAuthorizationFailed,
            C::SaslAuthenticationFailed,
            C::Authentication,
            C::SSL,
            C::MessageSizeTooLarge,
            C::InvalidTopic,
            C::InvalidRecord,
        ] {
            assert!(classify(code).is_fatal(), "{code:?}");
        }
        for code in
            [C::MessageTimedOut, C::QueueFull, C::NotLeaderForPartition, C::BrokerTransportFailure, C::AllBrokersDown]
        {
            assert!(!classify(code).is_fatal(), "{code:?}");
        }
        let e = classify(C::TopicAuthorizationFailed).to_string();
        assert!(e.contains("dead_letter.topic \"t.dlq\"") && e.contains("WRITE") && e.contains("ACL"), "{e}");
    }
}
