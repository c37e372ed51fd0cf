//! Click events: the contract with the ad servers (JSON, or Avro and Protobuf in the
//! Confluent wire format; field paths and timestamp units configurable), and the checks
//! that decide whether a Kafka record is a countable click or a dead letter.
//!
//! Decoding is pure: it sees the record's bytes, the record's Kafka timestamp and (for
//! Avro and Protobuf) the schema its ID names, never the wall clock, so a replay next
//! month makes exactly the decisions made today. Fetching schemas is I/O and lives in
//! `schema_registry`.

use std::fmt;
use std::time::Duration;

pub mod fields;
mod json;
pub mod wire;

use fields::Value;
pub use fields::{FieldPath, Fields, TsUnit};
pub use wire::{decode_wire_with, Format, Known, Schema, WireFormat};

/// Identifies one click across producer retries and redeliveries; the dedup key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClickId(String);

impl ClickId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClickId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Unix seconds as RFC 3339 in UTC, to the second (2026-11-30T08:15:00Z).
pub fn rfc3339(secs: u32) -> String {
    chrono::DateTime::from_timestamp(i64::from(secs), 0)
        .expect("u32 seconds are always a valid timestamp")
        .format("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// The start of an event-time minute, in seconds since the Unix epoch.
///
/// Stored in ClickHouse as `DateTime('UTC')`, which holds 32-bit unsigned seconds, so a
/// `Minute` only exists for 1970-01-01 ..= 2106-02-07; anything else is rejected at decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Minute(u32);

impl Minute {
    /// The minute containing `ts_ms` (milliseconds since the epoch), if representable.
    pub fn from_millis(ts_ms: i64) -> Option<Minute> {
        let secs = ts_ms.div_euclid(1000);
        let minute = secs - secs.rem_euclid(60);
        u32::try_from(minute).ok().map(Minute)
    }

    pub fn from_epoch_seconds(secs: u32) -> Minute {
        Minute(secs - secs % 60)
    }

    pub fn epoch_seconds(self) -> u32 {
        self.0
    }

    pub fn to_rfc3339(self) -> String {
        rfc3339(self.0)
    }
}

impl fmt::Display for Minute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

/// A valid click: what the rest of the pipeline sees.
///
/// `Id` is how the click ID is kept: [`ClickId`] (the text) by default; the pipeline
/// keeps only its dedup fingerprint (see [`decode_with`]), so a click costs no allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Click<Id = ClickId> {
    pub click_id: Id,
    pub ad_id: u64,
    /// Event time in milliseconds since the epoch, as the ad server reported it.
    pub ts_ms: i64,
    pub minute: Minute,
}

/// Why a record is not a countable click. Each reason is a metric label and the value
/// of the `clickagg-reason` header on the dead letter, so the set is closed and small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectReason {
    /// Tombstone or zero-length value.
    EmptyPayload,
    /// Larger than `validation.max_payload_bytes`.
    Oversized,
    NotUtf8,
    /// Not JSON, or not a JSON object.
    MalformedJson,
    MissingField,
    /// A field of the wrong type, an `ad_id` outside u64 (or a string of anything but
    /// its digits), an unparseable `ts`, or (JSON) a field given twice.
    WrongType,
    EmptyClickId,
    ClickIdTooLong,
    /// Event time further ahead of the Kafka record timestamp than `max_future_skew`.
    TimestampAhead,
    /// Event time further behind the Kafka record timestamp than `max_lateness`.
    TimestampBehind,
    /// Event time outside what a ClickHouse `DateTime` holds (1970..2106).
    TimestampOutOfRange,
    /// (Avro, Protobuf) Not the Confluent wire format: no magic byte 0 and schema ID,
    /// or Protobuf message indexes that do not parse or name no message of the schema.
    NotWireFormat,
    /// (Avro, Protobuf) The registry has no schema under the record's ID, or one that
    /// is not of the topic's format or does not compile.
    UnknownSchema,
    /// (Avro, Protobuf) The bytes after the header do not decode under their schema.
    MalformedPayload,
}

