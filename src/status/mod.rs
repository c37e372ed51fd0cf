//! How one member is doing ([`board`]): what `/status.json` on `http.addr` reports and
//! the page at `/` (`assets/status.html`) renders: identity, assigned partitions with
//! their positions, rates, freshness, readiness, clicks per minute. [`window`] turns the
//! member's own `/metrics` text into rates and quantiles. The whole group's view,
//! `clickagg status`, is a command (`commands::status`).

pub mod board;
pub mod window;

pub use board::{Identity, Snapshot, StatusBoard};

/// Unix time in seconds, as the flush timestamps are kept.
pub fn unix_now() -> f64 {
    chrono::Utc::now().timestamp_millis() as f64 / 1000.0
}
