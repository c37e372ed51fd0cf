//! The generator's records in Avro and Protobuf, in the Confluent wire format, and the
//! schemas they are written under. Encoded here by hand (zig-zag varints, tags, lengths)
//! rather than with the libraries the decoder uses, so a test of one against the other
//! checks both.
//!
//! Two revisions of each schema: 2 adds a field (`placement`) to 1, as a producer
//! evolving its schema mid-topic does; records under either count the same.

use std::path::Path;

use crate::click::{Limits, RejectReason};

/// How the generator writes its records (`produce --format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    #[default]
    Json,
    /// Avro under schema `id`, of the generator's schema `revision` (1 or 2).
    Avro { id: u32, revision: u8 },
    /// Protobuf under schema `id`, revision 1 or 2.
    Protobuf { id: u32, revision: u8 },
}

/// The ID the generator's records of class `unknown_schema` name: one no schema
/// source is expected to hold.
pub const UNKNOWN_SCHEMA_ID: u32 = 0x7fff_fffe;

/// The reject classes records of each encoding are made of, in turn. Protobuf cannot
/// carry an empty string (proto3 does not send a field at its default), so an empty
/// click ID there reads as a missing field.
pub fn classes(e: Encoding) -> &'static [RejectReason] {
    use RejectReason as R;
    match e {
        Encoding::Json => &RejectReason::JSON,
        Encoding::Avro { .. } => &[
            R::EmptyPayload,
            R::Oversized,
            R::NotWireFormat,
            R::UnknownSchema,
            R::MalformedPayload,
            R::EmptyClickId,
            R::ClickIdTooLong,
            R::TimestampAhead,
            R::TimestampBehind,
            R::TimestampOutOfRange,
        ],
        Encoding::Protobuf { .. } => &[
            R::EmptyPayload,
            R::Oversized,
            R::NotWireFormat,
            R::UnknownSchema,
            R::MalformedPayload,
            R::MissingField,
            R::ClickIdTooLong,
            R::TimestampAhead,
            R::TimestampBehind,
            R::TimestampOutOfRange,
        ],
    }
}

/// The schema text of a revision: `.avsc` JSON or `.proto` source.
pub fn schema_text(e: Encoding) -> Option<(&'static str, String)> {
    let (ext, revision) = match e {
        Encoding::Json => return None,
        Encoding::Avro { revision, .. } => ("avsc", revision),
        Encoding::Protobuf { revision, .. } => ("proto", revision),
    };
    let text = match (ext, revision) {
        ("avsc", 1) => AVRO_V1.to_string(),
        ("avsc", _) => AVRO_V1.replace("}}]}", "}},{\"name\":\"placement\",\"type\":\"string\",\"default\":\"\"}]}"),
        (_, 1) => PROTO_V1.to_string(),
        _ => PROTO_V1.replace("int64 ts = 3;", "int64 ts = 3;\n  string placement = 4;"),
    };
    Some((ext, text))
}

const AVRO_V1: &str = r#"{"type":"record","name":"Click","namespace":"clickagg.example","fields":[{"name":"click_id","type":"string"},{"name":"ad_id","type":"long"},{"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;

const PROTO_V1: &str = "syntax = \"proto3\";\npackage clickagg.example;\n\nmessage Click {\n  string click_id = 1;\n  int64 ad_id = 2;\n  int64 ts = 3;\n}\n";

/// Writes the schema of `e` as `<dir>/<id>.<ext>` (a schema file by ID, as
/// `source.schema_files` reads them). An existing file must hold the same text: a
/// schema ID never changes its schema.
pub fn write_schema_file(dir: &Path, e: Encoding) -> std::io::Result<()> {
    let (Some((ext, text)), Encoding::Avro { id, .. } | Encoding::Protobuf { id, .. }) = (schema_text(e), e) else {
        return Ok(());
    };
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{id}.{ext}"));
    match std::fs::read_to_string(&path) {
        Ok(existing) if existing == text => Ok(()),
        Ok(_) => Err(std::io::Error::other(format!(
            "{} holds another schema: a schema ID never changes its schema; pick another --schema-id",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::write(&path, text),
        Err(e) => Err(e),
    }
}

fn zigzag_long(out: &mut Vec<u8>, n: i64) {
    varint(out, ((n << 1) ^ (n >> 63)) as u64);
}

/// A base-128 varint, for tests that build messages by hand.
#[cfg(test)]
pub(crate) fn tests_varint(out: &mut Vec<u8>, v: u64) {
    varint(out, v)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn header(id: u32, protobuf: bool) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&id.to_be_bytes());
    if protobuf {
        out.push(0); // message indexes: the first message
    }
    out
}

/// A click in the wire format of `e` (not JSON). `placement` only under revision 2.
pub fn click(e: Encoding, click_id: &str, ad_id: u64, ts_ms: i64) -> Vec<u8> {
    match e {
        Encoding::Json => unreachable!("JSON clicks are written by click_json"),
        Encoding::Avro { id, revision } => {
            let mut out = header(id, false);
            let string = |out: &mut Vec<u8>, s: &str| {
                zigzag_long(out, s.len() as i64);
                out.extend_from_slice(s.as_bytes());
            };
            string(&mut out, click_id);
            // Avro longs are signed: an ad ID past i64 is not in this schema's range.
            zigzag_long(&mut out, ad_id as i64);
            zigzag_long(&mut out, ts_ms);
            if revision >= 2 {
                string(&mut out, "feed");
            }
            out
        }
        Encoding::Protobuf { id, revision } => {
            let mut out = header(id, true);
            let string = |out: &mut Vec<u8>, tag: u8, s: &str| {
                if !s.is_empty() {
                    out.push(tag);
                    varint(out, s.len() as u64);
                    out.extend_from_slice(s.as_bytes());
                }
            };
            string(&mut out, 0x0a, click_id);
            if ad_id != 0 {
                out.push(0x10);
                varint(&mut out, ad_id);
            }
            if ts_ms != 0 {
                out.push(0x18);
                varint(&mut out, ts_ms as u64);
            }
            if revision >= 2 {
                string(&mut out, 0x22, "feed");
            }
            out
        }
    }
}

/// A record of class `reason` in the wire format of `e`, rejected under the default
/// [`Limits`]; `None` for the classes every format shares, which the caller makes from
/// a click with the defect (`malformed` in `produce.rs`).
pub fn malformed_wire(e: Encoding, reason: RejectReason, id: &str, send_ms: i64) -> Option<Vec<u8>> {
    let (Encoding::Avro { id: schema, .. } | Encoding::Protobuf { id: schema, .. }) = e else { return None };
    let protobuf = matches!(e, Encoding::Protobuf { .. });
    Some(match reason {
        RejectReason::NotWireFormat => format!(r#"{{"click_id":"{id}","ad_id":12,"ts":{send_ms}}}"#).into_bytes(),
        RejectReason::UnknownSchema => {
            let mut b = click(e, id, 12, send_ms);
            b[1..5].copy_from_slice(&UNKNOWN_SCHEMA_ID.to_be_bytes());
            b
        }
        RejectReason::MalformedPayload => {
            let mut b = header(schema, protobuf);
            // Avro: a string length whose varint never ends. Protobuf: field 1 said to
            // be 127 bytes long, with none following.
            b.extend_from_slice(if protobuf { &[0x0a, 0x7f] } else { &[0x80] });
            b
        }
        RejectReason::Oversized => {
            let mut b = click(e, id, 12, send_ms);
            let pad = Limits::default().max_payload_bytes + 1 - b.len();
            b.resize(b.len() + pad, 0);
            b
        }
        _ => return None,
    })
}