impl RejectReason {
    pub const ALL: [RejectReason; 14] = [
        RejectReason::EmptyPayload,
        RejectReason::Oversized,
        RejectReason::NotUtf8,
        RejectReason::MalformedJson,
        RejectReason::MissingField,
        RejectReason::WrongType,
        RejectReason::EmptyClickId,
        RejectReason::ClickIdTooLong,
        RejectReason::TimestampAhead,
        RejectReason::TimestampBehind,
        RejectReason::TimestampOutOfRange,
        RejectReason::NotWireFormat,
        RejectReason::UnknownSchema,
        RejectReason::MalformedPayload,
    ];

    /// The reasons a JSON record can have (the others are the wire format's).
    pub const JSON: [RejectReason; 11] = [
        RejectReason::EmptyPayload,
        RejectReason::Oversized,
        RejectReason::NotUtf8,
        RejectReason::MalformedJson,
        RejectReason::MissingField,
        RejectReason::WrongType,
        RejectReason::EmptyClickId,
        RejectReason::ClickIdTooLong,
        RejectReason::TimestampAhead,
        RejectReason::TimestampBehind,
        RejectReason::TimestampOutOfRange,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::EmptyPayload => "empty_payload",
            RejectReason::Oversized => "oversized",
            RejectReason::NotUtf8 => "not_utf8",
            RejectReason::MalformedJson => "malformed_json",
            RejectReason::MissingField => "missing_field",
            RejectReason::WrongType => "wrong_type",
            RejectReason::EmptyClickId => "empty_click_id",
            RejectReason::ClickIdTooLong => "click_id_too_long",
            RejectReason::TimestampAhead => "timestamp_ahead",
            RejectReason::TimestampBehind => "timestamp_behind",
            RejectReason::TimestampOutOfRange => "timestamp_out_of_range",
            RejectReason::NotWireFormat => "not_wire_format",
            RejectReason::UnknownSchema => "unknown_schema",
            RejectReason::MalformedPayload => "malformed_payload",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected record: the reason, plus a human detail for logs and the dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub detail: String,
}

/// The longest [`Rejection::detail`], in bytes (plus an ellipsis when cut). serde_json
/// quotes the offending value in its messages, so without a bound one hostile record
/// would make its log line and its dead letter's header as large as the record itself.
pub const MAX_DETAIL_BYTES: usize = 256;

impl Rejection {
    pub(crate) fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        let mut detail = detail.into();
        if detail.len() > MAX_DETAIL_BYTES {
            let mut cut = MAX_DETAIL_BYTES;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push('…');
        }
        Rejection { reason, detail }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

/// How a record is read and the limits it is judged by (`[validation]` in the
/// configuration).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_payload_bytes: usize,
    pub max_click_id_len: usize,
    pub max_future_skew: Duration,
    pub max_lateness: Duration,
    /// Where the three fields are.
    pub fields: Fields,
    /// The unit of a numeric event time.
    pub ts_unit: TsUnit,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 64 * 1024,
            max_click_id_len: 128,
            max_future_skew: Duration::from_secs(5 * 60),
            max_lateness: Duration::from_secs(6 * 3600),
            fields: Fields::default(),
            ts_unit: TsUnit::default(),
        }
    }
}

