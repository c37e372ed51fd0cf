//! Integration tests against the real Kafka, Redis and ClickHouse started by
//! `scripts/stack up`. One binary, one module per concern; `helpers` gives each test
//! its own topic, group, Redis prefix and ClickHouse database.

mod backfill;
mod cache_trust;
mod codecs;
mod dead_letters;
mod decisions;
mod dedup_cache;
mod deploy;
mod exactly_once;
mod faults;
mod formats;
mod helpers;
mod operability;
mod periods;
mod platforms;
mod query;
mod robustness;
mod sealing;
mod status;
