//! The fuzzer's inputs: arbitrary bytes, JSON objects with random types and extreme
//! values, extreme record timestamps and limits, and records made to be of a known class
//! (a valid click, or exactly one defect).

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;

use super::*;

/// Record timestamps: mostly within an hour of [`NOW`], sometimes none or anything an
/// i64 holds.
pub(super) fn record_ts(rng: &mut SmallRng) -> Option<i64> {
    match rng.random_range(0..10) {
        0 => None,
        1 => Some(pick(rng, &[i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX - 1, i64::MAX])),
        2 => Some(rng.random()),
        _ => Some(NOW + rng.random_range(-HOUR..HOUR)),
    }
}

/// Event times around the default limits of a record near [`NOW`]: up to 8 h behind
/// and 1 h ahead, so both checks pass and fail.
pub(super) fn plausible_ts(rng: &mut SmallRng) -> i64 {
    NOW + rng.random_range(-8 * HOUR..HOUR)
}

/// Limits: mostly the defaults, sometimes the extremes a configuration can hold.
pub(super) fn limits(rng: &mut SmallRng) -> Limits {
    let mut l = Limits::default();
    if rng.random_bool(0.1) {
        let durations = [Duration::ZERO, Duration::from_millis(1), Duration::from_secs(u64::MAX), Duration::MAX];
        l.max_future_skew = pick(rng, &durations);
        l.max_lateness = pick(rng, &durations);
        l.max_click_id_len = pick(rng, &[0, 1, 128, usize::MAX]);
        l.max_payload_bytes = pick(rng, &[0, 1, 64, 65_536, usize::MAX]);
    }
    l
}

pub(super) fn pick<T: Copy>(rng: &mut SmallRng, from: &[T]) -> T {
    from[rng.random_range(0..from.len())]
}

pub(super) fn arbitrary_bytes(rng: &mut SmallRng) -> Vec<u8> {
    let len = if rng.random_bool(0.9) { rng.random_range(0..48) } else { rng.random_range(0..400) };
    if rng.random_bool(0.5) {
        (0..len).map(|_| rng.random()).collect()
    } else {
        (0..len).map(|_| pick(rng, JSONISH)).collect()
    }
}

/// A valid click with a few bytes inserted, deleted or replaced.
pub(super) fn mutated_click(rng: &mut SmallRng) -> Vec<u8> {
    let mut b = br#"{"click_id":"0f5c-a","ad_id":1234,"ts":1764489605123,"x":[1,{"y":null}]}"#.to_vec();
    for _ in 0..rng.random_range(1..4) {
        let at = rng.random_range(0..=b.len());
        match rng.random_range(0..3) {
            0 => b.insert(at, pick(rng, JSONISH)),
            1 if at < b.len() => {
                b.remove(at);
            }
            _ if at < b.len() => b[at] = rng.random(),
            _ => {}
        }
    }
    b
}

/// A JSON value as text, of any type; numbers well outside i64 and u64 included.
pub(super) fn value(rng: &mut SmallRng, depth: u32) -> String {
    match rng.random_range(0..14) {
        0 => "null".into(),
        1 => pick(rng, &["true", "false"]).into(),
        2 => pick(rng, &[i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX]).to_string(),
        3 => pick(rng, &[u64::MAX, u64::MAX - 1, 1 << 63]).to_string(),
        4 => pick(rng, &["18446744073709551616", "-9223372036854775809", "1e400", "-1e400", "99999999999999999999999"])
            .into(),
        5 => pick(rng, &["1.5", "-0", "-0.0", "0e0", "1E3", "1764489605123.0", "5e-324", "1.7976931348623157e308"])
            .into(),
        6 => rng.random::<i64>().to_string(),
        7 => plausible_ts(rng).to_string(),
        8 | 9 => json_string(&timestamp_text(rng)),
        10 => json_string(&text(rng)),
        11 if depth < 3 => {
            format!("[{}]", (0..rng.random_range(0..3)).map(|_| value(rng, depth + 1)).collect::<Vec<_>>().join(","))
        }
        12 if depth < 3 => format!("{{\"k\":{}}}", value(rng, depth + 1)),
        _ => "\"c\"".into(),
    }
}

