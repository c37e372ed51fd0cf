//! The Rust model of the dedup cache (`dedup::decide_shared` per key group, as
//! `claim.lua` applies it) and the comparison of the Redis function against it: the
//! same random claims — fresh and re-read, pinned, warm-up, on several partitions,
//! across restarts — must get the same verdicts. `dedup_cache.rs` runs it against one
//! Redis, the cluster suite against a Redis Cluster.

use std::collections::{BTreeMap, HashMap, HashSet};

use clickagg::cache::SharedCache;
use clickagg::dedup::{decide_shared, Chain, Claim, ClaimMode, Fingerprint, Frontier, Pin, Sighting, Verdict};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const WINDOW: u32 = 20;
pub const SHARDS: u32 = 4096;

/// One key group of the cache, as the Rust model holds it.
#[derive(Default)]
struct Group {
    entries: HashMap<u128, Vec<Chain>>,
    frontier: HashMap<i32, (i64, i64)>,
    /// Cross-partition verdicts not yet durable (`x:<partition>`).
    pins: HashSet<(i32, i64)>,
}

/// The Rust model of one topic's cache.
pub struct Model {
    groups: Vec<Group>,
}

impl Model {
    pub fn new(groups: u32) -> Model {
        Model { groups: (0..groups).map(|_| Group::default()).collect() }
    }

    /// One poll batch: each claim in its group (`shard mod groups`), in order, then the
    /// batch's marks (the highest offset per partition) in every group. `prev`: per
    /// partition, the mark the previous call sent; a group whose frontier is short of
    /// it applies nothing of the partition (its claims wait).
    pub fn claim(&mut self, claims: &[Claim], prev: &BTreeMap<i32, i64>) -> Vec<Verdict> {
        let mut marks: BTreeMap<i32, i64> = BTreeMap::new();
        let n = self.groups.len() as u32;
        let refused: HashSet<(usize, i32)> = (0..self.groups.len())
            .flat_map(|g| prev.iter().map(move |(&p, &o)| (g, p, o)))
            .filter(|&(g, p, o)| self.groups[g].frontier.get(&p).map_or(-1, |&(claimed, _)| claimed) < o)
            .map(|(g, p, _)| (g, p))
            .collect();
        let verdicts = claims
            .iter()
            .map(|c| {
                let s = c.sighting;
                if !c.mode.confirm {
                    let mark = marks.entry(s.partition).or_insert(s.offset);
                    *mark = (*mark).max(s.offset);
                }
                let g = (c.fingerprint.shard(SHARDS) % n) as usize;
                if refused.contains(&(g, s.partition)) {
                    return Verdict::Wait;
                }
                let group = &mut self.groups[g];
                let f = group.frontier.get(&s.partition).map(|&(claimed, exact_from)| Frontier { claimed, exact_from });
                let reread = f.is_some_and(|f| s.offset <= f.claimed);
                let cached = reread && group.pins.contains(&(s.partition, s.offset));
                let v = decide_shared(
                    group.entries.entry(c.fingerprint.0).or_default(),
                    s,
                    f,
                    c.mode,
                    cached,
                    true,
                    WINDOW,
                );
                // Only a fresh cross-partition decision is kept in the sorted set until
                // its pin is durable; an uncounted duplicate is told by its chain.
                if c.mode.pin.is_none() && v == Verdict::CrossDuplicate && !reread {
                    group.pins.insert((s.partition, s.offset));
                }
                if !reread && !c.mode.confirm {
                    group.frontier.insert(s.partition, (s.offset, f.map_or(0, |f| f.exact_from)));
                }
                v
            })
            .collect();
        for (g, group) in self.groups.iter_mut().enumerate() {
            for (&p, &o) in marks.iter().filter(|(p, _)| !refused.contains(&(g, **p))) {
                let now = group.frontier.get(&p).copied();
                if now.is_none_or(|(claimed, _)| o > claimed) {
                    group.frontier.insert(p, (o, now.map_or(0, |(_, exact_from)| exact_from)));
                }
            }
        }
        verdicts
    }

