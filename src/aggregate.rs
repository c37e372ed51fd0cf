//! The aggregator: per-partition, offset-aligned batches of per-ad per-minute counts.
//!
//! Pure and synchronous — no I/O, no clocks. The pipeline tells it which offsets were
//! read and which of them were counted clicks; it hands back [`Flush`]es: the rows to
//! write and the offsets that become safe to commit once those rows are durable.
//!
//! Why the rows are idempotent (see docs/DESIGN.md §3): a batch is the offset range
//! `[start, start + N)` of one partition, `start = offset - offset % N`. Within a batch,
//! the cumulative count of a bucket at offset `o` is a function of the log alone, and
//! never decreases as `o` grows. A row carries `(clicks, version = o)`, so any retried,
//! replayed or zombie write of the same batch either repeats a row or loses to a row
//! with a higher version in `ReplacingMergeTree(version)`. Hours and days are not
//! written here: the sealer (`seal`) compacts settled minute rows into them.

use std::collections::{BTreeMap, HashMap};

use crate::click::Minute;
use crate::dedup::Pin;
use crate::position::BatchOffsets;

/// One billing bucket: an ad in an event-time minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey {
    pub ad_id: u64,
    pub minute: Minute,
}

/// One row for `ad_clicks_minute` (the topic is added by the sink).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRow {
    /// The ad and the minute.
    pub key: BucketKey,
    pub partition: i32,
    pub batch_start: i64,
    /// Clicks of this bucket counted in this batch from `batch_start` up to `version`.
    pub clicks: u64,
    /// The last offset of the batch read when this row was cut.
    pub version: i64,
}

/// A cross-partition decision to record with the rows it shaped (`clickagg_pins`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinRow {
    pub partition: i32,
    pub offset: i64,
    pub pin: Pin,
}

/// What one flush writes, and what it allows to commit once it is durable.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Flush {
    /// Written before the rows: a re-read must find the decision the rows rest on.
    pub pins: Vec<PinRow>,
    pub rows: Vec<BatchRow>,
    /// Per partition, the offset to commit (librdkafka convention: the next offset to
    /// read). Always a batch boundary, and never past a click outside this flush or an
    /// earlier, durable one.
    pub commits: BTreeMap<i32, i64>,
}

impl Flush {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.pins.is_empty() && self.commits.is_empty()
    }

    /// Combines two cuts into one flush: once all rows are durable, every commit holds
    /// (the later cut's commits win for the partitions they name).
    pub fn merge(&mut self, later: Flush) {
        self.pins.extend(later.pins);
        self.rows.extend(later.rows);
        self.commits.extend(later.commits);
    }
}

#[derive(Debug)]
struct Batch {
    start: i64,
    /// Last offset read (counted or not); the version of rows cut now.
    last_offset: i64,
    /// Cumulative clicks per minute bucket in this batch, and whether the bucket
    /// changed since the last flush (only changed buckets are written: fewer rows per
    /// click).
    buckets: HashMap<BucketKey, Bucket>,
    /// Pins of this batch not flushed yet.
    pins: Vec<(i64, Pin)>,
}

impl Batch {
    fn minute_buckets(&self) -> usize {
        self.buckets.len()
    }

    fn new(start: i64, offset: i64) -> Batch {
        Batch { start, last_offset: offset, buckets: HashMap::new(), pins: Vec::new() }
    }

    fn cut_rows(&mut self, partition: i32, flush: &mut Flush) {
        flush.pins.extend(self.pins.drain(..).map(|(offset, pin)| PinRow { partition, offset, pin }));
        for (&key, b) in self.buckets.iter_mut() {
            if std::mem::take(&mut b.dirty) || b.contested {
                flush.rows.push(BatchRow {
                    key,
                    partition,
                    batch_start: self.start,
                    clicks: b.clicks,
                    version: self.last_offset,
                });
            }
        }
    }
}

#[derive(Debug, Default)]
struct Bucket {
    clicks: u64,
    dirty: bool,
    /// A cross-partition duplicate fell in this bucket: a replay that read it before any
    /// member did may have counted it, so every flush of this batch writes the bucket at
    /// its latest version (and the member's row outranks the replay's, see `sink`).
    contested: bool,
}

