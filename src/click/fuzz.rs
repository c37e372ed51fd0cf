//! The decoder against hostile input: arbitrary bytes, and JSON objects whose
//! `click_id`, `ad_id` and `ts` have random types and extreme values, judged against
//! extreme record timestamps and limits. Whatever comes in, [`decode`] returns a
//! [`Click`] that keeps every rule or a [`Rejection`]; it never panics.
//!
//! A plain generator loop with a fixed seed, not a shrinking property test: a million
//! cases must fit a CI debug build's time budget, and every run checks the same cases.
//! `CLICKAGG_FUZZ_SEED` and `CLICKAGG_FUZZ_CASES` explore further by hand, e.g.
//! `CLICKAGG_FUZZ_SEED=$RANDOM CLICKAGG_FUZZ_CASES=20000000 cargo test --release fuzz`.
//! A failure names the case, its seed and its input.

use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Cases per test when `CLICKAGG_FUZZ_CASES` is not set: the two tests together run
/// over a million.
const CASES: u64 = 600_000;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}")))
}

/// Runs the cases from `generate`, each with its own seeded generator, so a failing
/// case reproduces from its number alone. Returns every outcome seen (`None`: a click).
fn run(test: &str, generate: impl Fn(&mut SmallRng) -> Case) -> BTreeSet<Option<RejectReason>> {
    let seed = env_u64("CLICKAGG_FUZZ_SEED").unwrap_or(0x00c1_1c4a);
    let cases = env_u64("CLICKAGG_FUZZ_CASES").unwrap_or(CASES);
    let mut seen = BTreeSet::new();
    for n in 0..cases {
        let mut rng = SmallRng::seed_from_u64(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let case = generate(&mut rng);
        match catch_unwind(AssertUnwindSafe(|| case.check())) {
            Ok(outcome) => {
                seen.insert(outcome);
            }
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                panic!("{test}: case {n} of seed {seed:#x} failed: {what}\n{case:?}");
            }
        }
    }
    seen
}

/// Fails unless the generator reached every outcome in `want`: a generator that stopped
/// producing, say, accepted clicks would leave their checks unexercised.
fn assert_reached(test: &str, seen: &BTreeSet<Option<RejectReason>>, want: &[Option<RejectReason>]) {
    let missing: Vec<_> = want.iter().filter(|o| !seen.contains(o)).collect();
    assert!(missing.is_empty(), "{test}: the generator never produced {missing:?}");
}

/// One input to [`decode`].
struct Case {
    payload: Option<Vec<u8>>,
    record_ts: Option<i64>,
    limits: Limits,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let payload = self.payload.as_deref().map(|p| String::from_utf8_lossy(&p[..p.len().min(2000)]).into_owned());
        write!(f, "payload {payload:?}\nrecord_ts {:?}\nlimits {:?}", self.record_ts, self.limits)
    }
}

impl Case {
    /// Decodes, and checks that an accepted click keeps every rule it was judged by.
    fn check(&self) -> Option<RejectReason> {
        let click = match decode(self.payload.as_deref(), self.record_ts, &self.limits) {
            Ok(click) => click,
            Err(rejection) => {
                let d = &rejection.detail;
                assert!(!d.is_empty() && d.len() <= MAX_DETAIL_BYTES + '…'.len_utf8(), "detail {d:?}");
                return Some(rejection.reason);
            }
        };
        let len = self.payload.as_ref().map_or(0, Vec::len);
        assert!(len > 0 && len <= self.limits.max_payload_bytes, "accepted a payload of {len} bytes");
        let id = click.click_id.as_str();
        assert!(!id.is_empty() && id.len() <= self.limits.max_click_id_len, "accepted click_id {id:?}");
        assert_eq!(Some(click.minute), Minute::from_millis(click.ts_ms), "the minute of {}", click.ts_ms);
        if let Some(record_ts) = self.record_ts {
            let ahead = i128::from(click.ts_ms) - i128::from(record_ts);
            let skew = self.limits.max_future_skew.as_millis() as i128;
            let late = self.limits.max_lateness.as_millis().min(i128::MAX as u128) as i128;
            assert!(ahead <= skew && -ahead <= late, "accepted ts {} against record {record_ts}", click.ts_ms);
        }
        None
    }
}

/// 2025-11-30T08:00:00Z, the time around which plausible clicks are made.
const NOW: i64 = 1_764_489_600_000;
const HOUR: i64 = 3_600_000;

/// Record timestamps: mostly within an hour of [`NOW`], sometimes none or anything an
/// i64 holds.
fn record_ts(rng: &mut SmallRng) -> Option<i64> {
    match rng.random_range(0..10) {
        0 => None,
        1 => Some(pick(rng, &[i64::MIN, i64::MIN + 1, -1, 0, 1, i64::MAX - 1, i64::MAX])),
        2 => Some(rng.random()),
        _ => Some(NOW + rng.random_range(-HOUR..HOUR)),
    }
}

/// Event times around the default limits of a record near [`NOW`]: up to 8 h behind
/// and 1 h ahead, so both checks pass and fail.
fn plausible_ts(rng: &mut SmallRng) -> i64 {
    NOW + rng.random_range(-8 * HOUR..HOUR)
}