    pub fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) {
        for group in &mut self.groups {
            match group.frontier.get(&partition).copied() {
                Some((claimed, exact_from)) if claimed >= lookback - 1 => {
                    if claimed + 1 < boundary && exact_from < boundary {
                        group.frontier.insert(partition, (claimed, boundary));
                    }
                }
                _ => {
                    group.frontier.insert(partition, (lookback - 1, boundary));
                }
            }
        }
    }
}

/// Random batches of claims through `cache` and through the model; every verdict must
/// agree. Returns how many claims were compared.
pub async fn compare(mut cache: SharedCache, seed: u64) -> usize {
    let mut model = Model::new(cache.groups());
    let mut rng = StdRng::seed_from_u64(seed);
    // Few click IDs, each claimed again and again, so that entries collect several
    // partitions' chains; over 16 shards, so that they fall in up to 16 key groups.
    let ids: Vec<Fingerprint> = (0..40u128).map(|i| Fingerprint(((i % 16) << 96) | (i * 7919))).collect();
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut clock: HashMap<i32, u32> = HashMap::new();
    let mut unconfirmed: HashMap<i32, (i64, Fingerprint)> = HashMap::new();
    let mut last_mark: BTreeMap<i32, i64> = BTreeMap::new();
    let mut checked = 0;
    for round in 0..100 {
        // Now and then a reader starts over from an earlier offset (a re-read: claims the
        // cache holds already, its own included), or after a lost cache (a restart whose
        // warm-up makes the cache exact only from a boundary).
        if round % 7 == 3 {
            let p = rng.random_range(0..3);
            let back = rng.random_range(0..30);
            let at = next.get(&p).copied().unwrap_or(0).saturating_sub(back);
            next.insert(p, at);
        }
        if round % 11 == 5 {
            let p = rng.random_range(0..3);
            let at = next.get(&p).copied().unwrap_or(0);
            cache.restart(p, at, at + 5).await.unwrap();
            model.restart(p, at, at + 5);
        }
        let mut claims = Vec::new();
        for _ in 0..rng.random_range(1..200) {
            let p = rng.random_range(0..3);
            let o = next.entry(p).or_insert(0);
            let now = clock.entry(p).or_insert(1_000);
            *now += rng.random_range(0..4);
            let pin =
                rng.random_bool(0.05).then(|| if rng.random_bool(0.5) { Pin::CrossDuplicate } else { Pin::Uncounted });
            let mode = ClaimMode { pin, warm: rng.random_bool(0.1), confirm: false };
            let fingerprint = ids[rng.random_range(0..ids.len())];
            // Now and then a click judged ahead of its partition's clock (at its own
            // timestamp, the clock staying); the next sighting of the partition may
            // confirm its jump, moving its reach.
            let ahead = rng.random_bool(0.05);
            let judged = if ahead { *now + 3_601 + rng.random_range(0..3) * 7 } else { *now };
            if let Some((at, fp)) = unconfirmed.remove(&p) {
                if rng.random_bool(0.5) {
                    let reach = *now + rng.random_range(0..WINDOW * 2);
                    let sighting = Sighting { partition: p, offset: at, clock: judged, now: reach };
                    claims.push(Claim { fingerprint: fp, sighting, mode: ClaimMode { confirm: true, ..mode } });
                }
            }
            if ahead {
                unconfirmed.insert(p, (*o, fingerprint));
            }
            let sighting = Sighting { partition: p, offset: *o, clock: judged, now: *now };
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
        let calls = cache.claim_calls(&claims, &[], &prev).await.unwrap();
        let replies = cache.sender().await.unwrap().send(calls.calls.clone()).await;
        last_mark = calls.marks().collect();
        let from_redis = cache.answer(&calls, &claims, replies).unwrap();
        let from_model = model.claim(&claims, &prev);
        for (i, (r, m)) in from_redis.iter().zip(&from_model).enumerate() {
            assert_eq!(r, m, "seed {seed}, round {round}, claim {i}: {:?}", claims[i]);
        }
        checked += claims.len();
    }
    checked
}