/// Text that is, or nearly is, an RFC 3339 timestamp.
pub(super) fn timestamp_text(rng: &mut SmallRng) -> String {
    let fixed = [
        "2025-11-30T08:00:05.123Z",
        "0000-01-01T00:00:00Z",
        "9999-12-31T23:59:59.999999999Z",
        "9999-12-31T23:59:60Z",
        "1969-12-31T23:59:59.999Z",
        "1970-01-01T00:00:00+23:59",
        "2106-02-07T06:28:16Z",
        "2025-11-30t08:00:05z",
        "2025-11-30T08:00:05.1234567890123456789Z",
        "2025-02-29T00:00:00Z",
        "2025-11-30T24:00:00Z",
        "+2025-11-30T08:00:05Z",
        "",
    ];
    if rng.random_bool(0.5) {
        return pick(rng, &fixed).to_string();
    }
    let offset = if rng.random_bool(0.5) {
        "Z".to_string()
    } else {
        format!("{}{:02}:{:02}", pick(rng, &["+", "-"]), rng.random_range(0..30), rng.random_range(0..70))
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{}{offset}",
        rng.random_range(0..10_000),
        rng.random_range(0..14),
        rng.random_range(0..33),
        rng.random_range(0..26),
        rng.random_range(0..62),
        rng.random_range(0..62),
        if rng.random_bool(0.5) { format!(".{}", rng.random::<u32>()) } else { String::new() },
    )
}

pub(super) fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// Click IDs: empty, at and past the length limit, escapes, control and multibyte characters.
pub(super) fn text(rng: &mut SmallRng) -> String {
    match rng.random_range(0..8) {
        0 => String::new(),
        1 => "x".repeat(pick(rng, &[127, 128, 129, 5000])),
        2 => "é".repeat(rng.random_range(60..70)),
        3 => "\u{0}\u{1f}\"\\\u{7f}\u{fffd}\u{10ffff}".into(),
        _ => format!("c-{}", rng.random::<u32>()),
    }
}

/// A JSON object with each of `click_id`, `ad_id` and `ts` missing, once, or twice,
/// in any order, among unknown fields; and the fields it holds when it holds each once,
/// of its type.
pub(super) fn click_object(rng: &mut SmallRng) -> (Vec<u8>, Option<Fields>) {
    let mut fields: Vec<String> = Vec::new();
    let (mut click_id, mut ad_id, mut ts_ms) = (None, None, None);
    let mut plain = true;
    for name in ["click_id", "ad_id", "ts"] {
        let copies = pick(rng, &[0, 1, 1, 1, 1, 1, 1, 1, 1, 2]);
        plain &= copies == 1;
        for _ in 0..copies {
            // Mostly of the right type, so that the checks after parsing run too.
            let v = match (name, rng.random_range(0..4)) {
                (_, 0) => {
                    plain = false;
                    value(rng, 0)
                }
                ("click_id", _) => {
                    let id = text(rng);
                    let v = json_string(&id);
                    click_id = Some(id);
                    v
                }
                ("ad_id", _) => {
                    let id = rng.random_range(0..100_000u64);
                    ad_id = Some(id);
                    id.to_string()
                }
                _ => {
                    let ts = plausible_ts(rng);
                    ts_ms = Some(ts);
                    ts.to_string()
                }
            };
            fields.push(format!("\"{name}\":{v}"));
        }
    }
    for _ in 0..rng.random_range(0..3) {
        fields.push(format!("\"extra\":{}", value(rng, 0)));
    }
    // A fixed-size shuffle: the field order must not matter.
    for i in (1..fields.len()).rev() {
        fields.swap(i, rng.random_range(0..=i));
    }
    let known = match (plain, click_id, ad_id, ts_ms) {
        (true, Some(click_id), Some(ad_id), Some(ts_ms)) => Some(Fields { click_id, ad_id, ts_ms }),
        _ => None,
    };
    (format!("{{{}}}", fields.join(",")).into_bytes(), known)
}

