//! The Rust model of the dedup cache (`dedup::decide_shared` per key group, as
//! `claim.lua` applies it, and `Chain::kept_by_sweep` for its `sweep`) and the comparison
//! of the Redis function against it: the same random claims — fresh and re-read, pinned,
//! warm-up, judged ahead of the clock (or of no clock yet) and confirmed, on partitions
//! that start at different times, across restarts — must get the same verdicts, leave
//! the same items and frontiers, and sweeps between them at generated cutoffs must keep
//! the same items, and a cache lost between batches must answer lost and, in its new
//! namespace, decide as an empty model does. `dedup_cache.rs` runs it against one Redis,
//! the cluster suite against a Redis Cluster.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use clickagg::cache::{DedupError, Recovery, SharedCache};

use crate::helpers::TestEnv;
use clickagg::dedup::{
    decide_shared, Chain, Claim, ClaimMode, Fingerprint, Frontier, Pin, Secs, Sighting, Start, Verdict,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const WINDOW: u32 = 20;
pub const SHARDS: u32 = 4096;

/// One partition's frontier in one key group (`claim.lua`'s `frontier` hash): the highest
/// offset claimed, the partition clock there, and where re-reads are exact from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Front {
    pub claimed: i64,
    pub clock: Secs,
    pub exact_from: i64,
}

/// One key group of the cache, as the Rust model holds it.
#[derive(Default)]
struct Group {
    entries: HashMap<u128, Vec<Chain>>,
    frontier: HashMap<i32, Front>,
    /// Cross-partition verdicts not yet durable (`x:<partition>`).
    pins: HashSet<(i32, i64)>,
}

/// The Rust model of one topic's cache.
pub struct Model {
    groups: Vec<Group>,
    /// The record time of each fresh sighting (click, partition, offset): for the coverage
    /// count of chains kept by their latest sighting rather than their first.
    sighted: HashMap<(u128, i32, i64), Secs>,
}

/// What one comparison covered.
#[derive(Debug, Default, Clone, Copy)]
pub struct Compared {
    /// Claims whose verdicts were compared.
    pub claims: usize,
    pub sweeps: usize,
    /// Items the sweeps removed.
    pub swept: usize,
    /// Chains that continue a sighting judged ahead (their start a duplicate) which a
    /// sweep kept although its cutoff lies past their first sighting: kept by their latest.
    pub kept_by_latest: usize,
    /// Items judged ahead of no clock (reach 0) a sweep kept because their partition has
    /// no clock at its frontier in the group.
    pub kept_unclocked: usize,
    /// Caches lost and moved to a new namespace.
    pub losses: usize,
}

impl std::ops::AddAssign for Compared {
    fn add_assign(&mut self, o: Compared) {
        self.claims += o.claims;
        self.sweeps += o.sweeps;
        self.swept += o.swept;
        self.kept_by_latest += o.kept_by_latest;
        self.kept_unclocked += o.kept_unclocked;
        self.losses += o.losses;
    }
}

impl Model {
    pub fn new(groups: u32) -> Model {
        Model { groups: (0..groups).map(|_| Group::default()).collect(), sighted: HashMap::new() }
    }

    fn group_of(&self, fingerprint: Fingerprint) -> usize {
        (fingerprint.shard(SHARDS) % self.groups.len() as u32) as usize
    }

