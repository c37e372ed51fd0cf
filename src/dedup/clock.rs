//! A partition's record clock: the time every dedup decision in the partition is made
//! at (guide, "What counts", record time).
//!
//! The clock is the highest Kafka record timestamp among the records read so far, with
//! one exception that keeps a single absurd timestamp from moving it for good: a record
//! stamped more than [`CLOCK_JUMP`] ahead of the clock moves it only once the next
//! timestamped record of the partition confirms the jump (is stamped within
//! `CLOCK_JUMP` of it). Until then the clock stays where it was; the record itself is
//! judged at its own timestamp. So one junk record stamped in the year 2100 changes no
//! other record's time, while traffic that resumes after a quiet hour moves the clock
//! from its second record on — and a click and its retry sent right after the quiet
//! hour are judged at the same time. Two consecutive records stamped alike far ahead do
//! move the clock: that is what a producer whose clock really jumped looks like.
//!
//! A partition's first timestamped record is no exception to the exception: with no
//! clock to be ahead of, it cannot tell junk from traffic either, so it starts the clock
//! only once the next timestamped record is stamped within `CLOCK_JUMP` of it — at the
//! later of the two, the time ordinary traffic always had. Until then there is no clock
//! (record time 0 for records without a timestamp) and each record is judged at its own
//! timestamp, ahead of no clock. So a junk first record changes no other record's time
//! either (issue 35).
//!
//! Everything here is a function of the records read (their timestamps, in offset
//! order): a reader that starts from a recorded [`PartitionClock`] (a checkpoint at a
//! batch boundary) computes the same record times as the reader that wrote it.

/// Whole seconds in record time: a time since the epoch (a clock, a sighting's record
/// time), or a span of them (the window `W`, [`CLOCK_JUMP`]). Every dedup decision
/// compares in it; 0 is "no clock yet", [`Secs::MAX`] is 2106-02-07T06:28:15Z.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Secs(u32);

impl Secs {
    pub const ZERO: Secs = Secs(0);
    pub const MAX: Secs = Secs(u32::MAX);

    pub const fn new(secs: u32) -> Secs {
        Secs(secs)
    }

    pub const fn get(self) -> u32 {
        self.0
    }

    /// `secs`, or [`Secs::MAX`] past it.
    pub fn saturating_from(secs: u64) -> Secs {
        Secs(u32::try_from(secs).unwrap_or(u32::MAX))
    }

    pub fn saturating_add(self, span: Secs) -> Secs {
        Secs(self.0.saturating_add(span.0))
    }

    pub fn saturating_sub(self, span: Secs) -> Secs {
        Secs(self.0.saturating_sub(span.0))
    }

    /// How far apart two times are.
    pub fn abs_diff(self, other: Secs) -> Secs {
        Secs(self.0.abs_diff(other.0))
    }
}

/// A later time minus an earlier one (panics below zero in debug builds, like `u32`).
impl std::ops::Sub for Secs {
    type Output = Secs;

    fn sub(self, earlier: Secs) -> Secs {
        Secs(self.0 - earlier.0)
    }
}

impl From<Secs> for u64 {
    fn from(s: Secs) -> u64 {
        u64::from(s.0)
    }
}

impl From<Secs> for i64 {
    fn from(s: Secs) -> i64 {
        i64::from(s.0)
    }
}

/// Plain seconds, as the model's reports print a clock.
impl std::fmt::Display for Secs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// How far ahead of the clock a single record may move it without confirmation.
/// Kafka 4 brokers refuse records stamped more than an hour ahead of their own clock by
/// default (`log.message.timestamp.after.max.ms`), so on such a topic a jump this large
/// only follows a quiet stretch of the partition.
pub const CLOCK_JUMP: Secs = Secs(3_600);

/// The clock of one partition after some prefix of its records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PartitionClock {
    /// The record time reached (`None`: no timestamped record yet).
    now: Option<Secs>,
    /// The timestamp of the last record if it jumped more than [`CLOCK_JUMP`] ahead of
    /// `now` (or was read while there is no clock), waiting for the next record to
    /// confirm it.
    pending: Option<Secs>,
}

impl PartitionClock {
    /// A clock at `now` with nothing pending (`None`: nothing read before).
    pub const fn at(now: Option<Secs>) -> PartitionClock {
        PartitionClock { now, pending: None }
    }

    /// A clock as recorded (a checkpoint), pending jump included.
    pub const fn from_parts(now: Option<Secs>, pending: Option<Secs>) -> PartitionClock {
        PartitionClock { now, pending }
    }

