//! `clickagg produce`: a seeded load generator that writes click events to Kafka and
//! the ground truth (distinct valid clicks per ad per minute) to a file.
//!
//! The plan is pure ([`plan`]): the same seed and options give the same records in the
//! same order, so a failing test can be reproduced. Each record is one of:
//!
//! - a **new click** for an ad drawn from a Zipf distribution (a few hot ads, a long
//!   tail), event time a little before its send time — or, for *late* clicks, minutes
//!   before, so it lands in a minute whose other clicks went by long ago;
//! - a **duplicate**: the same click sent again, usually right after (a producer retry),
//!   sometimes much later (a redelivery from the ad server's outbox); with
//!   `retry_drift_ratio`, some of them carry another event time than their original
//!   (an ad server that re-stamps a retry), so that counting a retry instead of its
//!   original shows as a count in the wrong minute;
//! - a **malformed** record of one of the classes the pipeline dead-letters.
//!
//! Records are keyed by `click_id`, so a click and its duplicates share a partition, as
//! they do when an ad server retries. The Kafka record timestamp is set explicitly to
//! the simulated send time, so lateness is judged the same way on every replay.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

pub mod encode;
mod send;
pub use encode::{schema_text, write_schema_file, Encoding, UNKNOWN_SCHEMA_ID};
pub use send::{send, SendError};

use crate::aggregate::BucketKey;
use crate::click::{Limits, Minute, RejectReason};

/// What to generate (the flags of `clickagg produce`).
#[derive(Debug, Clone)]
pub struct Spec {
    /// Records to send, duplicates and malformed ones included.
    pub count: u64,
    pub seed: u64,
    /// Number of distinct ads; popularity follows Zipf(`zipf_exponent`).
    pub ads: u64,
    pub zipf_exponent: f64,
    /// Fraction of records that repeat an earlier click.
    pub duplicate_ratio: f64,
    /// Fraction of new clicks whose event time is minutes behind their send time.
    pub late_ratio: f64,
    /// Fraction of records that are invalid.
    pub malformed_ratio: f64,
    /// Fraction of duplicates sent under another key than the click ID, so that they
    /// may land on another partition (a producer that does not key by click ID).
    pub cross_partition_ratio: f64,
    /// Fraction of the other duplicates (same key, so same partition) whose event time
    /// lies in another minute than their original's, still within the default
    /// validation limits of their record. The truth counts the original's minute, so a
    /// pipeline that skipped an original and counted its retry is off by one in two
    /// buckets instead of looking exact. Copies on other partitions never drift: which
    /// copy counts there depends on the order the partitions are read in. 0 keeps the
    /// records of every seed as they were before the option existed.
    pub retry_drift_ratio: f64,
    /// Event time of the first record (ms); send times spread over `span` from there.
    pub start_ms: i64,
    pub span: Duration,
    /// JSON, or Avro or Protobuf in the wire format. The same seed gives the same
    /// clicks, duplicates and ground truth in every encoding (the malformed records
    /// differ: each encoding makes the reject classes it can have).
    pub encoding: Encoding,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            count: 100_000,
            seed: 42,
            ads: 1_000,
            zipf_exponent: 1.1,
            duplicate_ratio: 0.1,
            late_ratio: 0.02,
            malformed_ratio: 0.01,
            cross_partition_ratio: 0.0,
            retry_drift_ratio: 0.0,
            start_ms: 0,
            span: Duration::from_secs(600),
            encoding: Encoding::Json,
        }
    }
}

/// One record to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub key: String,
    pub payload: Vec<u8>,
    /// The Kafka record timestamp (the simulated send time).
    pub timestamp_ms: i64,
    pub kind: Kind,
    /// A fixed partition; `None` lets the producer's partitioner pick one from the key.
    pub partition: Option<i32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Click,
    LateClick,
    Duplicate,
    Malformed(RejectReason),
}

/// The ground truth and what was generated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Truth {
    pub counts: BTreeMap<BucketKey, u64>,
    pub clicks: u64,
    pub late: u64,
    pub duplicates: u64,
    /// Of the duplicates, those whose event time is in another minute than their
    /// original's (`Spec::retry_drift_ratio`).
    pub drifted: u64,
    pub malformed: BTreeMap<RejectReason, u64>,
}

impl Truth {
    pub fn malformed_total(&self) -> u64 {
        self.malformed.values().sum()
    }