    /// One poll batch: each claim in its group (`shard mod groups`), in order, then the
    /// batch's marks (the highest offset per partition, with the partition clock there, as
    /// `SharedCache::claim_calls` makes them) in every group. `prev`: per partition, the
    /// mark the previous call sent; a group whose frontier is short of it applies nothing
    /// of the partition (its claims wait).
    pub fn claim(&mut self, claims: &[Claim], prev: &BTreeMap<i32, i64>) -> Vec<Verdict> {
        let mut marks: BTreeMap<i32, (i64, Secs)> = BTreeMap::new();
        for c in claims {
            let s = c.sighting;
            let mark = marks.entry(s.partition).or_insert((s.offset, s.now));
            if s.offset >= mark.0 {
                *mark = (s.offset, s.now);
            }
        }
        let refused: HashSet<(usize, i32)> = (0..self.groups.len())
            .flat_map(|g| prev.iter().map(move |(&p, &o)| (g, p, o)))
            .filter(|&(g, p, o)| self.groups[g].frontier.get(&p).map_or(-1, |f| f.claimed) < o)
            .map(|(g, p, _)| (g, p))
            .collect();
        let mut verdicts = Vec::with_capacity(claims.len());
        for c in claims {
            let s = c.sighting;
            let g = self.group_of(c.fingerprint);
            if refused.contains(&(g, s.partition)) {
                verdicts.push(Verdict::Wait);
                continue;
            }
            let group = &mut self.groups[g];
            let f = group.frontier.get(&s.partition).copied();
            let frontier = f.map(|f| Frontier { claimed: f.claimed, exact_from: f.exact_from });
            let reread = f.is_some_and(|f| s.offset <= f.claimed);
            let cached = reread && group.pins.contains(&(s.partition, s.offset));
            let v = decide_shared(
                group.entries.entry(c.fingerprint.0).or_default(),
                s,
                frontier,
                c.mode,
                cached,
                true,
                Secs::new(WINDOW),
            );
            // Only a fresh cross-partition decision is kept in the sorted set until
            // its pin is durable; an uncounted duplicate is told by its chain.
            if c.mode.pin.is_none() && v == Verdict::CrossDuplicate && !reread {
                group.pins.insert((s.partition, s.offset));
            }
            if !reread && !c.mode.confirm {
                let exact_from = f.map_or(0, |f| f.exact_from);
                group.frontier.insert(s.partition, Front { claimed: s.offset, clock: s.now, exact_from });
                self.sighted.insert((c.fingerprint.0, s.partition, s.offset), s.clock);
            }
            verdicts.push(v);
        }
        for (g, group) in self.groups.iter_mut().enumerate() {
            for (&p, &(o, clock)) in marks.iter().filter(|(p, _)| !refused.contains(&(g, **p))) {
                let now = group.frontier.get(&p).copied();
                if now.is_none_or(|f| o > f.claimed) {
                    group.frontier.insert(p, Front { claimed: o, clock, exact_from: now.map_or(0, |f| f.exact_from) });
                }
            }
        }
        verdicts
    }

