//! What a member serves on `http.addr`: `/metrics` (Prometheus text), `/livez`,
//! `/readyz`, and its status page `/` (`assets/status.html`, which polls
//! `/status.json`, see `status`); and the probe that re-checks Redis and ClickHouse
//! for an idle member.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Html;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::cache::SharedCache;
use crate::health::Health;
use crate::sink::Sink;
use crate::status;
use crate::telemetry as t;

/// The status page, self-contained: the member's port may be all that is reachable.
const STATUS_PAGE: &str = include_str!("../assets/status.html");

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    metrics: PrometheusHandle,
}

/// Binds `addr` and serves until `shutdown`; returns the bound address (port 0 picks one).
pub async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    metrics: PrometheusHandle,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let app = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route("/status.json", get(status_json))
        .with_state(AppState { health, metrics });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
        if let Err(e) = served {
            tracing::error!(error = %e, "health server stopped");
        }
    });
    Ok((bound, task))
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    match s.health.readiness() {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(reasons) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", reasons.join(", "))),
    }
}

async fn metrics_text(State(s): State<AppState>) -> String {
    // Computed when scraped, so they are never older than the scrape.
    metrics::gauge!(t::READY).set(if s.health.readiness().is_ok() { 1.0 } else { 0.0 });
    t::collect_process_metrics();
    s.metrics.render()
}

async fn status_json(State(s): State<AppState>) -> ([(header::HeaderName, &'static str); 2], String) {
    let snapshot = s.health.status().snapshot(s.health.readiness(), &s.metrics.render(), status::unix_now());
    let body = serde_json::to_string(&snapshot).expect("plain data with string keys serializes");
    ([(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-store")], body)
}

/// Re-checks Redis and ClickHouse every `every` until `shutdown`.
pub async fn probe(
    health: Arc<Health>,
    mut redis: SharedCache,
    clickhouse: Sink,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    while tick(&mut ticker, &shutdown).await {
        health.set_redis(redis.ping().await.is_ok());
        health.set_clickhouse(clickhouse.ping().await.is_ok());
    }
}

/// Samples the counters of `metrics` into the status board every `every` until `shutdown`, so
/// `/status.json` can report rates whether or not anyone is looking.
pub async fn sample_forever(
    health: Arc<Health>,
    metrics: PrometheusHandle,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    while tick(&mut ticker, &shutdown).await {
        health.status().sample(&metrics.render(), status::unix_now());
    }
}

/// The next tick, or `false` once `shutdown` is cancelled.
async fn tick(ticker: &mut tokio::time::Interval, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = ticker.tick() => true,
    }
}
