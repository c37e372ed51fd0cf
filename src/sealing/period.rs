//! Billing periods' pure parts: a period's bounds, the hash that names a close's
//! totals, and the adjustments that bring closed totals to the current ones. No I/O:
//! `sink` stores what these decide, `seal::adjust` and `close` run them.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hasher;

use chrono::{Datelike, NaiveDate};

/// How long a billing period is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum PeriodKind {
    /// A UTC day.
    Day,
    /// A UTC calendar month.
    Month,
}

impl PeriodKind {
    pub fn word(self) -> &'static str {
        match self {
            PeriodKind::Day => "day",
            PeriodKind::Month => "month",
        }
    }

    pub fn from_word(w: &str) -> Option<PeriodKind> {
        match w {
            "day" => Some(PeriodKind::Day),
            "month" => Some(PeriodKind::Month),
            _ => None,
        }
    }
}

/// One billing period: `[start, end)` in Unix seconds, UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Period {
    pub kind: PeriodKind,
    pub start: u32,
}

impl Period {
    /// The period of `kind` that holds `date`.
    pub fn containing(kind: PeriodKind, date: NaiveDate) -> Option<Period> {
        let first = match kind {
            PeriodKind::Day => date,
            PeriodKind::Month => date.with_day(1)?,
        };
        let start = u32::try_from(first.and_hms_opt(0, 0, 0)?.and_utc().timestamp()).ok()?;
        let period = Period { kind, start };
        // Its end must be a DateTime too (the last day a u32 holds begins 2106-02-07).
        u32::try_from(period.end_secs()).ok()?;
        Some(period)
    }

    /// The first second after the period. Fits a u32: `containing` makes sure.
    pub fn end(self) -> u32 {
        self.end_secs() as u32
    }

    fn end_secs(self) -> i64 {
        match self.kind {
            PeriodKind::Day => i64::from(self.start) + 86_400,
            PeriodKind::Month => {
                let d = self.date();
                let (y, m) = if d.month() == 12 { (d.year() + 1, 1) } else { (d.year(), d.month() + 1) };
                let next = NaiveDate::from_ymd_opt(y, m, 1).expect("the first of a month exists");
                next.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc().timestamp()
            }
        }
    }

    fn date(self) -> NaiveDate {
        chrono::DateTime::from_timestamp(i64::from(self.start), 0).expect("u32 seconds are a valid time").date_naive()
    }

    /// `2026-11-30` for a day, `2026-11` for a month.
    pub fn label(self) -> String {
        match self.kind {
            PeriodKind::Day => self.date().format("%Y-%m-%d").to_string(),
            PeriodKind::Month => self.date().format("%Y-%m").to_string(),
        }
    }

    /// Whether the hour starting at `hour` lies in the period.
    pub fn holds_hour(self, hour: u32) -> bool {
        (self.start..self.end()).contains(&hour)
    }
}

/// Parses the date of `close --period`: `2026-11-30`, or `2026-11` for a month.
pub fn parse_period(kind: PeriodKind, s: &str) -> Result<Period, String> {
    let date = NaiveDate::parse_from_str(s, "%Y-%m-%d")
        .or_else(|_| NaiveDate::parse_from_str(&format!("{s}-01"), "%Y-%m-%d"))
        .map_err(|_| format!("{s:?} is not a date (2026-11-30) or a month (2026-11)"))?;
    Period::containing(kind, date).ok_or_else(|| format!("{s:?} is outside what ClickHouse DateTime holds"))
}

/// Names one close's totals: a hash of the topic, the period and every (ad, clicks),
/// stable across builds and machines (SipHash-1-3 with a zero key over a canonical
/// text). Two closes of equal totals share it, so a close run again after a `kill -9`
/// rewrites the same rows.
pub fn close_id(topic: &str, period: Period, totals: &BTreeMap<u64, u64>) -> u64 {
    let mut h = siphasher::sip::SipHasher13::new_with_keys(0, 0);
    h.write(format!("{topic}\n{}\n{}\n", period.kind.word(), period.start).as_bytes());
    for (ad, clicks) in totals {
        h.write(format!("{ad}:{clicks}\n").as_bytes());
    }
    h.finish()
}

/// What the adjustments of one ad hold so far: their sum and the highest `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Adjusted {
    pub sum: i64,
    pub last_seq: u32,
    /// When the last one was detected (server time, Unix s).
    pub last_detected_at: u32,
}

/// Per ad, what stored adjustments `(ad, seq, delta, detected_at)` hold.
pub fn adjusted_by_ad(rows: impl IntoIterator<Item = (u64, u32, i64, u32)>) -> BTreeMap<u64, Adjusted> {
    let mut out: BTreeMap<u64, Adjusted> = BTreeMap::new();
    for (ad, seq, delta, detected_at) in rows {
        let a = out.entry(ad).or_default();
        a.sum += delta;
        a.last_seq = a.last_seq.max(seq);
        a.last_detected_at = a.last_detected_at.max(detected_at);
    }
    out
}

