//! The decoder against hostile input: arbitrary bytes, and JSON objects whose
//! `click_id`, `ad_id` and `ts` have random types and extreme values, judged against
//! extreme record timestamps and limits. Whatever comes in, [`decode`] returns a
//! [`Click`] that keeps every rule or a [`Rejection`]; it never panics. And for inputs
//! made to be of a known class — a valid click, or a record with exactly one defect —
//! it returns that class: the click with the very `click_id`, `ad_id` and `ts` it was
//! made of, or the rejection reason of its defect.
//!
//! A plain generator loop, not a shrinking property test: a million cases must fit a
//! CI debug build's time budget. Each run draws a fresh seed and prints it (also on
//! stderr outside the captured output); `CLICKAGG_FUZZ_SEED` repeats a run and
//! `CLICKAGG_FUZZ_CASES` explores further, e.g.
//! `CLICKAGG_FUZZ_SEED=$RANDOM CLICKAGG_FUZZ_CASES=20000000 cargo test --release fuzz`.
//! A failure names the case, its seed and its input.

use std::collections::BTreeSet;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Cases per test when `CLICKAGG_FUZZ_CASES` is not set: the tests together run
/// over a million.
const CASES: u64 = 600_000;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}")))
}

/// This run's seed: `CLICKAGG_FUZZ_SEED`, or a fresh one, so that every run explores
/// other cases. Written straight to stderr, past the test harness's capture, so that
/// the log of any run (a passing one too) says how to repeat it.
fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = env_u64("CLICKAGG_FUZZ_SEED").unwrap_or_else(|| rand::rng().random());
        let _ = writeln!(std::io::stderr(), "decoder fuzz: seed {seed} (CLICKAGG_FUZZ_SEED={seed} repeats this run)");
        seed
    })
}

/// Runs the cases from `generate`, each with its own seeded generator, so a failing
/// case reproduces from its number alone. Returns every outcome seen (`None`: a click).
fn run(test: &str, generate: impl Fn(&mut SmallRng) -> Case) -> BTreeSet<Option<RejectReason>> {
    run_cases(test, CASES, generate)
}

fn run_cases(
    test: &str,
    default_cases: u64,
    generate: impl Fn(&mut SmallRng) -> Case,
) -> BTreeSet<Option<RejectReason>> {
    let seed = seed();
    let cases = env_u64("CLICKAGG_FUZZ_CASES").unwrap_or(default_cases);
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
                panic!("{test}: case {n} of seed {seed} (CLICKAGG_FUZZ_SEED={seed}) failed: {what}\n{case:?}");
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

/// One input to [`decode`], and what it must give when the generator knows.
struct Case {
    payload: Option<Vec<u8>>,
    record_ts: Option<i64>,
    limits: Limits,
    expect: Expect,
}

/// What a case must decode to.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    /// Anything, as long as the rules hold (hostile input of no known class).
    Anything,
    /// If accepted, these fields (the generator wrote them, but did not check the
    /// limits they are judged by).
    FieldsIfAccepted(Fields),
    /// Accepted, with these fields.
    Click(Fields),
    Rejected(RejectReason),
}

/// The fields a click was made of.
#[derive(Debug, Clone, PartialEq)]
struct Fields {
    click_id: String,
    ad_id: u64,
    ts_ms: i64,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let payload = self.payload.as_deref().map(|p| String::from_utf8_lossy(&p[..p.len().min(2000)]).into_owned());
        write!(
            f,
            "payload {payload:?}\nrecord_ts {:?}\nlimits {:?}\nexpected {:?}",
            self.record_ts, self.limits, self.expect
        )
    }
}

