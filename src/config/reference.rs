//! The guide's configuration reference (`docs/src/configure/reference.md`) against the
//! code: every key the settings read has a row and every row names a key they read, and
//! each documented default is what `Settings::default()` holds (or, for a setting left
//! unset whose value the code derives, what it derives).
//!
//! The keys come from serde itself: a probing deserializer asks `Settings` to
//! deserialize and reads the field names the derive hands to `deserialize_struct` (all
//! of them, `Option`s and the ones skipped when empty included), then walks into one
//! field at a time. A key that takes a map (`kafka.properties`) is `<key>` below it.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::time::Duration;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::Settings;

const REFERENCE: &str = "docs/src/configure/reference.md";

/// What the probe found at a path.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Struct(&'static [&'static str]),
    Map,
    Leaf,
}

type Error = de::value::Error;

/// A deserializer that follows `path` into nested structs and records the shape found at
/// its end; it never produces a value (every probe ends in an error, on purpose).
struct Probe<'a> {
    path: &'a [&'static str],
    found: &'a RefCell<Option<Shape>>,
}

impl Probe<'_> {
    fn leaf<T>(self) -> Result<T, Error> {
        if self.path.is_empty() {
            *self.found.borrow_mut() = Some(Shape::Leaf);
        }
        Err(de::Error::custom("probed"))
    }
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = Error;

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self.path.split_first() {
            None => {
                *self.found.borrow_mut() = Some(Shape::Struct(fields));
                Err(de::Error::custom("probed"))
            }
            Some((key, rest)) => visitor.visit_map(OneField { key: Some(key), rest, found: self.found }),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_map<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Error> {
        if self.path.is_empty() {
            *self.found.borrow_mut() = Some(Shape::Map);
        }
        Err(de::Error::custom("probed"))
    }

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Error> {
        self.leaf()
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Error> {
        self.leaf()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct identifier ignored_any
    }
}

/// A map of one entry: the next field on the probe's path.
struct OneField<'a> {
    key: Option<&'static str>,
    rest: &'a [&'static str],
    found: &'a RefCell<Option<Shape>>,
}

impl<'de> MapAccess<'de> for OneField<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        match self.key.take() {
            Some(key) => seed.deserialize(key.into_deserializer()).map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        seed.deserialize(Probe { path: self.rest, found: self.found })
    }
}