    /// Advances past one record and returns its record time: the clock, or the record's
    /// own timestamp when it jumps too far ahead to move the clock alone. Records without
    /// a timestamp (or with one outside 1970..2106, [`secs_of_millis`]) leave the clock
    /// where it is, confirm no jump and are judged at the clock.
    pub fn tick(&mut self, record_ts_ms: Option<i64>) -> Secs {
        self.tick_confirming(record_ts_ms).0
    }

    /// [`tick`](Self::tick), and whether the record confirmed the jump the record before
    /// it made (the clock moved to it): that record's sighting is then remembered from
    /// the clock it moved to (guide, "What counts").
    pub fn tick_confirming(&mut self, record_ts_ms: Option<i64>) -> (Secs, bool) {
        let Some(t) = record_ts_ms.and_then(secs_of_millis) else { return (self.now(), false) };
        let mut confirmed = false;
        match self.now {
            // No clock yet: the first two consecutive timestamped records stamped within
            // an hour of each other start it, at the later of the two.
            None => match self.pending {
                Some(p) if t.abs_diff(p) <= CLOCK_JUMP => {
                    *self = PartitionClock::at(Some(t.max(p)));
                    confirmed = true;
                }
                _ => {
                    self.pending = Some(t);
                    return (t, false);
                }
            },
            Some(c) if t <= c.saturating_add(CLOCK_JUMP) => *self = PartitionClock::at(Some(c.max(t))),
            Some(c) => match self.pending {
                // The second of two records stamped alike far ahead: a real jump.
                Some(p) if t.abs_diff(p) <= CLOCK_JUMP => {
                    *self = PartitionClock::at(Some(c.max(t.min(p))));
                    confirmed = true;
                }
                _ => {
                    self.pending = Some(t);
                    return (t, false);
                }
            },
        }
        (self.now(), confirmed)
    }

    /// The record time reached (0 while there is no clock).
    pub fn now(&self) -> Secs {
        self.now.unwrap_or(Secs::ZERO)
    }

    pub fn get(&self) -> Option<Secs> {
        self.now
    }

    pub fn pending(&self) -> Option<Secs> {
        self.pending
    }
}

/// A partition's clock as a reader keeps it, with the click judged ahead of it whose
/// jump the next timestamped record may still confirm (offset, fingerprint): when that
/// record does, the click's sighting reaches from the clock it moved to (guide, "What
/// counts"), and the reader says so to its dedup state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timeline {
    pub clock: PartitionClock,
    unconfirmed: Option<(i64, u128)>,
}

/// One record on its partition's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    /// Its record time.
    pub time: Secs,
    /// The partition's clock just after it: below `time` when it is judged ahead.
    pub now: Secs,
    /// The click judged ahead whose jump this record confirmed (offset, fingerprint).
    pub confirms: Option<(i64, u128)>,
}

impl Timeline {
    /// From a clock, without a click waiting for confirmation (a reader starting at a
    /// recorded boundary that has no jump pending, or one that cannot matter: see
    /// `planner::marks`).
    pub fn new(clock: PartitionClock) -> Timeline {
        Timeline { clock, unconfirmed: None }
    }

    /// Advances past the record at `offset` (a click with fingerprint `click`, if valid).
    pub fn read(&mut self, offset: i64, record_ts_ms: Option<i64>, click: Option<u128>) -> Read {
        let (time, confirmed) = self.clock.tick_confirming(record_ts_ms);
        let now = self.clock.now();
        let mut confirms = None;
        if record_ts_ms.and_then(secs_of_millis).is_some() {
            // Only the timestamped record right after a jump can confirm it.
            let before = std::mem::replace(&mut self.unconfirmed, click.filter(|_| time > now).map(|fp| (offset, fp)));
            confirms = before.filter(|_| confirmed);
        }
        Read { time, now, confirms }
    }
}

/// A partition's clock just before a batch boundary, as a reader that crossed the
/// boundary found it (table `clickagg_clocks`): where later readers take it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub partition: i32,
    pub boundary: i64,
    pub clock: PartitionClock,
}