    /// Writes `ad_id,minute,clicks` (minute in RFC 3339, UTC) with a header line.
    pub fn write_csv(&self, path: &Path) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        writeln!(out, "ad_id,minute,clicks")?;
        for (k, c) in &self.counts {
            writeln!(out, "{},{},{}", k.ad_id, k.minute.to_rfc3339(), c)?;
        }
        out.flush()
    }

    pub fn read_csv(path: &Path) -> Result<BTreeMap<BucketKey, u64>, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut counts = BTreeMap::new();
        for (i, line) in text.lines().enumerate().skip(1) {
            if line.trim().is_empty() {
                continue;
            }
            let bad = || format!("{}:{}: expected ad_id,minute,clicks, got {line:?}", path.display(), i + 1);
            let mut f = line.split(',');
            let (Some(ad), Some(minute), Some(clicks), None) = (f.next(), f.next(), f.next(), f.next()) else {
                return Err(bad());
            };
            let ad_id: u64 = ad.trim().parse().map_err(|_| bad())?;
            let ts = chrono::DateTime::parse_from_rfc3339(minute.trim()).map_err(|_| bad())?;
            let minute = Minute::from_millis(ts.timestamp_millis()).ok_or_else(bad)?;
            let clicks: u64 = clicks.trim().parse().map_err(|_| bad())?;
            *counts.entry(BucketKey { ad_id, minute }).or_default() += clicks;
        }
        Ok(counts)
    }

    pub fn summary(&self) -> String {
        let malformed: Vec<String> = self.malformed.iter().map(|(r, n)| format!("{r}={n}")).collect();
        let drifted = if self.drifted > 0 { format!(" ({} in another minute)", self.drifted) } else { String::new() };
        format!(
            "{} distinct clicks ({} late) in {} ad-minutes, {} duplicates{drifted}, {} malformed [{}]",
            self.clicks,
            self.late,
            self.counts.len(),
            self.duplicates,
            self.malformed_total(),
            malformed.join(" ")
        )
    }
}

/// The Kafka timestamp of a record whose event time ClickHouse cannot store: one second
/// after the epoch. The decoder judges lateness against the record timestamp first, so
/// only a record stamped this early can carry an event time before 1970 that is not
/// also far behind it. (librdkafka reads a timestamp of 0 as "now".)
const ANCIENT_RECORD_MS: i64 = 1_000;

/// The 128 random bits of a click ID; kept instead of the ID for every click sent, so
/// that a run of millions of records can repeat any of them without holding the strings.
fn click_id_bits(rng: &mut StdRng) -> (u64, u64) {
    let a: u64 = rng.random();
    let b: u64 = rng.random();
    (a, b)
}

/// UUID-shaped (36 bytes), like the IDs ad servers usually send.
fn format_click_id((a, b): (u64, u64)) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

fn click_id(rng: &mut StdRng) -> String {
    format_click_id(click_id_bits(rng))
}

/// A click as `encoding` writes it.
fn click_payload(encoding: Encoding, id: &str, ad_id: u64, ts_ms: i64, rng: &mut StdRng) -> Vec<u8> {
    match encoding {
        Encoding::Json => click_json(id, ad_id, ts_ms, rng),
        _ => {
            // The draw JSON makes, so that every encoding of a seed has the same records.
            let _ = rng.random_bool(0.5);
            encode::click(encoding, id, ad_id, ts_ms)
        }
    }
}

