//! A consumed Kafka message turned into a [`Record`] with a [`Decoder`]
//! (`record`), its headers read from librdkafka for the dead letter.

use rdkafka::message::{BorrowedMessage, Message};

use crate::record::{Decoder, Record, Rejected};

/// Decodes one consumed message with `decoder` (its schema resolved first,
/// [`Decoder::resolve`]).
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
