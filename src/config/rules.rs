//! The settings that decide which clicks count (guide, "What counts"): the window, the
//! fingerprint key, the shard count, the validation limits and how a record is read
//! (format, field paths, timestamp unit). They are part of the
//! definition, as the batch size is part of every batch's identity: a reader with other
//! values decides differently, so they are recorded per topic (`clickagg_settings`)
//! and every member must run with the ones recorded; `clickagg settings change`
//! changes them on purpose, from a recorded position on.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use siphasher::sip128::{Hasher128, SipHasher13};

use crate::dedup::Secs;

/// What shapes decisions, as recorded: durations in whole seconds, the fingerprint key
/// only as an identifier (a keyed hash with public keys: names the key, reveals
/// nothing usable about it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rules {
    pub window_secs: u64,
    pub fingerprint_key_id: String,
    pub shards: u32,
    pub max_payload_bytes: u64,
    pub max_click_id_len: u64,
    pub max_future_skew_secs: u64,
    pub max_lateness_secs: u64,
    /// Left out of the record while it is the default, so that a topic recorded before
    /// these settings existed records (and tags its cache) exactly as before.
    #[serde(default, skip_serializing_if = "Reading::is_default")]
    pub reading: Reading,
}

/// How a record is read: its encoding, where its fields are, the unit of a numeric
/// event time. Another value reads the same bytes as other clicks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Reading {
    pub format: crate::click::Format,
    pub fields: crate::click::Fields,
    pub ts_unit: crate::click::TsUnit,
}

impl Reading {
    pub fn is_default(&self) -> bool {
        *self == Reading::default()
    }
}

impl Rules {
    /// The identifier of a fingerprint key: 64 bits of a SipHash-1-3 under public keys.
    pub fn key_id(key: &str) -> String {
        let mut h = SipHasher13::new_with_keys(0x7275_6c65_732d_6b65, 0x792d_6964_656e_7469);
        std::hash::Hasher::write(&mut h, key.as_bytes());
        format!("{:016x}", h.finish128().h1)
    }

    /// The window `W` in record-time seconds, the unit every decision compares in.
    pub fn window(&self) -> Secs {
        Secs::saturating_from(self.window_secs)
    }

    /// A short name of all of them together: part of the dedup cache's namespace.
    pub fn tag(&self) -> String {
        let text = serde_json::to_string(self).expect("rules always serialize");
        let mut h = SipHasher13::new_with_keys(0, 0);
        std::hash::Hasher::write(&mut h, text.as_bytes());
        format!("{:08x}", h.finish128().h1 as u32)
    }

    /// Every setting whose value differs from `recorded`: (setting name, ours, recorded).
    pub fn differences(&self, recorded: &Rules) -> Vec<(&'static str, String, String)> {
        let secs = |s: u64| humantime::format_duration(std::time::Duration::from_secs(s)).to_string();
        let mut out = Vec::new();
        let mut check = |name: &'static str, ours: String, theirs: String| {
            if ours != theirs {
                out.push((name, ours, theirs));
            }
        };
        check("dedup.window", secs(self.window_secs), secs(recorded.window_secs));
        check(
            "dedup.fingerprint_key",
            format!("a key with id {}", self.fingerprint_key_id),
            format!("a key with id {}", recorded.fingerprint_key_id),
        );
        check("dedup.shards", self.shards.to_string(), recorded.shards.to_string());
        check(
            "validation.max_payload_bytes",
            self.max_payload_bytes.to_string(),
            recorded.max_payload_bytes.to_string(),
        );
        check("validation.max_click_id_len", self.max_click_id_len.to_string(), recorded.max_click_id_len.to_string());
        check("validation.max_future_skew", secs(self.max_future_skew_secs), secs(recorded.max_future_skew_secs));
        check("validation.max_lateness", secs(self.max_lateness_secs), secs(recorded.max_lateness_secs));
        let (ours, theirs) = (&self.reading, &recorded.reading);
        check("source.format", ours.format.to_string(), theirs.format.to_string());
        for ((name, mine), (_, recorded)) in ours.fields.named().into_iter().zip(theirs.fields.named()) {
            let setting = match name {
                "click_id" => "validation.fields.click_id",
                "ad_id" => "validation.fields.ad_id",
                _ => "validation.fields.ts",
            };
            check(setting, mine.to_string(), recorded.to_string());
        }
        check("validation.ts_unit", ours.ts_unit.to_string(), theirs.ts_unit.to_string());
        out
    }
}

