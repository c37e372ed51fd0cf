//! Avro and Protobuf records in the Confluent wire format: magic byte 0, the schema ID
//! (4 bytes, big-endian), for Protobuf the message indexes (a zig-zag varint count, then
//! that many zig-zag varints; a single 0 byte for the first message), then the payload.
//!
//! Pure: a record is decoded under the schema its ID names, as the registry gave it
//! (the writer's schema, never resolved against another), so that records under every
//! version of a schema decode by their own. Fetching and caching schemas is I/O
//! (`schema_registry`); compiling registry text into a [`Schema`] is here.

use std::sync::Arc;

use apache_avro::types::Value as Avro;
use prost_reflect::{DynamicMessage, MessageDescriptor, ReflectMessage, Value as Proto};

use super::fields::{FieldPath, Value};
use super::{judge, sized, Click, Limits, RejectReason, Rejection};

/// The binary encodings of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireFormat {
    Avro,
    Protobuf,
}

impl WireFormat {
    /// The registry's `schemaType` (absent means Avro).
    pub fn schema_type(self) -> &'static str {
        match self {
            WireFormat::Avro => "AVRO",
            WireFormat::Protobuf => "PROTOBUF",
        }
    }
}

/// A compiled schema.
#[derive(Debug)]
pub enum Schema {
    Avro(apache_avro::Schema),
    Protobuf(prost_reflect::FileDescriptor),
}

/// What the registry says of a schema ID. Both answers are final: a registry never
/// reuses an ID for another schema, so each is cached for the life of the process.
#[derive(Debug, Clone)]
pub enum Known {
    Schema(Arc<Schema>),
    /// No such ID (404), or a schema this topic's format cannot use: records under it
    /// are dead letters (`unknown_schema`), with this detail.
    Unusable(String),
}

/// The name the main file of a Protobuf schema compiles under; the references keep
/// their own names (the ones its `import`s use).
const MAIN_PROTO: &str = "clickagg-schema.proto";

impl Schema {
    /// Compiles the registry's text of a schema of `format` (with `references`, the
    /// schemas it imports, by the names it imports them under). `Err` says why it
    /// cannot be used.
    pub fn compile(format: WireFormat, text: &str, references: &[(String, String)]) -> Result<Schema, String> {
        match format {
            WireFormat::Avro => {
                if !references.is_empty() {
                    let others: Vec<&str> = references.iter().map(|(_, t)| t.as_str()).collect();
                    let (main, _) = apache_avro::Schema::parse_str_with_list(text, &others)
                        .map_err(|e| format!("not an Avro schema: {e}"))?;
                    return Ok(Schema::Avro(main));
                }
                apache_avro::Schema::parse_str(text).map(Schema::Avro).map_err(|e| format!("not an Avro schema: {e}"))
            }
            WireFormat::Protobuf => {
                let mut files = Sources(references.to_vec());
                files.0.push((MAIN_PROTO.to_string(), text.to_string()));
                let mut resolver = protox::file::ChainFileResolver::new();
                resolver.add(files);
                resolver.add(protox::file::GoogleFileResolver::new());
                let mut compiler = protox::Compiler::with_file_resolver(resolver);
                compiler.open_file(MAIN_PROTO).map_err(|e| format!("not a Protobuf schema: {e}"))?;
                let file = compiler.descriptor_pool().get_file_by_name(MAIN_PROTO);
                file.map(Schema::Protobuf).ok_or_else(|| "the Protobuf schema compiled to nothing".to_string())
            }
        }
    }

    fn format(&self) -> WireFormat {
        match self {
            Schema::Avro(_) => WireFormat::Avro,
            Schema::Protobuf(_) => WireFormat::Protobuf,
        }
    }
}

/// Protobuf files by name, for `import`s.
struct Sources(Vec<(String, String)>);

