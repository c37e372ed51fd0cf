//! The member's status board: what `/status.json` (and the page at `/`) shows.
//!
//! Two sources. What `/metrics` already says — counters, the freshness histogram,
//! librdkafka's lag, the record lag — is read from the same registry (see `window`),
//! so the page never disagrees with Prometheus. What no metric says is recorded here
//! by a few hooks at the points where it changes:
//!
//! | hook | called by | when |
//! |---|---|---|
//! | [`reading`](StatusBoard::reading) | `Stages::assign`, `Stages::fall_back` | a reader starts a partition |
//! | [`revoked`](StatusBoard::revoked) | `Stages::revoke` | partitions stop being ours |
//! | [`read_up_to`](StatusBoard::read_up_to) | `Stages::prepare` | a poll batch is taken in |
//! | [`flushed`](StatusBoard::flushed), [`committed`](StatusBoard::committed) | the flusher | a flush is durable, its offsets committed |
//!
//! Each hook takes a short lock on a small map; none does I/O.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use serde::Serialize;

use super::window::{History, Reading, FRESHNESS_WINDOW_SECONDS, RATE_WINDOW_SECONDS};
use crate::click::Minute;
use crate::position::BatchOffsets;
use crate::position::{Scope, Start};
use crate::telemetry::ClicksByTenth;

/// Minutes of clicks kept for the sparkline.
const MINUTES: u32 = 60;

/// Who this member is.
#[derive(Debug, Clone, Serialize)]
pub struct Identity {
    /// Its Kafka `client.id`, as the group's description lists it (`clickagg status`).
    pub client_id: String,
    pub group: String,
    pub topic: String,
    pub version: &'static str,
    pub started_at: String,
    /// To tell which batch a partition is filling.
    #[serde(skip)]
    pub batch_offsets: BatchOffsets,
}

impl Identity {
    /// This process, started now, as the member `client_id` of `group` reading `topic`
    /// in batches of `batch_offsets`.
    pub fn new(client_id: String, group: String, topic: String, batch_offsets: BatchOffsets) -> Identity {
        Identity {
            client_id,
            group,
            topic,
            version: env!("CARGO_PKG_VERSION"),
            started_at: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            batch_offsets,
        }
    }
}

/// One assigned partition, as far as the hooks know it.
#[derive(Debug, Clone, Copy)]
struct Partition {
    start: Start,
    /// The last offset taken in by the current reader; `None` before its first record.
    last_read: Option<i64>,
    /// The last offset this member committed.
    committed: Option<i64>,
    /// Unix time (s) of the last durable flush that covered the partition.
    last_flush_at: Option<f64>,
}

impl Partition {
    /// The next offset the reader takes in.
    fn next(&self) -> i64 {
        self.last_read.map_or(self.start.read_from, |o| o + 1)
    }

    /// Before the first counted offset the reader only rebuilds dedup state.
    fn scope(&self) -> &'static str {
        match self.start.scope {
            _ if self.next() < self.start.count_from => "warming up",
            Scope::Shared { .. } => "shared",
            Scope::Private { .. } => "private",
        }
    }

    /// The start of the offset-aligned batch the reader is filling (its next record's):
    /// a flush may already have written part of it, and a replay from here rebuilds it.
    fn open_batch_start(&self, n: Option<BatchOffsets>) -> i64 {
        match n {
            Some(n) => n.start_of(self.next()).max(self.start.count_from),
            None => self.start.count_from,
        }
    }
}

/// The state behind `/status.json`; one per member, inside its `Health`.
#[derive(Debug, Default)]
pub struct StatusBoard {
    identity: OnceLock<Identity>,
    partitions: Mutex<BTreeMap<i32, Partition>>,
    /// Clicks made durable, by the minute (s) of their Kafka record timestamp.
    minutes: Mutex<BTreeMap<u32, u64>>,
    history: Mutex<History>,
}

impl StatusBoard {
    /// Names the member; set once when `run` starts.
    pub fn set_identity(&self, identity: Identity) {
        let _ = self.identity.set(identity);
    }