#[derive(Debug, Default)]
struct PartitionState {
    /// The batch being read. `None` before the first record and right after a batch's
    /// last offset was read.
    open: Option<Batch>,
    /// Batches that can receive no more offsets but whose final rows are not cut yet.
    complete: Vec<Batch>,
    /// The boundary where the next batch starts once `open` is `None`.
    next_start: Option<i64>,
    /// The last offset read.
    last_offset: i64,
}

/// Per-partition batches of counts; see the module docs.
#[derive(Debug)]
pub struct Aggregator {
    n: BatchOffsets,
    partitions: HashMap<i32, PartitionState>,
    /// Minute buckets held across all batches; what `pipeline.max_unflushed_buckets`
    /// bounds.
    buckets_held: usize,
}

impl Aggregator {
    pub fn new(n: BatchOffsets) -> Aggregator {
        Aggregator { n, partitions: HashMap::new(), buckets_held: 0 }
    }

    pub fn batch_offsets(&self) -> BatchOffsets {
        self.n
    }

    /// Records that `offset` of `partition` was read; `counted` is the bucket it adds a
    /// click to, or `None` for a duplicate or a rejected record, and `pin` a
    /// cross-partition decision to record with the batch, with the click's bucket.
    /// Offsets of a partition must arrive in increasing order (gaps are fine:
    /// transaction markers).
    ///
    /// A cross-partition duplicate marks its bucket changed although it adds nothing, and
    /// contested for the rest of its batch: a replay that ran before the live decision
    /// may have counted it there, and only rows of the live member's at a version at
    /// least as high (they outrank the replay's, see `sink`) take that count back.
    pub fn observe(&mut self, partition: i32, offset: i64, counted: Option<BucketKey>, pin: Option<(Pin, BucketKey)>) {
        let n = self.n;
        let state = self.partitions.entry(partition).or_default();
        let start = n.start_of(offset);

        if let Some(open) = &state.open {
            debug_assert!(offset > open.last_offset, "offsets must increase within a partition");
            if start != open.start {
                // An offset beyond the open batch: that batch will get nothing more.
                state.complete.push(state.open.take().expect("checked above"));
            }
        }
        let batch = state.open.get_or_insert_with(|| Batch::new(start, offset));
        batch.last_offset = offset;
        // Only a cross-partition duplicate takes back what a replay may have counted; a
        // duplicate in a chain that did not count is a duplicate on every reading.
        let contested = matches!(pin, Some((Pin::CrossDuplicate, _)));
        let touched = counted.or(pin.filter(|_| contested).map(|(_, key)| key));
        if let Some(key) = touched {
            let bucket = batch.buckets.entry(key).or_insert_with(|| {
                self.buckets_held += 1;
                Bucket::default()
            });
            bucket.clicks += u64::from(counted.is_some());
            bucket.dirty = true;
            bucket.contested |= contested;
        }
        if let Some((pin, _)) = pin {
            batch.pins.push((offset, pin));
        }
        if offset == start + n.get() as i64 - 1 {
            // The batch's last offset: it is complete without waiting for the next record.
            state.complete.push(state.open.take().expect("just inserted"));
        }
        state.next_start = Some(start + n.get() as i64);
        state.last_offset = offset;
    }

    /// Cuts the rows of every bucket changed since the last flush, drops complete batches
    /// and reports the commit offset of every partition that has read anything.
    pub fn take_flush(&mut self) -> Flush {
        let partitions: Vec<i32> = self.partitions.keys().copied().collect();
        self.cut(&partitions, false)
    }

    /// The rows of the complete batches only, each whole; the open batches keep theirs
    /// for a later cut, and nothing is committed. For a superseding replay, whose rows
    /// outrank the complete rows already stored: a batch cut part-way and then killed
    /// would read short until the replay ran again.
    pub fn take_complete_batches(&mut self) -> Flush {
        let mut flush = Flush::default();
        for (&p, state) in self.partitions.iter_mut() {
            for mut batch in state.complete.drain(..) {
                batch.cut_rows(p, &mut flush);
                self.buckets_held -= batch.minute_buckets();
            }
        }
        flush.rows.sort_by_key(|r| (r.partition, r.batch_start, r.key));
        flush
    }

    /// `partition` gets no more offsets: its reader read its range to the end. Its open
    /// batch is complete as read (its last offsets may be transaction markers, never
    /// delivered), so [`take_complete_batches`](Self::take_complete_batches) cuts it.
    pub fn finish(&mut self, partition: i32) {
        if let Some(state) = self.partitions.get_mut(&partition) {
            if let Some(open) = state.open.take() {
                state.complete.push(open);
            }
        }
    }