fn click_json(id: &str, ad_id: u64, ts_ms: i64, rng: &mut StdRng) -> Vec<u8> {
    // Alternate the two timestamp encodings and add an extra field the pipeline ignores.
    if rng.random_bool(0.5) {
        format!(r#"{{"click_id":"{id}","ad_id":{ad_id},"ts":{ts_ms},"placement":"feed"}}"#).into_bytes()
    } else {
        let ts = chrono::DateTime::from_timestamp_millis(ts_ms).expect("valid").format("%Y-%m-%dT%H:%M:%S%.3fZ");
        format!(r#"{{"click_id":"{id}","ad_id":{ad_id},"ts":"{ts}","ua":"Mozilla/5.0"}}"#).into_bytes()
    }
}

/// A record of the class `reason`, rejected under the default [`Limits`]: its payload
/// and its Kafka timestamp (the send time, except where the class needs another).
fn malformed(encoding: Encoding, reason: RejectReason, send_ms: i64, rng: &mut StdRng) -> (Vec<u8>, i64) {
    let id = click_id(rng);
    if encoding != Encoding::Json {
        if let Some(payload) = encode::malformed_wire(encoding, reason, &id, send_ms) {
            return (payload, send_ms);
        }
        let day = 86_400_000;
        let (click_id, ts, record_ts) = match reason {
            RejectReason::EmptyPayload => return (Vec::new(), send_ms),
            // Protobuf does not send an empty string: the field is missing.
            RejectReason::EmptyClickId | RejectReason::MissingField => (String::new(), send_ms, send_ms),
            RejectReason::ClickIdTooLong => ("x".repeat(300), send_ms, send_ms),
            RejectReason::TimestampAhead => (id, send_ms + day, send_ms),
            RejectReason::TimestampBehind => (id, send_ms - 30 * day, send_ms),
            RejectReason::TimestampOutOfRange => (id, ANCIENT_RECORD_MS - 2_000, ANCIENT_RECORD_MS),
            other => unreachable!("{other} is not made for {encoding:?}"),
        };
        return (encode::click(encoding, &click_id, 12, ts), record_ts);
    }
    let payload = match reason {
        RejectReason::MalformedJson => format!(r#"{{"click_id":"{id}","ad_id":12,"ts":"#).into_bytes(),
        RejectReason::MissingField => format!(r#"{{"click_id":"{id}","ts":{send_ms}}}"#).into_bytes(),
        RejectReason::WrongType => format!(r#"{{"click_id":"{id}","ad_id":"twelve","ts":{send_ms}}}"#).into_bytes(),
        RejectReason::EmptyClickId => format!(r#"{{"click_id":"","ad_id":12,"ts":{send_ms}}}"#).into_bytes(),
        RejectReason::ClickIdTooLong => {
            format!(r#"{{"click_id":"{}","ad_id":12,"ts":{send_ms}}}"#, "x".repeat(300)).into_bytes()
        }
        RejectReason::NotUtf8 => {
            let mut b = format!(r#"{{"click_id":"{id}"#).into_bytes();
            b.extend_from_slice(&[0xff, 0xfe]);
            b.extend_from_slice(format!(r#"","ad_id":12,"ts":{send_ms}}}"#).as_bytes());
            b
        }
        // A day ahead of / a month behind the record timestamp: beyond any sane limit.
        RejectReason::TimestampAhead => {
            format!(r#"{{"click_id":"{id}","ad_id":12,"ts":{}}}"#, send_ms + 86_400_000).into_bytes()
        }
        RejectReason::TimestampBehind => {
            format!(r#"{{"click_id":"{id}","ad_id":12,"ts":{}}}"#, send_ms - 30 * 86_400_000).into_bytes()
        }
        RejectReason::EmptyPayload => Vec::new(),
        // A click that would be valid but for its size: the size alone must reject it.
        // Padding of one repeated byte compresses to almost nothing on the wire.
        RejectReason::Oversized => {
            let head = format!(r#"{{"click_id":"{id}","ad_id":12,"ts":{send_ms},"pad":""#);
            let pad = Limits::default().max_payload_bytes + 1 - head.len();
            format!(r#"{head}{}"}}"#, " ".repeat(pad)).into_bytes()
        }
        // Two seconds behind its record, so only the range check can reject it.
        RejectReason::TimestampOutOfRange => {
            let payload = format!(r#"{{"click_id":"{id}","ad_id":12,"ts":{}}}"#, ANCIENT_RECORD_MS - 2_000);
            return (payload.into_bytes(), ANCIENT_RECORD_MS);
        }
        RejectReason::NotWireFormat | RejectReason::UnknownSchema | RejectReason::MalformedPayload => {
            unreachable!("{reason} is no class of a JSON record")
        }
    };
    (payload, send_ms)
}

/// An event time 1 to 30 minutes before or after `ts` (so in another minute) that the
/// default limits still accept in a record stamped `send_ms`; `None` if neither is.
fn drifted(ts: i64, send_ms: i64, rng: &mut StdRng) -> Option<i64> {
    let limits = Limits::default();
    let accepted =
        send_ms - limits.max_lateness.as_millis() as i64..=send_ms + limits.max_future_skew.as_millis() as i64;
    let by = rng.random_range(1..=30i64) * 60_000;
    [ts - by, ts + by, ts - 60_000, ts + 60_000]
        .into_iter()
        .find(|t| accepted.contains(t) && Minute::from_millis(*t).is_some())
}

/// The records to send, in order, and the ground truth they imply.
pub fn plan(spec: &Spec) -> (Vec<Planned>, Truth) {
    let mut generator = Generator::new(spec.clone());
    let records = generator.by_ref().collect();
    (records, generator.into_truth())
}

/// [`plan`] one record at a time: the same records, without holding them all, for runs
/// of millions. The ground truth grows with every record taken.
pub struct Generator {
    spec: Spec,
    rng: StdRng,
    zipf: Zipf<f64>,
    truth: Truth,
    /// Every new click so far (ID bits, ad, event time): duplicates repeat one of them.
    sent: Vec<((u64, u64), u64, i64)>,
    /// Index of the next record.
    next: u64,
    malformed: usize,
}

impl Generator {
    pub fn new(spec: Spec) -> Generator {
        let zipf = Zipf::new(spec.ads.max(1) as f64, spec.zipf_exponent).expect("valid Zipf parameters");
        Generator {
            rng: StdRng::seed_from_u64(spec.seed),
            zipf,
            truth: Truth::default(),
            sent: Vec::new(),
            next: 0,
            malformed: 0,
            spec,
        }
    }

    /// The ground truth of the records taken so far.
    pub fn truth(&self) -> &Truth {
        &self.truth
    }

    pub fn into_truth(self) -> Truth {
        self.truth
    }
}

impl Iterator for Generator {
    type Item = Planned;

    fn next(&mut self) -> Option<Planned> {
        let (spec, rng, truth) = (&self.spec, &mut self.rng, &mut self.truth);
        if self.next >= spec.count {
            return None;
        }
        let i = self.next;
        self.next += 1;
        let span_ms = spec.span.as_millis() as i64;
        let send_ms = spec.start_ms + (i as i64 * span_ms) / spec.count.max(1) as i64;
        let roll: f64 = rng.random();
        if roll < spec.malformed_ratio {
            // Every class the decoder knows for this encoding, in turn.
            let classes = encode::classes(spec.encoding);
            let reason = classes[self.malformed % classes.len()];
            self.malformed += 1;
            *truth.malformed.entry(reason).or_default() += 1;
            let (payload, timestamp_ms) = malformed(spec.encoding, reason, send_ms, rng);
            Some(Planned {
                key: format!("bad-{i}"),
                payload,
                timestamp_ms,
                kind: Kind::Malformed(reason),
                partition: None,
            })
        } else if roll < spec.malformed_ratio + spec.duplicate_ratio && !self.sent.is_empty() {
            let sent = &self.sent;
            // Mostly a quick retry of a recent click; sometimes a much older one.
            let idx = if rng.random_bool(0.7) {
                sent.len() - 1 - rng.random_range(0..sent.len().min(50))
            } else {
                rng.random_range(0..sent.len())
            };
            let (bits, ad_id, ts) = sent[idx];
            let id = format_click_id(bits);
            truth.duplicates += 1;
            let (payload, copy) = if spec.retry_drift_ratio > 0.0 {
                // Whether it is a copy first: a copy keeps its original's fields. (This
                // order of draws only with drift asked for: without, every seed gives
                // the records it always gave.)
                let copy = rng.random_bool(spec.cross_partition_ratio);
                let mut event_ts = ts;
                if !copy && rng.random_bool(spec.retry_drift_ratio) {
                    if let Some(other) = drifted(ts, send_ms, rng) {
                        event_ts = other;
                        truth.drifted += 1;
                    }
                }
                (click_payload(spec.encoding, &id, ad_id, event_ts, rng), copy)
            } else {
                let payload = click_payload(spec.encoding, &id, ad_id, ts, rng);
                (payload, rng.random_bool(spec.cross_partition_ratio))
            };
            let key = if copy { format!("{id}#copy-{i}") } else { id };
            Some(Planned { key, payload, timestamp_ms: send_ms, kind: Kind::Duplicate, partition: None })
        } else {
            let bits = click_id_bits(rng);
            let id = format_click_id(bits);
            let ad_id = self.zipf.sample(rng) as u64;
            let late = rng.random_bool(spec.late_ratio);
            let delay_ms = if late { rng.random_range(60_000..20 * 60_000) } else { rng.random_range(0..2_000) };
            let ts = send_ms - delay_ms;
            let minute = Minute::from_millis(ts).expect("generated timestamps are after 1970");
            *truth.counts.entry(BucketKey { ad_id, minute }).or_default() += 1;
            truth.clicks += 1;
            truth.late += u64::from(late);
            let payload = click_payload(spec.encoding, &id, ad_id, ts, rng);
            self.sent.push((bits, ad_id, ts));
            Some(Planned {
                key: id,
                payload,
                timestamp_ms: send_ms,
                kind: if late { Kind::LateClick } else { Kind::Click },
                partition: None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::click::{decode, Click};
    use std::collections::HashSet;

    fn spec() -> Spec {
        Spec { count: 20_000, start_ms: 1_764_489_600_000, ..Spec::default() }
    }

    #[test]
    fn the_same_seed_gives_the_same_records() {
        assert_eq!(plan(&spec()).0, plan(&spec()).0);
        assert_ne!(plan(&spec()).0, plan(&Spec { seed: 7, ..spec() }).0);
    }

    /// The ground truth is what an exact pipeline would count: decode every record as
    /// the pipeline does, keep the first sighting of each click ID.
    #[test]
    fn the_truth_equals_an_independent_recount_of_the_records() {
        let (records, truth) = plan(&spec());
        let mut seen = HashSet::new();
        let mut recount: BTreeMap<BucketKey, u64> = BTreeMap::new();
        let mut rejected = 0;
        for r in &records {
            let payload = (!r.payload.is_empty()).then_some(r.payload.as_slice());
            match decode(payload, Some(r.timestamp_ms), &Limits::default()) {
                Ok(c) => {
                    if seen.insert(c.click_id.clone()) {
                        *recount.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
                    }
                }
                Err(rej) => {
                    assert!(matches!(r.kind, Kind::Malformed(reason) if reason == rej.reason), "{:?} vs {rej}", r.kind);
                    rejected += 1;
                }
            }
        }
        assert_eq!(recount, truth.counts);
        assert_eq!(rejected, truth.malformed_total());
        assert_eq!(truth.clicks + truth.duplicates + truth.malformed_total(), records.len() as u64);
        assert!(truth.duplicates > 1_500 && truth.late > 100, "{}", truth.summary());
    }

    /// A chaos run or a metrics test can only prove every class is dead-lettered if the
    /// generator makes every class the decoder knows.
    #[test]
    fn every_reject_class_is_generated() {
        for encoding in
            [Encoding::Json, Encoding::Avro { id: 3, revision: 1 }, Encoding::Protobuf { id: 3, revision: 2 }]
        {
            let (_, truth) = plan(&Spec { malformed_ratio: 0.05, encoding, ..spec() });
            for &reason in encode::classes(encoding) {
                let n = truth.malformed.get(&reason).copied().unwrap_or(0);
                assert!(n > 0, "{encoding:?}: no {reason} record: {}", truth.summary());
            }
        }
    }

    /// Avro and Protobuf records of a seed are its JSON records re-encoded: the same
    /// clicks and truth, and every record decodes (under the generator's schema, as a
    /// member reads it) to what the truth says of it.
    #[test]
    fn wire_encodings_carry_the_same_clicks_and_truth_as_json() {
        use crate::click::{decode_wire_with, Known, Schema, WireFormat};
        let (_, json_truth) = plan(&spec());
        for (encoding, format) in [
            (Encoding::Avro { id: 3, revision: 1 }, WireFormat::Avro),
            (Encoding::Avro { id: 4, revision: 2 }, WireFormat::Avro),
            (Encoding::Protobuf { id: 3, revision: 1 }, WireFormat::Protobuf),
            (Encoding::Protobuf { id: 4, revision: 2 }, WireFormat::Protobuf),
        ] {
            let (records, truth) = plan(&Spec { encoding, ..spec() });
            assert_eq!(truth.counts, json_truth.counts, "{encoding:?}");
            assert_eq!((truth.clicks, truth.duplicates), (json_truth.clicks, json_truth.duplicates));
            let schema = Known::Schema(std::sync::Arc::new(
                Schema::compile(format, &schema_text(encoding).unwrap().1, &[]).unwrap(),
            ));
            let unknown = Known::Unusable("no such ID".into());
            let lookup = |id: u32| Some(if id == UNKNOWN_SCHEMA_ID { unknown.clone() } else { schema.clone() });
            let mut seen = HashSet::new();
            let mut recount: BTreeMap<BucketKey, u64> = BTreeMap::new();
            let mut rejected: BTreeMap<RejectReason, u64> = BTreeMap::new();
            for r in &records {
                let payload = (!r.payload.is_empty()).then_some(r.payload.as_slice());
                let id_of = |id: &str| id.to_string();
                match decode_wire_with(format, payload, Some(r.timestamp_ms), &Limits::default(), lookup, id_of) {
                    Ok(c) => {
                        if seen.insert(c.click_id.clone()) {
                            *recount.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
                        }
                    }
                    Err(rej) => {
                        assert!(matches!(r.kind, Kind::Malformed(k) if k == rej.reason), "{:?} vs {rej}", r.kind);
                        *rejected.entry(rej.reason).or_default() += 1;
                    }
                }
            }
            assert_eq!(recount, truth.counts, "{encoding:?}");
            assert_eq!(rejected, truth.malformed, "{encoding:?}");
        }
    }

    /// The first sighting of each click ID, and every later one, decoded.
    fn sightings(records: &[Planned]) -> (BTreeMap<String, Click>, Vec<(Planned, Click)>) {
        let mut first = BTreeMap::new();
        let mut later = Vec::new();
        for r in records {
            let payload = (!r.payload.is_empty()).then_some(r.payload.as_slice());
            let Ok(c) = decode(payload, Some(r.timestamp_ms), &Limits::default()) else { continue };
            if first.contains_key(c.click_id.as_str()) {
                later.push((r.clone(), c));
            } else {
                first.insert(c.click_id.as_str().to_string(), c);
            }
        }
        (first, later)
    }

    #[test]
    fn drifted_retries_are_valid_clicks_in_another_minute_and_the_truth_counts_their_originals() {
        let spec = Spec { retry_drift_ratio: 0.5, cross_partition_ratio: 0.3, duplicate_ratio: 0.2, ..spec() };
        let (records, truth) = plan(&spec);
        let (first, later) = sightings(&records);
        let moved: Vec<&(Planned, Click)> =
            later.iter().filter(|(_, c)| c.minute != first[c.click_id.as_str()].minute).collect();
        assert!(truth.drifted > 500, "{}", truth.summary());
        assert_eq!(moved.len() as u64, truth.drifted, "every drifted retry decodes, in another minute");
        for (r, c) in &moved {
            let original = &first[c.click_id.as_str()];
            assert_eq!(c.ad_id, original.ad_id);
            assert_eq!(r.key, c.click_id.as_str(), "a drifted retry keeps its key, so its partition");
        }
        // Counting the first sighting of each ID gives the truth; counting the last one
        // (an original skipped, its retry counted) does not.
        let count = |clicks: &mut dyn Iterator<Item = &Click>| {
            let mut counts: BTreeMap<BucketKey, u64> = BTreeMap::new();
            for c in clicks {
                *counts.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
            }
            counts
        };
        assert_eq!(count(&mut first.values()), truth.counts);
        let mut last: BTreeMap<&str, &Click> = first.iter().map(|(k, c)| (k.as_str(), c)).collect();
        for (_, c) in &later {
            last.insert(c.click_id.as_str(), c);
        }
        assert_ne!(count(&mut last.values().copied()), truth.counts, "a retry counted instead shows");
    }

    #[test]
    fn copies_on_other_partitions_keep_their_originals_fields() {
        let spec = Spec { retry_drift_ratio: 1.0, cross_partition_ratio: 0.5, duplicate_ratio: 0.2, ..spec() };
        let (records, truth) = plan(&spec);
        let (first, later) = sightings(&records);
        let copies: Vec<&(Planned, Click)> = later.iter().filter(|(r, _)| r.key.contains("#copy")).collect();
        assert!(copies.len() > 1_000 && truth.drifted > 1_000, "{} copies; {}", copies.len(), truth.summary());
        for (_, c) in copies {
            let original = &first[c.click_id.as_str()];
            assert_eq!((c.ad_id, c.ts_ms), (original.ad_id, original.ts_ms), "copy of {}", c.click_id);
        }
    }

    #[test]
    fn popularity_is_skewed() {
        let (_, truth) = plan(&spec());
        let mut per_ad: BTreeMap<u64, u64> = BTreeMap::new();
        for (k, c) in &truth.counts {
            *per_ad.entry(k.ad_id).or_default() += c;
        }
        let top = per_ad.get(&1).copied().unwrap_or(0);
        let median_ad = per_ad.get(&500).copied().unwrap_or(0);
        assert!(top > 20 * median_ad.max(1), "ad 1: {top}, ad 500: {median_ad}");
    }

    #[test]
    fn truth_round_trips_through_csv() {
        let (_, truth) = plan(&Spec { count: 2_000, ..spec() });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("truth.csv");
        truth.write_csv(&path).unwrap();
        assert_eq!(Truth::read_csv(&path).unwrap(), truth.counts);
    }
}