    /// A reader starts `start.partition` (assigned, or fallen back to private state):
    /// what it read so far is forgotten, what it committed and flushed is kept.
    pub fn reading(&self, start: &Start) {
        let mut parts = self.partitions.lock().expect("not poisoned");
        let p = parts.entry(start.partition).or_insert(Partition {
            start: *start,
            last_read: None,
            committed: None,
            last_flush_at: None,
        });
        p.start = *start;
        p.last_read = None;
    }

    pub fn revoked(&self, partitions: &[i32]) {
        let mut parts = self.partitions.lock().expect("not poisoned");
        for p in partitions {
            parts.remove(p);
        }
    }

    /// The last offset each reader took in (offsets before a reader's start are the
    /// previous reader's and are ignored).
    pub fn read_up_to(&self, positions: impl IntoIterator<Item = (i32, i64)>) {
        let mut parts = self.partitions.lock().expect("not poisoned");
        for (partition, last) in positions {
            if let Some(p) = parts.get_mut(&partition).filter(|p| last >= p.start.read_from) {
                p.last_read = Some(last);
            }
        }
    }

    /// A flush covering `partitions` is durable at `at` (Unix s); `clicks` are the
    /// clicks it counted by record time (s).
    pub fn flushed(&self, partitions: impl IntoIterator<Item = i32>, clicks: &ClicksByTenth, at: f64) {
        {
            let mut parts = self.partitions.lock().expect("not poisoned");
            for partition in partitions {
                if let Some(p) = parts.get_mut(&partition) {
                    p.last_flush_at = Some(at);
                }
            }
        }
        let mut minutes = self.minutes.lock().expect("not poisoned");
        for (&tenth, &n) in clicks {
            let secs = u32::try_from(tenth / 10).unwrap_or(u32::MAX);
            *minutes.entry(secs - secs % 60).or_default() += n;
        }
        // Only the last hour is shown; a producer clock far ahead must not grow the map.
        let now = at as u32;
        minutes.retain(|&m, _| m.saturating_add(MINUTES * 60) > now && m <= now.saturating_add(600));
    }

    pub fn committed(&self, commits: &BTreeMap<i32, i64>) {
        let mut parts = self.partitions.lock().expect("not poisoned");
        for (partition, &offset) in commits {
            if let Some(p) = parts.get_mut(partition) {
                p.committed = Some(offset);
            }
        }
    }

    /// Records the counters of `metrics` (the `/metrics` text) at `at`, for rates.
    pub fn sample(&self, metrics: &str, at: f64) {
        let counters = Reading::parse(metrics).counters;
        self.history.lock().expect("not poisoned").push(at, counters);
    }

    /// Everything `/status.json` shows at `now`, with `metrics` rendered just before.
    pub fn snapshot(&self, readiness: Result<(), Vec<&'static str>>, metrics: &str, now: f64) -> Snapshot {
        let reading = Reading::parse(metrics);
        let identity = self.identity.get().cloned();
        let n = identity.as_ref().map(|i| i.batch_offsets);
        let partitions: Vec<PartitionRow> = self
            .partitions
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|(&partition, p)| PartitionRow {
                partition,
                committed_offset: p.committed,
                lag: reading.lag.get(&partition).map(|&l| l as i64),
                open_batch_start: p.open_batch_start(n),
                last_read_offset: p.last_read,
                last_flush_age_seconds: p.last_flush_at.map(|at| (now - at).max(0.0)),
                last_flush_at: p.last_flush_at,
                record_lag_seconds: reading.record_lag.get(&partition).copied(),
                scope: p.scope(),
            })
            .collect();
        let history = self.history.lock().expect("not poisoned");
        let current = &reading.counters;
        let rates = history.rates(now, current);
        let (p50, p99) =
            (history.freshness_quantile(0.5, now, current), history.freshness_quantile(0.99, now, current));
        let freshness = Freshness {
            p50_seconds: p50.map(|q| q.value),
            p50_more_than: p50.is_some_and(|q| q.more_than),
            p99_seconds: p99.map(|q| q.value),
            p99_more_than: p99.is_some_and(|q| q.more_than),
            window_seconds: FRESHNESS_WINDOW_SECONDS,
        };
        drop(history);
        // Minutes that started within the last hour, up to the current one.
        let now_s = now as u32;
        let clicks_per_minute = self
            .minutes
            .lock()
            .expect("not poisoned")
            .range(now_s.saturating_sub(MINUTES * 60 - 1)..=now_s)
            .map(|(&m, &clicks)| MinuteClicks { minute: Minute::from_epoch_seconds(m).to_rfc3339(), clicks })
            .collect();
        let (ready, not_ready_reasons) = match readiness {
            Ok(()) => (true, Vec::new()),
            Err(reasons) => (false, reasons),
        };
        Snapshot {
            member: identity,
            ready,
            not_ready_reasons,
            assigned_partitions: partitions.len(),
            partitions,
            rates: Rates {
                window_seconds: RATE_WINDOW_SECONDS,
                records_per_second: rates.as_ref().map(|r| r.records),
                counted_per_second: rates.as_ref().map(|r| r.counted),
                duplicates_per_second: rates.as_ref().map(|r| r.duplicates),
                dead_letters_per_second: rates.map(|r| r.dead_letters),
            },
            totals: Totals {
                records: current.records as u64,
                counted: current.counted as u64,
                duplicates: current.duplicates as u64,
                dead_letters: current.dead_letters.iter().map(|(k, &v)| (k.clone(), v as u64)).collect(),
            },
            freshness,
            clicks_per_minute,
        }
    }
}

