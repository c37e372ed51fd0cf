//! Which part of a billing read comes from where, as pure functions: what the seal
//! records and the touched-hour markers say is sealed and still current, and how a
//! range splits into sealed days, sealed hours and minute rows.
//!
//! A sealed hour is read from `ad_clicks_sealed_hour` only while it is current: no
//! marker of it is newer than its latest computation's `computed_at` minus the slack
//! (a marker at least that old was visible before the computation read the minute
//! rows, so its rows are in the seal). An hour written since is read from the minute
//! rows until the sealer has caught up: the read equals the minute table at every
//! moment, not only once the sealer ran. A sealed day is read from
//! `ad_clicks_sealed_day` while its record's version equals the sum of its 24 hours'
//! current versions (it was computed from them) and all 24 are current.
//!
//! An hour below the sealer's frontier with neither a seal record nor a marker has no
//! minute rows, and is left out of the minute read: the frontier passed it only as part
//! of a stretch it found empty (hours before a topic's first minute row, or whole days
//! it skipped), and any write there since left a marker, which makes the hour read from
//! the minute rows again. Without this, a range starting before the data read every
//! minute row of its span.

use std::collections::{BTreeMap, BTreeSet};

use super::plan::{DAY, HOUR};
use super::Grain;

/// One seal record (`clickagg_seals`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealRecord {
    pub topic: String,
    pub grain: Grain,
    /// The start of the hour or day, Unix seconds.
    pub bucket: u32,
    pub version: u64,
    /// Server time before the computation read its rows, Unix seconds.
    pub computed_at: u32,
}

/// The latest marker of one hour of one topic (`clickagg_touched`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    pub topic: String,
    pub hour: u32,
    pub written_at: u32,
}

/// What ClickHouse says about the seals of a range.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SealState {
    /// Every topic that may have minute rows in the range (registered, marked or sealed).
    pub topics: BTreeSet<String>,
    pub records: Vec<SealRecord>,
    pub markers: Vec<Marker>,
    /// Per topic, the sealer's frontier (`clickagg_seal_progress`): every hour before it
    /// was sealed, or passed as empty.
    pub frontiers: BTreeMap<String, u32>,
}

/// The sealed hours and days a read may take from the sealed tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Current {
    pub hours: BTreeSet<(String, u32)>,
    pub days: BTreeSet<(String, u32)>,
    /// Hours with a seal record or a marker: written to at some time.
    pub known: BTreeSet<(String, u32)>,
    pub frontiers: BTreeMap<String, u32>,
}

impl Current {
    /// No minute rows: below the frontier, never sealed as an hour with rows and never
    /// written to since (see the module's comment).
    pub fn is_empty_hour(&self, topic: &str, hour: u32) -> bool {
        self.frontiers.get(topic).is_some_and(|&f| hour < f) && !self.known.contains(&(topic.to_string(), hour))
    }
}

impl SealState {
    /// The sealed hours and days that are current, given the slack between a marker's
    /// time and its visibility (`seal.slack`).
    pub fn current(&self, slack: u32) -> Current {
        // Per hour: the highest version, and the latest computation that found it.
        let mut hours: BTreeMap<(&str, u32), (u64, u32)> = BTreeMap::new();
        let mut days: BTreeMap<(&str, u32), u64> = BTreeMap::new();
        for r in &self.records {
            let key = (r.topic.as_str(), r.bucket);
            match r.grain {
                Grain::Hour => {
                    let best = hours.entry(key).or_insert((r.version, r.computed_at));
                    if (r.version, r.computed_at) > *best {
                        *best = (r.version, r.computed_at);
                    }
                }
                Grain::Day => {
                    let v = days.entry(key).or_insert(r.version);
                    *v = (*v).max(r.version);
                }
                Grain::Minute => {}
            }
        }
        let mut latest_marker: BTreeMap<(&str, u32), u32> = BTreeMap::new();
        for m in &self.markers {
            let at = latest_marker.entry((m.topic.as_str(), m.hour)).or_insert(m.written_at);
            *at = (*at).max(m.written_at);
        }
        let mut current = Current { frontiers: self.frontiers.clone(), ..Current::default() };
        current.known.extend(hours.keys().chain(latest_marker.keys()).map(|&(t, h)| (t.to_string(), h)));
        for (&(topic, hour), &(_, computed_at)) in &hours {
            let stale = latest_marker
                .get(&(topic, hour))
                .is_some_and(|&w| u64::from(w) + u64::from(slack) >= u64::from(computed_at));
            if !stale {
                current.hours.insert((topic.to_string(), hour));
            }
        }
        for (&(topic, day), &version) in &days {
            let hours_of_day = (0..24).map(|i| (topic, day + i * HOUR));
            let versions: Option<Vec<u64>> = hours_of_day.clone().map(|k| hours.get(&k).map(|h| h.0)).collect();
            let all_current = hours_of_day.clone().all(|(t, h)| current.hours.contains(&(t.to_string(), h)));
            if all_current && versions.is_some_and(|v| super::plan::day_version(&v) == version) {
                current.days.insert((topic.to_string(), day));
            }
        }
        current
    }
}

