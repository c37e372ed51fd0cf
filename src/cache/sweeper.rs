//! The garbage collector of the shared cache: deletes what no reader can need any more.

use std::time::Duration;

use super::error::DedupError;
use super::shared::SharedCache;
use crate::dedup::Secs;

/// The garbage collector of the shared cache, run by every member: it walks all shards
/// once per quarter of `max_record_lag` (starting at a random shard, so members spread
/// out) and deletes entries whose last sighting is before [`sweep_cutoff`]: more than
/// `window + max_record_lag` before the wall clock, and more than a window before what
/// any lagging reader holds (`SharedCache::set_holds`). After each full walk the keys
/// of a namespace a renewal replaced are gone too. Errors are logged and the walk goes
/// on: a missed sweep only costs memory.
///
/// The first walk waits for `holds_given`: the member's loop cancels it once it gave the
/// holds of its first assignment. A group back after an outage longer than `window +
/// max_record_lag` left no hold behind (its readers did not lag when it went down), and
/// a walk before its readers say what they need would delete the sightings before the
/// outage that they still decide retries against.
pub async fn sweep_forever(
    mut cache: SharedCache,
    window: Duration,
    max_record_lag: Duration,
    holds_given: tokio_util::sync::CancellationToken,
    shutdown: tokio_util::sync::CancellationToken,
) {
    use rand::Rng;
    const TICK: Duration = Duration::from_secs(1);
    let shards = cache.shards();
    let cycle = (max_record_lag / 4).max(Duration::from_secs(60));
    let per_tick = ((u64::from(shards) * TICK.as_millis() as u64).div_ceil(cycle.as_millis() as u64)).max(1) as u32;
    let mut cursor = rand::rng().random_range(0..shards);
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = holds_given.cancelled() => {}
    }
    let mut ticker = tokio::time::interval(TICK);
    let mut failures = 0u64;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let end = (cursor + per_tick).min(shards);
        let swept = async {
            let held = cache.lowest_hold().await?;
            let cutoff = sweep_cutoff(chrono::Utc::now().timestamp(), window, max_record_lag, held);
            let removed = cache.sweep(cursor..end, cutoff).await?;
            if end >= shards {
                cache.forget_previous().await?;
            }
            Ok::<_, DedupError>(removed)
        };
        match swept.await {
            Ok(removed) => metrics::counter!(crate::telemetry::DEDUP_SWEPT).increment(removed),
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(error = %e, failures, "sweeping the dedup cache failed; retrying next tick");
                }
            }
        }
        cursor = if end >= shards { 0 } else { end };
    }
}

/// The record time before which the sweeper deletes sightings, at wall time `now` (s):
/// a window and `max_record_lag` before the wall clock, or a window before the lowest
/// record time a lagging reader holds, whichever is earlier. Every later sighting of a
/// reader has a record time at or after the one it holds (the clock never goes back),
/// so nothing within its window is collected however far behind it reads.
pub fn sweep_cutoff(now: i64, window: Duration, max_record_lag: Duration, held: Option<Secs>) -> Secs {
    let by_wall = now - (window + max_record_lag).as_secs() as i64;
    let by_hold = held.map_or(i64::MAX, |h| i64::from(h) - window.as_secs() as i64 - 1);
    Secs::new(by_wall.min(by_hold).clamp(0, i64::from(Secs::MAX)) as u32)
}
