//! The topic the model reads: partitions cut from one global timeline of producers, so
//! that the partitions' clocks stay close, with two disjoint kinds of click IDs:
//!
//! - **per-partition clicks**: an ID appears on one partition only (retried, repeated
//!   after quiet gaps longer than any window, sent by producers whose clocks are a little
//!   behind, without a timestamp, or stamped far ahead); the oracle gives their exact
//!   counts;
//! - **cross-partition clicks**: one click sent as copies to several partitions, all
//!   within half the smallest window of record time, with one ad and minute, used once:
//!   exactly one copy must count.
//!
//! Rejected records and records stamped far ahead (alone, or two alike: a producer
//! whose clock jumped, or past 2106) are mixed in, and every producer falls quiet for
//! more than an hour now and then.

use proptest::prelude::*;

use super::oracle::{self, ClickOf, CrossClick, Record, JUMP};

/// The windows a topic's settings may use (s); the first is the initial one.
pub const WINDOWS: [u32; 3] = [10, 14, 20];
const W_MIN: u32 = 10;
const W_MAX: u32 = 20;
/// Where record time starts: a minute before an hour (so roll-ups split early).
pub const T0: u32 = 2 * 86_400 + 3_540;
/// How far ahead a far-ahead record is stamped (plus 10 000 s per earlier one, so no two
/// far-ahead records are within an hour of each other by accident).
const FAR: u32 = 200_000;
/// Where records stamped past 2106 start: one past the last second 32 bits hold.
const BEYOND: u64 = u32::MAX as u64 + 1;
/// Per-partition IDs: a few per partition, so repeats are common.
const POOL: u8 = 6;
const CROSS_BASE: u32 = 1_000;
/// The IDs of each partition's last click.
const LAST_IDS: u32 = 900;
pub fn per_partition_id(p: usize, k: u8) -> u32 {
    1 + p as u32 * 16 + u32::from(k % POOL)
}

fn minute_of(t: u32) -> u32 {
    t - t % 60
}

/// One thing the producers do, in global order.
#[derive(Debug, Clone)]
pub enum Ev {
    /// A per-partition click (one of the partition's few IDs), `dt` s after the last
    /// event; stamped then, `behind` s earlier (a producer clock behind), or not at all.
    Click { p: u8, k: u8, ad: u8, dt: u8, stamp: Stamp },
    /// A record that is no valid click.
    Rejected { p: u8, dt: u8 },
    /// One click sent to the partitions in `parts` (at least two), each copy up to
    /// `spread` s after the one before; `twice`: the first partition gets a second copy.
    Cross { parts: u8, twice: bool, ad: u8, spread: u8 },
    /// Every producer is quiet for longer than any window.
    Gap { secs: u8 },
    /// One record stamped far ahead: a click of the partition (`Some`) or a rejected one.
    Far { p: u8, k: Option<u8> },
    /// Two records stamped alike far ahead: the partition's producer clock jumped, and its
    /// later records are stamped from there.
    FarPair { p: u8, k: Option<u8> },
    /// Every producer is quiet for more than an hour.
    Hour { x: u8 },
    /// A record stamped past 2106 (more than 32 bits of seconds): a click of the partition
    /// (`Some`) or a rejected one; `twice`: after another one, a year further.
    Beyond { p: u8, k: Option<u8>, twice: bool },
}

#[derive(Debug, Clone, Copy)]
pub enum Stamp {
    At,
    Behind(u8),
    Missing,
}

/// The topic: per partition its records, and the cross-partition clicks among them.
#[derive(Debug, Clone)]
pub struct Log {
    pub parts: Vec<Vec<Record>>,
    pub cross: Vec<CrossClick>,
    /// The oracle's record time of every record (for the model's in-flight checks).
    pub times: Vec<Vec<u32>>,
}

impl Log {
    pub fn len(&self, p: usize) -> i64 {
        self.parts[p].len() as i64
    }

    pub fn partitions(&self) -> usize {
        self.parts.len()
    }

