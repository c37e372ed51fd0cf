//! Whether the group kept making progress: the committed offsets of the group and the
//! log end offsets, sampled every second, and the longest time a partition had work
//! waiting and its committed offset did not pass the furthest it had reached.
//!
//! The group commits batch boundaries only (the start of its oldest open batch), so a
//! partition whose log ends inside the batch after its committed offset has nothing to
//! commit yet; it has work waiting once a whole batch lies past the furthest commit.
//! Progress is a commit past the furthest one before: a commit that moves back (a
//! zombie's, a re-read's) and forward again to where it was is not progress, and does
//! not end a stall.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};

/// The longest stall seen on one partition.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stall {
    pub partition: i32,
    /// Seconds from the start of the run.
    pub from_s: f64,
    pub length_s: f64,
    /// The committed offset it stood at, and the log end when the stall was last seen.
    pub committed: i64,
    pub log_end: i64,
}

#[derive(Debug, Clone, Copy)]
struct Partition {
    /// The furthest committed offset seen.
    furthest: i64,
    /// The committed offset of the last sample.
    last: i64,
    /// Since when work has waited without a commit past `furthest`.
    waiting_since: Option<f64>,
}

/// Folds samples into the longest stall. Pure: times are passed in.
#[derive(Debug, Clone)]
pub struct Stalls {
    batch_offsets: i64,
    partitions: BTreeMap<i32, Partition>,
    pub longest: Stall,
    /// Samples whose committed offset was below the one before (a zombie's commit, a
    /// reset): worth knowing, never progress.
    pub commits_back: u64,
}

impl Stalls {
    pub fn new(batch_offsets: u64) -> Stalls {
        Stalls {
            batch_offsets: batch_offsets as i64,
            partitions: BTreeMap::new(),
            longest: Stall::default(),
            commits_back: 0,
        }
    }

    /// One sample of a partition at `t_s` seconds: its committed offset (`None`: the
    /// group has committed none, so it stands at the log start) and its log end.
    pub fn observe(&mut self, t_s: f64, partition: i32, committed: Option<i64>, log_end: i64) {
        let committed = committed.unwrap_or(0);
        let state = self.partitions.entry(partition).or_insert(Partition {
            furthest: committed,
            last: committed,
            waiting_since: None,
        });
        if committed < state.last {
            self.commits_back += 1;
        }
        state.last = committed;
        // A stall lasts at least until this sample, moved or not: the move happened
        // since the last one (the resolution is the sampling interval).
        if let Some(since) = state.waiting_since {
            if t_s - since > self.longest.length_s {
                self.longest =
                    Stall { partition, from_s: since, length_s: t_s - since, committed: state.furthest, log_end };
            }
        }
        let advanced = committed > state.furthest;
        state.furthest = state.furthest.max(committed);
        let waiting = log_end - state.furthest >= self.batch_offsets;
        if advanced {
            state.waiting_since = waiting.then_some(t_s);
        } else if waiting {
            state.waiting_since.get_or_insert(t_s);
        } else {
            state.waiting_since = None;
        }
    }
}

/// Samples the group every second on a thread of its own (the broker calls block)
/// until stopped; a sample the broker cannot answer (it is restarting) is skipped, and
/// the stall it hides is measured by the next one.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    stalls: Arc<Mutex<Stalls>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub fn start(consumer: BaseConsumer, topic: String, partitions: Vec<i32>, stalls: Stalls, t0: Instant) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stalls = Arc::new(Mutex::new(stalls));
        let thread = {
            let (stop, stalls) = (stop.clone(), stalls.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    if let Some(sample) = sample(&consumer, &topic, &partitions) {
                        let t = t0.elapsed().as_secs_f64();
                        let mut stalls = stalls.lock().expect("not poisoned");
                        for (p, (committed, end)) in sample {
                            stalls.observe(t, p, committed, end);
                        }
                    }
                    std::thread::sleep(Duration::from_secs(1).saturating_sub(started.elapsed()));
                }
            })
        };
        Sampler { stop, stalls, thread: Some(thread) }
    }

    /// The longest stall, and how many samples saw a commit move back.
    pub fn stop(mut self) -> (Stall, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let stalls = self.stalls.lock().expect("not poisoned");
        (stalls.longest, stalls.commits_back)
    }
}

/// Per partition: the committed offset of the group (`None`: none yet) and the log end.
fn sample(c: &BaseConsumer, topic: &str, partitions: &[i32]) -> Option<BTreeMap<i32, (Option<i64>, i64)>> {
    let timeout = Duration::from_secs(2);
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        tpl.add_partition(topic, p);
    }
    let committed = c.committed_offsets(tpl, timeout).ok()?;
    let mut out = BTreeMap::new();
    for e in committed.elements() {
        let (_, high) = c.fetch_watermarks(topic, e.partition(), timeout).ok()?;
        let offset = match e.offset() {
            Offset::Offset(o) if o >= 0 => Some(o),
            _ => None,
        };
        out.insert(e.partition(), (offset, high));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_with_less_than_a_batch_past_its_commit_is_never_stalled() {
        let mut s = Stalls::new(100);
        for t in 0..600 {
            s.observe(t as f64, 0, Some(1_000), 1_099);
        }
        assert_eq!(s.longest.length_s, 0.0);
    }

    #[test]
    fn a_stall_runs_from_the_first_sample_with_a_whole_batch_waiting_until_the_commit_moves() {
        let mut s = Stalls::new(100);
        s.observe(0.0, 3, Some(1_000), 1_050);
        s.observe(1.0, 3, Some(1_000), 1_100); // a whole batch waits from here
        s.observe(2.0, 3, Some(1_000), 1_400);
        s.observe(41.0, 3, Some(1_000), 5_000);
        s.observe(42.0, 3, Some(1_300), 5_100); // moved
        s.observe(43.0, 3, Some(1_400), 5_200);
        assert_eq!(
            s.longest,
            Stall { partition: 3, from_s: 1.0, length_s: 42.0 - 1.0, committed: 1_000, log_end: 5_100 }
        );
    }

    #[test]
    fn no_commit_yet_counts_from_the_log_start() {
        let mut s = Stalls::new(100);
        s.observe(0.0, 0, None, 500);
        s.observe(9.0, 0, None, 900);
        assert_eq!(s.longest.length_s, 9.0);
        assert_eq!(s.longest.committed, 0);
    }

    #[test]
    fn a_commit_that_moves_back_and_forward_again_is_not_progress() {
        let mut s = Stalls::new(100);
        s.observe(0.0, 1, Some(5_000), 9_000);
        s.observe(10.0, 1, Some(4_000), 9_000); // a zombie commits an old offset
        s.observe(20.0, 1, Some(5_000), 9_000); // back where it was: nothing new committed
        s.observe(30.0, 1, Some(5_000), 9_000);
        assert_eq!(s.longest, Stall { partition: 1, from_s: 0.0, length_s: 30.0, committed: 5_000, log_end: 9_000 });
        assert_eq!(s.commits_back, 1);
        s.observe(31.0, 1, Some(5_100), 9_000); // past the furthest: progress
        s.observe(32.0, 1, Some(5_100), 9_000);
        assert_eq!(s.longest.length_s, 31.0);
    }

    #[test]
    fn the_longest_stall_of_any_partition_wins() {
        let mut s = Stalls::new(10);
        s.observe(0.0, 0, Some(0), 100);
        s.observe(0.0, 1, Some(0), 100);
        s.observe(5.0, 0, Some(50), 100);
        s.observe(20.0, 1, Some(50), 100);
        assert_eq!((s.longest.partition, s.longest.length_s), (1, 20.0));
    }
}