impl protox::file::FileResolver for Sources {
    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        match self.0.iter().find(|(n, _)| n == name) {
            Some((n, text)) => protox::file::File::from_source(n, text),
            None => Err(protox::Error::file_not_found(name)),
        }
    }
}

/// The schema ID of a record in the wire format, if it has the header.
pub fn schema_id(payload: Option<&[u8]>) -> Option<u32> {
    match payload? {
        [0, a, b, c, d, ..] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        _ => None,
    }
}

/// Decides what one record of an Avro or Protobuf topic is, under the schema its ID
/// names (`lookup` answers what the registry said of that ID; `None` only for an ID it
/// was never asked about, which the caller makes impossible by resolving every ID of a
/// poll batch first). The checks after the fields are read are JSON's.
pub fn decode_wire_with<Id>(
    format: WireFormat,
    payload: Option<&[u8]>,
    record_ts_ms: Option<i64>,
    limits: &Limits,
    lookup: impl FnOnce(u32) -> Option<Known>,
    id_of: impl FnOnce(&str) -> Id,
) -> Result<Click<Id>, Rejection> {
    let bytes = sized(payload, limits)?;
    let Some(id) = schema_id(Some(bytes)) else {
        let detail = match bytes.first() {
            Some(0) => format!("{} bytes: shorter than the 5-byte header", bytes.len()),
            Some(b) => format!("first byte {b:#04x}, not the magic byte 0"),
            None => "empty".to_string(),
        };
        return Err(Rejection::new(RejectReason::NotWireFormat, detail));
    };
    let body = &bytes[5..];
    let schema = match lookup(id) {
        Some(Known::Schema(s)) => s,
        Some(Known::Unusable(why)) => {
            return Err(Rejection::new(RejectReason::UnknownSchema, format!("schema {id}: {why}")));
        }
        None => panic!("schema {id} was not resolved before decoding: a bug in the caller"),
    };
    if schema.format() != format {
        // The cache answers by the topic's format (`Known::Unusable` for another), so
        // this is only reachable through a caller mixing caches of two topics.
        return Err(Rejection::new(RejectReason::UnknownSchema, format!("schema {id} is not {format:?}")));
    }
    let values = match &*schema {
        Schema::Avro(s) => avro_values(s, body, limits)?,
        Schema::Protobuf(file) => protobuf_values(file, body, limits)?,
    };
    judge(values, record_ts_ms, limits, id_of)
}

fn malformed(detail: impl std::fmt::Display) -> Rejection {
    Rejection::new(RejectReason::MalformedPayload, detail.to_string())
}

fn avro_values(
    schema: &apache_avro::Schema,
    body: &[u8],
    limits: &Limits,
) -> Result<[Option<Value<'static>>; 3], Rejection> {
    let mut reader = body;
    let reader_of = apache_avro::reader::datum::GenericDatumReader::builder(schema).build().map_err(malformed)?;
    let record = reader_of.read_value(&mut reader).map_err(|e| malformed(format!("not Avro of its schema: {e}")))?;
    if !reader.is_empty() {
        // Bytes its schema does not account for: most likely another schema's record.
        return Err(malformed(format!("{} bytes left after the record its schema describes", reader.len())));
    }
    let mut out: [Option<Value<'static>>; 3] = [None, None, None];
    for (slot, (_, path)) in out.iter_mut().zip(limits.fields.named()) {
        *slot = avro_at(&record, path)?;
    }
    Ok(out)
}

/// The value at `path` in an Avro record; `None` where a record lacks a field or an
/// optional field (a union with null) is null.
fn avro_at(record: &Avro, path: &FieldPath) -> Result<Option<Value<'static>>, Rejection> {
    let mut here = record;
    for (depth, name) in path.segments().iter().enumerate() {
        here = match unwrap_union(here) {
            Avro::Record(fields) => match fields.iter().find(|(n, _)| n == name) {
                Some((_, v)) => v,
                None => return Ok(None),
            },
            other => {
                let at = path.segments()[..depth].join(".");
                return Err(Rejection::new(
                    RejectReason::WrongType,
                    format!("{path}: `{at}` is {}, not a record", avro_kind(other)),
                ));
            }
        };
    }
    Ok(match unwrap_union(here) {
        Avro::Null => None,
        Avro::String(s) => Some(Value::Str(s.clone().into())),
        Avro::Uuid(u) => Some(Value::Str(u.to_string().into())),
        Avro::Int(n) => Some(Value::Int((*n).into())),
        Avro::Long(n) => Some(Value::Int((*n).into())),
        Avro::TimestampMillis(ms) => Some(Value::TimeMillis((*ms).into())),
        Avro::TimestampMicros(us) => Some(Value::TimeMillis(i128::from(*us).div_euclid(1_000))),
        Avro::TimestampNanos(ns) => Some(Value::TimeMillis(i128::from(*ns).div_euclid(1_000_000))),
        other => Some(Value::Other(avro_kind(other))),
    })
}

