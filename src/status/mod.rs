//! How one member is doing ([`board`]): what `/status.json` on `http.addr` reports and
//! the page at `/` (`assets/status.html`) renders: identity, assigned partitions with
//! their positions, rates, freshness, readiness, clicks per minute. [`window`] turns the
//! member's own `/metrics` text into rates and quantiles. The whole group's view,
//! `clickagg status`, is a command (`commands::status`).

pub mod board;
pub mod window;

use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

pub use board::{Identity, Snapshot, StatusBoard};

/// Unix time in seconds, as the flush timestamps are kept.
pub fn unix_now() -> f64 {
    chrono::Utc::now().timestamp_millis() as f64 / 1000.0
}

/// Samples the counters of `metrics` into the status board every `every` until `shutdown`, so
/// `/status.json` can report rates whether or not anyone is looking.
pub async fn sample_forever(
    health: std::sync::Arc<crate::health::Health>,
    metrics: PrometheusHandle,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => health.status().sample(&metrics.render(), unix_now()),
        }
    }
}
