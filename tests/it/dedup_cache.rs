//! The Redis function (`claim.lua`) against its Rust statement (`dedup::decide_shared`),
//! through `helpers::cache_model`: on one key group, and on three.

use std::collections::HashSet;
use std::time::Duration;

use clickagg::cache::{Claimer, DedupError, SharedCache};
use clickagg::dedup::{Claim, ClaimBatch, ClaimMode, Fingerprint, ReaderClaim, ReaderMark, Secs, Sighting, Verdict};
use clickagg::health::Health;

use crate::helpers::cache_model::{compare, compare_all, Compared, SHARDS, WINDOW};
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
        Secs::new(window),
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

/// Issue 35, defect 4, as the issue tells it: a click retried for longer than `window +
/// max_record_lag`, each retry within the window of the one before, must stay a duplicate
/// however often the sweeper walks (it deletes an item `window + max_record_lag` after
/// its *last* sighting). Here the click is its partition's first record, judged ahead of
/// no clock until the next record starts the clock and confirms it; its retries continue
/// it in a chain of their own, whose start is a duplicate. `claim.lua` swept that chain
/// by its first sighting, and the retry after counted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_retried_past_the_window_and_lag_stays_a_duplicate_across_sweeps() {
    let env = TestEnv::new("luaretried").await;
    let mut cache = cache_in_groups(&env, 1);
    cache.open().await.unwrap();
    let (click, other) = (Fingerprint((7 << 96) | 1), Fingerprint((8 << 96) | 2));
    let lag = Duration::from_secs(40);
    let live = ClaimMode::default();
    let t0 = 1_000_000;
    // The partition's first record, judged ahead of no clock; the next starts the clock.
    let first = Claim {
        fingerprint: click,
        sighting: Sighting { partition: 0, offset: 0, clock: Secs::new(t0), now: Secs::new(0) },
        mode: live,
    };
    assert_eq!(cache.claim(&[first]).await.unwrap(), vec![Verdict::First]);
    let confirm = Claim {
        sighting: Sighting { now: Secs::new(t0), ..first.sighting },
        mode: ClaimMode { confirm: true, ..live },
        ..first
    };
    let next = Claim { fingerprint: other, sighting: Sighting::at(0, 1, Secs::new(t0)), mode: live };
    assert_eq!(cache.claim(&[confirm, next]).await.unwrap()[1], Verdict::First);
    // Retries every 15 s (the window is 20 s) for three minutes, the member live: its
    // sweeper walks a second after each, at the wall clock's cutoff.
    for i in 0..12u32 {
        let clock = t0 + 5 + 15 * i;
        let retry =
            Claim { fingerprint: click, sighting: Sighting::at(0, 2 + i64::from(i), Secs::new(clock)), mode: live };
        let verdict = cache.claim(&[retry]).await.unwrap();
        assert_eq!(verdict, vec![Verdict::Duplicate], "the retry at {} s", clock - t0);
        let wall = i64::from(clock) + 1;
        let cutoff = clickagg::cache::sweeper::sweep_cutoff(wall, Duration::from_secs(WINDOW.into()), lag, None);
        cache.sweep(0..SHARDS, cutoff).await.unwrap();
    }
}

/// Issue 35, defect 4: `claim.lua`'s sweep kept a chain that continues a sighting judged
/// ahead (its start a duplicate, a 17-byte item) by the reach stored at its first
/// sighting, not by its latest, so a click retried for longer than `window +
/// max_record_lag` lost its chain to the sweeper and counted again. The comparison
/// interleaves sweeps with the claims; this test runs the histories that make such chains
/// (jumpy seeds) and those that keep the partitions together, on one key group and on
/// three, and checks that they met what the sweep must keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_function_sweeps_as_the_rust_model_does() {
    let mut seen = Compared::default();
    for (seed, groups) in [(31, 1), (32, 1), (33, 3), (34, 3), (35, 1), (37, 3), (39, 1), (41, 3)] {
        let env = TestEnv::new("luasweep").await;
        let compared = compare_all(cache_in_groups(&env, groups), seed, Some(&env)).await;
        eprintln!("seed {seed}, {groups} key groups: {compared:?}");
        seen += compared;
    }
    eprintln!("compared: {seen:?}");
    assert!(seen.claims > 60_000 && seen.sweeps > 800, "{seen:?}");
    assert!(seen.swept > 10_000, "sweeps removed items: {seen:?}");
    assert!(seen.kept_by_latest >= 20, "chains kept by their latest sighting, past their first: {seen:?}");
    assert!(seen.kept_unclocked >= 100, "items of partitions without a clock kept: {seen:?}");
    assert!(seen.losses >= 16, "caches lost and moved to a new namespace: {seen:?}");
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
                sighting: Sighting::at(0, o, Secs::new(1_000)),
                mode: ClaimMode::default(),
            })
            .map(|claim| ReaderClaim { claim, generation: 0 })
            .collect(),
        marks: vec![ReaderMark { last: Sighting::at(0, from + 49, Secs::new(1_000)), generation: 0 }],
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