fn unwrap_union(v: &Avro) -> &Avro {
    match v {
        Avro::Union(_, inner) => inner,
        other => other,
    }
}

fn avro_kind(v: &Avro) -> &'static str {
    match v {
        Avro::Null => "null",
        Avro::Boolean(_) => "a boolean",
        Avro::Float(_) | Avro::Double(_) => "a float",
        Avro::Bytes(_) | Avro::Fixed(..) => "bytes",
        Avro::Enum(..) => "an enum",
        Avro::Array(_) => "an array",
        Avro::Map(_) => "a map",
        Avro::Record(_) => "a record",
        Avro::LocalTimestampMillis(_) | Avro::LocalTimestampMicros(_) | Avro::LocalTimestampNanos(_) => {
            "a local timestamp (no time zone)"
        }
        _ => "a value of another logical type",
    }
}

/// Reads a zig-zag varint (Confluent's `ByteUtils.readVarint`, 32 bits).
fn zigzag_varint(bytes: &mut &[u8]) -> Option<i32> {
    let mut raw: u64 = 0;
    for shift in (0..35).step_by(7) {
        let (&b, rest) = bytes.split_first()?;
        *bytes = rest;
        raw |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            let raw = u32::try_from(raw).ok()?;
            return Some(((raw >> 1) as i32) ^ -((raw & 1) as i32));
        }
    }
    None
}

/// The message the indexes name: the path of positions from the file's top-level
/// messages down through nested ones; an empty path (a single 0 byte) is the first.
fn message_of(file: &prost_reflect::FileDescriptor, body: &mut &[u8]) -> Result<MessageDescriptor, Rejection> {
    let bad = |detail: String| Rejection::new(RejectReason::NotWireFormat, detail);
    let count = zigzag_varint(body).ok_or_else(|| bad("the message indexes do not parse".into()))?;
    // More levels than any schema nests is no index of a real message.
    if !(0..=64).contains(&count) {
        return Err(bad(format!("{count} message indexes")));
    }
    let mut indexes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        indexes.push(zigzag_varint(body).ok_or_else(|| bad("the message indexes do not parse".into()))?);
    }
    if indexes.is_empty() {
        indexes.push(0);
    }
    let nth = |mut it: Box<dyn Iterator<Item = MessageDescriptor> + '_>, i: i32| {
        usize::try_from(i).ok().and_then(|i| it.nth(i))
    };
    let mut message = nth(Box::new(file.messages()), indexes[0]);
    for &i in &indexes[1..] {
        message = message.and_then(|m| nth(Box::new(m.child_messages()), i));
    }
    message.ok_or_else(|| bad(format!("message indexes {indexes:?} name no message of the schema")))
}