impl Case {
    /// Decodes, and checks that an accepted click keeps every rule it was judged by and
    /// that the outcome is the expected one.
    fn check(&self) -> Option<RejectReason> {
        let click = match decode(self.payload.as_deref(), self.record_ts, &self.limits) {
            Ok(click) => click,
            Err(rejection) => {
                let d = &rejection.detail;
                assert!(!d.is_empty() && d.len() <= MAX_DETAIL_BYTES + '…'.len_utf8(), "detail {d:?}");
                match &self.expect {
                    Expect::Click(_) => panic!("a valid click was rejected: {rejection}"),
                    Expect::Rejected(reason) => {
                        assert_eq!(rejection.reason, *reason, "rejected for the wrong reason: {rejection}")
                    }
                    Expect::Anything | Expect::FieldsIfAccepted(_) => {}
                }
                return Some(rejection.reason);
            }
        };
        match &self.expect {
            Expect::Click(want) | Expect::FieldsIfAccepted(want) => {
                let got = Fields { click_id: click.click_id.to_string(), ad_id: click.ad_id, ts_ms: click.ts_ms };
                assert_eq!(&got, want, "the click's fields are not the ones it was made of");
                // The pipeline's path: the ID as the text borrowed from the payload.
                let mut seen = String::new();
                let _ = decode_with(self.payload.as_deref(), self.record_ts, &self.limits, |id| seen = id.to_string());
                assert_eq!(seen, want.click_id, "decode_with hands on another click_id");
                // The minute, computed here without Minute.
                let minute_s = want.ts_ms.div_euclid(60_000) * 60;
                assert_eq!(i64::from(click.minute.epoch_seconds()), minute_s, "the minute of {}", want.ts_ms);
            }
            Expect::Rejected(reason) => panic!("accepted a record that must be rejected as {reason}: {click:?}"),
            Expect::Anything => {}
        }
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
/// in any order, among unknown fields; and the fields it holds when it holds each once,
/// of its type.
fn click_object(rng: &mut SmallRng) -> (Vec<u8>, Option<Fields>) {
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

/// The first millisecond whose minute a ClickHouse `DateTime` (u32 seconds) cannot
/// hold: the last minute it holds starts at 4 294 967 280 s (a multiple of 60) and
/// ends 60 s later. Written out here, not taken from `Minute`, which is under test.
const END_OF_MINUTES_MS: i64 = 4_294_967_340_000;

/// The classes a record is made to be of: a valid click, or one defect.
const CLASSES: [Option<RejectReason>; 12] = [
    None,
    Some(RejectReason::EmptyPayload),
    Some(RejectReason::Oversized),
    Some(RejectReason::NotUtf8),
    Some(RejectReason::MalformedJson),
    Some(RejectReason::MissingField),
    Some(RejectReason::WrongType),
    Some(RejectReason::EmptyClickId),
    Some(RejectReason::ClickIdTooLong),
    Some(RejectReason::TimestampAhead),
    Some(RejectReason::TimestampBehind),
    Some(RejectReason::TimestampOutOfRange),
];

/// Limits a class can be made under: mostly the defaults, sometimes others (never the
/// extremes, under which some classes cannot exist).
fn class_limits(rng: &mut SmallRng) -> Limits {
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
fn any_click_id(rng: &mut SmallRng, max: usize) -> String {
    let len = rng.random_range(1..=max.min(64));
    id_of_len(rng, len)
}

/// A string of exactly `len` bytes.
fn id_of_len(rng: &mut SmallRng, len: usize) -> String {
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
fn escaped(rng: &mut SmallRng, s: &str) -> String {
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
fn any_ts(rng: &mut SmallRng, ts_ms: i64) -> String {
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
fn ws(rng: &mut SmallRng) -> &'static str {
    pick(rng, &["", "", "", " ", "\n", "\t", " \r\n  "])
}

/// An object of `fields` (name, JSON value) in random order, among unknown fields.
fn object(rng: &mut SmallRng, mut fields: Vec<(&str, String)>, separator: &str) -> String {
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
fn valid_fields(rng: &mut SmallRng, limits: &Limits, record_ts: Option<i64>) -> Fields {
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
fn members(rng: &mut SmallRng, f: &Fields) -> Vec<(&'static str, String)> {
    vec![("click_id", escaped(rng, &f.click_id)), ("ad_id", f.ad_id.to_string()), ("ts", any_ts(rng, f.ts_ms))]
}

/// Bytes that are not UTF-8 wherever they stand.
const NOT_UTF8: &[&[u8]] = &[
    &[0x80],
    &[0xbf],
    &[0xc0, 0xaf],
    &[0xc3],
    &[0xe0, 0x80, 0x80],
    &[0xed, 0xa0, 0x80],
    &[0xf4, 0x90, 0x80, 0x80],
    &[0xf8],
    &[0xfe],
    &[0xff],
];

/// A record made to be of `class`: a valid click, or a valid click but for one defect.
fn classed(rng: &mut SmallRng, class: Option<RejectReason>) -> Case {
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
                1 => &["\"7\"", "-1", "1.5", "1e3", "18446744073709551616", "true", "null", "[]", "{}"],
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

#[test]
fn no_byte_string_panics_the_decoder() {
    let seen = run("bytes", |rng| {
        let payload = match rng.random_range(0..10) {
            0 => None,
            1..=3 => Some(mutated_click(rng)),
            _ => Some(arbitrary_bytes(rng)),
        };
        Case { payload, record_ts: record_ts(rng), limits: limits(rng), expect: Expect::Anything }
    });
    use RejectReason as R;
    let want = [None, Some(R::EmptyPayload), Some(R::Oversized), Some(R::NotUtf8), Some(R::MalformedJson)];
    assert_reached("bytes", &seen, &want);
}

#[test]
fn no_json_object_panics_the_decoder_and_every_accepted_click_keeps_the_rules() {
    let seen = run("json", |rng| {
        let (payload, fields) = click_object(rng);
        let expect = fields.map_or(Expect::Anything, Expect::FieldsIfAccepted);
        Case { payload: Some(payload), record_ts: record_ts(rng), limits: limits(rng), expect }
    });
    // Every outcome but the two a JSON text cannot have (no bytes, not UTF-8).
    let mut want: Vec<_> = RejectReason::ALL.iter().copied().map(Some).collect();
    want.retain(|r| ![Some(RejectReason::EmptyPayload), Some(RejectReason::NotUtf8)].contains(r));
    want.push(None);
    assert_reached("json", &seen, &want);
}

#[test]
fn every_valid_click_decodes_to_its_own_fields_and_every_defect_to_its_reason() {
    let seen = run_cases("classes", CASES / 2, |rng| {
        let class = pick(rng, &CLASSES);
        classed(rng, class)
    });
    assert_reached("classes", &seen, &CLASSES);
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