    pub fn from_events(partitions: usize, events: &[Ev]) -> Log {
        let mut parts: Vec<Vec<Record>> = vec![Vec::new(); partitions];
        let mut cross: Vec<CrossClick> = Vec::new();
        let mut skew = vec![0u32; partitions];
        let mut far = 0u32;
        let mut t = T0;
        for ev in events {
            match *ev {
                Ev::Click { p, k, ad, dt, stamp } => {
                    let p = usize::from(p) % partitions;
                    t += u32::from(dt % 4);
                    let ts = match stamp {
                        Stamp::At => Some(t + skew[p]),
                        Stamp::Behind(b) => Some(t + skew[p] - u32::from(b % 6)),
                        Stamp::Missing => None,
                    };
                    let ts = ts.map(u64::from);
                    let click = ClickOf { id: per_partition_id(p, k), ad: ad % 3, minute: minute_of(t) };
                    parts[p].push(Record { ts, click: Some(click) });
                }
                Ev::Rejected { p, dt } => {
                    let p = usize::from(p) % partitions;
                    t += u32::from(dt % 4);
                    parts[p].push(Record { ts: Some(u64::from(t + skew[p])), click: None });
                }
                Ev::Cross { parts: mask, twice, ad, spread } => {
                    let mut holders: Vec<usize> = (0..partitions).filter(|p| mask & (1 << p) != 0).collect();
                    if holders.len() < 2 {
                        let first = holders.first().copied().unwrap_or(usize::from(mask) % partitions);
                        holders = vec![first, (first + 1) % partitions];
                    }
                    if twice {
                        holders.push(holders[0]);
                    }
                    let id = CROSS_BASE + cross.len() as u32;
                    let (ad, minute) = (ad % 3, minute_of(t));
                    let mut copies = Vec::new();
                    for (i, &p) in holders.iter().enumerate() {
                        if i > 0 {
                            t += u32::from(spread) % 3;
                        }
                        copies.push((p, parts[p].len()));
                        let ts = Some(u64::from(t + skew[p]));
                        parts[p].push(Record { ts, click: Some(ClickOf { id, ad, minute }) });
                    }
                    cross.push(CrossClick { id, ad, minute, copies });
                }
                Ev::Gap { secs } => t += W_MAX + 1 + u32::from(secs % 20),
                Ev::Far { p, k } => {
                    let p = usize::from(p) % partitions;
                    let stamp = t + FAR + 10_000 * far;
                    far += 1;
                    let click = k.map(|k| ClickOf { id: per_partition_id(p, k), ad: 0, minute: minute_of(t) });
                    parts[p].push(Record { ts: Some(u64::from(stamp)), click });
                }
                Ev::FarPair { p, k } => {
                    let p = usize::from(p) % partitions;
                    let stamp = t + FAR + 10_000 * far;
                    far += 1;
                    let click = k.map(|k| ClickOf { id: per_partition_id(p, k), ad: 1, minute: minute_of(t) });
                    parts[p].push(Record { ts: Some(u64::from(stamp)), click: None });
                    parts[p].push(Record { ts: Some(u64::from(stamp)), click });
                    skew[p] = stamp - t;
                }
                Ev::Beyond { p, k, twice } => {
                    let p = usize::from(p) % partitions;
                    let click = k.map(|k| ClickOf { id: per_partition_id(p, k), ad: 0, minute: minute_of(t) });
                    let stamp = BEYOND + 100_000 * u64::from(far);
                    far += 1;
                    if twice {
                        parts[p].push(Record { ts: Some(stamp + 86_400 * 365), click: None });
                    }
                    parts[p].push(Record { ts: Some(stamp), click });
                }
                Ev::Hour { x } => t += JUMP + 1 + u32::from(x),
            }
        }
        // Every partition ends with a click of its own: producers keep sending. (A
        // partition whose warm-up ends on records that are not clicks, with no click after
        // them, would keep every other partition's new clicks waiting for ever:
        // `a_partition_whose_warm_up_ends_on_a_rejected_record_keeps_the_others_waiting`.)
        t += 1;
        for (p, records) in parts.iter_mut().enumerate() {
            let click = ClickOf { id: LAST_IDS + p as u32, ad: 2, minute: minute_of(t) };
            records.push(Record { ts: Some(u64::from(t + skew[p])), click: Some(click) });
        }
        for records in &mut parts {
            stamp_confirmations_alike(records);
        }
        Log::from_parts(parts, cross)
    }

