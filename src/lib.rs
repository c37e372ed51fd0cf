//! clickagg: exactly-once, billable per-ad per-minute click counts from a Kafka topic
//! into ClickHouse.
//!
//! # Layout
//!
//! Bottom-up; a module imports only modules below it (`ARCHITECTURE.md`, "Layers"):
//!
//! - [`click`], [`retry`], [`secrets`]: the click event and its rules; waiting out a
//!   failing service (transient → retry with backoff, fatal → stop); values that never print.
//! - [`dedup`], [`aggregate`]: which clicks count (the definition, record clocks, pure
//!   decisions, the private state a reader rebuilds from the log); offset-aligned batches.
//! - [`config`], [`position`], [`sealing`]: typed settings; where a reader starts a
//!   partition; when an hour is due for sealing, how a seal is versioned and how a read
//!   splits into sealed and minute rows.
//! - [`source`], [`schema_registry`], [`sink`], [`cache`], [`dead_letter`], [`telemetry`],
//!   [`status`], [`health`]: Kafka, the Avro and Protobuf schemas by ID (fetched once and
//!   kept), ClickHouse, the Redis cache of dedup state, the dead-letter topic, logs and
//!   metrics, what a member reports and the flags readiness is made of.
//! - [`pipeline`]: the stages' state and what they do to a poll batch (no I/O).
//! - [`planner`], [`flusher`], [`seal`]: the look-ups that decide where readers start;
//!   durable writes, then commits; the sealer's rounds, which compact settled minute rows
//!   into sealed hours and days and re-seal them when those change, with the lease that
//!   keeps one sealer at a time.
//! - [`member`], [`replay`], [`reconcile`], [`query`], [`explain`], [`server`],
//!   [`produce`], [`verify`]: the processes and what they serve.
//! - [`commands`]: the flags and one function per subcommand.
//! - `model` (tests only): the property test of the whole arrangement. It drives the
//!   pure pieces of every layer and mirrors the steps that do I/O, so it sits above them
//!   all, beside `commands`, and nothing imports it.
//!
//! `ARCHITECTURE.md` draws the stages and says which steps are safe to replay.

// Before the modules: `stop_point!` is used by name in them.
#[cfg(feature = "test-hooks")]
#[macro_use]
mod test_hooks;
/// A point where the integration tests may kill the process (`test_hooks`); nothing
/// in a build without the `test-hooks` feature.
#[cfg(not(feature = "test-hooks"))]
macro_rules! stop_point {
    ($step:literal) => {};
}

pub mod aggregate;
pub mod cache;
pub mod click;
pub mod close;
pub mod commands;
pub mod config;
pub mod dead_letter;
pub mod dedup;
pub mod explain;
pub mod flusher;
pub mod health;
pub mod member;
#[cfg(test)]
mod model;
pub mod pipeline;
pub mod planner;
pub mod position;
pub mod produce;
pub mod query;
pub mod readiness;
pub mod reconcile;
pub mod record;
pub mod replay;
pub mod retry;
pub mod schema_registry;
pub mod seal;
pub mod sealing;
pub mod secrets;
pub mod server;
pub mod sink;
pub mod source;
pub mod status;
pub mod telemetry;
pub mod time;
pub mod verify;
