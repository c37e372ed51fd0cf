//! Test helpers, one file per concern:
//!
//! - [`browser`]: the status page in headless Chromium, and its DOM contract;
//! - [`env`]: the test's own slice of the shared services (`TestEnv`), producing clicks,
//!   reading billing counts;
//! - [`process`]: the `clickagg` child processes (`Member`) and their captured output;
//! - [`stack`]: private service instances a fault test may stop (`PrivateStack`);
//! - [`kafka`]: reading topics and group offsets back;
//! - [`http`]: the member's HTTP endpoints and the metrics text;
//! - [`registry`]: the schema registry, registering the generator's schemas;
//! - [`wait`]: the one way to wait for a condition (`wait_until`);
//! - [`cache_model`]: the Rust model of the Redis dedup cache, to compare `claim.lua` with;
//! - [`cluster`]: the cluster stack (`scripts/stack up cluster`) and its nodes.

pub mod browser;
pub mod cache_model;
// Only the cluster test target (tests/cluster) uses it.
#[allow(dead_code)]
pub mod cluster;
pub mod env;
pub mod http;
pub mod kafka;
pub mod process;
pub mod registry;
pub mod stack;
pub mod wait;

pub use env::{redis_url, StoredRow, TestEnv};
pub use http::metric_value;
pub use kafka::{positions_of_keys, read_dead_letters, source_payload};
pub use process::{wait_ready, Member};
pub use stack::PrivateStack;
pub use wait::{equals, wait_until};
