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

mod inputs;
use inputs::*;

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

/// Bytes a JSON parser has to look at closely.
const JSONISH: &[u8] = b"{}[]\":,\\ \t\n0123456789-+.eEtrufalsn\"click_id\"ad_ts\xc3\xa9\xff\x00";

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
    let mut want: Vec<_> = RejectReason::JSON.iter().copied().map(Some).collect();
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
