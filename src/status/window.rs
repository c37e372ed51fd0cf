//! Rates and quantiles over a sliding window, from the member's own `/metrics` text.
//!
//! The status page reads its counters from the same registry Prometheus scrapes, so
//! that the page, `/metrics`, the dashboard and the alerts can never disagree about
//! what happened. A sampler renders the registry once a second into a [`History`];
//! a rate is the increase since the sample closest to the start of the window, and a
//! quantile interpolates within the histogram's buckets the way Prometheus'
//! `histogram_quantile` does. Pure: the time is passed in.

use std::collections::{BTreeMap, VecDeque};

use crate::telemetry as t;

/// Rates look back this far: long enough to smooth poll batches, short enough that a
/// member that stopped shows 0 within seconds.
pub const RATE_WINDOW_SECONDS: f64 = 10.0;

/// Freshness quantiles look back this far, like the `rate(…[5m])` of the
/// ClickaggFreshnessOverTarget alert.
pub const FRESHNESS_WINDOW_SECONDS: f64 = 300.0;

/// The counters and the freshness histogram at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    pub records: f64,
    pub counted: f64,
    pub duplicates: f64,
    /// Per rejection reason.
    pub dead_letters: BTreeMap<String, f64>,
    /// Cumulative `(le, count)` of `clickagg_freshness_seconds`, `le` ascending, the
    /// last one `+Inf`.
    pub freshness: Vec<(f64, f64)>,
}

/// One `/metrics` text read for what the status page shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub counters: Counters,
    /// Per partition: `clickagg_consumer_lag` (librdkafka's statistics).
    pub lag: BTreeMap<i32, f64>,
    /// Per partition: `clickagg_record_lag_seconds`.
    pub record_lag: BTreeMap<i32, f64>,
}

impl Reading {
    /// Reads the Prometheus text exposition format as the exporter writes it: one
    /// `name{label="value",…} number` per line, comments starting with `#`.
    pub fn parse(text: &str) -> Reading {
        let mut r = Reading::default();
        let partition = |labels: &str| label(labels, "partition").and_then(|p| p.parse::<i32>().ok());
        for (name, labels, value) in samples(text) {
            match name {
                t::RECORDS_CONSUMED => r.counters.records += value,
                t::CLICKS_COUNTED => r.counters.counted += value,
                t::DUPLICATES_DROPPED => r.counters.duplicates += value,
                t::DEAD_LETTERS => {
                    let reason = label(labels, "reason").unwrap_or("").to_string();
                    *r.counters.dead_letters.entry(reason).or_default() += value;
                }
                t::CONSUMER_LAG => {
                    if let Some(p) = partition(labels) {
                        r.lag.insert(p, value);
                    }
                }
                t::RECORD_LAG => {
                    if let Some(p) = partition(labels) {
                        r.record_lag.insert(p, value);
                    }
                }
                _ if name.strip_suffix("_bucket") == Some(t::FRESHNESS) => {
                    let le = match label(labels, "le") {
                        Some("+Inf") => f64::INFINITY,
                        Some(le) => match le.parse() {
                            Ok(le) => le,
                            Err(_) => continue,
                        },
                        None => continue,
                    };
                    r.counters.freshness.push((le, value));
                }
                _ => {}
            }
        }
        r.counters.freshness.sort_by(|a, b| a.0.total_cmp(&b.0));
        r
    }
}

/// `(name, labels inside the braces, value)` of every sample line.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter(|l| !l.starts_with('#')).filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let value: f64 = value.parse().ok()?;
        match series.split_once('{') {
            Some((name, rest)) => Some((name, rest.strip_suffix('}')?, value)),
            None => Some((series, "", value)),
        }
    })
}

/// The value of `key` in `a="x",b="y"`. The member's label values are numbers and
/// fixed words, never quotes or commas.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Counters sampled once a second, kept for the longest window.
#[derive(Debug, Default)]
pub struct History {
    samples: VecDeque<(f64, Counters)>,
}

impl History {
    pub fn push(&mut self, at: f64, counters: Counters) {
        self.samples.push_back((at, counters));
        // One extra sample beyond the window, so a full window always has a start.
        while self.samples.len() > 2 && self.samples[1].0 <= at - FRESHNESS_WINDOW_SECONDS {
            self.samples.pop_front();
        }
    }