fn protobuf_values(
    file: &prost_reflect::FileDescriptor,
    mut body: &[u8],
    limits: &Limits,
) -> Result<[Option<Value<'static>>; 3], Rejection> {
    let descriptor = message_of(file, &mut body)?;
    let message = DynamicMessage::decode(descriptor.clone(), body)
        .map_err(|e| malformed(format!("not a {} message: {e}", descriptor.full_name())))?;
    let mut out: [Option<Value<'static>>; 3] = [None, None, None];
    for (slot, (_, path)) in out.iter_mut().zip(limits.fields.named()) {
        *slot = protobuf_at(&message, path)?;
    }
    Ok(out)
}

/// The value at `path` in a message; `None` where the message does not carry the field
/// (proto3 cannot tell a field at its default — 0, "" — from one not sent: declare such
/// fields `optional` to send 0).
fn protobuf_at(message: &DynamicMessage, path: &FieldPath) -> Result<Option<Value<'static>>, Rejection> {
    protobuf_below(message, path.segments(), path)
}

fn protobuf_below(
    message: &DynamicMessage,
    segments: &[String],
    path: &FieldPath,
) -> Result<Option<Value<'static>>, Rejection> {
    let (name, rest) = segments.split_first().expect("a path has at least one segment");
    if !message.has_field_by_name(name) {
        return Ok(None);
    }
    let value = message.get_field_by_name(name).expect("has_field_by_name said so");
    match (&*value, rest.is_empty()) {
        (v, true) => Ok(Some(protobuf_leaf(v))),
        (Proto::Message(inner), false) => protobuf_below(inner, rest, path),
        (other, false) => Err(Rejection::new(
            RejectReason::WrongType,
            format!("{path}: `{name}` is {}, not a message", protobuf_kind(other)),
        )),
    }
}

fn protobuf_leaf(v: &Proto) -> Value<'static> {
    match v {
        Proto::String(s) => Value::Str(s.clone().into()),
        Proto::I32(n) => Value::Int((*n).into()),
        Proto::I64(n) => Value::Int((*n).into()),
        Proto::U32(n) => Value::Int((*n).into()),
        Proto::U64(n) => Value::Int((*n).into()),
        Proto::Message(m) if m.descriptor().full_name() == "google.protobuf.Timestamp" => {
            let int = |name: &str| match m.get_field_by_name(name).as_deref() {
                Some(Proto::I64(n)) => i128::from(*n),
                Some(Proto::I32(n)) => i128::from(*n),
                _ => 0,
            };
            Value::TimeMillis(int("seconds") * 1_000 + int("nanos").div_euclid(1_000_000))
        }
        other => Value::Other(protobuf_kind(other)),
    }
}

fn protobuf_kind(v: &Proto) -> &'static str {
    match v {
        Proto::Bool(_) => "a boolean",
        Proto::F32(_) | Proto::F64(_) => "a float",
        Proto::Bytes(_) => "bytes",
        Proto::EnumNumber(_) => "an enum",
        Proto::List(_) => "a repeated field",
        Proto::Map(_) => "a map",
        Proto::Message(_) => "a message",
        Proto::String(_) => "a string",
        _ => "an integer",
    }
}

