//! What a member serves on `http.addr`: `/metrics` (Prometheus text), `/livez`,
//! `/readyz`, and its status page `/` (`assets/status.html`, which polls
//! `/status.json`, see `status`).
//!
//! Ready means: partitions assigned, and Redis and ClickHouse answered their last
//! check. The pipeline flips the Redis and ClickHouse flags on every success and error
//! it sees; a probe re-checks both every few seconds so an idle member notices too.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Html;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::dedup::SharedCache;
use crate::sink::Sink;
use crate::status::{self, StatusBoard};
use crate::telemetry as t;

/// The status page, self-contained: the member's port may be all that is reachable.
const STATUS_PAGE: &str = include_str!("../assets/status.html");

/// What `/readyz` and the status page report; shared by the pipeline, the flusher,
/// the probe and the HTTP server.
#[derive(Debug, Default)]
pub struct Health {
    assigned_partitions: AtomicUsize,
    redis_ok: AtomicBool,
    /// Why claims fail right now ([`RedisTrouble`] as u8, 0 while they succeed). Kept
    /// apart from `redis_ok`, which the probe's PING sets: a Redis out of memory or
    /// read-only still answers PING, but the member cannot claim.
    claims_failing: AtomicU8,
    clickhouse_ok: AtomicBool,
    /// Here because every stage that reports to it already holds the `Health`.
    status: StatusBoard,
}

/// Why Redis refuses claims; decides the readiness reason and the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RedisTrouble {
    Unreachable = 1,
    OutOfMemory = 2,
    ReadOnly = 3,
    /// Claims wait while other partitions' dedup state is rebuilt from the log (after
    /// the cache was lost).
    Rebuilding = 4,
}

impl RedisTrouble {
    pub const ALL: [RedisTrouble; 4] =
        [RedisTrouble::Unreachable, RedisTrouble::OutOfMemory, RedisTrouble::ReadOnly, RedisTrouble::Rebuilding];

    /// Reads a Redis error: OOM (maxmemory reached with noeviction) and READONLY (the
    /// node became a replica, e.g. after a failover) are the two ways a reachable Redis
    /// refuses writes; anything else counts as unreachable.
    pub fn of(error: &redis::RedisError) -> RedisTrouble {
        match error.code() {
            Some("OOM") => RedisTrouble::OutOfMemory,
            Some("READONLY") => RedisTrouble::ReadOnly,
            _ => RedisTrouble::Unreachable,
        }
    }

    /// The `kind` label of `clickagg_redis_errors_total`.
    pub fn label(self) -> &'static str {
        match self {
            RedisTrouble::Unreachable => "unreachable",
            RedisTrouble::OutOfMemory => "out_of_memory",
            RedisTrouble::ReadOnly => "read_only",
            RedisTrouble::Rebuilding => "rebuilding",
        }
    }

    fn reason(self) -> &'static str {
        match self {
            RedisTrouble::Unreachable => "redis unreachable",
            RedisTrouble::OutOfMemory => "redis out of memory: claims refused (raise maxmemory)",
            RedisTrouble::ReadOnly => "redis read-only: claims refused (point redis.url at the master)",
            RedisTrouble::Rebuilding => "dedup cache being rebuilt from the log after it was lost",
        }
    }
}

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health::default())
    }

    pub fn set_assigned(&self, n: usize) {
        self.assigned_partitions.store(n, Ordering::Relaxed);
    }

    pub fn set_redis(&self, ok: bool) {
        self.redis_ok.store(ok, Ordering::Relaxed);
    }

    /// Records the outcome of a claim request: `None` on success.
    pub fn set_claims_failing(&self, trouble: Option<RedisTrouble>) {
        self.claims_failing.store(trouble.map_or(0, |t| t as u8), Ordering::Relaxed);
        if trouble.is_none() {
            self.set_redis(true);
        }
    }

    /// Whether the last claim request failed: consumption pauses until one succeeds.
    pub fn claims_failing(&self) -> Option<RedisTrouble> {
        RedisTrouble::ALL.into_iter().find(|&t| t as u8 == self.claims_failing.load(Ordering::Relaxed))
    }

    pub fn set_clickhouse(&self, ok: bool) {
        self.clickhouse_ok.store(ok, Ordering::Relaxed);
    }

    /// The state behind `/status.json`.
    pub fn status(&self) -> &StatusBoard {
        &self.status
    }

    /// `Ok` when ready, otherwise the reasons it is not.
    pub fn readiness(&self) -> Result<(), Vec<&'static str>> {
        let mut not = Vec::new();
        if self.assigned_partitions.load(Ordering::Relaxed) == 0 {
            not.push("no partitions assigned");
        }
        match self.claims_failing() {
            Some(trouble) => not.push(trouble.reason()),
            None if !self.redis_ok.load(Ordering::Relaxed) => not.push(RedisTrouble::Unreachable.reason()),
            None => {}
        }
        if !self.clickhouse_ok.load(Ordering::Relaxed) {
            not.push("clickhouse unreachable");
        }
        if not.is_empty() {
            Ok(())
        } else {
            Err(not)
        }
    }
}

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
    // Computed when scraped, so it is never older than the scrape.
    metrics::gauge!(t::READY).set(if s.health.readiness().is_ok() { 1.0 } else { 0.0 });
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
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        health.set_redis(redis.ping().await.is_ok());
        health.set_clickhouse(clickhouse.ping().await.is_ok());
    }
}
