//! Where a record carries the three fields of a click, and how a field's value becomes
//! that field: the rules every format shares (JSON, Avro, Protobuf), so that an `ad_id`
//! or a `ts` means the same whatever encoding brought it.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{RejectReason, Rejection};

/// A dotted path of field names (`event.id`): the field `id` of the object, record or
/// message in the field `event`. Names are matched exactly; a name cannot contain a dot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FieldPath(Vec<String>);

impl FieldPath {
    /// Parses `a.b.c`; every segment must be non-empty.
    pub fn parse(text: &str) -> Result<FieldPath, String> {
        let segments: Vec<String> = text.split('.').map(str::to_string).collect();
        if segments.iter().any(String::is_empty) {
            return Err(format!("{text:?} is not a field path: names separated by single dots, none empty"));
        }
        Ok(FieldPath(segments))
    }

    pub fn segments(&self) -> &[String] {
        &self.0
    }

    /// Whether `self` names a field inside `other` or `other` itself.
    pub fn starts_with(&self, other: &FieldPath) -> bool {
        self.0.starts_with(&other.0)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("."))
    }
}

impl Serialize for FieldPath {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for FieldPath {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        FieldPath::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Where each field of a click is (`validation.fields`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Fields {
    pub click_id: FieldPath,
    pub ad_id: FieldPath,
    pub ts: FieldPath,
}

impl Default for Fields {
    fn default() -> Self {
        let path = |name: &str| FieldPath(vec![name.to_string()]);
        Fields { click_id: path("click_id"), ad_id: path("ad_id"), ts: path("ts") }
    }
}

impl Fields {
    /// The three paths with their setting names, in the order a missing one is reported.
    pub fn named(&self) -> [(&'static str, &FieldPath); 3] {
        [("click_id", &self.click_id), ("ad_id", &self.ad_id), ("ts", &self.ts)]
    }

    /// Why these paths cannot be read from one record: two fields at one path, or one
    /// field inside another (a value cannot be both a leaf and an object).
    pub fn conflict(&self) -> Option<String> {
        let named = self.named();
        for (i, (a, pa)) in named.iter().enumerate() {
            for (b, pb) in &named[i + 1..] {
                if pa.starts_with(pb) || pb.starts_with(pa) {
                    return Some(format!(
                        "validation.fields.{a} ({pa}) and validation.fields.{b} ({pb}) overlap: each field needs a \
                         path of its own, neither inside the other"
                    ));
                }
            }
        }
        None
    }
}

/// The unit of a numeric event time (`validation.ts_unit`). RFC 3339 strings and
/// timestamps whose schema names their unit (Avro's `timestamp-millis` and
/// `timestamp-micros`, Protobuf's `google.protobuf.Timestamp`) do not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TsUnit {
    /// By magnitude ([`TsUnit::of_magnitude`]).
    Auto,
    #[serde(rename = "s")]
    Seconds,
    /// What clickagg always read (the default), so existing topics decide as before.
    #[default]
    #[serde(rename = "ms")]
    Millis,
    #[serde(rename = "us")]
    Micros,
}

/// Under `auto`, an epoch below this magnitude is in seconds: 10^11 s is the year 5138,
/// while 10^11 ms is 1973-03-03 — no click is older.
pub const AUTO_MILLIS_FROM: i128 = 100_000_000_000;
/// Under `auto`, an epoch from this magnitude on is in microseconds (10^14 ms is the
/// year 5138, 10^14 µs 1973-03-03).
pub const AUTO_MICROS_FROM: i128 = 100_000_000_000_000;

impl TsUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            TsUnit::Auto => "auto",
            TsUnit::Seconds => "s",
            TsUnit::Millis => "ms",
            TsUnit::Micros => "us",
        }
    }

    /// The unit `auto` reads `n` in, by its magnitude alone (so the same number always
    /// means the same time): below 10^11 seconds, below 10^14 milliseconds, else
    /// microseconds. Every time from 1973-03-03 to the year 5138 is read right in any
    /// of the three units.
    pub fn of_magnitude(n: i128) -> TsUnit {
        match n.unsigned_abs() {
            m if m < AUTO_MILLIS_FROM as u128 => TsUnit::Seconds,
            m if m < AUTO_MICROS_FROM as u128 => TsUnit::Millis,
            _ => TsUnit::Micros,
        }
    }