/// Where each part of a read comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// (topic, day) read from the sealed days.
    pub days: Vec<(String, u32)>,
    /// (topic, hour) read from the sealed hours.
    pub hours: Vec<(String, u32)>,
    /// The minute rows read: `[from, to)` (empty when `from == to`), without the
    /// (topic, hour) pairs in `covered`: the hours of `days` and `hours`, and the hours
    /// known to be empty, that lie inside that range.
    pub minutes: (u32, u32),
    pub covered: Vec<(String, u32)>,
}

/// How a read of `[from, to)` in buckets of `by`, over `topics`, splits: whole days
/// inside the range from the sealed days when the buckets are days, whole hours from
/// the sealed hours when the buckets are hours or days, everything else (partial hours
/// at the edges, hours not sealed or not current, minute buckets) from the minute rows.
pub fn split(from: u32, to: u32, by: Grain, topics: &BTreeSet<String>, current: &Current) -> Split {
    let mut out = Split::default();
    let (mut lo, mut hi) = (u32::MAX, 0u32);
    for topic in topics {
        let mut covered: BTreeSet<u32> = BTreeSet::new();
        if by == Grain::Day {
            for day in whole(from, to, DAY) {
                if current.days.contains(&(topic.clone(), day)) {
                    out.days.push((topic.clone(), day));
                    covered.extend((0..24).map(|i| day + i * HOUR));
                }
            }
        }
        if by != Grain::Minute {
            for hour in whole(from, to, HOUR) {
                if covered.contains(&hour) {
                    continue;
                }
                if current.hours.contains(&(topic.clone(), hour)) {
                    out.hours.push((topic.clone(), hour));
                    covered.insert(hour);
                } else if current.is_empty_hour(topic, hour) {
                    // Nothing to read anywhere; covered, so the minute read leaves it out.
                    covered.insert(hour);
                }
            }
        }
        // The part of [from, to) this topic still reads from minutes, as a hull.
        let (mut a, mut b) = (from, to);
        while a < b && covered.contains(&a) {
            a += HOUR;
        }
        while a < b && b >= HOUR && covered.contains(&(b - HOUR)) {
            b -= HOUR;
        }
        if a < b {
            lo = lo.min(a);
            hi = hi.max(b);
        }
        out.covered.extend(covered.into_iter().map(|h| (topic.clone(), h)));
    }
    out.minutes = if lo < hi { (lo, hi) } else { (0, 0) };
    // Only the covered hours inside the minute read need leaving out of it: the rest lie
    // outside its range anyway, and a long list costs ClickHouse 18.16 time on every
    // row it reads (a 30-day read with 715 covered hours: 3.2 s; with none: 0.5 s).
    out.covered.retain(|&(_, h)| lo < hi && h < hi && h + HOUR > lo);
    out
}

