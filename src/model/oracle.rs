//! The reference: which records count, computed from the definition (guide, "What
//! counts") and nothing else. It shares no code with `dedup::clock` or `dedup::decide`
//! (nor with anything the simulated system runs): every rule is a plain scan over the
//! log, quadratic and obvious rather than fast.
//!
//! Where the guide's wording leaves a case open, the oracle refuses it (it panics with
//! "ambiguous"), and the generator does not produce it:
//! - a far-ahead record confirmed by a next record stamped *differently* (within the hour
//!   of it, but not alike): is the confirming record judged at its own timestamp or at
//!   the confirmed one, and does the clock reach the higher or the lower one? The log
//!   generator stamps a confirming record alike.

use std::collections::BTreeMap;

/// How far ahead of the clock one record may move it without confirmation (an hour).
pub const JUMP: u32 = 3_600;

/// One record as the definition sees it: its Kafka timestamp (whole seconds; `None`
/// when it has none; it may lie past what the clock holds) and, for a valid click, its
/// click ID and billing bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub ts: Option<u64>,
    pub click: Option<ClickOf>,
}

/// The timestamp a record's clock reads: none when it has none, or one past what 32 bits
/// of seconds hold (2106-02-07T06:28:15Z) — such a record leaves the clock where it is.
pub fn stamp(ts: Option<u64>) -> Option<u32> {
    ts.and_then(|t| u32::try_from(t).ok())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClickOf {
    pub id: u32,
    pub ad: u8,
    /// The start of the event-time minute, in seconds.
    pub minute: u32,
}

/// Whether a record stamped `t` cannot move the clock `before` on its own: it is more
/// than an hour ahead of it, or there is no clock yet (a partition's first timestamped
/// record starts the clock only with the next one stamped within an hour of it).
fn jumps(before: Option<u32>, t: u32) -> bool {
    before.is_none_or(|c| t > c.saturating_add(JUMP))
}

/// The clock of the partition just before each record and after the last
/// (`clocks(ts)[i]`: after records `0..i`): the highest timestamp among them that moved
/// it. A timestamp moves it when it is not more than an hour ahead of the clock before
/// it, or — for one that is — once the next timestamped record (read before `i`) is
/// stamped within an hour of it. While there is no clock, a timestamp moves it only
/// together with the timestamp next to it, before or after, when the two lie within an
/// hour of each other: the clock starts at the later of the first two consecutive
/// timestamped records that do. `None`: no clock before `i` (no two such records).
pub fn clocks(ts: &[Option<u32>]) -> Vec<Option<u32>> {
    // next[j], prev[j]: the next and the previous record of j that carry a timestamp.
    let next: Vec<Option<usize>> = (0..ts.len()).map(|j| (j + 1..ts.len()).find(|&k| ts[k].is_some())).collect();
    let prev: Vec<Option<usize>> = (0..ts.len()).map(|j| (0..j).rev().find(|&k| ts[k].is_some())).collect();
    let within = |k: usize, t: u32| ts[k].expect("stamped").abs_diff(t) <= JUMP;
    let mut before: Vec<Option<u32>> = Vec::with_capacity(ts.len() + 1);
    for i in 0..=ts.len() {
        let mut moved: Option<u32> = None;
        for j in 0..i {
            let Some(t) = ts[j] else { continue };
            let accepted = match before[j] {
                Some(c) if !jumps(Some(c), t) => true,
                Some(_) => next[j].is_some_and(|k| {
                    let tk = ts[k].expect("stamped");
                    let confirms = k < i && tk.abs_diff(t) <= JUMP;
                    assert!(!confirms || tk == t, "ambiguous: a jump to {t} confirmed by a record stamped {tk}");
                    confirms
                }),
                // No clock yet: the first of a pair once its partner is read, or the second.
                None => next[j].is_some_and(|k| k < i && within(k, t)) || prev[j].is_some_and(|k| within(k, t)),
            };
            if accepted {
                moved = Some(moved.map_or(t, |m| m.max(t)));
            }
        }
        before.push(moved);
    }
    before
}

/// The clock just before record `i` (see [`clocks`]).
pub fn clock_before(ts: &[Option<u32>], i: usize) -> Option<u32> {
    clocks(&ts[..i])[i]
}

/// Before each record and after the last: the timestamp of the last timestamped record
/// if it is still more than an hour ahead of the clock (a jump nothing confirmed yet:
/// what a reader starting there must remember).
pub fn pending(ts: &[Option<u32>]) -> Vec<Option<u32>> {
    let clock = clocks(ts);
    (0..=ts.len())
        .map(|i| {
            let t = (0..i).rev().find_map(|j| ts[j])?;
            jumps(clock[i], t).then_some(t)
        })
        .collect()
}

/// The record time of every record: the clock once it is read (0 while there is none)
/// — or, for a record that cannot move the clock alone (stamped more than an hour ahead
/// of it, or read while there is none) and did not move it, its own timestamp.
pub fn record_times(ts: &[Option<u32>]) -> Vec<u32> {
    let clock = clocks(ts);
    (0..ts.len())
        .map(|i| match ts[i] {
            Some(t) if jumps(clock[i], t) && clock[i + 1] == clock[i] => t,
            _ => clock[i + 1].unwrap_or(0),
        })
        .collect()
}

/// Within one partition, in offset order: a valid click counts unless an earlier valid
/// click of the partition with the same ID has a record time within the window before
/// it (`τ(o) − W ≤ τ(o') ≤ τ(o)`, bounds inclusive) — and, when that earlier one was
/// judged ahead of its partition's clock (at its own timestamp, the clock not moving),
/// the partition's clock just after `o` is within the window of its *reach*: the clock
/// after it, or, once the next timestamped record confirmed its jump, the clock after
/// that record. Every sighting counts for the window, counted or not. `window_at(o)`:
/// the window of the settings deciding offset `o`.
pub fn counts_within_partition(records: &[Record], window_at: &dyn Fn(usize) -> u32) -> Vec<bool> {
    let ts: Vec<Option<u32>> = records.iter().map(|r| stamp(r.ts)).collect();
    let tau = record_times(&ts);
    let clock = clocks(&ts);
    let after = |i: usize| clock[i + 1].unwrap_or(0);
    // The reach of record j as record i (after it) sees it.
    let reach = |j: usize, i: usize| {
        let Some(t) = ts[j] else { return after(j) };
        match (j + 1..ts.len()).find(|&k| ts[k].is_some()) {
            Some(k) if k <= i && ts[k].is_some_and(|tk| tk.abs_diff(t) <= JUMP) => after(k),
            _ => after(j),
        }
    };
    (0..records.len())
        .map(|i| {
            let Some(c) = records[i].click else { return false };
            let w = window_at(i);
            !(0..i).any(|j| {
                let ahead = tau[j] > after(j);
                records[j].click.is_some_and(|e| e.id == c.id)
                    && tau[j] <= tau[i]
                    && tau[i] - tau[j] <= w
                    && (!ahead || after(i).saturating_sub(w) <= reach(j, i))
            })
        })
        .collect()
}

/// A click whose copies sit on several partitions, all within a tight span of record
/// time (at most half the smallest window) and with one ad and minute: exactly one copy
/// counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossClick {
    pub id: u32,
    pub ad: u8,
    pub minute: u32,
    /// (partition, offset) of every copy.
    pub copies: Vec<(usize, usize)>,
}