/// Limits a class can be made under: mostly the defaults, sometimes others (never the
/// extremes, under which some classes cannot exist).
pub(super) fn class_limits(rng: &mut SmallRng) -> Limits {
    let mut l = Limits::default();
    if rng.random_bool(0.3) {
        l.max_click_id_len = rng.random_range(1..=200);
        l.max_future_skew = Duration::from_millis(rng.random_range(1_000..=10 * HOUR as u64));
        l.max_lateness = Duration::from_millis(rng.random_range(1_000..=10 * HOUR as u64));
    }
    l
}

/// A click ID of `1..=max` bytes: ASCII, quotes, backslashes, control and multibyte
/// characters, which the JSON text escapes in any of the ways JSON allows.
pub(super) fn any_click_id(rng: &mut SmallRng, max: usize) -> String {
    let len = rng.random_range(1..=max.min(64));
    id_of_len(rng, len)
}

/// A string of exactly `len` bytes.
pub(super) fn id_of_len(rng: &mut SmallRng, len: usize) -> String {
    const CHARS: &[char] =
        &['a', 'Z', '0', '9', '-', '_', ' ', '"', '\\', '/', '\n', '\u{1}', '\u{7f}', 'é', '€', '\u{fffd}', '😀'];
    let mut id = String::new();
    while id.len() < len {
        let c = pick(rng, CHARS);
        id.push(if id.len() + c.len_utf8() <= len { c } else { 'x' });
    }
    id
}