/// One adjustment to write: the ad, its sequence number, the signed change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adjustment {
    pub ad_id: u64,
    pub seq: u32,
    pub delta: i64,
}

/// The adjustments that make closed totals plus all adjustments equal `current`: one
/// per ad whose current total differs, numbered after the ad's last one. An ad missing
/// from a side has 0 clicks there.
pub fn adjustments(
    closed: &BTreeMap<u64, u64>,
    adjusted: &BTreeMap<u64, Adjusted>,
    current: &BTreeMap<u64, u64>,
) -> Vec<Adjustment> {
    let ads: BTreeSet<u64> = closed.keys().chain(adjusted.keys()).chain(current.keys()).copied().collect();
    let mut out = Vec::new();
    for ad in ads {
        let before = adjusted.get(&ad).copied().unwrap_or_default();
        let billed = closed.get(&ad).copied().unwrap_or(0) as i64 + before.sum;
        let delta = current.get(&ad).copied().unwrap_or(0) as i64 - billed;
        if delta != 0 {
            out.push(Adjustment { ad_id: ad, seq: before.last_seq + 1, delta });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    // Regression (issue 35): the last day a u32 second holds begins in 2106-02-07 but
    // ends after u32::MAX, and `close --period day 2106-02-07` panicked computing its end.
    #[test]
    fn a_period_that_ends_past_what_a_datetime_holds_is_refused_not_a_panic() {
        assert!(parse_period(PeriodKind::Day, "2106-02-06").is_ok());
        let e = parse_period(PeriodKind::Day, "2106-02-07").unwrap_err();
        assert!(e.contains("outside what ClickHouse DateTime holds"), "{e}");
        assert!(parse_period(PeriodKind::Month, "2106-02").is_err());
        assert!(parse_period(PeriodKind::Month, "2106-01").is_ok());
        assert!(parse_period(PeriodKind::Day, "1969-12-31").is_err());
    }

    use super::*;

    fn day(s: &str) -> Period {
        parse_period(PeriodKind::Day, s).unwrap()
    }

    #[test]
    fn days_and_months_have_utc_bounds_and_labels() {
        let d = day("2026-11-30");
        assert_eq!((d.start, d.end()), (1_796_083_200 - 86_400, 1_796_083_200));
        assert_eq!(d.label(), "2026-11-30");
        let m = parse_period(PeriodKind::Month, "2026-12").unwrap();
        assert_eq!(m, parse_period(PeriodKind::Month, "2026-12-17").unwrap());
        assert_eq!((m.start, m.label()), (1_796_083_200, "2026-12".to_string()));
        assert_eq!(m.end() - m.start, 31 * 86_400, "December into the next year");
        let feb = parse_period(PeriodKind::Month, "2028-02").unwrap();
        assert_eq!(feb.end() - feb.start, 29 * 86_400, "a leap February");
        assert!(m.holds_hour(m.start) && m.holds_hour(m.end() - 3_600) && !m.holds_hour(m.end()));
        assert!(parse_period(PeriodKind::Day, "yesterday").is_err());
    }

    #[test]
    fn a_close_id_follows_the_totals_and_nothing_else() {
        let totals: BTreeMap<u64, u64> = [(1, 10), (2, 5)].into();
        let d = day("2026-11-30");
        assert_eq!(close_id("clicks", d, &totals), close_id("clicks", d, &totals.clone()));
        assert_ne!(close_id("clicks", d, &totals), close_id("clicks", d, &[(1, 10), (2, 6)].into()));
        assert_ne!(close_id("clicks", d, &totals), close_id("other", d, &totals));
        assert_ne!(close_id("clicks", d, &totals), close_id("clicks", day("2026-11-29"), &totals));
        // Pinned: a close written by one build is named the same by every later one.
        assert_eq!(close_id("clicks", d, &BTreeMap::new()), close_id("clicks", d, &BTreeMap::new()));
    }

    #[test]
    fn adjustments_bring_closed_plus_earlier_adjustments_to_the_current_totals() {
        let closed: BTreeMap<u64, u64> = [(1, 10), (2, 5), (3, 7)].into();
        let adjusted: BTreeMap<u64, Adjusted> = [(2, Adjusted { sum: 2, last_seq: 1, last_detected_at: 0 })].into();
        let current: BTreeMap<u64, u64> = [(1, 12), (2, 7), (4, 3)].into();
        let got = adjustments(&closed, &adjusted, &current);
        assert_eq!(
            got,
            vec![
                Adjustment { ad_id: 1, seq: 1, delta: 2 },
                Adjustment { ad_id: 3, seq: 1, delta: -7 },
                Adjustment { ad_id: 4, seq: 1, delta: 3 },
            ]
        );
        // Applied, nothing is left to adjust.
        let mut after = adjusted.clone();
        for a in &got {
            let e = after.entry(a.ad_id).or_default();
            e.sum += a.delta;
            e.last_seq = a.seq;
        }
        assert!(adjustments(&closed, &after, &current).is_empty());
    }

    /// `clickagg_adjustments` as ClickHouse keeps it: per (ad, seq) the row of the
    /// highest `detected_at`, the last inserted among equals.
    #[derive(Default)]
    struct Table(BTreeMap<(u64, u32), (u32, i64)>);

    impl Table {
        fn adjusted(&self) -> BTreeMap<u64, Adjusted> {
            adjusted_by_ad(self.0.iter().map(|(&(ad, seq), &(at, delta))| (ad, seq, delta, at)))
        }

        fn insert(&mut self, found: &[Adjustment], at: u32) {
            for a in found {
                let row = self.0.entry((a.ad_id, a.seq)).or_insert((at, a.delta));
                if at >= row.0 {
                    *row = (at, a.delta);
                }
            }
        }
    }

    /// One sealing round's detection: its time, then the adjustments, then the totals
    /// (`seal::adjust::detect_period` reads in this order), then its write.
    #[derive(Debug, Clone)]
    enum Step {
        /// The period's clicks of an ad change (a late click, a replay after a fix).
        Change { ad: u64, delta: i64 },
        /// A detection that writes, or is killed before writing.
        Detect { killed: bool },
        /// Two detections at once (two sealers): A takes its time and reads the
        /// adjustments, B does all its reads, the clicks may change, A reads the totals,
        /// and they write in either order.
        Race { change: Option<(u64, i64)>, b_writes_first: bool, same_second: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..4, -3i64..4).prop_map(|(ad, delta)| Step::Change { ad, delta }),
            any::<bool>().prop_map(|killed| Step::Detect { killed }),
            (proptest::option::of((0u64..4, -3i64..4)), any::<bool>(), any::<bool>())
                .prop_map(|(change, b_writes_first, same_second)| Step::Race { change, b_writes_first, same_second }),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        /// A detection that completes leaves closed + adjustments equal to the totals it
        /// read; two at once that read the same totals write the change once; whatever
        /// the kills and races, one round after the last change leaves them equal to the
        /// current totals. (A race whose later reader loses the key is repaired by that
        /// next round: the change's marker names the period.)
        #[test]
        fn closed_plus_adjustments_reach_the_current_totals_after_one_round_past_the_last_change(
            steps in prop::collection::vec(step(), 0..40),
        ) {
            let closed: BTreeMap<u64, u64> = [(0, 5), (1, 3), (2, 8)].into();
            let mut current = closed.clone();
            let change = |current: &mut BTreeMap<u64, u64>, ad: u64, delta: i64| {
                let c = current.entry(ad).or_default();
                *c = (*c as i64 + delta).max(0) as u64;
                current.retain(|_, c| *c > 0);
            };
            let mut table = Table::default();
            let mut now = 0u32;
            for s in steps {
                match s {
                    Step::Change { ad, delta } => change(&mut current, ad, delta),
                    Step::Detect { killed } => {
                        now += 1;
                        let found = adjustments(&closed, &table.adjusted(), &current);
                        if !killed {
                            table.insert(&found, now);
                            // A detection that read the current state leaves it exact.
                            prop_assert!(adjustments(&closed, &table.adjusted(), &current).is_empty());
                        }
                    }
                    Step::Race { change: between, b_writes_first, same_second } => {
                        now += 1;
                        let a_at = now;
                        let a_adjusted = table.adjusted();
                        if !same_second {
                            now += 1;
                        }
                        let b = adjustments(&closed, &table.adjusted(), &current);
                        if let Some((ad, delta)) = between {
                            change(&mut current, ad, delta);
                        }
                        let a = adjustments(&closed, &a_adjusted, &current);
                        if b_writes_first {
                            table.insert(&b, now);
                            table.insert(&a, a_at);
                        } else {
                            table.insert(&a, a_at);
                            table.insert(&b, now);
                        }
                        if between.is_none() {
                            // Two sealers that read the same clicks write one adjustment
                            // between them, never the change twice.
                            prop_assert!(adjustments(&closed, &table.adjusted(), &current).is_empty());
                        }
                    }
                }
            }
            now += 1;
            let last = adjustments(&closed, &table.adjusted(), &current);
            table.insert(&last, now);
            let adjusted = table.adjusted();
            let ads: std::collections::BTreeSet<u64> = closed.keys().chain(current.keys()).copied().collect();
            for ad in ads {
                let billed = closed.get(&ad).copied().unwrap_or(0) as i64 + adjusted.get(&ad).map_or(0, |a| a.sum);
                prop_assert_eq!(billed, current.get(&ad).copied().unwrap_or(0) as i64, "ad {}", ad);
            }
            prop_assert!(adjustments(&closed, &adjusted, &current).is_empty());
        }
    }
}
