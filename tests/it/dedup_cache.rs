//! The Redis function (`claim.lua`) against its Rust statement (`dedup::decide_shared`):
//! the same random claims — fresh and re-read, pinned, warm-up, on several partitions,
//! across restarts — must get the same verdicts from both.

use std::collections::HashMap;

use clickagg::dedup::{
    decide_shared, Chain, Claim, ClaimMode, Fingerprint, Frontier, Pin, SharedCache, Sighting, Verdict,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::helpers::TestEnv;

const WINDOW: u32 = 20;

/// The Rust model of one topic's cache.
#[derive(Default)]
struct Model {
    entries: HashMap<u128, Vec<Chain>>,
    frontier: HashMap<i32, (i64, i64)>,
}

impl Model {
    fn claim(&mut self, c: &Claim) -> Verdict {
        let s = c.sighting;
        let f = self.frontier.get(&s.partition).map(|&(claimed, exact_from)| Frontier { claimed, exact_from });
        let v = decide_shared(self.entries.entry(c.fingerprint.0).or_default(), s, f, c.mode, WINDOW);
        if f.is_none_or(|f| s.offset > f.claimed) {
            self.frontier.insert(s.partition, (s.offset, f.map_or(0, |f| f.exact_from)));
        }
        v
    }

    fn restart(&mut self, partition: i32, lookback: i64, boundary: i64) {
        if self.frontier.get(&partition).is_none_or(|&(claimed, _)| claimed < lookback - 1) {
            self.frontier.insert(partition, (lookback - 1, boundary));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_function_decides_every_claim_as_the_rust_model_does() {
    for seed in 0..4 {
        compare(seed).await;
    }
}

async fn compare(seed: u64) {
    let env = TestEnv::new("luamodel").await;
    let s = env.settings();
    let window = std::time::Duration::from_secs(u64::from(WINDOW));
    let mut cache =
        SharedCache::new(s.redis_client().unwrap(), &env.redis_prefix, &env.topic, 4096, 1, window, s.redis.timeout);
    let mut model = Model::default();
    let mut rng = StdRng::seed_from_u64(seed);
    // Few click IDs over few shards, so that entries collect several partitions' chains.
    let ids: Vec<Fingerprint> = (0..40u128).map(|i| Fingerprint(((i % 5) << 96) | (i * 7919))).collect();
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut clock: HashMap<i32, u32> = HashMap::new();
    let mut checked = 0;
    for round in 0..100 {
        // Now and then a reader starts over from an earlier offset (a re-read), or after a
        // lost cache (a restart whose warm-up makes the cache exact only from a boundary).
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
            let mode =
                ClaimMode { pin: rng.random_bool(0.05).then_some(Pin::CrossDuplicate), warm: rng.random_bool(0.1) };
            let sighting = Sighting { partition: p, offset: *o, clock: *now };
            claims.push(Claim { fingerprint: ids[rng.random_range(0..ids.len())], sighting, mode });
            *o += 1;
        }
        let from_redis = cache.claim(&claims).await.unwrap();
        let from_model: Vec<Verdict> = claims.iter().map(|c| model.claim(c)).collect();
        for (i, (r, m)) in from_redis.iter().zip(&from_model).enumerate() {
            assert_eq!(r, m, "seed {seed}, round {round}, claim {i}: {:?}", claims[i]);
        }
        checked += claims.len();
    }
    assert!(checked > 5_000, "{checked} claims compared");
}