impl super::Settings {
    /// These settings with the decisions' part of recorded `rules`: the window, the
    /// validation limits and how a record is read (the fingerprint key and the shard
    /// count only shape the cache, which a private reader does not use). A replay or
    /// `explain` of a range reads it under the rules recorded for it.
    pub fn with_recorded(&self, rules: &Rules) -> super::Settings {
        let mut under = self.clone();
        under.dedup.window = Some(Duration::from_secs(rules.window_secs));
        under.validation.max_payload_bytes = rules.max_payload_bytes as usize;
        under.validation.max_click_id_len = rules.max_click_id_len as usize;
        under.validation.max_future_skew = Duration::from_secs(rules.max_future_skew_secs);
        under.validation.max_lateness = Duration::from_secs(rules.max_lateness_secs);
        under.source.format = rules.reading.format;
        under.validation.fields = rules.reading.fields.clone();
        under.validation.ts_unit = rules.reading.ts_unit;
        under
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            window_secs: 86_400,
            fingerprint_key_id: Rules::key_id("secret"),
            shards: 65_536,
            max_payload_bytes: 65_536,
            max_click_id_len: 128,
            max_future_skew_secs: 300,
            max_lateness_secs: 21_600,
            reading: Reading::default(),
        }
    }

    #[test]
    fn the_default_reading_is_recorded_as_before_and_another_is_named() {
        let json = serde_json::to_string(&rules()).unwrap();
        assert!(!json.contains("reading"), "{json}");
        let old: Rules = serde_json::from_str(&json).unwrap();
        assert_eq!(old, rules(), "a record without the reading reads as the default");
        let mut avro = rules();
        avro.reading.format = crate::click::Format::Avro;
        avro.reading.ts_unit = crate::click::TsUnit::Auto;
        avro.reading.fields.ad_id = crate::click::FieldPath::parse("ad.id").unwrap();
        let back: Rules = serde_json::from_str(&serde_json::to_string(&avro).unwrap()).unwrap();
        assert_eq!(back, avro);
        let names: Vec<&str> = avro.differences(&rules()).iter().map(|d| d.0).collect();
        assert_eq!(names, ["source.format", "validation.fields.ad_id", "validation.ts_unit"]);
        assert_ne!(avro.tag(), rules().tag());
    }

    #[test]
    fn the_window_is_in_seconds_and_each_moved_field_is_named_as_its_own_setting() {
        assert_eq!(rules().window(), Secs::new(86_400));
        assert_eq!(Rules { window_secs: u64::MAX, ..rules() }.window(), Secs::MAX, "saturates");
        let mut moved = rules();
        moved.reading.fields.click_id = crate::click::FieldPath::parse("id").unwrap();
        moved.reading.fields.ts = crate::click::FieldPath::parse("meta.ts").unwrap();
        let names: Vec<&str> = moved.differences(&rules()).iter().map(|d| d.0).collect();
        assert_eq!(names, ["validation.fields.click_id", "validation.fields.ts"]);
    }

    #[test]
    fn a_changed_setting_is_named_with_both_values_and_the_key_only_by_its_id() {
        let other = Rules { window_secs: 3_600, fingerprint_key_id: Rules::key_id("other"), ..rules() };
        let d = rules().differences(&other);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[0], ("dedup.window", "1day".to_string(), "1h".to_string()));
        assert_eq!(d[1].0, "dedup.fingerprint_key");
        assert!(!d[1].1.contains("secret") && !d[1].2.contains("other"));
        assert!(rules().differences(&rules()).is_empty());
        assert_ne!(rules().tag(), other.tag());
        assert_eq!(rules().tag(), rules().tag());
    }
}
