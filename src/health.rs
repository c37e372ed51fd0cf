//! How a member is doing, as flags every stage sets where it learns something: Redis
//! and ClickHouse answering, claims failing and why, and the status board
//! (`status::board`). The HTTP server (`server`) reads them back for `/readyz` and the
//! status page.
//!
//! Ready means the member can make progress: Redis and ClickHouse answered their last
//! check and Redis accepts its claims. Owning partitions is no part of it: a member
//! without any (more members than partitions, a surge pod of a rolling update, between
//! rebalances) is a ready standby; the status page shows what it owns. The pipeline
//! flips the Redis and ClickHouse flags on every success and error it sees; a probe
//! re-checks both every few seconds so an idle member notices too.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use crate::readiness::{ClaimsReport, RedisTrouble};
use crate::status::board::StatusBoard;

/// What `/readyz` and the status page report; shared by the pipeline, the flusher,
/// the probe and the HTTP server.
#[derive(Debug, Default)]
pub struct Health {
    redis_ok: AtomicBool,
    /// Why claims fail right now ([`RedisTrouble`] as u8, 0 while they succeed). Kept
    /// apart from `redis_ok`, which the probe's PING sets: a Redis out of memory or
    /// read-only still answers PING, but the member cannot claim.
    claims_failing: AtomicU8,
    clickhouse_ok: AtomicBool,
    /// Set while the schema registry does not answer (Avro and Protobuf topics): the
    /// poll batch waits for its schemas.
    schema_registry_down: AtomicBool,
    /// Set for good once the Kafka client reported a record batch it cannot decode:
    /// consumption stops there (`member::poll_loop`), and only an operator can help.
    undecodable: AtomicBool,
    /// Here for the HTTP server and the flusher, which hold the `Health`; the stages
    /// get a handle of their own ([`Health::board`]).
    status: Arc<StatusBoard>,
}

/// The readiness reason of a member stopped at a record batch it cannot decode.
pub const UNDECODABLE: &str = "kafka: the client cannot decode a record batch; consumption stopped, nothing past it \
     is counted or committed (see the log and clickagg_undecodable_batches_total)";

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health::default())
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

    pub fn set_schema_registry(&self, ok: bool) {
        self.schema_registry_down.store(!ok, Ordering::Relaxed);
    }

    /// Records that the Kafka client could not decode a record batch.
    pub fn set_undecodable(&self) {
        self.undecodable.store(true, Ordering::Relaxed);
    }

    /// Whether consumption stopped at a record batch the client cannot decode.
    pub fn undecodable(&self) -> bool {
        self.undecodable.load(Ordering::Relaxed)
    }

    /// The state behind `/status.json`.
    pub fn status(&self) -> &StatusBoard {
        &self.status
    }

    /// The status board, for the stages that record where their readers are.
    pub fn board(&self) -> Arc<StatusBoard> {
        self.status.clone()
    }

    /// `Ok` when ready, otherwise the reasons it is not.
    pub fn readiness(&self) -> Result<(), Vec<&'static str>> {
        let mut not = Vec::new();
        match self.claims_failing() {
            Some(trouble) => not.push(trouble.reason()),
            None if !self.redis_ok.load(Ordering::Relaxed) => not.push(RedisTrouble::Unreachable.reason()),
            None => {}
        }
        if !self.clickhouse_ok.load(Ordering::Relaxed) {
            not.push("clickhouse unreachable");
        }
        if self.schema_registry_down.load(Ordering::Relaxed) {
            not.push("schema registry unreachable: records wait for their schemas");
        }
        if self.undecodable() {
            not.push(UNDECODABLE);
        }
        if not.is_empty() {
            Ok(())
        } else {
            Err(not)
        }
    }
}

impl ClaimsReport for Health {
    fn claims(&self, trouble: Option<RedisTrouble>) {
        self.set_claims_failing(trouble);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_is_redis_and_clickhouse_answering_and_claims_accepted_with_or_without_partitions() {
        let h = Health::default();
        assert_eq!(h.readiness(), Err(vec!["redis unreachable", "clickhouse unreachable"]), "nothing checked yet");
        h.set_redis(true);
        h.set_clickhouse(true);
        assert_eq!(h.readiness(), Ok(()), "a member that owns no partition is a ready standby");
        h.set_claims_failing(Some(RedisTrouble::OutOfMemory));
        assert_eq!(h.readiness(), Err(vec![RedisTrouble::OutOfMemory.reason()]), "PING answers, claims do not");
        h.set_claims_failing(None);
        h.set_clickhouse(false);
        assert_eq!(h.readiness(), Err(vec!["clickhouse unreachable"]));
    }
}