    /// A log as given (the cross-partition clicks among it named), with a cross-partition
    /// click whose copies spread wider than half the smallest window turned into rejected
    /// records.
    pub fn from_parts(mut parts: Vec<Vec<Record>>, mut cross: Vec<CrossClick>) -> Log {
        let times: Vec<Vec<u32>> = parts
            .iter()
            .map(|r| oracle::record_times(&r.iter().map(|r| oracle::stamp(r.ts)).collect::<Vec<_>>()))
            .collect();
        // A cross-partition click whose copies' record times spread wider than half the
        // smallest window (a partition's clock moved away) is not one: its copies become
        // rejected records (same timestamps, so no record time changes).
        // Copies made rejected records are no copies.
        for c in &mut cross {
            c.copies.retain(|&(p, o)| parts[p][o].click.is_some_and(|k| k.id == c.id));
        }
        cross.retain(|c| {
            if c.copies.is_empty() {
                return false;
            }
            let at: Vec<u32> = c.copies.iter().map(|&(p, o)| times[p][o]).collect();
            let tight = at.iter().max().expect("copies") - at.iter().min().expect("copies") <= W_MIN / 2;
            if !tight {
                for &(p, o) in &c.copies {
                    parts[p][o].click = None;
                }
            }
            tight
        });
        Log { parts, cross, times }
    }
}

/// The definition leaves open how a jump confirmed by a record stamped differently (within
/// the hour of it) is timed; the generator avoids it by stamping the confirming record
/// alike (a click and its immediate retry after a quiet hour). Left to right, so the
/// oracle's clock before each record only involves confirmations already stamped alike.
fn stamp_confirmations_alike(records: &mut [Record]) {
    for j in 0..records.len() {
        let ts: Vec<Option<u32>> = records.iter().map(|r| oracle::stamp(r.ts)).collect();
        let Some(t) = ts[j] else { continue };
        let jumps = oracle::clocks(&ts[..j])[j].is_some_and(|c| t > c.saturating_add(JUMP));
        let Some(k) = (j + 1..ts.len()).find(|&k| ts[k].is_some()) else { continue };
        let tk = ts[k].expect("stamped");
        if jumps && tk != t && tk.abs_diff(t) <= JUMP {
            records[k].ts = Some(u64::from(t));
        }
    }
}

/// Events for `partitions` partitions.
pub fn events(max: usize) -> impl Strategy<Value = Vec<Ev>> {
    let stamp = prop_oneof![6 => Just(Stamp::At), 2 => any::<u8>().prop_map(Stamp::Behind), 1 => Just(Stamp::Missing)];
    let ev = prop_oneof![
        30 => (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>(), stamp)
            .prop_map(|(p, k, ad, dt, stamp)| Ev::Click { p, k, ad, dt, stamp }),
        4 => (any::<u8>(), any::<u8>()).prop_map(|(p, dt)| Ev::Rejected { p, dt }),
        8 => (any::<u8>(), any::<bool>(), any::<u8>(), any::<u8>())
            .prop_map(|(parts, twice, ad, spread)| Ev::Cross { parts, twice, ad, spread }),
        3 => any::<u8>().prop_map(|secs| Ev::Gap { secs }),
        1 => (any::<u8>(), prop::option::of(any::<u8>())).prop_map(|(p, k)| Ev::Far { p, k }),
        1 => (any::<u8>(), prop::option::of(any::<u8>())).prop_map(|(p, k)| Ev::FarPair { p, k }),
        1 => any::<u8>().prop_map(|x| Ev::Hour { x }),
        1 => (any::<u8>(), prop::option::of(any::<u8>()), any::<bool>())
            .prop_map(|(p, k, twice)| Ev::Beyond { p, k, twice }),
    ];
    prop::collection::vec(ev, 0..max)
}