/// What the billing table must hold per bucket `(ad, start of the minute/hour/day)`:
/// at least `.0` and at most `.1` clicks (equal for every bucket whose counts the
/// definition fixes).
pub type Bounds = BTreeMap<(u8, u32), (u64, u64)>;

/// How firmly the definition fixes a cross-partition click's count, given what the system
/// went through (the caller decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fixed {
    /// Exactly one copy counts.
    Once,
    /// At least one, at most one per partition holding a copy.
    AtLeastOnce,
    /// At most one per partition holding a copy.
    AtMostOncePerPartition,
}

/// The counts per bucket of width `grain_secs` (60, 3 600, 86 400): every counted
/// per-partition click but those `left_out(partition, offset)` names, plus each
/// cross-partition click as `fixed` says.
pub fn expected(
    partitions: &[Vec<Record>],
    cross: &[CrossClick],
    fixed: &dyn Fn(&CrossClick) -> Fixed,
    window_at: &dyn Fn(usize, usize) -> u32,
    grain_secs: u32,
    left_out: &dyn Fn(usize, usize) -> bool,
) -> Bounds {
    let bucket = |ad: u8, minute: u32| (ad, minute - minute % grain_secs);
    let cross_ids: Vec<u32> = cross.iter().map(|c| c.id).collect();
    let mut out: Bounds = BTreeMap::new();
    for (p, records) in partitions.iter().enumerate() {
        let per_partition: Vec<Record> = records
            .iter()
            .map(|r| Record { ts: r.ts, click: r.click.filter(|c| !cross_ids.contains(&c.id)) })
            .collect();
        let counted = counts_within_partition(&per_partition, &|o| window_at(p, o));
        for (o, (r, counts)) in per_partition.iter().zip(counted).enumerate() {
            if counts && !left_out(p, o) {
                let c = r.click.expect("counted clicks are clicks");
                let slot = out.entry(bucket(c.ad, c.minute)).or_default();
                slot.0 += 1;
                slot.1 += 1;
            }
        }
    }
    for c in cross {
        let slot = out.entry(bucket(c.ad, c.minute)).or_default();
        let mut holders: Vec<usize> = c.copies.iter().map(|&(p, _)| p).collect();
        holders.sort_unstable();
        holders.dedup();
        let (lo, hi) = match fixed(c) {
            Fixed::Once => (1, 1),
            Fixed::AtLeastOnce => (1, holders.len() as u64),
            Fixed::AtMostOncePerPartition => (0, holders.len() as u64),
        };
        slot.0 += lo;
        slot.1 += hi;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[Option<u32>]) -> Vec<u32> {
        record_times(v)
    }

    #[test]
    fn the_clock_is_the_highest_timestamp_and_never_goes_back() {
        assert_eq!(t(&[Some(5), Some(3), None, Some(9)]), vec![5, 5, 5, 9]);
        assert_eq!(t(&[None, Some(7)]), vec![0, 7], "nothing stamped yet: 0");
    }

    #[test]
    fn the_clock_starts_with_the_first_two_records_stamped_within_an_hour_at_the_later() {
        let far = 10 + 2 * JUMP;
        // A first record far ahead of the traffic after it moves nothing.
        assert_eq!(t(&[Some(far), Some(10), None, Some(12), Some(11)]), vec![far, 10, 0, 12, 12]);
        assert_eq!(clocks(&[Some(far), Some(10), None, Some(12)]), vec![None, None, None, None, Some(12)]);
        assert_eq!(pending(&[Some(far), Some(10), None, Some(12)]), vec![None, Some(far), Some(10), Some(10), None]);
        // The later of the two, whichever comes first.
        assert_eq!(t(&[Some(12), Some(10), Some(11)]), vec![12, 12, 12]);
        assert_eq!(t(&[Some(10), Some(10 + JUMP)]), vec![10, 10 + JUMP], "exactly an hour: no jump");
    }

    #[test]
    fn one_record_far_ahead_is_judged_at_its_own_time_and_moves_nothing() {
        let far = 10 + 2 * JUMP;
        assert_eq!(t(&[Some(9), Some(10), Some(far), Some(11)]), vec![9, 10, far, 11]);
        assert_eq!(clock_before(&[Some(9), Some(10), Some(far), Some(11)], 4), Some(11));
        assert_eq!(pending(&[Some(9), Some(10), Some(far)])[3], Some(far));
        assert_eq!(pending(&[Some(9), Some(10), Some(far), None])[4], Some(far));
        assert_eq!(pending(&[Some(9), Some(10), Some(far), Some(11)])[4], None);
    }

    #[test]
    fn two_records_stamped_alike_far_ahead_move_the_clock() {
        let far = 10 + 2 * JUMP;
        assert_eq!(t(&[Some(9), Some(10), Some(far), None, Some(far), Some(12)]), vec![9, 10, far, 10, far, far]);
        assert_eq!(clock_before(&[Some(9), Some(10), Some(far), None, Some(far)], 5), Some(far));
        assert_eq!(pending(&[Some(9), Some(10), Some(far), None, Some(far)])[5], None, "confirmed");
        // Exactly an hour ahead is no jump.
        assert_eq!(t(&[Some(9), Some(10), Some(10 + JUMP)]), vec![9, 10, 10 + JUMP]);
        // Two alike first: that is where the clock starts.
        assert_eq!(t(&[Some(far), Some(far), Some(12)]), vec![far, far, far]);
    }

    #[test]
    #[should_panic(expected = "ambiguous")]
    fn a_jump_confirmed_by_a_record_stamped_differently_is_refused() {
        record_times(&[Some(9), Some(10), Some(10 + 2 * JUMP), Some(10 + 2 * JUMP + 5)]);
    }

    #[test]
    fn a_record_stamped_past_2106_is_read_as_one_without_a_timestamp() {
        let past = u64::from(u32::MAX) + 1;
        assert_eq!((stamp(Some(past)), stamp(Some(u64::from(u32::MAX)))), (None, Some(u32::MAX)));
        let click = |id, ts| Record { ts: Some(ts), click: Some(ClickOf { id, ad: 0, minute: 0 }) };
        let junk = |ts| Record { ts: Some(ts), click: None };
        let log = [click(1, 100), click(2, 101), junk(past), junk(past + 86_400), click(1, 102), click(1, 200)];
        assert_eq!(counts_within_partition(&log, &|_| 10), vec![true, true, false, false, false, true]);
    }

    #[test]
    fn the_rule_follows_the_latest_sighting_and_is_inclusive() {
        let click = |id, ts| Record { ts: Some(ts), click: Some(ClickOf { id, ad: 0, minute: 0 }) };
        let log = [click(1, 0), click(1, 10), click(1, 20), click(1, 31), click(2, 31)];
        assert_eq!(counts_within_partition(&log, &|_| 10), vec![true, false, false, true, true]);
        // Judged at the clock: a producer clock behind does not reach back.
        let behind = [click(1, 0), Record { ts: Some(30), click: None }, click(1, 1)];
        assert_eq!(counts_within_partition(&behind, &|_| 10), vec![true, false, true]);
        // A sighting judged far ahead is not "before" a later one judged at the clock.
        let far = [click(1, 100), click(1, u64::from(100 + 2 * JUMP)), click(1, 105)];
        assert_eq!(counts_within_partition(&far, &|_| 10), vec![true, true, false]);
        let far_first = [click(1, 100), Record { ts: Some(u64::from(100 + 2 * JUMP)), click: None }, click(1, 200)];
        assert_eq!(counts_within_partition(&far_first, &|_| 10), vec![true, false, true]);
    }
}