    /// The sample a window of `seconds` ending at `now` starts from: the newest one at
    /// or before its start, or the oldest one when the history is shorter (a member
    /// that just started). `None` without a sample before `now`.
    fn start_of(&self, now: f64, seconds: f64) -> Option<&(f64, Counters)> {
        let start = now - seconds;
        self.samples
            .iter()
            .rev()
            .find(|(at, _)| *at <= start)
            .or_else(|| self.samples.front())
            .filter(|(at, _)| *at < now)
    }

    /// Per-second rates over the last [`RATE_WINDOW_SECONDS`] up to `now`, whose
    /// counters are `current`.
    pub fn rates(&self, now: f64, current: &Counters) -> Option<Rates> {
        let (at, old) = self.start_of(now, RATE_WINDOW_SECONDS)?;
        let per_second = |new: f64, old: f64| ((new - old) / (now - at)).max(0.0);
        Some(Rates {
            records: per_second(current.records, old.records),
            counted: per_second(current.counted, old.counted),
            duplicates: per_second(current.duplicates, old.duplicates),
            dead_letters: current
                .dead_letters
                .iter()
                .map(|(reason, &n)| {
                    (reason.clone(), per_second(n, old.dead_letters.get(reason).copied().unwrap_or(0.0)))
                })
                .collect(),
        })
    }

    /// The `q`-quantile of the freshness of the clicks made durable over the last
    /// [`FRESHNESS_WINDOW_SECONDS`]; `None` when none were (or nothing was sampled yet).
    pub fn freshness_quantile(&self, q: f64, now: f64, current: &Counters) -> Option<Quantile> {
        let (_, old) = self.start_of(now, FRESHNESS_WINDOW_SECONDS)?;
        let increase: Vec<(f64, f64)> = current
            .freshness
            .iter()
            .map(|&(le, n)| {
                let before = old.freshness.iter().find(|(l, _)| *l == le).map_or(0.0, |b| b.1);
                (le, n - before)
            })
            .collect();
        histogram_quantile(q, &increase)
    }
}

/// Rates per second.
#[derive(Debug, Clone, PartialEq)]
pub struct Rates {
    pub records: f64,
    pub counted: f64,
    pub duplicates: f64,
    pub dead_letters: BTreeMap<String, f64>,
}

/// A quantile read from histogram buckets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantile {
    pub value: f64,
    /// The rank fell in the `+Inf` bucket: the quantile is more than `value` (the
    /// highest finite bound), by an amount the buckets cannot tell.
    pub more_than: bool,
}

impl Quantile {
    fn at(value: f64) -> Quantile {
        Quantile { value, more_than: false }
    }
}