    /// Like [`take_flush`](Self::take_flush) for the given partitions only, and forgets
    /// them: used when partitions are revoked.
    pub fn take_partitions(&mut self, partitions: &[i32]) -> Flush {
        self.cut(partitions, true)
    }

    /// Forgets a partition without cutting rows: its state is stale (assigned again, so
    /// the consumer restarts from the committed boundary and rebuilds it).
    pub fn forget(&mut self, partition: i32) {
        if let Some(state) = self.partitions.remove(&partition) {
            self.buckets_held -= held(&state);
        }
    }

    fn cut(&mut self, partitions: &[i32], remove: bool) -> Flush {
        let mut flush = Flush::default();
        for &p in partitions {
            let Some(state) = self.partitions.get_mut(&p) else { continue };
            for mut batch in state.complete.drain(..) {
                batch.cut_rows(p, &mut flush);
                self.buckets_held -= batch.minute_buckets();
            }
            if let Some(open) = &mut state.open {
                open.cut_rows(p, &mut flush);
            }
            // The position after the last offset read: everything before it is in this
            // flush. A reader starting there begins at the batch boundary at or below it
            // and rebuilds the open batch's rows as they were, so committing the flushed
            // position (not the open batch's start) changes nothing a restart re-reads,
            // and lag tools see a caught-up member as caught up.
            flush.commits.insert(p, state.last_offset + 1);
            if remove {
                let state = self.partitions.remove(&p).expect("present");
                self.buckets_held -= held(&state);
            }
        }
        flush.rows.sort_by_key(|r| (r.partition, r.batch_start, r.key));
        flush
    }

    /// The start of the batch `partition` is in now, open or next (`None`: nothing read
    /// of it): where a re-read that rebuilds its rows must start.
    pub fn open_batch_start(&self, partition: i32) -> Option<i64> {
        let state = self.partitions.get(&partition)?;
        match &state.open {
            Some(open) => Some(open.start),
            None => state.next_start,
        }
    }

    /// Buckets held in memory across all batches (bounded by the pipeline).
    pub fn buckets_held(&self) -> usize {
        self.buckets_held
    }

    /// The last offset read per partition.
    pub fn last_offsets(&self) -> BTreeMap<i32, i64> {
        self.partitions.iter().map(|(&p, s)| (p, s.last_offset)).collect()
    }

    pub fn partitions(&self) -> impl Iterator<Item = i32> + '_ {
        self.partitions.keys().copied()
    }
}