    pub fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) {
        for group in &mut self.groups {
            match group.frontier.get_mut(&partition) {
                Some(f) if f.claimed >= lookback - 1 => {
                    if f.claimed + 1 < boundary && f.exact_from < boundary {
                        f.exact_from = boundary;
                    }
                }
                _ => {
                    group
                        .frontier
                        .insert(partition, Front { claimed: lookback - 1, clock: Secs::new(0), exact_from: boundary });
                }
            }
        }
    }

    /// `SharedCache::sweep(shards, cutoff)`: in each group, the items of the entries in
    /// `shards` that `Chain::kept_by_sweep` does not keep, given the record time at their
    /// partition's frontier in that group. Returns how many went; counts into `seen`.
    pub fn sweep(&mut self, shards: &Range<u32>, cutoff: Secs, seen: &mut Compared) -> usize {
        let mut removed = 0;
        let sighted = &self.sighted;
        for group in &mut self.groups {
            let clocks: HashMap<i32, Secs> = group.frontier.iter().map(|(&p, f)| (p, f.clock)).collect();
            for (&fp, chains) in &mut group.entries {
                if !shards.contains(&Fingerprint(fp).shard(SHARDS)) {
                    continue;
                }
                let before = chains.len();
                chains.retain(|c| {
                    let clock = clocks.get(&c.partition).copied();
                    let kept = c.kept_by_sweep(cutoff, clock);
                    if kept && c.reach() < cutoff {
                        seen.kept_unclocked += 1;
                    }
                    let first = sighted.get(&(fp, c.partition, c.first)).copied();
                    if kept && c.start == Start::Duplicate && c.ahead.is_none() && first.is_some_and(|t| t < cutoff) {
                        seen.kept_by_latest += 1;
                    }
                    kept
                });
                removed += before - chains.len();
            }
            group.entries.retain(|_, chains| !chains.is_empty());
        }
        removed
    }

    /// A cutoff that lies where a sweep decides something: at or just past some item's
    /// reach, or, for a chain that continues a sighting judged ahead, after its first
    /// sighting and at or before its latest.
    fn telling_cutoff(&self, rng: &mut StdRng) -> Option<Secs> {
        let mut items: Vec<(u128, Chain)> = self
            .groups
            .iter()
            .flat_map(|g| g.entries.iter().flat_map(|(&fp, cs)| cs.iter().map(move |&c| (fp, c))))
            .collect();
        // In an order of their own, not the hash maps': the same seed, the same history.
        items.sort_by_key(|(fp, c)| (*fp, c.partition, c.first, c.ahead, c.last_seen));
        let dup = |c: &Chain| c.start == Start::Duplicate && c.ahead.is_none();
        let dups: Vec<&(u128, Chain)> = items.iter().filter(|(_, c)| dup(c)).collect();
        let (fp, c) = if !dups.is_empty() && rng.random_bool(0.5) {
            *dups[rng.random_range(0..dups.len())]
        } else {
            *items.get(rng.random_range(0..items.len().max(1)))?
        };
        match self.sighted.get(&(fp, c.partition, c.first)) {
            Some(&first) if dup(&c) && first < c.last_seen && rng.random_bool(0.7) => {
                Some(Secs::new(rng.random_range(first.get() + 1..=c.last_seen.get())))
            }
            _ => Some(Secs::new(c.reach().get() + rng.random_range(0..2))),
        }
    }

    /// The items the model holds for `fingerprint`.
    pub fn entry(&self, fingerprint: Fingerprint) -> Vec<Chain> {
        self.groups[self.group_of(fingerprint)].entries.get(&fingerprint.0).cloned().unwrap_or_default()
    }

    /// Per key group, the frontier of `partition`.
    pub fn frontiers(&self, partition: i32) -> Vec<Option<Front>> {
        self.groups.iter().map(|g| g.frontier.get(&partition).copied()).collect()
    }
}

/// The items of one entry as `claim.lua` packs them (its header): a 12-byte chain
/// `'>HI6I4'` (partition, bit 15 set when it counted; the offset it started at; its
/// latest sighting), or, with bit 14 set, a 17-byte item `'>HBI6I4I4'` with a flags byte
/// (bits 0-1 its start, bit 2 judged ahead) and a reach. Read as the Rust copy's chains: a
/// reach belongs to an item judged ahead only (a chain's is its latest sighting,
/// `Chain::reach`).
pub fn decode(v: &[u8]) -> Vec<Chain> {
    let u48 = |b: &[u8]| {
        let mut x = [0u8; 8];
        x[2..].copy_from_slice(b);
        i64::from_be_bytes(x)
    };
    let u32_at = |b: &[u8]| u32::from_be_bytes(b.try_into().expect("4 bytes"));
    let mut out = Vec::new();
    let mut j = 0;
    while j < v.len() {
        let pc = u16::from_be_bytes([v[j], v[j + 1]]);
        let counted = pc & 0x8000 != 0;
        if pc & 0x4000 != 0 {
            let item = &v[j..j + 17];
            let flags = item[2];
            let start = match flags % 4 {
                0 => Start::Counted,
                1 => Start::Cross,
                2 => Start::Duplicate,
                f => panic!("an item's start {f} in {v:02x?}"),
            };
            out.push(Chain {
                partition: i32::from(pc & 0x3fff),
                first: u48(&item[3..9]),
                start,
                counted,
                last_seen: Secs::new(u32_at(&item[9..13])),
                ahead: (flags & 4 != 0).then(|| Secs::new(u32_at(&item[13..17]))),
            });
            j += 17;
        } else {
            let item = &v[j..j + 12];
            out.push(Chain {
                partition: i32::from(pc & 0x7fff),
                first: u48(&item[2..8]),
                start: if counted { Start::Counted } else { Start::Cross },
                counted,
                last_seen: Secs::new(u32_at(&item[8..12])),
                ahead: None,
            });
            j += 12;
        }
    }
    out
}