/// `s` as a JSON string, each character escaped or not as JSON allows.
pub(super) fn escaped(rng: &mut SmallRng, s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' if rng.random_bool(0.5) => out.push_str("\\n"),
            c if (c as u32) < 0x20 || rng.random_bool(0.15) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            '/' if rng.random_bool(0.5) => out.push_str("\\/"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `ts_ms` as epoch milliseconds or, where a year of four digits holds it, RFC 3339
/// in any offset, with 0, 3, 6 or 9 digits of fraction (sub-millisecond digits are cut).
pub(super) fn any_ts(rng: &mut SmallRng, ts_ms: i64) -> String {
    let utc = chrono::DateTime::from_timestamp_millis(ts_ms);
    let offset = chrono::FixedOffset::east_opt(rng.random_range(-23 * 3600..=23 * 3600) / 60 * 60).expect("in range");
    match utc.map(|t| t.with_timezone(&offset)) {
        Some(t) if rng.random_bool(0.5) && (0..=9999).contains(&chrono::Datelike::year(&t)) => {
            let ms = ts_ms.rem_euclid(1000);
            let fraction = match rng.random_range(0..4) {
                0 if ms == 0 => String::new(),
                1 => format!(".{ms:03}{:03}", rng.random_range(0..1000)),
                2 => format!(".{ms:03}{:06}", rng.random_range(0..1_000_000)),
                _ => format!(".{ms:03}"),
            };
            let zone = if rng.random_bool(0.3) && offset.local_minus_utc() == 0 {
                "Z".to_string()
            } else {
                t.format("%:z").to_string()
            };
            format!("\"{}{fraction}{zone}\"", t.format("%Y-%m-%dT%H:%M:%S"))
        }
        _ => ts_ms.to_string(),
    }
}

/// Whitespace JSON allows between tokens.
pub(super) fn ws(rng: &mut SmallRng) -> &'static str {
    pick(rng, &["", "", "", " ", "\n", "\t", " \r\n  "])
}

/// An object of `fields` (name, JSON value) in random order, among unknown fields.
pub(super) fn object(rng: &mut SmallRng, mut fields: Vec<(&str, String)>, separator: &str) -> String {
    for _ in 0..rng.random_range(0..3) {
        let name = pick(rng, &["ua", "placement", "Click_id", "ad", "ts_ms", "click_id_"]);
        fields.push((name, value(rng, 0)));
    }
    for i in (1..fields.len()).rev() {
        fields.swap(i, rng.random_range(0..=i));
    }
    let members: Vec<String> =
        fields.iter().map(|(k, v)| format!("{}\"{k}\"{}:{}{v}{}", ws(rng), ws(rng), ws(rng), ws(rng))).collect();
    format!("{}{{{}}}{}", ws(rng), members.join(separator), ws(rng))
}

/// A valid click's fields under `limits` and `record_ts`: the ID within the length
/// limit, the event time within the skew and lateness of the record (at their bounds
/// now and then) and within what a minute can hold.
pub(super) fn valid_fields(rng: &mut SmallRng, limits: &Limits, record_ts: Option<i64>) -> Fields {
    let click_id = any_click_id(rng, limits.max_click_id_len);
    let ad_id = match rng.random_range(0..4) {
        0 => pick(rng, &[0, 1, u64::MAX - 1, u64::MAX]),
        1 => rng.random(),
        _ => rng.random_range(0..100_000),
    };
    let (lo, hi) = match record_ts {
        Some(r) => (
            (r - limits.max_lateness.as_millis() as i64).max(0),
            (r + limits.max_future_skew.as_millis() as i64).min(END_OF_MINUTES_MS - 1),
        ),
        None => (0, END_OF_MINUTES_MS - 1),
    };
    let ts_ms = match rng.random_range(0..6) {
        0 => lo,
        1 => hi,
        _ => rng.random_range(lo..=hi),
    };
    Fields { click_id, ad_id, ts_ms }
}

/// The three fields as JSON members.
pub(super) fn members(rng: &mut SmallRng, f: &Fields) -> Vec<(&'static str, String)> {
    // An ad ID as a JSON integer, or as a string of its digits (leading zeros too).
    let ad_id = match rng.random_range(0..4) {
        0 => format!("\"{}\"", f.ad_id),
        1 => format!("\"{}{}\"", "0".repeat(rng.random_range(1..4)), f.ad_id),
        _ => f.ad_id.to_string(),
    };
    vec![("click_id", escaped(rng, &f.click_id)), ("ad_id", ad_id), ("ts", any_ts(rng, f.ts_ms))]
}

/// A record made to be of `class`: a valid click, or a valid click but for one defect.
pub(super) fn classed(rng: &mut SmallRng, class: Option<RejectReason>) -> Case {
    use RejectReason as R;
    let mut limits = class_limits(rng);
    let mut record_ts = if rng.random_bool(0.1) { None } else { Some(NOW + rng.random_range(-24 * HOUR..24 * HOUR)) };
    let mut f = valid_fields(rng, &limits, record_ts);
    let text = |rng: &mut SmallRng, f: &Fields| {
        let m = members(rng, f);
        object(rng, m, ",")
    };
    let payload: Option<Vec<u8>> = match class {
        None => Some(text(rng, &f).into_bytes()),
        Some(R::EmptyPayload) => rng.random_bool(0.5).then(Vec::new),
        Some(R::Oversized) => {
            let p = if rng.random_bool(0.7) { text(rng, &f).into_bytes() } else { arbitrary_bytes(rng) };
            let p = if p.is_empty() { vec![b'{'] } else { p };
            limits.max_payload_bytes = rng.random_range(0..p.len());
            Some(p)
        }
        Some(R::NotUtf8) => {
            let mut p = text(rng, &f).into_bytes();
            let at = rng.random_range(0..=p.len());
            p.splice(at..at, pick(rng, NOT_UTF8).iter().copied());
            assert!(std::str::from_utf8(&p).is_err(), "the generator made UTF-8");
            Some(p)
        }
        Some(R::MalformedJson) => {
            let whole = text(rng, &f);
            let broken = match rng.random_range(0..5) {
                // Cut short anywhere (on a character boundary, so it stays UTF-8).
                0 | 1 => {
                    let end = whole.trim_end().len() - 1;
                    let mut cut = rng.random_range(1..=end);
                    while !whole.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    whole[..cut.max(1)].to_string()
                }
                2 => format!("{whole}{}", pick(rng, &["x", "{}", ",", "]", "1", "\"a\""])),
                3 => {
                    let m = members(rng, &f);
                    object(rng, m, " ")
                }
                _ => pick(rng, &["click_id=c&ad_id=1", "{'click_id':'c'}", "{\"click_id\"}", "{,}", "nul", "[,1]"])
                    .to_string(),
            };
            if broken.trim().is_empty() {
                Some(b"{".to_vec())
            } else {
                Some(broken.into_bytes())
            }
        }
        Some(R::MissingField) => {
            let mut m = members(rng, &f);
            let keep = rng.random_range(0..7u8); // a proper subset of the three fields
            let mut i = 0;
            m.retain(|_| {
                i += 1;
                keep & (1 << (i - 1)) != 0
            });
            Some(object(rng, m, ",").into_bytes())
        }
        Some(R::WrongType) => {
            let mut m = members(rng, &f);
            let field = rng.random_range(0..4);
            let wrong: &[&str] = match field {
                0 => &["1", "true", "null", "[\"c\"]", "{\"id\":\"c\"}", "1.5"],
                1 => &[
                    "\"7x\"",
                    "\"\"",
                    "\"-7\"",
                    "\" 7\"",
                    "\"18446744073709551616\"",
                    "-1",
                    "1.5",
                    "1e3",
                    "18446744073709551616",
                    "true",
                    "null",
                    "[]",
                    "{}",
                ],
                2 => &[
                    "true",
                    "null",
                    "[]",
                    "{}",
                    "1.5",
                    "\"yesterday\"",
                    "\"\"",
                    "\"2025-13-01T00:00:00Z\"",
                    "9223372036854775808",
                ],
                _ => &[],
            };
            if field < 3 {
                m[field].1 = pick(rng, wrong).to_string();
                Some(object(rng, m, ",").into_bytes())
            } else {
                // Not an object at all.
                Some(pick(rng, &["[1,2]", "\"click\"", "123", "true", "null", "[]"]).as_bytes().to_vec())
            }
        }
        Some(R::EmptyClickId) => {
            f.click_id = String::new();
            Some(text(rng, &f).into_bytes())
        }
        Some(R::ClickIdTooLong) => {
            let over = rng.random_range(1..=20);
            f.click_id = id_of_len(rng, limits.max_click_id_len + over);
            Some(text(rng, &f).into_bytes())
        }
        Some(R::TimestampAhead) => {
            let r = *record_ts.get_or_insert(NOW);
            let beyond = if rng.random_bool(0.3) { 1 } else { rng.random_range(1..100 * HOUR) };
            f.ts_ms = r + limits.max_future_skew.as_millis() as i64 + beyond;
            Some(text(rng, &f).into_bytes())
        }
        Some(R::TimestampBehind) => {
            let r = *record_ts.get_or_insert(NOW);
            let beyond = if rng.random_bool(0.3) { 1 } else { rng.random_range(1..100 * HOUR) };
            f.ts_ms = r - limits.max_lateness.as_millis() as i64 - beyond;
            Some(text(rng, &f).into_bytes())
        }
        Some(R::NotWireFormat | R::UnknownSchema | R::MalformedPayload) => unreachable!("not a class of JSON"),
        Some(R::TimestampOutOfRange) => {
            let skew = limits.max_future_skew.as_millis() as i64;
            let late = limits.max_lateness.as_millis() as i64;
            // Before 1970 or past the last minute, yet within the limits of its record.
            (record_ts, f.ts_ms) = match rng.random_range(0..4) {
                0 => (None, -rng.random_range(1..=100 * 365 * 24 * HOUR)),
                1 => (None, END_OF_MINUTES_MS + rng.random_range(0..=100 * 365 * 24 * HOUR)),
                2 => {
                    let r = rng.random_range(0..late);
                    (Some(r), r - rng.random_range(r + 1..=late))
                }
                _ => {
                    let r = END_OF_MINUTES_MS - rng.random_range(1..=skew);
                    (Some(r), rng.random_range(END_OF_MINUTES_MS..=r + skew))
                }
            };
            Some(text(rng, &f).into_bytes())
        }
    };
    if class != Some(R::Oversized) {
        let len = payload.as_ref().map_or(0, Vec::len);
        limits.max_payload_bytes = limits.max_payload_bytes.max(len);
    }
    let expect = match class {
        None => Expect::Click(f),
        Some(reason) => Expect::Rejected(reason),
    };
    Case { payload, record_ts, limits, expect }
}
