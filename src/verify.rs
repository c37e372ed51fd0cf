//! Diffing billing counts: `clickagg verify` (against a ground-truth file) and
//! `clickagg reconcile` (against a recount of the topic) share this.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::aggregate::BucketKey;

/// One bucket whose counts differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    pub key: BucketKey,
    pub expected: u64,
    pub actual: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    pub buckets_expected: usize,
    pub buckets_actual: usize,
    pub clicks_expected: u64,
    pub clicks_actual: u64,
    pub mismatches: Vec<Mismatch>,
}

impl Diff {
    pub fn is_exact(&self) -> bool {
        self.mismatches.is_empty()
    }

    /// A readable summary: totals, then up to `limit` differing buckets.
    pub fn report(&self, limit: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "expected {} clicks in {} ad-minutes; ClickHouse has {} clicks in {} ad-minutes",
            self.clicks_expected, self.buckets_expected, self.clicks_actual, self.buckets_actual
        );
        if self.is_exact() {
            let _ = writeln!(s, "exact match");
            return s;
        }
        let missing = self.mismatches.iter().filter(|m| m.actual == 0).count();
        let extra = self.mismatches.iter().filter(|m| m.expected == 0).count();
        let over: u64 = self.mismatches.iter().map(|m| m.actual.saturating_sub(m.expected)).sum();
        let under: u64 = self.mismatches.iter().map(|m| m.expected.saturating_sub(m.actual)).sum();
        let _ = writeln!(
            s,
            "{} ad-minutes differ ({missing} missing, {extra} unexpected): {under} clicks missing, {over} clicks over-counted",
            self.mismatches.len()
        );
        let _ = writeln!(s, "{:>20}  {:<20}  {:>10}  {:>10}  {:>8}", "ad_id", "minute", "expected", "actual", "diff");
        for m in self.mismatches.iter().take(limit) {
            let _ = writeln!(
                s,
                "{:>20}  {:<20}  {:>10}  {:>10}  {:>+8}",
                m.key.ad_id,
                m.key.minute.to_rfc3339(),
                m.expected,
                m.actual,
                m.actual as i64 - m.expected as i64
            );
        }
        if self.mismatches.len() > limit {
            let _ = writeln!(s, "… and {} more", self.mismatches.len() - limit);
        }
        s
    }
}

/// Compares two sets of counts bucket by bucket (a bucket absent on one side is 0).
pub fn diff(expected: &BTreeMap<BucketKey, u64>, actual: &BTreeMap<BucketKey, u64>) -> Diff {
    let mut mismatches = Vec::new();
    for (k, &e) in expected {
        let a = actual.get(k).copied().unwrap_or(0);
        if a != e {
            mismatches.push(Mismatch { key: *k, expected: e, actual: a });
        }
    }
    for (k, &a) in actual {
        if !expected.contains_key(k) && a != 0 {
            mismatches.push(Mismatch { key: *k, expected: 0, actual: a });
        }
    }
    mismatches.sort_by_key(|m| m.key);
    Diff {
        buckets_expected: expected.len(),
        buckets_actual: actual.len(),
        clicks_expected: expected.values().sum(),
        clicks_actual: actual.values().sum(),
        mismatches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::click::Minute;

    fn k(ad: u64, m: u32) -> BucketKey {
        BucketKey { ad_id: ad, minute: Minute::from_epoch_seconds(m * 60) }
    }

    #[test]
    fn diff_finds_missing_extra_and_different_buckets() {
        let expected = BTreeMap::from([(k(1, 0), 3), (k(2, 0), 1), (k(3, 0), 5)]);
        let actual = BTreeMap::from([(k(1, 0), 3), (k(3, 0), 6), (k(4, 0), 2)]);
        let d = diff(&expected, &actual);
        assert!(!d.is_exact());
        assert_eq!(
            d.mismatches,
            vec![
                Mismatch { key: k(2, 0), expected: 1, actual: 0 },
                Mismatch { key: k(3, 0), expected: 5, actual: 6 },
                Mismatch { key: k(4, 0), expected: 0, actual: 2 },
            ]
        );
        let report = d.report(10);
        assert!(
            report.contains("3 ad-minutes differ (1 missing, 1 unexpected): 1 clicks missing, 3 clicks over-counted"),
            "{report}"
        );
    }

    #[test]
    fn equal_counts_are_exact() {
        let counts = BTreeMap::from([(k(1, 0), 3)]);
        let d = diff(&counts, &counts);
        assert!(d.is_exact());
        assert!(d.report(10).contains("exact match"));
    }
}