/// Prometheus' `histogram_quantile` over cumulative `(le, count)` buckets, `le`
/// ascending and ending with `+Inf`: linear interpolation within the bucket holding the
/// rank, from 0 for the first bucket; a rank in the `+Inf` bucket gives the highest
/// finite bound, flagged [`more_than`](Quantile::more_than). `None` without
/// observations.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<Quantile> {
    let total = buckets.last()?.1;
    if total <= 0.0 || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let rank = q * total;
    let i = buckets.iter().position(|&(_, n)| n >= rank)?;
    let (upper, count) = buckets[i];
    let (lower, below) = if i == 0 { (0.0, 0.0) } else { buckets[i - 1] };
    if upper.is_infinite() {
        return (i > 0).then_some(Quantile { value: lower, more_than: true });
    }
    if count == below {
        return Some(Quantile::at(upper));
    }
    Some(Quantile::at(lower + (upper - lower) * (rank - below) / (count - below)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE clickagg_records_consumed_total counter
clickagg_records_consumed_total 1200
clickagg_clicks_counted_total 1000
clickagg_duplicates_dropped_total 150
clickagg_dead_letters_produced_total{reason=\"malformed_json\"} 40
clickagg_dead_letters_produced_total{reason=\"missing_field\"} 10
clickagg_consumer_lag{partition=\"0\"} 35
clickagg_consumer_lag{partition=\"12\"} 0
clickagg_record_lag_seconds{partition=\"12\"} 1.5
clickagg_freshness_seconds_bucket{le=\"0.5\"} 500
clickagg_freshness_seconds_bucket{le=\"1\"} 900
clickagg_freshness_seconds_bucket{le=\"+Inf\"} 1000
clickagg_freshness_seconds_sum 700
clickagg_freshness_seconds_count 1000
clickagg_flush_duration_seconds_bucket{le=\"0.5\"} 3
";

    #[test]
    fn the_metrics_text_gives_the_counters_the_histogram_and_the_partition_gauges() {
        let r = Reading::parse(TEXT);
        assert_eq!((r.counters.records, r.counters.counted, r.counters.duplicates), (1200.0, 1000.0, 150.0));
        assert_eq!(r.counters.dead_letters["malformed_json"], 40.0);
        assert_eq!(r.counters.dead_letters["missing_field"], 10.0);
        assert_eq!(r.counters.freshness, vec![(0.5, 500.0), (1.0, 900.0), (f64::INFINITY, 1000.0)]);
        assert_eq!(r.lag, BTreeMap::from([(0, 35.0), (12, 0.0)]));
        assert_eq!(r.record_lag, BTreeMap::from([(12, 1.5)]));
    }

    #[test]
    fn quantiles_interpolate_within_buckets_like_prometheus() {
        let b = [(0.5, 500.0), (1.0, 900.0), (2.0, 1000.0), (f64::INFINITY, 1000.0)];
        let value = |q: f64, b: &[(f64, f64)]| histogram_quantile(q, b).map(|x| (x.value, x.more_than));
        assert_eq!(value(0.5, &b), Some((0.5, false)));
        assert_eq!(value(0.25, &b), Some((0.25, false)));
        assert_eq!(value(0.7, &b), Some((0.75, false)));
        assert_eq!(value(0.95, &b), Some((1.5, false)));
        assert_eq!(value(1.0, &b), Some((2.0, false)), "the last observation is within the last finite bucket");
        // Ranks in the +Inf bucket get the highest finite bound, known only as a floor.
        let tail = [(1.0, 10.0), (f64::INFINITY, 100.0)];
        assert_eq!(value(0.99, &tail), Some((1.0, true)));
        assert_eq!(value(0.05, &tail), Some((0.5, false)));
        assert_eq!(value(0.5, &[(1.0, 0.0), (f64::INFINITY, 0.0)]), None);
    }

    fn counters(records: f64, freshness: &[(f64, f64)]) -> Counters {
        Counters { records, freshness: freshness.to_vec(), ..Counters::default() }
    }

    #[test]
    fn rates_are_the_increase_since_the_start_of_the_window() {
        let mut h = History::default();
        assert_eq!(h.rates(100.0, &counters(0.0, &[])), None, "nothing sampled yet");
        for s in 0..=20 {
            h.push(100.0 + f64::from(s), counters(f64::from(s) * 50.0, &[]));
        }
        // At 120 the window starts at 110 (500 records); 1000 now.
        let r = h.rates(120.0, &counters(1000.0, &[])).unwrap();
        assert_eq!(r.records, 50.0);
        // A member that stopped reading shows 0 once the window passed.
        let r = h.rates(131.0, &counters(1000.0, &[])).unwrap();
        assert_eq!(r.records, 0.0);
    }

    #[test]
    fn a_young_member_rates_over_what_it_has_seen_and_quantiles_over_the_increase() {
        let mut h = History::default();
        h.push(10.0, counters(0.0, &[(1.0, 100.0), (f64::INFINITY, 100.0)]));
        h.push(12.0, counters(40.0, &[(1.0, 100.0), (f64::INFINITY, 200.0)]));
        let now = counters(40.0, &[(1.0, 100.0), (f64::INFINITY, 200.0)]);
        assert_eq!(h.rates(14.0, &now).unwrap().records, 10.0, "40 records over 4 s");
        // The 100 observations before the first sample are not in the window: all of
        // the increase is above 1 s.
        assert_eq!(h.freshness_quantile(0.5, 14.0, &now), Some(Quantile { value: 1.0, more_than: true }));
    }

    #[test]
    fn the_history_keeps_one_freshness_window() {
        let mut h = History::default();
        for s in 0..1000 {
            h.push(f64::from(s), Counters::default());
        }
        assert!(h.samples.len() <= FRESHNESS_WINDOW_SECONDS as usize + 2, "{}", h.samples.len());
        assert!(h.samples[0].0 <= 999.0 - FRESHNESS_WINDOW_SECONDS);
    }
}
