//! The Redis function (`claim.lua`) against its Rust statement (`dedup::decide_shared`),
//! through `helpers::cache_model`: on one key group, and on three.

use std::collections::HashSet;

use clickagg::cache::SharedCache;

use crate::helpers::cache_model::{compare, SHARDS, WINDOW};
use crate::helpers::TestEnv;

/// The test's dedup cache, spread over `groups` key groups.
fn cache_in_groups(env: &TestEnv, groups: u32) -> SharedCache {
    let s = env.settings();
    let window = WINDOW;
    SharedCache::new(
        clickagg::cache::RedisTarget::client(&s.redis).unwrap(),
        &env.redis_prefix,
        &env.topic,
        SHARDS,
        groups,
        window,
        s.redis.timeout,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_function_decides_every_claim_as_the_rust_model_does() {
    for seed in 0..4 {
        let env = TestEnv::new("luamodel").await;
        let cache = cache_in_groups(&env, 1);
        let checked = compare(cache, seed).await;
        assert!(checked > 5_000, "{checked} claims compared");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_function_decides_as_the_rust_model_does_with_the_cache_in_three_key_groups() {
    // Key groups on one Redis: what a Redis Cluster does, minus the network.
    for seed in 10..12 {
        let env = TestEnv::new("luagroups").await;
        let cache = cache_in_groups(&env, 3);
        let checked = compare(cache, seed).await;
        assert!(checked > 5_000, "{checked} claims compared");
        let keys = env.dedup_keys().await;
        let tags: HashSet<&str> = keys.iter().filter_map(|k| k.split(['{', '}']).nth(1)).collect();
        assert_eq!(tags.len(), 3, "three hash tags, one per group: {tags:?}");
    }
}
