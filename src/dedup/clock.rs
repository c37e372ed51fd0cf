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
//! Everything here is a function of the records read (their timestamps, in offset
//! order): a reader that starts from a recorded [`PartitionClock`] (a checkpoint at a
//! batch boundary) computes the same record times as the reader that wrote it.

/// Seconds since the epoch, in record time.
pub type Secs = u32;

/// How far ahead of the clock a single record may move it without confirmation.
/// Kafka 4 brokers refuse records stamped more than an hour ahead of their own clock by
/// default (`log.message.timestamp.after.max.ms`), so on such a topic a jump this large
/// only follows a quiet stretch of the partition.
pub const CLOCK_JUMP: Secs = 3_600;

/// The clock of one partition after some prefix of its records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PartitionClock {
    /// The record time reached (`None`: no timestamped record yet).
    now: Option<Secs>,
    /// The timestamp of the last record if it jumped more than [`CLOCK_JUMP`] ahead of
    /// `now`, waiting for the next record to confirm it.
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
    /// a timestamp (or with one outside 1970..2106) leave the clock where it is.
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
            // The first record of the partition sets the clock.
            None => *self = PartitionClock::at(Some(t)),
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

    /// The record time reached (0 before any timestamped record).
    pub fn now(&self) -> Secs {
        self.now.unwrap_or(0)
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

/// Whole seconds of a Kafka timestamp, if it is one (librdkafka reports "none" as -1).
pub fn secs_of_millis(ms: i64) -> Option<Secs> {
    (ms >= 0).then(|| Secs::try_from(ms / 1000).unwrap_or(Secs::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticks(clock: &mut PartitionClock, ts: &[Option<i64>]) -> Vec<Secs> {
        ts.iter().map(|&t| clock.tick(t)).collect()
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
        let mut c = PartitionClock::at(Some(1_000_000));
        assert_eq!(c.tick(Some(year_2100)), 4_102_444_800, "judged at its own time");
        assert_eq!(c.get(), Some(1_000_000), "the clock did not move");
        assert_eq!(c.tick(Some(1_000_001_000)), 1_000_001, "ordinary traffic goes on from where it was");
        assert_eq!(c.pending(), None, "the jump was not confirmed and is forgotten");
    }

    #[test]
    fn traffic_resuming_after_a_quiet_stretch_moves_the_clock_from_its_second_record() {
        let mut c = PartitionClock::at(Some(1_000));
        let later = i64::from(1_000 + 2 * CLOCK_JUMP) * 1000;
        assert_eq!(c.tick(Some(later)), 1_000 + 2 * CLOCK_JUMP, "the first record after the gap: its own time");
        assert_eq!(c.get(), Some(1_000), "but the clock waits for a second record");
        assert_eq!(c.tick(Some(later + 2_000)), 1_000 + 2 * CLOCK_JUMP, "the second confirms the jump");
        assert_eq!(c.tick(Some(later + 3_000)), 1_003 + 2 * CLOCK_JUMP);
    }

    #[test]
    fn a_jump_within_the_limit_moves_the_clock_at_once() {
        let mut c = PartitionClock::at(Some(1_000));
        assert_eq!(c.tick(Some(i64::from(1_000 + CLOCK_JUMP) * 1000)), 1_000 + CLOCK_JUMP);
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
        let mut line = Timeline::new(PartitionClock::at(Some(1_000)));
        let jump = i64::from(1_000 + 2 * CLOCK_JUMP) * 1000;
        assert_eq!(line.read(7, Some(jump), Some(42)).confirms, None);
        assert_eq!(line.read(8, None, Some(43)).confirms, None, "no timestamp: confirms nothing");
        assert_eq!(line.read(9, Some(jump + 1_000), None).confirms, Some((7, 42)));
        // A jump that the next record does not confirm names nothing.
        let far = 4_102_444_800_000;
        let mut line = Timeline::new(PartitionClock::at(Some(1_000)));
        line.read(1, Some(far), Some(42));
        assert_eq!(line.read(2, Some(1_001_000), Some(43)).confirms, None);
    }
}