/// Decides what one Kafka record is. `record_ts_ms` is the Kafka record timestamp
/// (create or log-append time); when a record has none, the time checks are skipped
/// rather than judged against the wall clock.
///
/// ```
/// use clickagg::click::{decode, Limits, RejectReason};
///
/// let record_ts = 1_764_489_600_000; // 2025-11-30T08:00:00Z
/// let payload = br#"{"click_id":"0f5c","ad_id":1234,"ts":"2025-11-30T07:59:05.123Z","ua":"x"}"#;
/// let click = decode(Some(payload), Some(record_ts), &Limits::default()).unwrap();
/// assert_eq!((click.click_id.as_str(), click.ad_id, click.ts_ms), ("0f5c", 1234, 1_764_489_545_123));
/// assert_eq!(click.minute.to_rfc3339(), "2025-11-30T07:59:00Z");
///
/// // Seven hours behind its record: past the default lateness of six.
/// let late = br#"{"click_id":"0f5c","ad_id":1234,"ts":1764464400000}"#;
/// let rejected = decode(Some(late), Some(record_ts), &Limits::default()).unwrap_err();
/// assert_eq!(rejected.reason, RejectReason::TimestampBehind);
/// ```
pub fn decode(payload: Option<&[u8]>, record_ts_ms: Option<i64>, limits: &Limits) -> Result<Click, Rejection> {
    decode_with(payload, record_ts_ms, limits, |id| ClickId(id.to_owned()))
}

/// [`decode`] of a JSON record, keeping the click ID as `id_of` makes it from the text
/// borrowed from the payload (the pipeline hashes it to its fingerprint there and then).
pub fn decode_with<Id>(
    payload: Option<&[u8]>,
    record_ts_ms: Option<i64>,
    limits: &Limits,
    id_of: impl FnOnce(&str) -> Id,
) -> Result<Click<Id>, Rejection> {
    let bytes = sized(payload, limits)?;
    let text = std::str::from_utf8(bytes)
        .map_err(|e| Rejection::new(RejectReason::NotUtf8, format!("invalid UTF-8 at byte {}", e.valid_up_to())))?;
    let values = json::extract(text, &limits.fields)?;
    judge(values, record_ts_ms, limits, id_of)
}

/// The payload, unless it is empty or larger than the limit: the checks every format
/// makes before reading a byte.
fn sized<'a>(payload: Option<&'a [u8]>, limits: &Limits) -> Result<&'a [u8], Rejection> {
    let bytes = match payload {
        None | Some([]) => return Err(Rejection::new(RejectReason::EmptyPayload, "record has no value")),
        Some(b) => b,
    };
    if bytes.len() > limits.max_payload_bytes {
        return Err(Rejection::new(
            RejectReason::Oversized,
            format!("{} bytes, limit {}", bytes.len(), limits.max_payload_bytes),
        ));
    }
    Ok(bytes)
}