/// `/status.json`. `assets/status.html` documents the schema and renders it.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub member: Option<Identity>,
    pub ready: bool,
    pub not_ready_reasons: Vec<&'static str>,
    /// Partitions this member owns; 0 for a standby (more members than partitions),
    /// which is ready all the same.
    pub assigned_partitions: usize,
    pub partitions: Vec<PartitionRow>,
    pub rates: Rates,
    pub totals: Totals,
    pub freshness: Freshness,
    pub clicks_per_minute: Vec<MinuteClicks>,
}

#[derive(Debug, Serialize)]
pub struct PartitionRow {
    pub partition: i32,
    pub committed_offset: Option<i64>,
    pub lag: Option<i64>,
    pub open_batch_start: i64,
    pub last_read_offset: Option<i64>,
    pub last_flush_age_seconds: Option<f64>,
    pub last_flush_at: Option<f64>,
    pub record_lag_seconds: Option<f64>,
    pub scope: &'static str,
}

/// Per second over the last `window_seconds`; `null` until the first sample.
#[derive(Debug, Serialize)]
pub struct Rates {
    pub window_seconds: f64,
    pub records_per_second: Option<f64>,
    pub counted_per_second: Option<f64>,
    pub duplicates_per_second: Option<f64>,
    pub dead_letters_per_second: Option<BTreeMap<String, f64>>,
}

/// Since the member started: the counters of `/metrics`.
#[derive(Debug, Serialize)]
pub struct Totals {
    pub records: u64,
    pub counted: u64,
    pub duplicates: u64,
    pub dead_letters: BTreeMap<String, u64>,
}

