//! clickagg: exactly-once, billable per-ad per-minute click counts from a Kafka topic
//! into ClickHouse.
//!
//! # Layout
//!
//! In pipeline order:
//!
//! - [`config`]: typed settings (defaults < TOML < `CLICKAGG__…` env < flags), secrets.
//! - [`telemetry`]: logs, metric names, the log rate limiter.
//! - [`click`]: the click event, its newtypes, and the decode/validate rules.
//! - [`schema_registry`]: the Avro and Protobuf schemas by ID, fetched once and kept.
//! - [`source`]: Kafka client settings, consumed records, topic and offset look-ups.
//! - [`dead_letter`]: rejected records to the dead-letter topic, with reason headers.
//! - [`dedup`]: which clicks count (the definition), the Redis cache of that state and
//!   the private state a reader rebuilds from the log.
//! - [`position`]: where a reader starts a partition: a batch boundary, after a warm-up.
//! - [`aggregate`]: pure per-partition, offset-aligned batches of counts → flushes.
//! - [`sink`]: ClickHouse migrations, the idempotent insert, billing reads.
//! - [`pipeline`]: the stages' state and what they do to a poll batch.
//! - [`member`]: the consumer-group loop, rebalance callbacks and the drain.
//! - [`health`]: `/metrics`, `/livez`, `/readyz` and the status page `/` on `http.addr`.
//! - [`status`]: what a member reports about itself (`/status.json`) and the group view
//!   of `clickagg status`.
//! - [`replay`]: backfill by re-reading a range of the topic through the same stages.
//! - [`query`]: billing counts per ad and minute, hour or day, read through `FINAL`.
//! - [`reconcile`]: an independent recount of the topic, diffed against ClickHouse.
//! - [`produce`], [`verify`]: the seeded load generator with its ground truth, and the diff.
//! - [`cli`], [`commands`]: flags and one function per subcommand.
//!
//! `ARCHITECTURE.md` draws the stages and says which steps are safe to replay.

pub mod aggregate;
pub mod cache;
pub mod click;
pub mod commands;
pub mod config;
pub mod dead_letter;
pub mod dedup;
pub mod flusher;
pub mod health;
pub mod member;
pub mod pipeline;
pub mod planner;
pub mod position;
pub mod produce;
pub mod query;
pub mod reconcile;
pub mod replay;
pub mod retry;
pub mod schema_registry;
pub mod secrets;
pub mod server;
pub mod sink;
pub mod source;
pub mod status;
pub mod telemetry;
pub mod verify;