/// Whole seconds of a Kafka timestamp, if it is one the clock can hold: none for "none"
/// (librdkafka reports it as -1) or any other negative value, and none past the last
/// second [`Secs`] holds (2106-02-07T06:28:15Z). Clamping those to that second made any
/// two of them "stamped alike" and moved the clock there for good (issue 35); read as
/// records without a timestamp, they leave the clock where it is and are judged at it.
pub fn secs_of_millis(ms: i64) -> Option<Secs> {
    if ms < 0 {
        return None;
    }
    u32::try_from(ms / 1000).ok().map(Secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`CLOCK_JUMP`] in plain seconds, for the cases' arithmetic.
    const JUMP: u32 = CLOCK_JUMP.get();

    fn ticks(clock: &mut PartitionClock, ts: &[Option<i64>]) -> Vec<u32> {
        ts.iter().map(|&t| clock.tick(t).get()).collect()
    }

    fn at(secs: u32) -> PartitionClock {
        PartitionClock::at(Some(Secs::new(secs)))
    }

    fn secs(s: Option<Secs>) -> Option<u32> {
        s.map(Secs::get)
    }

    fn read(time: u32, now: u32, confirms: Option<(i64, u128)>) -> Read {
        Read { time: Secs::new(time), now: Secs::new(now), confirms }
    }

    #[test]
    fn a_record_without_a_timestamp_is_not_one_stamped_in_1970() {
        // librdkafka reports "no timestamp" as -1 ms: that is no time, not the epoch.
        assert_eq!(secs_of_millis(-1), None);
        assert_eq!(secs_of_millis(-1_000), None);
        assert_eq!(secs_of_millis(0), Some(Secs::ZERO), "the epoch itself is a time");
        assert_eq!(secs_of_millis(999), Some(Secs::ZERO));
        assert_eq!(secs_of_millis(1_000), Some(Secs::new(1)));
        assert_eq!(Secs::new(90).to_string(), "90", "printed as plain seconds");
    }

    #[test]
    fn the_clock_keeps_the_highest_timestamp_and_ignores_records_without_one() {
        let mut c = PartitionClock::default();
        let got = ticks(&mut c, &[Some(5_999), Some(3_000), None, Some(-1), Some(9_000)]);
        assert_eq!(got, vec![5, 5, 5, 5, 9], "a record stamped earlier does not move the clock back");
    }

    #[test]
    fn one_record_stamped_far_ahead_is_judged_at_the_clock_and_moves_nothing() {
        let year_2100 = 4_102_444_800_000;
        let mut c = at(1_000_000);
        assert_eq!(c.tick(Some(year_2100)).get(), 4_102_444_800, "judged at its own time");
        assert_eq!(secs(c.get()), Some(1_000_000), "the clock did not move");
        assert_eq!(c.tick(Some(1_000_001_000)).get(), 1_000_001, "ordinary traffic goes on from where it was");
        assert_eq!(secs(c.pending()), None, "the jump was not confirmed and is forgotten");
    }

    #[test]
    fn traffic_resuming_after_a_quiet_stretch_moves_the_clock_from_its_second_record() {
        let mut c = at(1_000);
        let later = i64::from(1_000 + 2 * JUMP) * 1000;
        assert_eq!(c.tick(Some(later)).get(), 1_000 + 2 * JUMP, "the first record after the gap: its own time");
        assert_eq!(secs(c.get()), Some(1_000), "but the clock waits for a second record");
        assert_eq!(c.tick(Some(later + 2_000)).get(), 1_000 + 2 * JUMP, "the second confirms the jump");
        assert_eq!(c.tick(Some(later + 3_000)).get(), 1_003 + 2 * JUMP);
    }

    #[test]
    fn a_jump_within_the_limit_moves_the_clock_at_once() {
        let mut c = at(1_000);
        assert_eq!(c.tick(Some(i64::from(1_000 + JUMP) * 1000)).get(), 1_000 + JUMP);
    }

    // Issue 35, defect 2: the first record of a partition set its clock, so a junk first
    // record stamped in 2100 put every later record of the partition at 2100.
    #[test]
    fn a_first_record_stamped_far_ahead_changes_no_other_records_time() {
        let year_2100 = 4_102_444_800_000;
        let mut c = PartitionClock::default();
        assert_eq!(c.tick(Some(year_2100)).get(), 4_102_444_800, "judged at its own time");
        assert_eq!(secs(c.get()), None, "it does not start the clock alone");
        assert_eq!(c.tick(Some(1_000_000_000)).get(), 1_000_000, "the next record: its own time, not 2100");
        assert_eq!(secs(c.get()), None, "still no clock: nothing confirmed the first record, nor this one yet");
        assert_eq!(c.tick(Some(1_000_001_000)).get(), 1_000_001, "the record after confirms it: the clock starts");
        assert_eq!((secs(c.get()), secs(c.pending())), (Some(1_000_001), None));
        assert_eq!(c.tick(Some(1_000_002_000)).get(), 1_000_002, "ordinary traffic goes on");
    }

    #[test]
    fn the_clock_starts_at_the_later_of_the_first_two_records_stamped_within_an_hour() {
        // The record times ordinary traffic always had: the first at its own time, the
        // second at the highest timestamp so far.
        for (first, second, times) in [(10, 9, [10, 10]), (9, 10, [9, 10]), (10, 10 + JUMP, [10, 10 + JUMP])] {
            let mut c = PartitionClock::default();
            let got = ticks(&mut c, &[Some(i64::from(first) * 1000), None, Some(i64::from(second) * 1000)]);
            assert_eq!(got, vec![times[0], 0, times[1]], "{first}, {second}");
            assert_eq!(secs(c.get()), Some(first.max(second)));
        }
        // More than an hour apart: the second waits for a third.
        let mut c = PartitionClock::default();
        assert_eq!(ticks(&mut c, &[Some(10_000), Some(i64::from(11 + JUMP) * 1000)]), vec![10, 11 + JUMP]);
        assert_eq!((secs(c.get()), secs(c.pending())), (None, Some(11 + JUMP)));
    }

    #[test]
    fn a_timeline_names_a_partitions_first_click_when_the_next_record_starts_the_clock() {
        let mut line = Timeline::default();
        let first = line.read(0, Some(5_000), Some(42));
        assert_eq!(first, read(5, 0, None), "judged ahead of no clock");
        assert_eq!(line.read(1, Some(7_000), Some(43)), read(7, 7, Some((0, 42))));
        // A junk first record that nothing confirms names nothing.
        let mut line = Timeline::default();
        line.read(0, Some(4_102_444_800_000), Some(42));
        assert_eq!(line.read(1, Some(5_000), Some(43)).confirms, None);
        assert_eq!(line.read(2, Some(6_000), None), read(6, 6, Some((1, 43))));
    }

    // Issue 35, defect 5: a timestamp past what `Secs` holds was clamped to its last
    // second, so any two such records were "stamped alike" and moved the clock there for
    // good.
    #[test]
    fn records_stamped_past_2106_leave_the_clock_where_it_is() {
        let last = i64::from(Secs::MAX) * 1000 + 999;
        assert_eq!(secs_of_millis(last), Some(Secs::MAX));
        for past in [last + 1, last + 1 + 365 * 86_400_000, i64::MAX] {
            assert_eq!(secs_of_millis(past), None, "{past} ms");
        }
        let mut c = at(1_000_000);
        let (y2200, y2300) = (7_258_118_400_000, 10_413_792_000_000);
        assert_eq!(ticks(&mut c, &[Some(y2200), Some(y2300)]), vec![1_000_000, 1_000_000], "judged at the clock");
        assert_eq!((secs(c.get()), secs(c.pending())), (Some(1_000_000), None), "nothing moved, nothing pending");
        assert_eq!(c.tick(Some(1_000_001_000)).get(), 1_000_001, "ordinary traffic goes on from where it was");
        // Between a jump and the record that confirms it, such a record is transparent:
        // it is not the next timestamped record.
        let jump = i64::from(1_000_001 + 2 * JUMP) * 1000;
        let mut line = Timeline::new(c);
        line.read(7, Some(jump), Some(42));
        assert_eq!(line.read(8, Some(y2200), Some(43)), read(1_000_001, 1_000_001, None));
        assert_eq!(line.read(9, Some(jump), None).confirms, Some((7, 42)));
    }

    #[test]
    fn a_recorded_clock_with_a_pending_jump_decides_like_the_one_that_recorded_it() {
        let ts = [Some(10_000), Some(9_000_000_000), None, Some(9_000_001_000), Some(11_000)];
        let mut whole = PartitionClock::default();
        let all = ticks(&mut whole, &ts);
        let mut head = PartitionClock::default();
        ticks(&mut head, &ts[..2]);
        let mut resumed = PartitionClock::from_parts(head.get(), head.pending());
        assert_eq!(ticks(&mut resumed, &ts[2..]), all[2..].to_vec());
    }

    #[test]
    fn a_timeline_names_the_click_whose_jump_the_next_stamped_record_confirms() {
        let mut line = Timeline::new(at(1_000));
        let jump = i64::from(1_000 + 2 * JUMP) * 1000;
        assert_eq!(line.read(7, Some(jump), Some(42)).confirms, None);
        assert_eq!(line.read(8, None, Some(43)).confirms, None, "no timestamp: confirms nothing");
        assert_eq!(line.read(9, Some(jump + 1_000), None).confirms, Some((7, 42)));
        // A jump that the next record does not confirm names nothing.
        let far = 4_102_444_800_000;
        let mut line = Timeline::new(at(1_000));
        line.read(1, Some(far), Some(42));
        assert_eq!(line.read(2, Some(1_001_000), Some(43)).confirms, None);
    }
}