/// Of the clicks made durable over the last `window_seconds`; `null` when none were.
/// `…_more_than`: the quantile lies beyond the histogram's top bucket (5 minutes), so
/// it is more than `…_seconds` (that bucket's bound), not equal to it.
#[derive(Debug, Serialize)]
pub struct Freshness {
    pub p50_seconds: Option<f64>,
    pub p50_more_than: bool,
    pub p99_seconds: Option<f64>,
    pub p99_more_than: bool,
    pub window_seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct MinuteClicks {
    pub minute: String,
    pub clicks: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(partition: i32, read_from: i64, count_from: i64, scope: Scope) -> Start {
        Start { partition, read_from, count_from, clock: Default::default(), scope, commit_floor: count_from }
    }

    fn board() -> StatusBoard {
        let b = StatusBoard::default();
        let s = crate::config::Settings::default();
        let n = BatchOffsets::new(1000).unwrap();
        b.set_identity(Identity::new("clickagg-test".into(), s.kafka.group.clone(), s.kafka.topic.clone(), n));
        b
    }

    fn rows(b: &StatusBoard) -> Vec<PartitionRow> {
        b.snapshot(Ok(()), "", 1_000.0).partitions
    }

    #[test]
    fn a_partition_reads_its_warm_up_then_fills_batches_from_its_boundary() {
        let b = board();
        b.reading(&start(3, 400, 2000, Scope::Shared { reread_until: None }));
        let r = &rows(&b)[0];
        assert_eq!((r.partition, r.scope, r.open_batch_start, r.last_read_offset), (3, "warming up", 2000, None));
        b.read_up_to([(3, 1998)]);
        assert_eq!(rows(&b)[0].scope, "warming up");
        b.read_up_to([(3, 1999)]);
        assert_eq!((rows(&b)[0].scope, rows(&b)[0].open_batch_start), ("shared", 2000));
        b.read_up_to([(3, 3456)]);
        assert_eq!((rows(&b)[0].open_batch_start, rows(&b)[0].last_read_offset), (3000, Some(3456)));
        // The batch's last offset read: the next one opens the next batch.
        b.read_up_to([(3, 3999)]);
        assert_eq!(rows(&b)[0].open_batch_start, 4000);
    }

    #[test]
    fn a_partition_falling_back_keeps_its_commit_and_a_revoked_one_leaves() {
        let b = board();
        b.reading(&start(0, 0, 0, Scope::Shared { reread_until: None }));
        b.reading(&start(1, 0, 0, Scope::Shared { reread_until: None }));
        b.read_up_to([(0, 1500), (1, 10), (7, 99)]);
        b.flushed([0, 7], &BTreeMap::new(), 990.0);
        b.committed(&BTreeMap::from([(0, 1000), (7, 5)]));
        b.reading(&start(0, 200, 1000, Scope::Private { resume: None }));
        let r = &rows(&b)[0];
        assert_eq!(
            (r.committed_offset, r.last_flush_age_seconds, r.last_flush_at),
            (Some(1000), Some(10.0), Some(990.0))
        );
        assert_eq!((r.scope, r.last_read_offset), ("warming up", None), "the new reader re-reads its lookback");
        // Offsets of the replaced reader (fetched before the seek) are not its own.
        b.read_up_to([(0, 150)]);
        assert_eq!(rows(&b)[0].last_read_offset, None);
        b.revoked(&[0]);
        assert_eq!(rows(&b).iter().map(|r| r.partition).collect::<Vec<_>>(), [1], "7 was never ours");
    }

    #[test]
    fn clicks_per_minute_cover_the_last_hour_by_record_time() {
        let b = board();
        let now = 100 * 3600;
        let tenths = |s: u32| u64::from(s) * 10 + 9; // late in its second: still that second
        let clicks = BTreeMap::from([
            (tenths(now - 3600), 7),
            (tenths(now - 3540), 2),
            (tenths(now - 61), 3),
            (tenths(now - 59), 4),
            (tenths(now - 1), 5),
        ]);
        b.flushed([], &clicks, f64::from(now));
        let s = b.snapshot(Ok(()), "", f64::from(now));
        let got: Vec<(String, u64)> = s.clicks_per_minute.into_iter().map(|m| (m.minute, m.clicks)).collect();
        let minute = |s: u32| Minute::from_epoch_seconds(s).to_rfc3339();
        assert_eq!(got, [(minute(now - 3540), 2), (minute(now - 120), 3), (minute(now - 60), 9)]);
    }

    #[test]
    fn the_snapshot_shows_readiness_with_its_reasons_and_gauges_of_our_partitions_only() {
        let b = board();
        b.reading(&start(2, 0, 0, Scope::Shared { reread_until: None }));
        let metrics = "clickagg_consumer_lag{partition=\"2\"} 17\nclickagg_consumer_lag{partition=\"5\"} 9\n\
                       clickagg_record_lag_seconds{partition=\"2\"} 0.5\n";
        let s = b.snapshot(Err(vec!["redis unreachable"]), metrics, 1_000.0);
        assert!(!s.ready);
        assert_eq!(s.not_ready_reasons, ["redis unreachable"]);
        assert_eq!(s.partitions.len(), 1, "partition 5's gauge is a stale copy from before a rebalance");
        assert_eq!((s.partitions[0].lag, s.partitions[0].record_lag_seconds), (Some(17), Some(0.5)));
        assert_eq!(s.rates.records_per_second, None, "no sample yet");
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["member"]["group"], "clickagg");
        assert_eq!(json["partitions"][0]["scope"], "shared");
    }
}