/// Reads the values found at the three paths (click ID, ad ID, event time) as a
/// click's fields and judges them by the limits: the rules every format shares.
fn judge<Id>(
    values: [Option<Value<'_>>; 3],
    record_ts_ms: Option<i64>,
    limits: &Limits,
    id_of: impl FnOnce(&str) -> Id,
) -> Result<Click<Id>, Rejection> {
    let f = &limits.fields;
    let [click_id, ad_id, ts] = values;
    let missing = |name: &str, path: &FieldPath| {
        Rejection::new(RejectReason::MissingField, format!("missing field `{path}` ({name})"))
    };
    let click_id = click_id.ok_or_else(|| missing("click_id", &f.click_id))?;
    let ad_id = ad_id.ok_or_else(|| missing("ad_id", &f.ad_id))?;
    let ts = ts.ok_or_else(|| missing("ts", &f.ts))?;
    let click_id = fields::click_id(&f.click_id, click_id)?;
    let ad_id = fields::ad_id(&f.ad_id, ad_id)?;
    let ts = fields::ts_millis(&f.ts, ts, limits.ts_unit)?;

    if click_id.is_empty() {
        return Err(Rejection::new(RejectReason::EmptyClickId, "click_id is empty"));
    }
    if click_id.len() > limits.max_click_id_len {
        return Err(Rejection::new(
            RejectReason::ClickIdTooLong,
            format!("click_id has {} bytes, limit {}", click_id.len(), limits.max_click_id_len),
        ));
    }
    if let Some(record_ts) = record_ts_ms {
        // The producer chooses both times, so any two i64s meet here (and an event time
        // converted from seconds goes past i64): the difference is exact in i128, and
        // the limits are compared as the u128 milliseconds a Duration holds, never cast
        // down to i64.
        let ahead = ts - i128::from(record_ts);
        if ahead > 0 && ahead.unsigned_abs() > limits.max_future_skew.as_millis() {
            return Err(Rejection::new(
                RejectReason::TimestampAhead,
                format!("ts is {ahead} ms ahead of the record timestamp"),
            ));
        }
        if ahead < 0 && ahead.unsigned_abs() > limits.max_lateness.as_millis() {
            return Err(Rejection::new(
                RejectReason::TimestampBehind,
                format!("ts is {} ms behind the record timestamp", ahead.unsigned_abs()),
            ));
        }
    }
    let in_range = i64::try_from(ts).ok().and_then(|ms| Some((ms, Minute::from_millis(ms)?)));
    let (ts_ms, minute) = in_range.ok_or_else(|| {
        Rejection::new(RejectReason::TimestampOutOfRange, format!("ts {ts} ms is outside 1970..2106"))
    })?;
    Ok(Click { click_id: id_of(&click_id), ad_id, ts_ms, minute })
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    const RECORD_TS: i64 = 1_764_489_600_000; // 2025-11-30T08:00:00Z

    fn decode_str(s: &str) -> Result<Click, Rejection> {
        decode(Some(s.as_bytes()), Some(RECORD_TS), &Limits::default())
    }

    fn reason(s: &str) -> RejectReason {
        decode_str(s).unwrap_err().reason
    }

    #[test]
    fn accepts_epoch_millis_and_rfc3339_and_ignores_extra_fields() {
        let a = decode_str(r#"{"click_id":"c1","ad_id":7,"ts":1764489605123,"ua":"x"}"#).unwrap();
        let b = decode_str(r#"{"ts":"2025-11-30T08:00:05.123Z","ad_id":7,"click_id":"c1"}"#).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.minute.to_rfc3339(), "2025-11-30T08:00:00Z");
        assert_eq!(a.click_id.as_str(), "c1");
    }

    #[test]
    fn rfc3339_offsets_are_normalised_to_utc() {
        let c = decode_str(r#"{"click_id":"c","ad_id":1,"ts":"2025-11-30T09:01:30+01:00"}"#).unwrap();
        assert_eq!(c.minute.to_rfc3339(), "2025-11-30T08:01:00Z");
    }

    #[test]
    fn every_bad_input_class_has_its_reason() {
        assert_eq!(decode(None, Some(RECORD_TS), &Limits::default()).unwrap_err().reason, RejectReason::EmptyPayload);
        assert_eq!(reason(""), RejectReason::EmptyPayload);
        assert_eq!(reason("{not json"), RejectReason::MalformedJson);
        assert_eq!(reason("[1,2]"), RejectReason::WrongType);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":1}"#), RejectReason::MissingField);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":"one","ts":1764489605123}"#), RejectReason::WrongType);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":-1,"ts":1764489605123}"#), RejectReason::WrongType);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":1,"ts":"yesterday"}"#), RejectReason::WrongType);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":1,"ts":1.5}"#), RejectReason::WrongType);
        assert_eq!(reason(r#"{"click_id":"","ad_id":1,"ts":1764489605123}"#), RejectReason::EmptyClickId);
        let long = format!(r#"{{"click_id":"{}","ad_id":1,"ts":1764489605123}}"#, "x".repeat(129));
        assert_eq!(reason(&long), RejectReason::ClickIdTooLong);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":1,"ts":1764499605123}"#), RejectReason::TimestampAhead);
        assert_eq!(reason(r#"{"click_id":"c","ad_id":1,"ts":1700000000000}"#), RejectReason::TimestampBehind);
        let bad_utf8 = b"{\"click_id\":\"\xff\",\"ad_id\":1,\"ts\":1}";
        assert_eq!(decode(Some(bad_utf8), None, &Limits::default()).unwrap_err().reason, RejectReason::NotUtf8);
        let big = vec![b' '; 70 * 1024];
        assert_eq!(decode(Some(&big), None, &Limits::default()).unwrap_err().reason, RejectReason::Oversized);
        assert_eq!(
            decode(Some(br#"{"click_id":"c","ad_id":1,"ts":-120000}"#), None, &Limits::default()).unwrap_err().reason,
            RejectReason::TimestampOutOfRange
        );
    }

    #[test]
    fn lateness_is_judged_against_the_record_timestamp_not_the_wall_clock() {
        // An event from 2020 inside a record stamped in 2020 is on time, whatever today is.
        let then = 1_577_836_800_000; // 2020-01-01
        let payload = br#"{"click_id":"c","ad_id":1,"ts":1577836790000}"#;
        assert!(decode(Some(payload), Some(then), &Limits::default()).is_ok());
    }

    #[test]
    fn the_limits_are_inclusive() {
        let limits = Limits::default();
        let skew = limits.max_future_skew.as_millis() as i64;
        let late = limits.max_lateness.as_millis() as i64;
        let at = |ts: i64| format!(r#"{{"click_id":"c","ad_id":1,"ts":{ts}}}"#);
        assert!(decode_str(&at(RECORD_TS + skew)).is_ok());
        assert!(decode_str(&at(RECORD_TS - late)).is_ok());
        assert_eq!(reason(&at(RECORD_TS + skew + 1)), RejectReason::TimestampAhead);
        assert_eq!(reason(&at(RECORD_TS - late - 1)), RejectReason::TimestampBehind);
    }

    #[test]
    fn a_detail_quoting_a_huge_value_is_cut_on_a_character_boundary() {
        let huge = format!(r#"{{"click_id":"c","ad_id":"{}","ts":1764489605123}}"#, "é".repeat(20_000));
        let e = decode_str(&huge).unwrap_err();
        assert_eq!(e.reason, RejectReason::WrongType);
        assert!(e.detail.len() <= MAX_DETAIL_BYTES + '…'.len_utf8() && e.detail.ends_with('…'), "{}", e.detail);
        assert!(e.detail.starts_with("ad_id: \"ééé"), "{}", e.detail);
    }

    fn at(click_id: &str, ad_id: &str, ts: &str, ts_unit: TsUnit) -> Limits {
        let p = |s: &str| FieldPath::parse(s).unwrap();
        Limits { fields: Fields { click_id: p(click_id), ad_id: p(ad_id), ts: p(ts) }, ts_unit, ..Limits::default() }
    }

    #[test]
    fn ad_ids_may_be_strings_of_digits_but_nothing_else_and_never_overflow() {
        let ts = 1_764_489_605_123i64;
        let with = |ad: &str| decode_str(&format!(r#"{{"click_id":"c","ad_id":{ad},"ts":{ts}}}"#));
        assert_eq!(with(r#""1234""#).unwrap().ad_id, 1234);
        assert_eq!(with(r#""18446744073709551615""#).unwrap().ad_id, u64::MAX);
        assert_eq!(with("18446744073709551615").unwrap().ad_id, u64::MAX);
        for bad in [r#""18446744073709551616""#, r#""-1""#, r#""1.0""#, r#""""#, r#""12ab""#, "18446744073709551616"] {
            assert_eq!(with(bad).unwrap_err().reason, RejectReason::WrongType, "{bad}");
        }
    }

    #[test]
    fn numeric_timestamps_are_read_in_the_configured_unit() {
        let body = |ts: i64| format!(r#"{{"click_id":"c","ad_id":1,"ts":{ts}}}"#);
        let ms = 1_764_489_605_123i64;
        let cases = [
            (TsUnit::Seconds, ms / 1000, ms / 1000 * 1000),
            (TsUnit::Millis, ms, ms),
            (TsUnit::Micros, ms * 1000 + 456, ms),
            (TsUnit::Auto, ms / 1000, ms / 1000 * 1000),
            (TsUnit::Auto, ms, ms),
            (TsUnit::Auto, ms * 1000 + 456, ms),
        ];
        for (unit, sent, want) in cases {
            let limits = Limits { ts_unit: unit, ..Limits::default() };
            let c = decode(Some(body(sent).as_bytes()), Some(RECORD_TS), &limits).unwrap();
            assert_eq!(c.ts_ms, want, "{sent} in {unit}");
        }
        // Seconds read as milliseconds are 1970: far behind the record, not a wrap.
        assert_eq!(reason(&body(ms / 1000)), RejectReason::TimestampBehind);
        // The largest i64 of seconds is past any millisecond an i64 holds: still judged.
        let s = Limits { ts_unit: TsUnit::Seconds, ..Limits::default() };
        let e = decode(Some(body(i64::MAX).as_bytes()), Some(RECORD_TS), &s).unwrap_err();
        assert_eq!(e.reason, RejectReason::TimestampAhead);
        let e = decode(Some(body(i64::MAX).as_bytes()), None, &s).unwrap_err();
        assert_eq!(e.reason, RejectReason::TimestampOutOfRange);
        // RFC 3339 strings do not depend on the unit.
        let rfc = br#"{"click_id":"c","ad_id":1,"ts":"2025-11-30T08:00:05.123Z"}"#;
        assert_eq!(decode(Some(rfc), Some(RECORD_TS), &s).unwrap().ts_ms, ms);
    }

    #[test]
    fn fields_are_found_at_nested_paths() {
        let limits = at("event.id", "ad.id", "meta.time", TsUnit::Auto);
        let payload =
            br#"{"meta":{"time":1764489605,"x":[1]},"ad":{"id":"77","name":"a"},"event":{"id":"e-1"},"click_id":"no"}"#;
        let c = decode(Some(payload), Some(RECORD_TS), &limits).unwrap();
        assert_eq!((c.click_id.as_str(), c.ad_id, c.ts_ms), ("e-1", 77, 1_764_489_605_000));
        let r = |p: &str| decode(Some(p.as_bytes()), Some(RECORD_TS), &limits).unwrap_err();
        let e = r(r#"{"meta":{"time":1764489605},"ad":{"id":7},"event":{}}"#);
        assert_eq!((e.reason, e.detail.as_str()), (RejectReason::MissingField, "missing field `event.id` (click_id)"));
        assert_eq!(r(r#"{"meta":{"time":1764489605},"ad":{"id":7}}"#).reason, RejectReason::MissingField);
        let e = r(r#"{"meta":{"time":1764489605},"ad":[7],"event":{"id":"e"}}"#);
        assert_eq!(e.reason, RejectReason::WrongType, "{e}");
        assert!(e.detail.contains("an object at `ad`"), "{e}");
        assert_eq!(r(r#"{"meta":{"time":1764489605},"ad":"7","event":{"id":"e"}}"#).reason, RejectReason::WrongType);
        let e = r(r#"{"meta":{"time":1764489605},"ad":{"id":7,"id":8},"event":{"id":"e"}}"#);
        assert_eq!((e.reason, e.detail.contains("duplicate field `ad.id`")), (RejectReason::WrongType, true), "{e}");
        assert_eq!(
            r(r#"{"meta":{"time":1764489605},"ad":{"id":7},"event":{"id":"e"},"ad":{}}"#).reason,
            RejectReason::WrongType
        );
        assert_eq!(
            r(r#"{"meta":{"time":1764489605},"ad":{"id":7,]},"event":{"id":"e"}}"#).reason,
            RejectReason::MalformedJson
        );
        assert_eq!(r(r#"{"meta":{"time":1.5},"ad":{"id":7},"event":{"id":"e"}}"#).reason, RejectReason::WrongType);
    }

    #[test]
    fn minutes_round_down_including_before_the_epoch_second() {
        assert_eq!(Minute::from_millis(59_999).unwrap().epoch_seconds(), 0);
        assert_eq!(Minute::from_millis(60_000).unwrap().epoch_seconds(), 60);
        assert_eq!(Minute::from_millis(-1), None);
    }
}