    /// `n` of this unit in milliseconds, exactly (i128 holds any i64 times 1000), a
    /// fraction of a millisecond rounded down (as a minute is).
    pub fn to_millis(self, n: i128) -> i128 {
        match self {
            TsUnit::Auto => TsUnit::of_magnitude(n).to_millis(n),
            TsUnit::Seconds => n * 1000,
            TsUnit::Millis => n,
            TsUnit::Micros => n.div_euclid(1000),
        }
    }
}

impl fmt::Display for TsUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A field's value as the record carries it, before it is read as a click's field.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Str(Cow<'a, str>),
    /// An integer of the encoding's own integer types (JSON integers within i64 or
    /// u64, Avro `int`/`long`, every Protobuf integer type).
    Int(i128),
    /// An event time whose unit the schema states, in milliseconds.
    TimeMillis(i128),
    /// Anything else, by the name of its type ("a float", "an object", …).
    Other(&'static str),
}

impl Value<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Value::Str(_) => "a string",
            Value::Int(_) => "an integer",
            Value::TimeMillis(_) => "a timestamp",
            Value::Other(what) => what,
        }
    }
}

fn wrong_type(field: &str, detail: impl fmt::Display) -> Rejection {
    Rejection::new(RejectReason::WrongType, format!("{field}: {detail}"))
}

/// The click ID: a string.
pub fn click_id<'a>(path: &FieldPath, v: Value<'a>) -> Result<Cow<'a, str>, Rejection> {
    match v {
        Value::Str(s) => Ok(s),
        other => Err(wrong_type(&path.to_string(), format_args!("{}, expected a string", other.kind()))),
    }
}

/// The ad ID: an integer in 0..=u64::MAX, or a string of ASCII digits whose number is.
/// Anything else (a sign, blanks, a fraction, an empty string, a number past u64) is
/// `wrong_type`: an ID is never guessed at, rounded or wrapped.
pub fn ad_id(path: &FieldPath, v: Value<'_>) -> Result<u64, Rejection> {
    let expected = "expected an integer in 0..=18446744073709551615 or a string of its digits";
    match v {
        Value::Int(n) => u64::try_from(n).map_err(|_| wrong_type(&path.to_string(), format_args!("{n}, {expected}"))),
        Value::Str(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            // Only digits, so the one failure left is overflow.
            s.parse::<u64>().map_err(|_| wrong_type(&path.to_string(), format_args!("{s:?} overflows u64")))
        }
        Value::Str(s) => Err(wrong_type(&path.to_string(), format_args!("{s:?}, {expected}"))),
        other => Err(wrong_type(&path.to_string(), format_args!("{}, {expected}", other.kind()))),
    }
}