fn shape(path: &[&'static str]) -> Shape {
    let found = RefCell::new(None);
    let _ = Settings::deserialize(Probe { path, found: &found });
    found.into_inner().unwrap_or_else(|| panic!("the probe found nothing at {}", path.join(".")))
}

/// Every key the settings read, dotted; a map's keys as `<key>`.
fn code_keys() -> BTreeSet<String> {
    fn walk(path: &mut Vec<&'static str>, out: &mut BTreeSet<String>) {
        match shape(path) {
            Shape::Struct(fields) => {
                for field in fields {
                    path.push(field);
                    walk(path, out);
                    path.pop();
                }
            }
            Shape::Map => {
                out.insert(format!("{}.<key>", path.join(".")));
            }
            Shape::Leaf => {
                out.insert(path.join("."));
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&mut Vec::new(), &mut out);
    out
}

/// One row of the reference table: its keys (flags left out) and its default cell.
struct Row {
    keys: Vec<String>,
    default: String,
    line: usize,
}

/// The cells of a table row, split at `|` outside backticks.
fn cells(line: &str) -> Vec<String> {
    let mut cells = vec![String::new()];
    let mut code = false;
    for c in line.trim().trim_matches('|').chars() {
        match c {
            '`' => {
                code = !code;
                cells.last_mut().expect("a cell").push(c);
            }
            '|' if !code => cells.push(String::new()),
            _ => cells.last_mut().expect("a cell").push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The spans in backticks of a cell.
fn quoted(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The rows of the table headed `| key | default | meaning |`.
fn rows(text: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut in_table = false;
    for (i, line) in text.lines().enumerate() {
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let c = cells(line);
        if c.len() == 3 && c[0] == "key" && c[1] == "default" && c[2] == "meaning" {
            in_table = true;
            continue;
        }
        if !in_table || c.iter().all(|c| c.chars().all(|ch| ch == '-' || ch == ':')) {
            continue;
        }
        assert_eq!(c.len(), 3, "{REFERENCE}:{}: a row of the reference has three cells", i + 1);
        // Flags (`--brokers`, `migrate --cluster`) stand beside the keys they set.
        let keys = quoted(&c[0])
            .into_iter()
            .filter(|k| !k.starts_with('-') && !k.contains(" --"))
            .map(|k| match k.split_once('<') {
                Some((map, _)) => format!("{map}<key>"),
                None => k.to_string(),
            })
            .collect();
        rows.push(Row { keys, default: c[1].clone(), line: i + 1 });
    }
    rows
}

/// The default cell of a row, one part per key: `a, b` for two keys, or one for all.
fn defaults_per_key(row: &Row) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut code = false;
    for c in row.default.chars() {
        match c {
            '`' => {
                code = !code;
                parts.last_mut().expect("a part").push(c);
            }
            ',' if !code => parts.push(String::new()),
            _ => parts.last_mut().expect("a part").push(c),
        }
    }
    let parts: Vec<String> = parts.into_iter().map(|p| p.trim().to_string()).collect();
    if parts.len() == row.keys.len() {
        parts
    } else {
        vec![row.default.trim().to_string(); row.keys.len()]
    }
}

/// The value of a key in `Settings::default()` as `clickagg config` prints it, if set.
fn default_value(key: &str) -> Option<toml::Value> {
    let mut v = toml::Value::try_from(Settings::default()).expect("the defaults serialize");
    for part in key.split('.') {
        v = v.get(part)?.clone();
    }
    Some(v)
}

fn as_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Settings left unset whose value the code derives from others: the values the
/// reference gives, in the order it gives them.
fn derived(key: &str) -> Option<Vec<String>> {
    let single = Settings::default();
    let mut cluster = Settings::default();
    cluster.redis.url = crate::config::SecretUrl::new("redis://a:6379/,redis://b:6379/");
    cluster.clickhouse.cluster = Some("c".into());
    let replicas = |s: &Settings| s.redis.wait().map_or(0, |w| w.replicas).to_string();
    Some(match key {
        // `false`; `true` with several URLs.
        "redis.cluster" => vec![single.redis.is_cluster().to_string(), cluster.redis.is_cluster().to_string()],
        // `16` on a cluster.
        "redis.slot_groups" => vec![cluster.redis.groups().to_string()],
        // `1` on a cluster and behind Sentinel, `0` otherwise.
        "redis.wait_replicas" => vec![replicas(&cluster), replicas(&single)],
        "dedup.window" => vec![humantime::format_duration(single.dedup_window()).to_string()],
        // `2` with a cluster.
        "clickhouse.insert_quorum" => vec![cluster.clickhouse.quorum().to_string()],
        // `<topic>.dlq`.
        "dead_letter.topic" => {
            let mut s = Settings::default();
            s.kafka.topic = "<topic>".into();
            vec![s.dead_letter_topic()]
        }
        _ => return None,
    })
}

/// Whether a documented value is the code's: the same text, the same duration, or the
/// same URL (`clickagg config` prints `http://host:8123` as `http://host:8123/`).
fn same(doc: &str, code: &str) -> bool {
    let duration = |s: &str| humantime::parse_duration(s).ok().filter(|d| *d > Duration::ZERO);
    doc == code
        || matches!((duration(doc), duration(code)), (Some(a), Some(b)) if a == b)
        || (doc.contains("://") && doc.trim_end_matches('/') == code.trim_end_matches('/'))
}

#[test]
fn the_configuration_reference_names_every_key_and_its_default() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/configure/reference.md");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{REFERENCE}: {e}"));
    let rows = rows(&text);
    assert!(rows.len() > 20, "{REFERENCE}: no `| key | default | meaning |` table found");

    let code = code_keys();
    let mut documented = BTreeSet::new();
    let mut problems = Vec::new();
    for row in &rows {
        for key in &row.keys {
            if !documented.insert(key.clone()) {
                problems.push(format!("line {}: `{key}` has more than one row", row.line));
            }
        }
    }
    for key in code.difference(&documented) {
        problems.push(format!("`{key}` is a setting the code reads, but has no row"));
    }
    for key in documented.difference(&code) {
        problems.push(format!("`{key}` has a row, but is no setting the code reads"));
    }

    for row in &rows {
        for (key, cell) in row.keys.iter().zip(defaults_per_key(row)) {
            if !code.contains(key) {
                continue;
            }
            let values = quoted(&cell);
            let wrong = |want: &str| format!("line {}: `{key}` defaults to {want}, not {cell}", row.line);
            let value = default_value(key).filter(|v| !matches!(v, toml::Value::Table(t) if t.is_empty()));
            match (value, derived(key)) {
                (_, Some(want)) => {
                    let ok = values.len() >= want.len() && want.iter().zip(&values).all(|(w, d)| same(d, w));
                    if !ok {
                        problems.push(wrong(&want.join(", then ")));
                    }
                }
                (None, None) if cell != "—" => problems.push(wrong("nothing (—)")),
                (None, None) => {}
                // A secret's default is not printed: the reference says there is one.
                (Some(v), None) if as_text(&v) == "[redacted]" => {
                    if cell == "—" || !values.is_empty() {
                        problems.push(wrong("a value that is not printed (a secret): say so, in words"));
                    }
                }
                (Some(v), None) => {
                    if values.first().is_none_or(|d| !same(d, &as_text(&v))) {
                        problems.push(wrong(&format!("`{}`", as_text(&v))));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{REFERENCE} disagrees with the code:\n{}", problems.join("\n"));
}

#[test]
fn the_probe_sees_options_and_maps() {
    let keys = code_keys();
    for key in
        ["kafka.brokers", "dedup.window", "redis.sentinel.urls", "validation.fields.ts", "kafka.properties.<key>"]
    {
        assert!(keys.contains(key), "{key} missing from {keys:?}");
    }
    assert!(!keys.iter().any(|k| k == "redis.sentinel"), "a struct is not a key");
}