/// Limits: mostly the defaults, sometimes the extremes a configuration can hold.
fn limits(rng: &mut SmallRng) -> Limits {
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

fn pick<T: Copy>(rng: &mut SmallRng, from: &[T]) -> T {
    from[rng.random_range(0..from.len())]
}

/// Bytes a JSON parser has to look at closely.
const JSONISH: &[u8] = b"{}[]\":,\\ \t\n0123456789-+.eEtrufalsn\"click_id\"ad_ts\xc3\xa9\xff\x00";

fn arbitrary_bytes(rng: &mut SmallRng) -> Vec<u8> {
    let len = if rng.random_bool(0.9) { rng.random_range(0..48) } else { rng.random_range(0..400) };
    if rng.random_bool(0.5) {
        (0..len).map(|_| rng.random()).collect()
    } else {
        (0..len).map(|_| pick(rng, JSONISH)).collect()
    }
}

/// A valid click with a few bytes inserted, deleted or replaced.
fn mutated_click(rng: &mut SmallRng) -> Vec<u8> {
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
fn value(rng: &mut SmallRng, depth: u32) -> String {
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
fn timestamp_text(rng: &mut SmallRng) -> String {
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

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// Click IDs: empty, at and past the length limit, escapes, control and multibyte characters.
fn text(rng: &mut SmallRng) -> String {
    match rng.random_range(0..8) {
        0 => String::new(),
        1 => "x".repeat(pick(rng, &[127, 128, 129, 5000])),
        2 => "é".repeat(rng.random_range(60..70)),
        3 => "\u{0}\u{1f}\"\\\u{7f}\u{fffd}\u{10ffff}".into(),
        _ => format!("c-{}", rng.random::<u32>()),
    }
}

/// A JSON object with each of `click_id`, `ad_id` and `ts` missing, once, or twice,
/// in any order, among unknown fields.
fn click_object(rng: &mut SmallRng) -> Vec<u8> {
    let mut fields: Vec<String> = Vec::new();
    for name in ["click_id", "ad_id", "ts"] {
        let copies = pick(rng, &[0, 1, 1, 1, 1, 1, 1, 1, 1, 2]);
        for _ in 0..copies {
            // Mostly of the right type, so that the checks after parsing run too.
            let v = match (name, rng.random_range(0..4)) {
                (_, 0) => value(rng, 0),
                ("click_id", _) => json_string(&text(rng)),
                ("ad_id", _) => rng.random_range(0..100_000u64).to_string(),
                _ => plausible_ts(rng).to_string(),
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
    format!("{{{}}}", fields.join(",")).into_bytes()
}

#[test]
fn no_byte_string_panics_the_decoder() {
    let seen = run("bytes", |rng| {
        let payload = match rng.random_range(0..10) {
            0 => None,
            1..=3 => Some(mutated_click(rng)),
            _ => Some(arbitrary_bytes(rng)),
        };
        Case { payload, record_ts: record_ts(rng), limits: limits(rng) }
    });
    use RejectReason as R;
    let want = [None, Some(R::EmptyPayload), Some(R::Oversized), Some(R::NotUtf8), Some(R::MalformedJson)];
    assert_reached("bytes", &seen, &want);
}

#[test]
fn no_json_object_panics_the_decoder_and_every_accepted_click_keeps_the_rules() {
    let seen =
        run("json", |rng| Case { payload: Some(click_object(rng)), record_ts: record_ts(rng), limits: limits(rng) });
    // Every outcome but the two a JSON text cannot have (no bytes, not UTF-8).
    let mut want: Vec<_> = RejectReason::ALL.iter().copied().map(Some).collect();
    want.retain(|r| ![Some(RejectReason::EmptyPayload), Some(RejectReason::NotUtf8)].contains(r));
    want.push(None);
    assert_reached("json", &seen, &want);
}

#[test]
fn the_most_negative_event_time_is_rejected_not_an_overflow() {
    let payload = br#"{"click_id":"c","ad_id":1,"ts":-9223372036854775808}"#;
    let e = decode(Some(payload), Some(1_764_489_600_000), &Limits::default()).unwrap_err();
    assert_eq!(e.reason, RejectReason::TimestampBehind, "{e}");
    let e = decode(Some(payload), Some(i64::MAX), &Limits::default()).unwrap_err();
    assert_eq!(e.reason, RejectReason::TimestampBehind, "{e}");
    let payload = br#"{"click_id":"c","ad_id":1,"ts":9223372036854775807}"#;
    let e = decode(Some(payload), Some(i64::MIN), &Limits::default()).unwrap_err();
    assert_eq!(e.reason, RejectReason::TimestampAhead, "{e}");
}

#[test]
fn limits_beyond_i64_milliseconds_accept_everything_in_range() {
    let limits = Limits { max_future_skew: Duration::MAX, max_lateness: Duration::MAX, ..Limits::default() };
    for (ts, record_ts) in [(0i64, i64::MAX), (4_000_000_000_000, i64::MIN), (1_764_489_605_123, 0)] {
        let payload = format!(r#"{{"click_id":"c","ad_id":1,"ts":{ts}}}"#);
        assert!(decode(Some(payload.as_bytes()), Some(record_ts), &limits).is_ok(), "{ts} vs {record_ts}");
    }
}
