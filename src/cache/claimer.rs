//! The claim task of a member: the one place a member's claims reach the shared cache,
//! in the order the poll batches were read, while the member decodes the next batch.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::error::DedupError;
use super::shared::SharedCache;
use crate::dedup::Verdict;
use crate::dedup::{Claim, ClaimBatch};
use crate::health::RedisTrouble;
use crate::retry::{Retry, Stopped};

/// The claim task of a member: applies each poll batch's claims in the order they were
/// handed over (the cache's decisions depend on that order), retrying while Redis is
/// unavailable — dedup is never skipped — so the member can decode the next poll batch
/// while one is in flight. The verdicts come back in the same order on the receiver
/// `start` returns, one answer per batch (a batch without claims is answered at once,
/// in its turn).
pub struct Claimer {
    // Unbounded: the member loop bounds what it hands over (two batches in flight,
    // fewer than that reaching it while consumption is paused), and must never block
    // here, or it would stop polling Kafka and be evicted from the group.
    tx: tokio::sync::mpsc::UnboundedSender<ClaimBatch>,
    /// Cancelled when the member drops its handle: a claim still being retried then
    /// has nobody to answer.
    stop: CancellationToken,
}

impl Drop for Claimer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The verdicts of the handed-over batches, in order.
pub type Verdicts = tokio::sync::mpsc::Receiver<Result<Vec<Verdict>, DedupError>>;

impl Claimer {
    pub fn start(
        mut cache: SharedCache,
        max_backoff: Duration,
        health: std::sync::Arc<crate::health::Health>,
    ) -> (Claimer, Verdicts) {
        use crate::telemetry as t;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ClaimBatch>();
        let (answer_tx, answers) = tokio::sync::mpsc::channel(4);
        let stop = CancellationToken::new();
        let handle_stop = stop.clone();
        tokio::spawn(async move {
            let log_limit = t::RateLimiter::new(Duration::from_secs(5));
            // Per partition, the reader generation whose sighting had to wait: its later
            // claims, already handed over, must not be decided before that sighting (the
            // reader is rewound to it and claims them again under a new generation).
            let mut waiting: std::collections::HashMap<i32, u64> = std::collections::HashMap::new();
            let mut clock = t::StageClock::new("claimer");
            while let Some(batch) = rx.recv().await {
                clock.mark("idle");
                let stale = |i: usize| {
                    let p = batch.claims[i].sighting.partition;
                    waiting.get(&p).is_some_and(|&g| batch.generations[i] <= g)
                };
                let (sent, held): (Vec<usize>, Vec<usize>) = (0..batch.claims.len()).partition(|&i| !stale(i));
                for &i in &sent {
                    waiting.remove(&batch.claims[i].sighting.partition);
                }
                let claims: Vec<Claim> = sent.iter().map(|&i| batch.claims[i]).collect();
                // Marks of a reader generation that had to wait are stale like its claims.
                let marks: Vec<crate::dedup::Sighting> = batch
                    .marks
                    .iter()
                    .filter(|(s, g)| !waiting.get(&s.partition).is_some_and(|w| g <= w))
                    .map(|&(s, _)| s)
                    .collect();
                let mut retry = Retry::new(max_backoff, &stop);
                let answer = loop {
                    match cache.claim_marked(&claims, &marks).await {
                        Ok(v) => {
                            health.set_claims_failing(None);
                            let mut all = vec![Verdict::Wait; batch.claims.len()];
                            for (&i, verdict) in sent.iter().zip(v) {
                                if verdict == Verdict::Wait {
                                    let p = batch.claims[i].sighting.partition;
                                    let g = waiting.entry(p).or_insert(batch.generations[i]);
                                    *g = (*g).max(batch.generations[i]);
                                }
                                all[i] = verdict;
                            }
                            debug_assert!(held.iter().all(|&i| all[i] == Verdict::Wait));
                            break Ok(all);
                        }
                        Err(e) if e.is_lost() => break Err(e),
                        Err(e) => {
                            let transient = |e: &DedupError| {
                                // The member loop pauses consumption while this is set.
                                let trouble = e.trouble().unwrap_or(RedisTrouble::Unreachable);
                                health.set_claims_failing(Some(trouble));
                                metrics::counter!(t::REDIS_ERRORS, "kind" => trouble.label()).increment(1);
                                metrics::counter!(t::REDIS_RETRIES).increment(1);
                                if log_limit.allow("redis", std::time::Instant::now()).is_some() {
                                    tracing::warn!(error = %e, "dedup failed; retrying with backoff");
                                }
                            };
                            match retry.after(e, transient).await {
                                Ok(()) => {}
                                Err(Stopped::Fatal(e)) => break Err(e),
                                // The member is gone (its handle dropped): nobody waits any more.
                                Err(Stopped::ShutDown) => return,
                            }
                        }
                    }
                };
                clock.mark("busy");
                if answer_tx.send(answer).await.is_err() {
                    return;
                }
                clock.mark("blocked");
            }
        });
        (Claimer { tx, stop: handle_stop }, answers)
    }

    /// Hands one poll batch's claims over.
    pub fn claim(&self, batch: ClaimBatch) {
        let _ = self.tx.send(batch);
    }
}