fn held(state: &PartitionState) -> usize {
    state.complete.iter().chain(state.open.iter()).map(Batch::minute_buckets).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn key(ad_id: u64, minute: u32) -> BucketKey {
        BucketKey { ad_id, minute: Minute::from_epoch_seconds(minute * 60) }
    }

    fn n(v: u64) -> BatchOffsets {
        BatchOffsets::new(v).unwrap()
    }

    /// A stand-in for the `ReplacingMergeTree(version)` minute table read with FINAL: per
    /// batch and bucket keep the row with the highest version, then sum over batches.
    #[derive(Default)]
    struct Table {
        rows: HashMap<(i32, i64, BucketKey), (u64, i64)>,
    }

    impl Table {
        fn apply(&mut self, flush: &Flush) {
            for r in &flush.rows {
                let slot = self.rows.entry((r.partition, r.batch_start, r.key)).or_insert((r.clicks, r.version));
                if r.version >= slot.1 {
                    *slot = (r.clicks, r.version);
                }
            }
        }
        fn billing(&self) -> BTreeMap<BucketKey, u64> {
            let mut out = BTreeMap::new();
            for ((_, _, k), (c, _)) in &self.rows {
                *out.entry(*k).or_default() += c;
            }
            out
        }
    }

    #[test]
    fn batch_boundaries_are_multiples_of_n() {
        let n = n(100);
        assert_eq!(n.start_of(0), 0);
        assert_eq!(n.start_of(99), 0);
        assert_eq!(n.start_of(100), 100);
        assert_eq!(n.start_of(250), 200);
        assert_eq!(n.boundary_at_or_after(200), 200);
        assert_eq!(n.boundary_at_or_after(201), 300);
        assert!(BatchOffsets::new(0).is_none());
    }

    #[test]
    fn rows_carry_cumulative_counts_and_the_last_offset_read() {
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 0, Some(key(1, 0)), None);
        agg.observe(0, 1, None, None);
        agg.observe(0, 2, Some(key(1, 0)), None);
        let f = agg.take_flush();
        let row = BatchRow { key: key(1, 0), partition: 0, batch_start: 0, clicks: 2, version: 2 };
        assert_eq!(f.rows, vec![row], "one minute row; hours and days are the sealer's");
        // The flushed position, although the batch is open: a restart reads from the batch
        // boundary at or below it (0) and rebuilds the batch's rows as they were.
        assert_eq!(f.commits, BTreeMap::from([(0, 3)]));

        agg.observe(0, 3, Some(key(1, 0)), None);
        let f = agg.take_flush();
        assert_eq!(f.rows[0].clicks, 3);
        assert_eq!(f.rows[0].version, 3);
    }

    #[test]
    fn only_buckets_changed_since_the_last_flush_are_written() {
        let mut agg = Aggregator::new(n(100));
        agg.observe(0, 0, Some(key(1, 0)), None);
        agg.observe(0, 1, Some(key(2, 0)), None);
        agg.take_flush();
        agg.observe(0, 2, Some(key(2, 0)), None);
        let f = agg.take_flush();
        assert_eq!(f.rows.len(), 1);
        assert_eq!(f.rows[0].key, key(2, 0));
        assert!(agg.take_flush().rows.is_empty());
    }

    #[test]
    fn a_batch_completes_at_its_last_offset_or_when_a_later_offset_arrives() {
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 9, Some(key(1, 0)), None);
        let f = agg.take_flush();
        assert_eq!(f.commits, BTreeMap::from([(0, 10)]));

        agg.observe(1, 5, Some(key(1, 0)), None);
        agg.observe(1, 23, None, None); // offsets 6..23 compacted away
        let f = agg.take_flush();
        assert_eq!(f.rows.len(), 1);
        assert_eq!(f.commits, BTreeMap::from([(0, 10), (1, 24)]));
        assert_eq!(agg.buckets_held(), 0);
    }

    #[test]
    fn only_complete_batches_are_cut_whole_and_the_open_one_keeps_its_rows_for_later() {
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 3, Some(key(1, 0)), None);
        agg.observe(0, 12, Some(key(1, 0)), None); // batch 0 complete, batch 10 open
        agg.observe(0, 14, Some(key(1, 0)), None);
        let f = agg.take_complete_batches();
        let rows: Vec<(i64, u64, i64)> = f.rows.iter().map(|r| (r.batch_start, r.clicks, r.version)).collect();
        assert_eq!(rows, [(0, 1, 3)], "batch 0 whole, nothing of the open batch");
        assert!(f.commits.is_empty(), "nothing committed");
        assert_eq!(agg.buckets_held(), 1);
        agg.observe(0, 19, Some(key(1, 0)), None); // its last offset: complete
        let rows: Vec<(i64, u64, i64)> =
            agg.take_complete_batches().rows.iter().map(|r| (r.batch_start, r.clicks, r.version)).collect();
        assert_eq!(rows, [(10, 3, 19)], "the open batch once complete, with every click of it");
        assert_eq!(agg.buckets_held(), 0);
    }

    #[test]
    fn a_partition_read_to_the_end_of_its_range_has_its_open_batch_complete_as_read() {
        // Offsets 18 and 19 are transaction markers: no record closes batch 10.
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 12, Some(key(1, 0)), None);
        agg.observe(0, 17, Some(key(1, 0)), None);
        agg.observe(1, 4, Some(key(2, 0)), None); // still being read
        assert!(agg.take_complete_batches().rows.is_empty());
        agg.finish(0);
        agg.finish(7); // nothing read of it: nothing to do
        let rows: Vec<(i32, i64, u64, i64)> = agg
            .take_complete_batches()
            .rows
            .iter()
            .map(|r| (r.partition, r.batch_start, r.clicks, r.version))
            .collect();
        assert_eq!(rows, [(0, 10, 2, 17)], "partition 0's last batch whole; nothing of partition 1's open one");
        assert_eq!(agg.buckets_held(), 1);
    }

    #[test]
    fn revoked_partitions_are_cut_and_forgotten() {
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 0, Some(key(1, 0)), None);
        agg.observe(1, 0, Some(key(1, 0)), None);
        let f = agg.take_partitions(&[1]);
        assert_eq!(f.rows.len(), 1);
        assert_eq!(f.commits, BTreeMap::from([(1, 1)]));
        assert_eq!(agg.partitions().collect::<Vec<_>>(), vec![0]);
        assert_eq!(agg.buckets_held(), 1);
        agg.forget(0);
        assert_eq!(agg.buckets_held(), 0);
    }

    #[test]
    fn pins_are_flushed_once_with_their_batch_and_a_cross_partition_duplicate_writes_its_bucket() {
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 0, Some(key(1, 0)), None);
        agg.observe(0, 1, None, Some((Pin::CrossDuplicate, key(2, 0))));
        let f = agg.take_flush();
        assert_eq!(f.pins.len(), 1);
        let row = |k| f.rows.iter().find(|r| r.key == k).map(|r| r.clicks);
        assert_eq!((row(key(1, 0)), row(key(2, 0))), (Some(1), Some(0)));
        assert!(agg.take_flush().pins.is_empty(), "a pin is written once");
    }

    #[test]
    fn a_contested_bucket_is_written_again_at_every_later_version_of_its_batch_but_an_uncounted_pin_is_not_contested() {
        // A replay that read the batch before the member may have counted the copy: the
        // member's rows of that bucket must reach the batch's last version to outrank it.
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 0, None, Some((Pin::CrossDuplicate, key(2, 0))));
        agg.observe(0, 1, None, Some((Pin::Uncounted, key(3, 0))));
        let first = agg.take_flush();
        let keys: Vec<BucketKey> = first.rows.iter().map(|r| r.key).collect();
        assert_eq!(keys, vec![key(2, 0)], "only the cross-partition duplicate's bucket is written");
        assert_eq!(first.pins.len(), 2, "both pins are");
        agg.observe(0, 2, Some(key(1, 0)), None);
        let later = agg.take_flush();
        let versions: BTreeMap<BucketKey, i64> = later.rows.iter().map(|r| (r.key, r.version)).collect();
        assert_eq!(versions, BTreeMap::from([(key(1, 0), 2), (key(2, 0), 2)]), "the contested bucket again, at 2");
    }

    #[test]
    fn the_open_batch_start_and_the_last_offsets_follow_the_reads() {
        let mut agg = Aggregator::new(n(10));
        assert_eq!(agg.open_batch_start(0), None, "nothing read");
        assert!(agg.last_offsets().is_empty());
        agg.observe(0, 3, Some(key(1, 0)), None);
        agg.observe(1, 25, None, None);
        assert_eq!((agg.open_batch_start(0), agg.open_batch_start(1)), (Some(0), Some(20)));
        // The batch's last offset completes it: the next one starts at the boundary.
        agg.observe(0, 9, None, None);
        assert_eq!(agg.open_batch_start(0), Some(10));
        assert_eq!(agg.last_offsets(), BTreeMap::from([(0, 9), (1, 25)]));
        // A gap past the boundary (transaction markers) opens the batch it lands in.
        agg.observe(0, 31, None, None);
        assert_eq!(agg.open_batch_start(0), Some(30));
        assert_eq!(agg.open_batch_start(2), None, "a partition never read");
    }

    #[test]
    fn a_flush_is_empty_only_without_rows_pins_and_commits() {
        assert!(Flush::default().is_empty());
        let mut agg = Aggregator::new(n(10));
        agg.observe(0, 0, None, None);
        let commit_only = agg.take_flush();
        assert!(commit_only.rows.is_empty() && !commit_only.is_empty(), "a commit is work: {commit_only:?}");
    }

    #[test]
    fn a_replayed_flush_with_a_lower_version_never_wins() {
        let mut table = Table::default();
        let mut live = Aggregator::new(n(10));
        for o in 0..10 {
            live.observe(0, o, Some(key(1, 0)), None);
        }
        let complete = live.take_flush();
        table.apply(&complete);

        // A zombie that read only the first 4 offsets of the batch flushes late.
        let mut zombie = Aggregator::new(n(10));
        for o in 0..4 {
            zombie.observe(0, o, Some(key(1, 0)), None);
        }
        table.apply(&zombie.take_flush());
        assert_eq!(table.billing()[&key(1, 0)], 10);

        // Retrying the complete flush changes nothing either.
        table.apply(&complete);
        assert_eq!(table.billing()[&key(1, 0)], 10);
    }

    /// One partition's log: each offset either counts a click in a bucket or not.
    fn log_strategy() -> impl Strategy<Value = Vec<Option<(u64, u32)>>> {
        prop::collection::vec(prop::option::weighted(0.8, (0u64..5, 0u32..4)), 1..300)
    }

    proptest! {
        /// Billing counts do not depend on when flushes happen, and equal the number of
        /// counted clicks per bucket.
        #[test]
        fn counts_are_independent_of_flush_timing(
            logs in prop::collection::vec(log_strategy(), 1..4),
            batch in 1u64..50,
            flush_points in prop::collection::hash_set(0usize..300, 0..20),
        ) {
            let mut expected: BTreeMap<BucketKey, u64> = BTreeMap::new();
            let mut table = Table::default();
            let mut agg = Aggregator::new(n(batch));
            let longest = logs.iter().map(Vec::len).max().unwrap();
            for i in 0..longest {
                for (p, log) in logs.iter().enumerate() {
                    if let Some(entry) = log.get(i) {
                        let counted = entry.map(|(ad, m)| key(ad, m));
                        if let Some(k) = counted { *expected.entry(k).or_default() += 1; }
                        agg.observe(p as i32, i as i64, counted, None);
                    }
                }
                if flush_points.contains(&i) {
                    table.apply(&agg.take_flush());
                }
            }
            table.apply(&agg.take_flush());
            prop_assert_eq!(table.billing(), expected);
        }

        /// A consumer that crashes and restarts from its last commit, at any point, rebuilds
        /// rows that end in the same billing counts (the at-least-once + idempotent rows argument).
        #[test]
        fn restarting_from_the_committed_offset_counts_every_click_once(
            log in log_strategy(),
            batch in 1u64..40,
            crash_points in prop::collection::vec((0usize..300, any::<bool>()), 0..6),
        ) {
            let mut expected: BTreeMap<BucketKey, u64> = BTreeMap::new();
            for k in log.iter().flatten() { *expected.entry(key(k.0, k.1)).or_default() += 1; }

            let mut table = Table::default();
            // A reader starts at the batch boundary at or below the committed offset.
            let mut committed = 0i64;
            for (crash_at, flush_before_crash) in crash_points {
                let mut agg = Aggregator::new(n(batch));
                let from = n(batch).start_of(committed) as usize;
                for (o, entry) in log.iter().enumerate().skip(from).take(crash_at) {
                    agg.observe(0, o as i64, entry.map(|(a, m)| key(a, m)), None);
                }
                if flush_before_crash && agg.partitions().next().is_some() {
                    let f = agg.take_flush();
                    table.apply(&f);
                    committed = f.commits[&0];
                }
                // Crash: everything not flushed is lost.
            }
            let mut agg = Aggregator::new(n(batch));
            for (o, entry) in log.iter().enumerate().skip(n(batch).start_of(committed) as usize) {
                agg.observe(0, o as i64, entry.map(|(a, m)| key(a, m)), None);
            }
            table.apply(&agg.take_flush());
            prop_assert_eq!(table.billing(), expected);
        }

        /// A commit is the flushed position: never past the last offset read (whose click
        /// may be only in this flush), and its batch boundary — where a restart reads from
        /// — never more than the open batch behind it: a restart re-reads at most one batch
        /// per partition.
        #[test]
        fn commits_are_the_flushed_position_and_restarts_at_most_one_batch_behind(
            log in log_strategy(),
            batch in 1u64..40,
            flush_every in 1usize..50,
        ) {
            let n = n(batch);
            let mut agg = Aggregator::new(n);
            for (o, entry) in log.iter().enumerate() {
                let o = o as i64;
                agg.observe(0, o, entry.map(|(a, m)| key(a, m)), None);
                if (o as usize).is_multiple_of(flush_every) {
                    let f = agg.take_flush();
                    let commit = f.commits[&0];
                    prop_assert_eq!(commit, o + 1);
                    prop_assert!(n.start_of(commit) >= n.start_of(o));
                    for r in &f.rows { prop_assert!(r.version <= o); }
                }
            }
        }
    }
}