/// How the records of the topic are encoded (guide, "Click events").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// A JSON object per record.
    #[default]
    Json,
    /// Avro in the Confluent wire format, schemas from `source.schema_registry`.
    Avro,
    /// Protobuf in the Confluent wire format, schemas from `source.schema_registry`.
    Protobuf,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Avro => "avro",
            Format::Protobuf => "protobuf",
        }
    }

    /// Whether records name a schema in a registry (the Confluent wire format).
    pub fn uses_registry(self) -> bool {
        self != Format::Json
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::click::{Fields, TsUnit};
    use crate::produce::encode::{click, schema_text};
    use crate::produce::Encoding;

    const RECORD_TS: i64 = 1_764_489_600_000; // 2025-11-30T08:00:00Z
    const TS: i64 = 1_764_489_605_123;

    fn known(format: WireFormat, text: &str) -> Known {
        Known::Schema(Arc::new(Schema::compile(format, text, &[]).unwrap()))
    }

    fn decode(format: WireFormat, schema: &Known, payload: &[u8], limits: &Limits) -> Result<Click, Rejection> {
        let id_of = |id: &str| crate::click::ClickId(id.to_string());
        decode_wire_with(format, Some(payload), Some(RECORD_TS), limits, |_| Some(schema.clone()), id_of)
    }

    fn reason(format: WireFormat, schema: &Known, payload: &[u8], limits: &Limits) -> RejectReason {
        decode(format, schema, payload, limits).unwrap_err().reason
    }

    fn limits_at(click_id: &str, ad_id: &str, ts: &str) -> Limits {
        let p = |s: &str| FieldPath::parse(s).unwrap();
        Limits { fields: Fields { click_id: p(click_id), ad_id: p(ad_id), ts: p(ts) }, ..Limits::default() }
    }

    #[test]
    fn avro_records_of_both_revisions_decode_to_their_fields() {
        for revision in [1, 2] {
            let e = Encoding::Avro { id: 7, revision };
            let schema = known(WireFormat::Avro, &schema_text(e).unwrap().1);
            let c = decode(WireFormat::Avro, &schema, &click(e, "c-1", 42, TS), &Limits::default()).unwrap();
            assert_eq!((c.click_id.as_str(), c.ad_id, c.ts_ms), ("c-1", 42, TS), "revision {revision}");
        }
    }

    #[test]
    fn protobuf_records_of_both_revisions_decode_to_their_fields() {
        for revision in [1, 2] {
            let e = Encoding::Protobuf { id: 7, revision };
            let schema = known(WireFormat::Protobuf, &schema_text(e).unwrap().1);
            let c = decode(WireFormat::Protobuf, &schema, &click(e, "c-1", 42, TS), &Limits::default()).unwrap();
            assert_eq!((c.click_id.as_str(), c.ad_id, c.ts_ms), ("c-1", 42, TS), "revision {revision}");
        }
    }

    /// Avro with the fields nested, a string ad ID, micros by logical type, an optional.
    const NESTED_AVRO: &str = r#"{"type":"record","name":"E","fields":[
        {"name":"event","type":{"type":"record","name":"Ev","fields":[
            {"name":"id","type":["null","string"]},
            {"name":"time","type":{"type":"long","logicalType":"timestamp-micros"}},
            {"name":"score","type":"double"}]}},
        {"name":"ad","type":{"type":"record","name":"Ad","fields":[{"name":"id","type":"string"}]}}]}"#;

    #[allow(deprecated)]
    fn nested_avro(id: Option<&str>, ad: &str, time_us: i64) -> Vec<u8> {
        use apache_avro::types::Value as V;
        let Schema::Avro(schema) = Schema::compile(WireFormat::Avro, NESTED_AVRO, &[]).unwrap() else { panic!() };
        let id = match id {
            Some(s) => V::Union(1, Box::new(V::String(s.into()))),
            None => V::Union(0, Box::new(V::Null)),
        };
        let event = V::Record(vec![
            ("id".into(), id),
            ("time".into(), V::TimestampMicros(time_us)),
            ("score".into(), V::Double(0.5)),
        ]);
        let record = V::Record(vec![
            ("event".into(), event),
            ("ad".into(), V::Record(vec![("id".into(), V::String(ad.into()))])),
        ]);
        let mut out = vec![0, 0, 0, 0, 9];
        out.extend(apache_avro::to_avro_datum(&schema, record).unwrap());
        out
    }

    #[test]
    fn avro_paths_reach_into_nested_records_and_every_defect_has_its_reason() {
        let schema = known(WireFormat::Avro, NESTED_AVRO);
        let limits = limits_at("event.id", "ad.id", "event.time");
        let c = decode(WireFormat::Avro, &schema, &nested_avro(Some("e-1"), "0042", TS * 1000 + 999), &limits).unwrap();
        assert_eq!((c.click_id.as_str(), c.ad_id, c.ts_ms), ("e-1", 42, TS), "micros by the schema, not ts_unit");
        let r = |payload: &[u8], limits: &Limits| reason(WireFormat::Avro, &schema, payload, limits);
        assert_eq!(r(&nested_avro(None, "1", TS * 1000), &limits), RejectReason::MissingField, "a null optional");
        assert_eq!(r(&nested_avro(Some("e"), "ad-1", TS * 1000), &limits), RejectReason::WrongType);
        assert_eq!(r(&nested_avro(Some("e"), "18446744073709551616", TS * 1000), &limits), RejectReason::WrongType);
        assert_eq!(r(&nested_avro(Some(""), "1", TS * 1000), &limits), RejectReason::EmptyClickId);
        assert_eq!(r(&nested_avro(Some("e"), "1", (TS + 3_600_000) * 1000), &limits), RejectReason::TimestampAhead);
        let good = nested_avro(Some("e"), "1", TS * 1000);
        assert_eq!(r(&good, &limits_at("event.id", "event.score", "event.time")), RejectReason::WrongType);
        assert_eq!(r(&good, &limits_at("event.id", "ad.id.x", "event.time")), RejectReason::WrongType);
        assert_eq!(r(&good, &limits_at("event.id", "ad.nope", "event.time")), RejectReason::MissingField);
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(r(&trailing, &limits), RejectReason::MalformedPayload, "bytes its schema does not describe");
        assert_eq!(r(&good[..good.len() - 2], &limits), RejectReason::MalformedPayload, "cut short");
    }

    const NESTED_PROTO: &str = r#"syntax = "proto3";
        import "google/protobuf/timestamp.proto";
        message Other { string x = 1; }
        message Envelope {
          message Event { string id = 1; google.protobuf.Timestamp time = 2; int64 epoch = 3; }
          Event event = 1;
          string ad = 2;
          double score = 3;
        }"#;

    /// Envelope (the second message: indexes [1]) with event {id, time or epoch}, ad.
    fn nested_proto(id: &str, ad: &str, time: Option<(i64, i32)>, epoch: i64) -> Vec<u8> {
        let mut event = Vec::new();
        if !id.is_empty() {
            event.extend([0x0a, id.len() as u8]);
            event.extend(id.as_bytes());
        }
        if let Some((secs, nanos)) = time {
            let mut t = Vec::new();
            t.push(0x08);
            crate::produce::encode::tests_varint(&mut t, secs as u64);
            t.push(0x10);
            crate::produce::encode::tests_varint(&mut t, nanos as u64);
            event.extend([0x12, t.len() as u8]);
            event.extend(t);
        }
        if epoch != 0 {
            event.push(0x18);
            crate::produce::encode::tests_varint(&mut event, epoch as u64);
        }
        let mut out = vec![0, 0, 0, 0, 9, 2, 2]; // indexes: one, [1]
        out.extend([0x0a, event.len() as u8]);
        out.extend(event);
        if !ad.is_empty() {
            out.extend([0x12, ad.len() as u8]);
            out.extend(ad.as_bytes());
        }
        out
    }

    #[test]
    fn protobuf_paths_reach_into_nested_messages_and_every_defect_has_its_reason() {
        let schema = known(WireFormat::Protobuf, NESTED_PROTO);
        let limits = limits_at("event.id", "ad", "event.time");
        let payload = nested_proto("e-1", "77", Some((TS / 1000, 123_999_999)), 0);
        let c = decode(WireFormat::Protobuf, &schema, &payload, &limits).unwrap();
        assert_eq!((c.click_id.as_str(), c.ad_id, c.ts_ms), ("e-1", 77, TS), "a Timestamp message, to the ms");
        // An epoch in seconds, read by `auto`.
        let auto = Limits { ts_unit: TsUnit::Auto, ..limits_at("event.id", "ad", "event.epoch") };
        let c = decode(WireFormat::Protobuf, &schema, &nested_proto("e", "1", None, TS / 1000), &auto).unwrap();
        assert_eq!(c.ts_ms, TS / 1000 * 1000);
        let r = |payload: &[u8], limits: &Limits| reason(WireFormat::Protobuf, &schema, payload, limits);
        assert_eq!(r(&nested_proto("", "1", Some((TS / 1000, 0)), 0), &limits), RejectReason::MissingField);
        assert_eq!(r(&nested_proto("e", "", Some((TS / 1000, 0)), 0), &limits), RejectReason::MissingField);
        assert_eq!(r(&nested_proto("e", "x1", Some((TS / 1000, 0)), 0), &limits), RejectReason::WrongType);
        assert_eq!(
            r(&nested_proto("e", "1", Some((TS / 1000, 0)), 0), &limits_at("event.id", "score", "event.time")),
            RejectReason::MissingField,
            "a double at 0 is not sent"
        );
        assert_eq!(
            r(&nested_proto("e", "1", Some((TS / 1000, 0)), 0), &limits_at("event.id", "ad.x", "event.time")),
            RejectReason::WrongType
        );
        assert_eq!(r(&nested_proto("e", "1", Some((1_000, 0)), 0), &limits), RejectReason::TimestampBehind);
        let good = nested_proto("e", "1", Some((TS / 1000, 0)), 0);
        let mut indexes = good.clone();
        indexes[6] = 4; // [2]: no third message
        assert_eq!(r(&indexes, &limits), RejectReason::NotWireFormat);
        indexes[5] = 0xff; // a varint that never ends
        indexes.truncate(6);
        assert_eq!(r(&indexes, &limits), RejectReason::NotWireFormat);
        assert_eq!(r(&good[..good.len() - 1], &limits), RejectReason::MalformedPayload);
    }

    #[test]
    fn framing_and_unknown_schemas_are_their_own_reasons() {
        let e = Encoding::Avro { id: 7, revision: 1 };
        let schema = known(WireFormat::Avro, &schema_text(e).unwrap().1);
        let l = Limits::default();
        assert_eq!(reason(WireFormat::Avro, &schema, br#"{"click_id":"c"}"#, &l), RejectReason::NotWireFormat);
        assert_eq!(reason(WireFormat::Avro, &schema, &[0, 0, 7], &l), RejectReason::NotWireFormat);
        let unknown = Known::Unusable("the registry has no schema with this ID".into());
        let e = decode(WireFormat::Avro, &unknown, &click(Encoding::Avro { id: 7, revision: 1 }, "c", 1, TS), &l);
        let e = e.unwrap_err();
        assert_eq!(e.reason, RejectReason::UnknownSchema);
        assert!(e.detail.contains("schema 7"), "{}", e.detail);
        assert_eq!(reason(WireFormat::Avro, &schema, &[], &l), RejectReason::EmptyPayload);
        assert!(Schema::compile(WireFormat::Protobuf, "message {", &[]).is_err());
        assert!(Schema::compile(WireFormat::Avro, "{\"type\":\"nope\"}", &[]).is_err());
        assert_eq!(schema_id(Some(&[0, 0, 0, 1, 2, 9])), Some(258));
        assert_eq!(schema_id(Some(&[1, 0, 0, 1, 2])), None);
    }

    #[test]
    fn confluent_message_indexes_are_zigzag_varints() {
        let mut b: &[u8] = &[0x02, 0x7f, 0x80, 0x01, 0x03];
        assert_eq!(zigzag_varint(&mut b), Some(1));
        assert_eq!(zigzag_varint(&mut b), Some(-64));
        assert_eq!(zigzag_varint(&mut b), Some(64));
        assert_eq!(zigzag_varint(&mut b), Some(-2));
        assert_eq!(zigzag_varint(&mut b), None);
    }
}
