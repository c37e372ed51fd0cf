//! clickagg: exactly-once, billable per-ad per-minute click counts from a Kafka topic
//! into ClickHouse.
//!
//! # Layout
//!
//! Floor by floor, bottom-up; a module imports only modules on floors below it
//! (`ARCHITECTURE.md`, "Floors: imports only point down"):
//!
//! 1. [`click`], [`dedup`], [`retry`], [`secrets`], [`readiness`], [`time`]: the click
//!    event and its rules; which clicks count (the definition, record clocks, pure
//!    decisions, the private state a reader rebuilds from the log); waiting out a failing
//!    service (transient → retry with backoff, fatal → stop); values that never print;
//!    what the adapters tell the member's readiness; times on the command line. (And
//!    `test_hooks`, the tests' kill points, only in builds with the `test-hooks` feature.)
//! 2. [`position`], [`record`], [`telemetry`]: where a reader starts a partition and the
//!    batch size; a decoded record and the decoder every reader uses; metric names.
//! 3. [`config`], [`aggregate`], [`sealing`], [`status`], [`dead_letter`]: typed settings
//!    and the recorded rules; offset-aligned batches; when an hour is due for sealing,
//!    how a seal is versioned and how a read splits into sealed and minute rows; what a
//!    member reports; the dead-letter topic.
//! 4. [`source`], [`schema_registry`], [`cache`], [`sink`], [`pipeline`], [`health`],
//!    [`verify`]: the adapters side by side (Kafka, the Avro and Protobuf schemas by ID,
//!    the Redis cache of dedup state, ClickHouse), none importing another; the stages'
//!    state and what they do to a poll batch (no I/O); the flags readiness is made of.
//! 5. [`planner`], [`flusher`], [`seal`], [`server`], [`produce`]: the look-ups that
//!    decide where readers start; durable writes, then commits; the sealer's rounds,
//!    which compact settled minute rows into sealed hours and days and re-seal them when
//!    those change, with the lease that keeps one sealer at a time; HTTP; load.
//! 6. [`member`], [`replay`], [`explain`], [`reconcile`], [`query`], [`close`]: the
//!    processes, none importing another.
//! 7. [`commands`]: the flags and one function per subcommand.
//!
//! `model` (tests only), the property test of the whole arrangement, drives the pure
//! pieces of every floor and mirrors the steps that do I/O; nothing imports it.
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
