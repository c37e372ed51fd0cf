//! The Redis function (`claim.lua`) against its Rust statement (`dedup::decide_shared`),
//! through `helpers::cache_model`: on one key group, and on three.

use std::collections::HashSet;
use std::time::Duration;

use clickagg::cache::{Claimer, DedupError, SharedCache};
use clickagg::dedup::{Claim, ClaimBatch, ClaimMode, Fingerprint, Sighting, Verdict};
use clickagg::health::Health;

use crate::helpers::cache_model::{compare, SHARDS, WINDOW};
use crate::helpers::{PrivateStack, TestEnv};

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

/// The claim task with several poll batches in flight when Redis goes away and comes
/// back empty: the oldest batch's call fails, is retried with backoff, and finds the
/// namespace gone. Every batch handed over must be answered, the oldest as lost, and none
/// with an error that would stop the member. Seen once in six runs of the zombie test
/// (`cache_trust`): the task polled the finished calls of the batches behind the oldest
/// again, panicked, and the member stopped with "the claim task stopped".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_in_flight_across_a_redis_restarted_empty_are_all_answered_the_oldest_as_lost() {
    let stack = PrivateStack::start("claimer-lost", &["redis"]).await;
    let env = TestEnv::with_stack("claimerlost", &stack).await;
    let mut cache = cache_in_groups(&env, 1);
    cache.open().await.unwrap();
    // Its reader planned, as a member's is before it claims: a call relies on the frontier
    // of every partition it reads through the cache.
    cache.restart(0, 0, 0).await.unwrap();
    // 50 new clicks of partition 0 from `from` on, marked up to the last.
    let batch = |from: i64| ClaimBatch {
        claims: (from..from + 50)
            .map(|o| Claim {
                fingerprint: Fingerprint(o as u128 * 7_919 + 1),
                sighting: Sighting::at(0, o, 1_000),
                mode: ClaimMode::default(),
            })
            .collect(),
        generations: vec![0; 50],
        marks: vec![(Sighting::at(0, from + 49, 1_000), 0)],
    };
    let (claimer, mut verdicts) = Claimer::start(cache.handle(), Duration::from_millis(300), 3, Health::new());
    claimer.claim(batch(0));
    let first = verdicts.recv().await.expect("the claim task runs").expect("claimed");
    assert_eq!(first, vec![Verdict::First; 50], "new clicks count");

    // Frozen, so that the three calls are all in Redis, unanswered, when the oldest
    // times out; then gone while the oldest is retried, and back empty.
    let pid = stack.pid("redis").await;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP to Redis (pid {pid})");
    for i in 1..=3 {
        claimer.claim(batch(i * 50));
    }
    tokio::time::sleep(env.settings().redis.timeout * 2 + Duration::from_secs(1)).await;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "SIGKILL to Redis (pid {pid})");
    stack.down("redis").await;
    stack.wipe_redis_data();
    stack.up("redis").await;

    let mut answers = Vec::new();
    for i in 1..=3 {
        let answer = tokio::time::timeout(Duration::from_secs(60), verdicts.recv())
            .await
            .unwrap_or_else(|_| panic!("batch {i} answered within 60 s"))
            .unwrap_or_else(|| panic!("the claim task still runs to answer batch {i}"));
        answers.push(answer);
    }
    assert!(matches!(answers[0], Err(DedupError::Lost(_))), "the oldest finds the cache lost: {:?}", answers[0]);
    for (i, a) in answers.iter().enumerate().skip(1) {
        assert!(matches!(a, Err(DedupError::Lost(_))), "batch {} behind it: lost too, not {a:?}", i + 1);
    }
}
