//! A consumed message, decoded: the [`Decoder`] every reader uses (JSON, or Avro and
//! Protobuf with their schemas resolved first), and the [`Record`] it makes, which
//! keeps its raw bytes only when rejected (for the dead-letter topic).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::message::{BorrowedMessage, Message};

use crate::click::{decode_wire_with, decode_with, Click, Limits, Rejection, WireFormat};
use crate::config::{ConfigError, Format, Settings};
use crate::dedup::{Fingerprint, Fingerprinter};
use crate::schema_registry::{RegistryError, SchemaRegistry};

/// One consumed record, decoded. Only rejected records keep their raw bytes (for the
/// dead-letter topic); valid ones keep just what the pipeline needs.
#[derive(Debug)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    /// A valid click keeps its ID only as its dedup fingerprint.
    pub outcome: Result<Click<Fingerprint>, Box<Rejected>>,
}

/// What decoding a record needs: the validation limits, the deployment's fingerprint
/// key and, for Avro and Protobuf, the schemas the records name.
#[derive(Clone)]
pub struct Decoder {
    pub limits: Limits,
    pub fingerprints: Fingerprinter,
    /// The topic's wire format and its schemas (`None`: JSON).
    pub schemas: Option<Arc<SchemaRegistry>>,
}

impl Decoder {
    /// The decoder every reader of these settings uses (a member, a replay, reconcile):
    /// these limits, this fingerprint key, this format (`source.format`) and its schemas.
    pub fn from_settings(s: &Settings) -> Result<Decoder, ConfigError> {
        let format = match s.source.format {
            Format::Json => None,
            Format::Avro => Some(WireFormat::Avro),
            Format::Protobuf => Some(WireFormat::Protobuf),
        };
        let schemas = match format {
            Some(f) => Some(Arc::new(SchemaRegistry::new(&s.source, f)?)),
            None => None,
        };
        Ok(Decoder {
            limits: s.validation.limits(),
            fingerprints: Fingerprinter::new(s.dedup.fingerprint_key.expose()),
            schemas,
        })
    }

    /// Makes sure the schema of every record among `payloads` is known, so that
    /// [`Record::decode`] can decide each of them: an Avro or Protobuf topic asks the
    /// registry for the IDs it has not seen, waiting out an outage (`answering` is told
    /// whether the registry answers: a member turns not ready meanwhile) — a record is
    /// never a dead letter because the registry is away.
    pub async fn resolve(
        &self,
        ids: Vec<u32>,
        max_backoff: Duration,
        shutdown: &tokio_util::sync::CancellationToken,
        answering: impl Fn(bool),
    ) -> Result<(), crate::retry::Stopped<RegistryError>> {
        let Some(registry) = &self.schemas else { return Ok(()) };
        registry.resolve(ids, max_backoff, shutdown, |outage| answering(outage.is_none())).await
    }

    /// The schema IDs the records among `payloads` name (none for JSON), for
    /// [`Decoder::resolve`]: taken out first, so that no record is held across the wait.
    pub fn schema_ids<'a>(&self, payloads: impl IntoIterator<Item = Option<&'a [u8]>>) -> Vec<u32> {
        match &self.schemas {
            None => Vec::new(),
            Some(_) => payloads.into_iter().filter_map(crate::click::wire::schema_id).collect(),
        }
    }

    /// Decides one record (its schema resolved first, see [`Decoder::resolve`]).
    pub fn decode<Id>(
        &self,
        payload: Option<&[u8]>,
        timestamp_ms: Option<i64>,
        id_of: impl FnOnce(&str) -> Id,
    ) -> Result<Click<Id>, Rejection> {
        match &self.schemas {
            None => decode_with(payload, timestamp_ms, &self.limits, id_of),
            Some(registry) => {
                decode_wire_with(registry.format(), payload, timestamp_ms, &self.limits, |id| registry.known(id), id_of)
            }
        }
    }
}

/// A rejected record with everything the dead letter must carry.
#[derive(Debug, Clone)]
pub struct Rejected {
    pub rejection: Rejection,
    pub payload: Option<Vec<u8>>,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Record {
    pub fn decode(msg: &BorrowedMessage<'_>, decoder: &Decoder) -> Record {
        let timestamp_ms = msg.timestamp().to_millis();
        let fingerprint = |id: &str| decoder.fingerprints.of(id);
        let outcome = decoder.decode(msg.payload(), timestamp_ms, fingerprint).map_err(|rejection| {
            let headers = source_headers(msg);
            Box::new(Rejected {
                rejection,
                payload: msg.payload().map(<[u8]>::to_vec),
                key: msg.key().map(<[u8]>::to_vec),
                headers,
            })
        });
        Record { partition: msg.partition(), offset: msg.offset(), timestamp_ms, outcome }
    }
}

/// The headers of a consumed record as (key, value) pairs; a key that is not UTF-8 is
/// converted lossily (U+FFFD), an absent value becomes empty.
///
/// Read from librdkafka directly: rdkafka's own header accessor unwraps every key as
/// UTF-8 and panics on one that is not, which any producer outside Rust can send.
fn source_headers(msg: &BorrowedMessage<'_>) -> Vec<(String, Vec<u8>)> {
    use rdkafka::bindings::{rd_kafka_message_headers, rd_kafka_resp_err_t};
    let mut native = std::ptr::null_mut();
    // SAFETY: `msg.ptr()` is the live librdkafka message `msg` borrows; the headers
    // object it hands out belongs to that message and lives as long as it.
    let err = unsafe { rd_kafka_message_headers(msg.ptr(), &mut native) };
    if err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || native.is_null() {
        return Vec::new(); // no headers (RD_KAFKA_RESP_ERR__NOENT)
    }
    // SAFETY: as above; `msg` outlives this call.
    unsafe { header_pairs(native) }
}

/// Every header of a librdkafka headers object, copied out.
///
/// # Safety
/// `headers` must point to a live `rd_kafka_headers_t` for the duration of the call.
pub(super) unsafe fn header_pairs(headers: *const rdkafka::bindings::rd_kafka_headers_t) -> Vec<(String, Vec<u8>)> {
    use rdkafka::bindings::{rd_kafka_header_cnt, rd_kafka_header_get_all, rd_kafka_resp_err_t};
    let mut out = Vec::new();
    for idx in 0..rd_kafka_header_cnt(headers) {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
        let err = rd_kafka_header_get_all(headers, idx, &mut name, &mut value, &mut size);
        if err != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // librdkafka keeps names NUL-terminated and values as (pointer, size) in the object.
        let key = std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned();
        let value =
            if value.is_null() { Vec::new() } else { std::slice::from_raw_parts(value.cast::<u8>(), size).to_vec() };
        out.push((key, value));
    }
    out
}