/// The starts of the whole buckets of `width` seconds inside `[from, to)`.
fn whole(from: u32, to: u32, width: u32) -> impl Iterator<Item = u32> {
    let first = u64::from(from).div_ceil(u64::from(width)) * u64::from(width);
    (first..u64::from(to))
        .step_by(width as usize)
        .filter(move |&b| b + u64::from(width) <= u64::from(to))
        .map(|b| b as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: u32 = 1_795_996_800; // 2026-11-30T00:00:00Z

    fn topics(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn record(topic: &str, grain: Grain, bucket: u32, version: u64, computed_at: u32) -> SealRecord {
        SealRecord { topic: topic.into(), grain, bucket, version, computed_at }
    }

    /// Every hour of `day` sealed at version `v` (computed at `at`), and the day at 24 v.
    fn sealed_day(topic: &str, day: u32, v: u64, at: u32) -> Vec<SealRecord> {
        let mut r: Vec<SealRecord> = (0..24).map(|i| record(topic, Grain::Hour, day + i * HOUR, v, at)).collect();
        r.push(record(topic, Grain::Day, day, 24 * v, at));
        r
    }

    #[test]
    fn a_sealed_hour_is_current_until_a_marker_newer_than_its_computation_minus_the_slack() {
        let h = D + 5 * HOUR;
        let state = |written_at| SealState {
            topics: topics(&["t"]),
            records: vec![record("t", Grain::Hour, h, 7, D + DAY)],
            markers: vec![Marker { topic: "t".into(), hour: h, written_at }],
            ..SealState::default()
        };
        assert!(state(D + DAY - 61).current(60).hours.contains(&("t".into(), h)));
        assert!(state(D + DAY - 60).current(60).hours.is_empty(), "within the slack: maybe not in the seal");
        assert!(state(D + DAY + 5).current(60).hours.is_empty(), "written after the seal");
        // A later computation that found the same rows makes it current again.
        let mut again = state(D + DAY + 5);
        again.records.push(record("t", Grain::Hour, h, 7, D + DAY + 100));
        assert_eq!(again.current(60).hours.len(), 1);
        // ... but not one with an older version written late (a lagging sealer).
        let mut lagging = state(D + DAY + 5);
        lagging.records.push(record("t", Grain::Hour, h, 6, D + DAY + 100));
        assert!(lagging.current(60).hours.is_empty());
    }

    #[test]
    fn a_sealed_day_is_current_when_computed_from_its_hours_current_versions() {
        let mut state = SealState {
            topics: topics(&["t"]),
            records: sealed_day("t", D, 5, D + 2 * DAY),
            markers: vec![],
            ..SealState::default()
        };
        assert_eq!(state.current(60).days, BTreeSet::from([("t".to_string(), D)]));
        // An hour re-sealed (version 9) after the day: the day is stale until sealed again.
        state.records.push(record("t", Grain::Hour, D + 3 * HOUR, 9, D + 3 * DAY));
        let c = state.current(60);
        assert!(c.days.is_empty() && c.hours.len() == 24);
        state.records.push(record("t", Grain::Day, D, 24 * 5 + 4, D + 3 * DAY));
        assert_eq!(state.current(60).days.len(), 1);
        // A missing hour, or a stale one, keeps the day out.
        state.markers.push(Marker { topic: "t".into(), hour: D + 7 * HOUR, written_at: D + 4 * DAY });
        assert!(state.current(60).days.is_empty());
        let partial = SealState { records: sealed_day("t", D, 5, D + 2 * DAY)[1..].to_vec(), ..state };
        assert!(partial.current(60).days.is_empty());
    }

    #[test]
    fn a_range_reads_whole_sealed_days_and_hours_and_the_rest_from_minutes() {
        let mut records = sealed_day("t", D, 5, D + 9 * DAY);
        records.extend(sealed_day("t", D + DAY, 5, D + 9 * DAY));
        // Day 3: only its first 10 hours sealed so far.
        records.extend((0..10).map(|i| record("t", Grain::Hour, D + 2 * DAY + i * HOUR, 1, D + 9 * DAY)));
        let current =
            SealState { topics: topics(&["t"]), records, markers: vec![], ..SealState::default() }.current(60);

        // By day from 12:30 on day 1 to day 3, 20:00: the partial hour and the hours of
        // day 1 from 13:00 sealed hours, day 2 whole, day 3's first 10 hours, the rest
        // minutes.
        let s = split(D + 12 * HOUR + 1_800, D + 2 * DAY + 20 * HOUR, Grain::Day, &topics(&["t"]), &current);
        assert_eq!(s.days, [("t".to_string(), D + DAY)]);
        let hours: Vec<u32> = s.hours.iter().map(|(_, h)| (h - D) / HOUR).collect();
        assert_eq!(hours, (13..24).chain(48..58).collect::<Vec<_>>());
        assert_eq!(s.minutes, (D + 12 * HOUR + 1_800, D + 2 * DAY + 20 * HOUR));
        assert_eq!(s.covered.len(), 24 + 11 + 10);

        // By hour: no day; the hull shrinks to what is not covered at its ends.
        let s = split(D, D + DAY + 5 * HOUR, Grain::Hour, &topics(&["t"]), &current);
        assert!(s.days.is_empty() && s.hours.len() == 29 && s.minutes == (0, 0));
        let s = split(D + 20 * HOUR, D + 2 * DAY + 12 * HOUR, Grain::Hour, &topics(&["t"]), &current);
        assert_eq!(s.minutes, (D + 2 * DAY + 10 * HOUR, D + 2 * DAY + 12 * HOUR));

        // By minute: everything from minutes.
        let s = split(D, D + DAY, Grain::Minute, &topics(&["t"]), &current);
        assert_eq!(s, Split { minutes: (D, D + DAY), ..Split::default() });
    }

    #[test]
    fn every_topic_is_split_on_its_own_seals_and_an_unsealed_one_reads_minutes() {
        let current = SealState {
            topics: topics(&["a", "b"]),
            records: sealed_day("a", D, 5, D + 9 * DAY),
            markers: vec![],
            ..SealState::default()
        }
        .current(60);
        let s = split(D, D + DAY, Grain::Day, &topics(&["a", "b"]), &current);
        assert_eq!(s.days, [("a".to_string(), D)]);
        assert_eq!(s.minutes, (D, D + DAY), "b has no seals");
        assert!(s.covered.iter().all(|(t, _)| t == "a"));
        let s = split(D, D + DAY, Grain::Day, &topics(&["a"]), &current);
        assert_eq!(s.minutes, (0, 0));
        assert!(split(D, D + DAY, Grain::Day, &BTreeSet::new(), &current).covered.is_empty());
    }

    #[test]
    fn hours_below_the_frontier_without_seal_or_marker_are_left_out_of_the_minute_read() {
        // Data from day 29 on: the frontier started there and stands at day 30, 06:00
        // (day 29 sealed whole). Day 10, 03:00 was written later (a backfill): a marker.
        let start = D - 29 * DAY;
        let mut state = SealState {
            topics: topics(&["t", "u"]),
            records: sealed_day("t", D - DAY, 5, D + 6 * HOUR),
            markers: vec![Marker { topic: "t".into(), hour: start + 9 * DAY + 3 * HOUR, written_at: D }],
            ..SealState::default()
        };
        state.frontiers.insert("t".into(), D + 6 * HOUR);
        let current = state.current(60);
        assert!(current.is_empty_hour("t", start));
        assert!(!current.is_empty_hour("t", start + 9 * DAY + 3 * HOUR), "written to: read it");
        assert!(!current.is_empty_hour("t", D + 6 * HOUR), "at the frontier: not passed yet");
        assert!(!current.is_empty_hour("u", start), "no frontier: nothing known");

        // 30 days by day over t: day 29 sealed, the hours before it empty except the
        // marked one, which the minute read spans from; after the frontier, minutes.
        let s = split(start, D + DAY, Grain::Day, &topics(&["t"]), &current);
        assert_eq!(s.days, [("t".to_string(), D - DAY)]);
        assert!(s.hours.is_empty());
        assert_eq!(s.minutes, (start + 9 * DAY + 3 * HOUR, D + DAY));
        assert!(!s.covered.contains(&("t".to_string(), start)), "before the minute read: not listed");
        assert!(!s.covered.contains(&("t".to_string(), start + 9 * DAY + 3 * HOUR)));
        assert!(s.covered.contains(&("t".to_string(), start + 9 * DAY + 4 * HOUR)));
        assert!(!s.covered.contains(&("t".to_string(), D + 6 * HOUR)));
        // Without the marked hour, the minute read starts at the frontier.
        state.markers.clear();
        let s = split(start, D + DAY, Grain::Day, &topics(&["t"]), &state.current(60));
        assert_eq!(s.minutes, (D + 6 * HOUR, D + DAY));
        assert!(s.covered.is_empty(), "nothing covered inside the minute read: {:?}", s.covered);
        // A topic without a frontier still reads its whole span.
        let s = split(start, D + DAY, Grain::Day, &topics(&["t", "u"]), &state.current(60));
        assert_eq!(s.minutes, (start, D + DAY));
        // By minute: nothing is left out.
        assert_eq!(split(start, D, Grain::Minute, &topics(&["t"]), &state.current(60)).minutes, (start, D));
    }

    #[test]
    fn whole_buckets_lie_inside_the_range() {
        assert_eq!(whole(D + 1, D + 3 * HOUR, HOUR).collect::<Vec<_>>(), [D + HOUR, D + 2 * HOUR]);
        assert_eq!(whole(D, D + HOUR - 1, HOUR).count(), 0);
        assert_eq!(whole(u32::MAX - 10, u32::MAX, HOUR).count(), 0);
    }
}