/// The event time in milliseconds: an integer epoch in `unit`, an RFC 3339 string, or a
/// timestamp whose schema states its unit. i128, so that no unit conversion overflows;
/// the range checks come after.
pub fn ts_millis(path: &FieldPath, v: Value<'_>, unit: TsUnit) -> Result<i128, Rejection> {
    match v {
        // Past i64 in any unit is no time a producer meant (and JSON's own limit).
        Value::Int(n) if i64::try_from(n).is_err() => {
            Err(wrong_type(&path.to_string(), format_args!("{n} is outside the 64-bit epochs")))
        }
        Value::Int(n) => Ok(unit.to_millis(n)),
        Value::TimeMillis(ms) => Ok(ms),
        Value::Str(s) => chrono::DateTime::parse_from_rfc3339(&s)
            .map(|t| i128::from(t.timestamp_millis()))
            .map_err(|_| wrong_type(&path.to_string(), format_args!("{s:?} is not an RFC 3339 timestamp"))),
        other => Err(wrong_type(
            &path.to_string(),
            format_args!("{}, expected an epoch integer or an RFC 3339 string", other.kind()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> FieldPath {
        FieldPath::parse(s).unwrap()
    }

    #[test]
    fn paths_parse_and_overlaps_are_named() {
        assert_eq!(p("event.id").segments(), ["event", "id"]);
        for bad in ["", ".", "a.", ".a", "a..b"] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?}");
        }
        let mut f = Fields::default();
        assert_eq!(f.conflict(), None);
        f.ts = p("ad_id.time");
        assert!(f.conflict().unwrap().contains("validation.fields.ad_id (ad_id)"));
        f.ts = p("click_id");
        assert!(f.conflict().is_some());
        f.ts = p("meta.time");
        f.click_id = p("meta.id");
        assert_eq!(f.conflict(), None, "siblings in one object are fine");
    }

    #[test]
    fn ad_ids_are_integers_or_strings_of_digits_and_never_wrap() {
        let path = p("ad_id");
        assert_eq!(ad_id(&path, Value::Int(7)), Ok(7));
        assert_eq!(ad_id(&path, Value::Int(u64::MAX.into())), Ok(u64::MAX));
        assert_eq!(ad_id(&path, Value::Str("0042".into())), Ok(42));
        assert_eq!(ad_id(&path, Value::Str("18446744073709551615".into())), Ok(u64::MAX));
        for bad in ["18446744073709551616", "99999999999999999999999", "", "-1", "+1", " 1", "1.0", "1e3", "12x", "٣"]
        {
            let e = ad_id(&path, Value::Str(bad.into())).unwrap_err();
            assert_eq!(e.reason, RejectReason::WrongType, "{bad:?}");
        }
        assert_eq!(ad_id(&path, Value::Int(-1)).unwrap_err().reason, RejectReason::WrongType);
        assert_eq!(ad_id(&path, Value::Int(i128::from(u64::MAX) + 1)).unwrap_err().reason, RejectReason::WrongType);
        assert_eq!(ad_id(&path, Value::Other("a float")).unwrap_err().reason, RejectReason::WrongType);
        assert!(ad_id(&p("ad.id"), Value::Str("x".into())).unwrap_err().detail.starts_with("ad.id: "));
    }

    #[test]
    fn auto_reads_each_unit_by_its_magnitude_band() {
        use TsUnit::*;
        let t = 1_764_489_605_123i128; // 2025-11-30T08:00:05.123Z in ms
        assert_eq!(Auto.to_millis(t / 1000), t / 1000 * 1000);
        assert_eq!(Auto.to_millis(t), t);
        assert_eq!(Auto.to_millis(t * 1000 + 999), t);
        // The band edges: just below is the smaller unit.
        assert_eq!(TsUnit::of_magnitude(AUTO_MILLIS_FROM - 1), Seconds);
        assert_eq!(TsUnit::of_magnitude(AUTO_MILLIS_FROM), Millis);
        assert_eq!(TsUnit::of_magnitude(AUTO_MICROS_FROM - 1), Millis);
        assert_eq!(TsUnit::of_magnitude(AUTO_MICROS_FROM), Micros);
        assert_eq!(TsUnit::of_magnitude(-(AUTO_MILLIS_FROM - 1)), Seconds);
        assert_eq!(TsUnit::of_magnitude(i128::from(i64::MIN)), Micros);
        // Fixed units, rounding down; nothing overflows.
        assert_eq!(Seconds.to_millis(i128::from(i64::MAX)), i128::from(i64::MAX) * 1000);
        assert_eq!(Micros.to_millis(-1), -1);
        assert_eq!(Micros.to_millis(1_999), 1);
    }

    #[test]
    fn timestamps_are_epochs_in_the_unit_or_rfc3339_strings() {
        let path = p("ts");
        assert_eq!(ts_millis(&path, Value::Int(1_764_489_605), TsUnit::Seconds), Ok(1_764_489_605_000));
        assert_eq!(ts_millis(&path, Value::Int(1_764_489_605_123_456), TsUnit::Micros), Ok(1_764_489_605_123));
        assert_eq!(ts_millis(&path, Value::TimeMillis(5), TsUnit::Seconds), Ok(5), "the schema's unit wins");
        assert_eq!(
            ts_millis(&path, Value::Str("2025-11-30T09:00:05.123+01:00".into()), TsUnit::Seconds),
            Ok(1_764_489_605_123)
        );
        for bad in [Value::Str("1764489605".into()), Value::Str("yesterday".into()), Value::Other("a float")] {
            assert_eq!(ts_millis(&path, bad, TsUnit::Auto).unwrap_err().reason, RejectReason::WrongType);
        }
    }
}