/// Every entry and every frontier in Redis must be the model's.
async fn compare_state(cache: &mut SharedCache, model: &Model, ids: &[Fingerprint], at: &str) {
    for &fp in ids {
        let bytes = cache.entry_bytes(fp).await.unwrap();
        let redis = bytes.as_deref().map(decode).unwrap_or_default();
        assert_eq!(redis, model.entry(fp), "{at}: the items of click {:032x} (left: claim.lua, right: Rust)", fp.0);
    }
    let partitions = [0, 1, 2];
    let frontiers = cache.frontiers(&partitions).await.unwrap();
    for p in partitions {
        let redis: Vec<Option<Front>> = frontiers[&p]
            .iter()
            .map(|f| f.map(|f| Front { claimed: f.claimed, clock: f.clock, exact_from: f.exact_from }))
            .collect();
        assert_eq!(redis, model.frontiers(p), "{at}: the frontiers of partition {p} (left: claim.lua, right: Rust)");
    }
}

/// Random batches of claims through `cache` and through the model, with sweeps between
/// them; every verdict must agree. Returns how many claims were compared.
pub async fn compare(cache: SharedCache, seed: u64) -> usize {
    compare_all(cache, seed, None).await.claims
}

/// [`compare`], with what it covered. Odd seeds are *jumpy*: partitions start without a
/// clock (their first records judged ahead of no clock until one starts it), and clicks
/// judged ahead are often confirmed by a real jump of the partition's clock to them, so
/// that their retries continue them in chains of their own (whose start is a duplicate).
/// Even seeds keep the partitions' clocks close together, for copies across partitions.
///
/// With `losses`, the cache loses its namespace now and then (as a Redis restarted empty
/// does): the next call must answer lost rather than decide, and after the move to a new namespace
/// (`SharedCache::recover`) and a restart of every partition where it is, as a member
/// makes them, both sides decide from an empty cache again.
pub async fn compare_all(mut cache: SharedCache, seed: u64, losses: Option<&TestEnv>) -> Compared {
    let mut model = Model::new(cache.groups());
    let mut rng = StdRng::seed_from_u64(seed);
    let jumpy = seed % 2 == 1;
    // Few click IDs, each claimed again and again, so that entries collect several
    // partitions' chains; over 16 shards, so that they fall in up to 16 key groups. The
    // first few are hot: retried within the window sighting after sighting, their chains
    // live on far longer than one window.
    let ids: Vec<Fingerprint> = (0..40u128).map(|i| Fingerprint(((i % 16) << 96) | (i * 7919))).collect();
    const HOT: usize = 3;
    // Per partition: the round its first record is read in, and the round its clock
    // starts in (before it, jumpy seeds only: every record is judged at its own stamp,
    // more than an hour after the one before, so none starts the clock).
    let starts: Vec<(u32, u32)> = (0..3)
        .map(|p| {
            let from = if p == 0 { 0 } else { rng.random_range(0..12) };
            (from, from + if jumpy { rng.random_range(0..3) } else { 0 })
        })
        .collect();
    let mut next: HashMap<i32, i64> = HashMap::new();
    // The partition clock (0: none yet), and the last stamp of a partition without one.
    let mut clock: HashMap<i32, u32> = HashMap::new();
    let mut stamp: HashMap<i32, u32> = HashMap::new();
    // The click judged ahead that the partition's next record may confirm, and its time.
    let mut unconfirmed: HashMap<i32, (i64, Fingerprint, Secs)> = HashMap::new();
    let mut last_mark: BTreeMap<i32, i64> = BTreeMap::new();
    let mut seen = Compared::default();
    for round in 0..100u32 {
        let live: Vec<i32> = (0..3).filter(|&p| starts[p as usize].0 <= round).collect();
        // Now and then a reader starts over from an earlier offset (a re-read: claims the
        // cache holds already, its own included), or after a lost cache (a restart whose
        // warm-up makes the cache exact only from a boundary).
        if round % 7 == 3 {
            let p = live[rng.random_range(0..live.len())];
            let back = rng.random_range(0..30);
            let at = (next.get(&p).copied().unwrap_or(0) - back).max(0);
            next.insert(p, at);
        }
        if round % 11 == 5 {
            let p = live[rng.random_range(0..live.len())];
            let at = next.get(&p).copied().unwrap_or(0);
            cache.restart(p, at, at + 5).await.unwrap();
            model.restart(p, at, at + 5);
        }
        // Where each partition's claims of this round start: where it restarts after a loss.
        let round_from: BTreeMap<i32, i64> = live.iter().map(|&p| (p, next.get(&p).copied().unwrap_or(0))).collect();
        let lose = losses.filter(|_| round % 23 == 17);
        if let Some(env) = lose {
            // Each key group's namespace key, as a cache that lost its data has none: the
            // entries left under the old name are never read again.
            let mut conn = env.redis().await;
            for g in 0..cache.groups() {
                let key = cache.ns_key(g);
                let deleted: i64 = redis::cmd("DEL").arg(&key).query_async(&mut conn).await.unwrap();
                assert_eq!(deleted, 1, "seed {seed}, round {round}: the namespace key {key}");
            }
        }
        let mut claims = Vec::new();
        for _ in 0..rng.random_range(1..200) {
            let p = live[rng.random_range(0..live.len())];
            let o = next.entry(p).or_insert(0);
            let now = clock.entry(p).or_insert(0);
            let pin =
                rng.random_bool(0.05).then(|| if rng.random_bool(0.5) { Pin::CrossDuplicate } else { Pin::Uncounted });
            let mode = ClaimMode { pin, warm: rng.random_bool(0.1), confirm: false };
            let fingerprint =
                if rng.random_bool(0.3) { ids[rng.random_range(0..HOT)] } else { ids[rng.random_range(0..ids.len())] };
            // In jumpy seeds a click judged ahead is mostly a hot one: the first record
            // after a quiet hour, retried on and on once its jump is confirmed.
            let hot = ids[rng.random_range(0..HOT)];
            if round < starts[p as usize].1 {
                // No clock yet: judged ahead of no clock, at its own stamp.
                let t = match stamp.get(&p) {
                    Some(&t) => t + 3_601 + rng.random_range(0..10),
                    None => 1_000 + rng.random_range(0..40),
                };
                stamp.insert(p, t);
                let fingerprint = if rng.random_bool(0.5) { hot } else { fingerprint };
                unconfirmed.insert(p, (*o, fingerprint, Secs::new(t)));
                let sighting = Sighting { partition: p, offset: *o, clock: Secs::new(t), now: Secs::new(0) };
                claims.push(Claim { fingerprint, sighting, mode });
                *o += 1;
                continue;
            }
            // The clock starts (at the later of the last stamp and this record's, within
            // an hour of it), or goes on.
            let started = *now == 0;
            *now = match (started, stamp.get(&p)) {
                (true, Some(&t)) => t + rng.random_range(0..3),
                (true, None) => 1_000,
                (false, _) => *now + rng.random_range(0..4),
            };
            // Now and then a click judged ahead of its partition's clock (at its own
            // timestamp, the clock staying); the next sighting of the partition may
            // confirm its jump, moving its reach — and, a real jump, the clock to it.
            if let Some((at, fp, judged)) = unconfirmed.remove(&p) {
                let confirm = |now: Secs| {
                    let sighting = Sighting { partition: p, offset: at, clock: judged, now };
                    Claim { fingerprint: fp, sighting, mode: ClaimMode { confirm: true, ..mode } }
                };
                match if started { 2 } else { rng.random_range(0..if jumpy { 3 } else { 2 }) } {
                    0 => {}
                    1 => claims.push(confirm(Secs::new(*now + rng.random_range(0..WINDOW * 2)))),
                    _ => {
                        *now = (*now).max(judged.get());
                        claims.push(confirm(Secs::new(*now)));
                    }
                }
            }
            let ahead = rng.random_bool(0.05);
            let judged = if ahead { *now + 3_601 + rng.random_range(0..3) * 7 } else { *now };
            let fingerprint = if ahead && jumpy && rng.random_bool(0.8) { hot } else { fingerprint };
            if ahead {
                unconfirmed.insert(p, (*o, fingerprint, Secs::new(judged)));
            }
            let sighting = Sighting { partition: p, offset: *o, clock: Secs::new(judged), now: Secs::new(*now) };
            claims.push(Claim { fingerprint, sighting, mode });
            *o += 1;
        }
        // Where the previous call left each partition, as the claimer sends it; now and
        // then one ahead of it, as after a call that did not apply (its claims wait).
        let mut prev: BTreeMap<i32, i64> = BTreeMap::new();
        for c in &claims {
            if let Some(&o) = last_mark.get(&c.sighting.partition) {
                let ahead = rng.random_bool(0.05);
                prev.insert(c.sighting.partition, if ahead { o + 1 } else { o });
            }
        }
        if lose.is_some() {
            let calls = cache.claim_calls(&claims, &[], &prev).await.unwrap();
            let replies = cache.sender().await.unwrap().send(calls.calls.clone()).await;
            let lost = match cache.answer(&calls, &claims, replies) {
                Err(DedupError::Lost(lost)) => lost,
                other => panic!("seed {seed}, round {round}: a call into a deleted cache must answer lost: {other:?}"),
            };
            assert!(matches!(cache.recover(&lost).await.unwrap(), Recovery::Renewed(_)), "seed {seed}, round {round}");
            model = Model::new(cache.groups());
            for (&p, &at) in &round_from {
                cache.restart(p, at, at).await.unwrap();
                model.restart(p, at, at);
            }
            prev.clear();
            seen.losses += 1;
        }
        let calls = cache.claim_calls(&claims, &[], &prev).await.unwrap();
        let replies = cache.sender().await.unwrap().send(calls.calls.clone()).await;
        last_mark = calls.marks().collect();
        let from_redis = cache.answer(&calls, &claims, replies).unwrap();
        let from_model = model.claim(&claims, &prev);
        for (i, (r, m)) in from_redis.iter().zip(&from_model).enumerate() {
            assert_eq!(r, m, "seed {seed}, round {round}, claim {i}: {:?}", claims[i]);
        }
        seen.claims += claims.len();
        compare_state(&mut cache, &model, &ids, &format!("seed {seed}, after round {round}'s claims")).await;
        // The sweeper walks (all shards, or some), at a cutoff around where some
        // partition's clock is: a window and `max_record_lag` behind the wall clock, or a
        // window behind a lagging reader's hold. Now and then one past every clock, and
        // often one where it tells: at an item's reach or just past it, or within a chain
        // that continues a sighting judged ahead.
        for _ in 0..rng.random_range(0..4) {
            let cutoff = match rng.random_range(0..10) {
                0 => Secs::new(clock.values().copied().max().unwrap_or(0) + 4 * WINDOW),
                1..5 => model.telling_cutoff(&mut rng).unwrap_or(Secs::new(0)),
                _ => {
                    let q = live[rng.random_range(0..live.len())];
                    Secs::new(clock.get(&q).copied().unwrap_or(0).saturating_sub(rng.random_range(0..4 * WINDOW)))
                }
            };
            let shards = if rng.random_bool(0.7) {
                0..SHARDS
            } else {
                let a = rng.random_range(0..16);
                a..rng.random_range(a + 1..=16)
            };
            let from_redis = cache.sweep(shards.clone(), cutoff).await.unwrap();
            let from_model = model.sweep(&shards, cutoff, &mut seen);
            seen.sweeps += 1;
            seen.swept += from_model;
            let at = format!("seed {seed}, after round {round}: a sweep of shards {shards:?} at cutoff {cutoff}");
            compare_state(&mut cache, &model, &ids, &at).await;
            assert_eq!(from_redis, from_model as u64, "{at}: items removed (left: claim.lua, right: Rust)");
        }
    }
    seen
}
