//! The claim task of a member: the one place a member's claims reach the shared cache,
//! in the order the poll batches were read, while the member decodes the next batches.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesOrdered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::claims::{ClaimCalls, ClaimReply, ClaimSender};
use super::error::DedupError;
use super::shared::SharedCache;
use crate::dedup::{Claim, ClaimBatch, ReaderClaim, ReaderMark, Sighting, Verdict};
use crate::readiness::{ClaimsReport, RedisTrouble};
use crate::retry::{Retry, Stopped};
use crate::telemetry as t;

/// The claim task of a member: applies each poll batch's claims in the order they were
/// handed over (the cache's decisions depend on that order), retrying while Redis is
/// unavailable — dedup is never skipped — so the member can decode the next poll batches
/// while earlier ones are in flight. The verdicts come back in the same order on the
/// receiver `start` returns, one answer per batch (a batch without claims is answered
/// in its turn).
///
/// Up to `in_flight` batches' calls are in Redis at once, on one connection per node:
/// Redis runs them in the order sent, and each call carries where the previous batch of
/// each partition's reader left it (`prev`), so that a call after one whose sighting
/// waited — or that failed — applies nothing of that partition (its claims answer
/// [`Verdict::Wait`]: the reader is rewound and claims them again). A failed call is
/// claimed again with backoff after the calls behind it are answered, and those are sent
/// again after it: a claim sent again answers what it answered the first time.
pub struct Claimer {
    // Unbounded: the member loop bounds what it hands over, and must never block here,
    // or it would stop polling Kafka and be evicted from the group.
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

/// One batch handed over, its calls sent and not answered yet.
struct Sent {
    batch: ClaimBatch,
    /// The positions in `batch.claims` of the claims sent (the others are of a reader
    /// generation that had to wait: answered `Wait` without being sent).
    sent: Vec<usize>,
    claims: Vec<Claim>,
    reached: Vec<Sighting>,
    prev: BTreeMap<i32, i64>,
    calls: Option<ClaimCalls>,
    reply: Reply,
}

type Replies = Result<Vec<ClaimReply>, DedupError>;

/// The replies of one batch's calls: still running, or in (kept, since the replies of
/// calls behind a failed one are awaited before they are answered).
enum Reply {
    Running(oneshot::Receiver<Replies>),
    Done(Replies),
}

impl Reply {
    /// Waits for the calls to end. Cancel-safe: the replies are kept once in.
    async fn settle(&mut self) {
        if let Reply::Running(handle) = self {
            let replies = handle.await.unwrap_or_else(|_| Err(DedupError::unreachable("the claim sending task ended")));
            *self = Reply::Done(replies);
        }
    }

    /// The replies, once: a batch is answered once, or sent again first.
    async fn take(&mut self) -> Replies {
        self.settle().await;
        match std::mem::replace(self, Reply::Done(Err(DedupError::unreachable("claim replies taken twice")))) {
            Reply::Done(replies) => replies,
            Reply::Running(_) => unreachable!("settled above"),
        }
    }
}

/// The claim task's state between batches.
struct Task {
    cache: SharedCache,
    /// Per partition, the reader generation whose sighting had to wait: its later claims,
    /// already handed over, must not be decided before that sighting (the reader is
    /// rewound to it and claims them again under a new generation).
    waiting: HashMap<i32, u64>,
    /// Per partition, the reader generation and the mark of the last batch sent for it.
    sent_marks: HashMap<i32, (u64, i64)>,
    /// To [`send_in_order`]: the calls, in the order they must reach Redis.
    outbox: mpsc::UnboundedSender<Outgoing>,
}

/// One batch's calls to send, the connection to send them on, and where the replies go.
type Outgoing = (ClaimSender, Vec<redis::Cmd>, oneshot::Sender<Replies>);

/// Sends the calls handed over in that order, several in flight. A call's first poll
/// puts its request on the connection, and `FuturesOrdered` first polls its calls in
/// the order pushed, so Redis receives them in batch order. (A task spawned per call
/// could overtake the one before: its `prev` is then refused and its partitions rewound
/// and claimed again. That stays exact, but it cost a round trip and a 300 ms pause of
/// the partition each time, and the drain gained nothing from the calls in flight.)
async fn send_in_order(mut outbox: mpsc::UnboundedReceiver<Outgoing>) {
    let mut sending = FuturesOrdered::new();
    loop {
        tokio::select! {
            biased;
            _ = sending.next(), if !sending.is_empty() => {}
            next = outbox.recv() => match next {
                Some((sender, calls, reply)) => sending.push_back(async move {
                    let _ = reply.send(sender.send(calls).await);
                }),
                None => break,
            },
        }
    }
    while sending.next().await.is_some() {}
}

impl Task {
    /// Sends one batch's calls, with each partition's `prev` (the mark of the last batch
    /// sent by the same reader generation).
    async fn send(&mut self, batch: ClaimBatch) -> Sent {
        let stale = |c: &ReaderClaim| self.waiting.get(&c.claim.sighting.partition).is_some_and(|&g| c.generation <= g);
        let (sent, _held): (Vec<usize>, Vec<usize>) = (0..batch.claims.len()).partition(|&i| !stale(&batch.claims[i]));
        for &i in &sent {
            self.waiting.remove(&batch.claims[i].claim.sighting.partition);
        }
        let claims: Vec<Claim> = sent.iter().map(|&i| batch.claims[i].claim).collect();
        // Marks of a reader generation that had to wait are stale like its claims.
        let marks: Vec<ReaderMark> = batch
            .marks
            .iter()
            .filter(|m| self.waiting.get(&m.last.partition).is_none_or(|&w| m.generation > w))
            .copied()
            .collect();
        let prev: BTreeMap<i32, i64> = marks
            .iter()
            .filter_map(|m| match self.sent_marks.get(&m.last.partition) {
                Some(&(sent_g, o)) if sent_g == m.generation => Some((m.last.partition, o)),
                _ => None,
            })
            .collect();
        let reached: Vec<Sighting> = marks.iter().map(|m| m.last).collect();
        let mut out = Sent { batch, sent, claims, reached, prev, calls: None, reply: Reply::Done(Ok(Vec::new())) };
        self.dispatch(&mut out).await;
        for m in marks {
            let p = m.last.partition;
            let mark = out.calls.as_ref().and_then(|c| c.marks().find(|&(q, _)| q == p)).map(|(_, o)| o);
            if let Some(o) = mark {
                self.sent_marks.insert(p, (m.generation, o));
            }
        }
        out
    }

    /// Builds the calls of `s` and sends them (again, after a failure).
    async fn dispatch(&mut self, s: &mut Sent) {
        let built = async {
            let calls = self.cache.claim_calls(&s.claims, &s.reached, &s.prev).await?;
            let sender = self.cache.sender().await?;
            Ok::<_, DedupError>((calls, sender))
        };
        match built.await {
            Ok((calls, sender)) => {
                let (tx, rx) = oneshot::channel();
                let _ = self.outbox.send((sender, calls.calls.clone(), tx));
                s.reply = Reply::Running(rx);
                s.calls = Some(calls);
            }
            Err(e) => {
                s.calls = None;
                s.reply = Reply::Done(Err(e));
            }
        }
    }

    /// The answer of the oldest batch: its verdicts in the order of its claims, or why
    /// there are none.
    fn answer(&mut self, s: &Sent, replies: Replies) -> Result<Vec<Verdict>, DedupError> {
        let v = match &s.calls {
            Some(calls) => self.cache.answer(calls, &s.claims, replies)?,
            None => return Err(replies.err().unwrap_or_else(|| DedupError::unreachable("no claim calls"))),
        };
        let mut all = vec![Verdict::Wait; s.batch.claims.len()];
        for (&i, verdict) in s.sent.iter().zip(v) {
            if verdict == Verdict::Wait {
                let ReaderClaim { claim, generation } = s.batch.claims[i];
                let g = self.waiting.entry(claim.sighting.partition).or_insert(generation);
                *g = (*g).max(generation);
            }
            all[i] = verdict;
        }
        Ok(all)
    }
}

impl Claimer {
    /// Starts the task; at most `in_flight` batches' calls are in Redis at once.
    pub fn start(
        cache: SharedCache,
        max_backoff: Duration,
        in_flight: usize,
        report: Arc<dyn ClaimsReport>,
    ) -> (Claimer, Verdicts) {
        let (tx, mut rx) = mpsc::unbounded_channel::<ClaimBatch>();
        let (answer_tx, answers) = mpsc::channel(in_flight.max(1) + 2);
        let stop = CancellationToken::new();
        let handle_stop = stop.clone();
        let depth = in_flight.max(1);
        tokio::spawn(async move {
            let log_limit = t::RateLimiter::new(Duration::from_secs(5));
            let (outbox, to_send) = mpsc::unbounded_channel();
            tokio::spawn(send_in_order(to_send));
            let mut task = Task { cache, waiting: HashMap::new(), sent_marks: HashMap::new(), outbox };
            let mut queue: VecDeque<Sent> = VecDeque::new();
            let mut clock = t::StageClock::new("claimer");
            let mut open = true;
            while open || !queue.is_empty() {
                tokio::select! {
                    biased;
                    replies = async { queue.front_mut().expect("checked").reply.take().await }, if !queue.is_empty() => {
                        clock.mark("waiting_for_redis");
                        let mut front = queue.pop_front().expect("checked");
                        let mut answer = task.answer(&front, replies);
                        if matches!(&answer, Err(e) if !e.is_lost() && !matches!(e, DedupError::Fatal(_))) {
                            // The calls behind it may have run or not: let them end, claim this
                            // batch again, then send them again, in order.
                            for s in queue.iter_mut() {
                                s.reply.settle().await;
                            }
                            let mut retry = Retry::new(max_backoff, &stop);
                            loop {
                                match answer {
                                    Err(e) if !e.is_lost() && !matches!(e, DedupError::Fatal(_)) => {
                                        let transient = |e: &DedupError| {
                                            // The member loop pauses consumption while this is set.
                                            let trouble = e.trouble().unwrap_or(RedisTrouble::Unreachable);
                                            report.claims(Some(trouble));
                                            metrics::counter!(t::REDIS_ERRORS, "kind" => trouble.label()).increment(1);
                                            metrics::counter!(t::REDIS_RETRIES).increment(1);
                                            if log_limit.allow("redis", std::time::Instant::now()).is_some() {
                                                tracing::warn!(error = %e, "dedup failed; retrying with backoff");
                                            }
                                        };
                                        match retry.after(e, transient).await {
                                            Ok(()) => {}
                                            Err(Stopped::Fatal(e)) => {
                                                answer = Err(e);
                                                break;
                                            }
                                            // The member is gone (its handle dropped): nobody waits any more.
                                            Err(Stopped::ShutDown) => return,
                                        }
                                        task.dispatch(&mut front).await;
                                        let replies = front.reply.take().await;
                                        answer = task.answer(&front, replies);
                                    }
                                    _ => break,
                                }
                            }
                            // Sent again, the calls behind answer as the cache now stands
                            // (verdicts, or the loss the oldest found): never with the
                            // transient error they met before, which would stop the member.
                            if !matches!(answer, Err(DedupError::Fatal(_))) {
                                for s in queue.iter_mut() {
                                    task.dispatch(s).await;
                                }
                            }
                        }
                        if answer.is_ok() {
                            report.claims(None);
                        }
                        clock.mark("busy");
                        if answer_tx.send(answer).await.is_err() {
                            return;
                        }
                        clock.mark("blocked");
                    }
                    batch = rx.recv(), if open && queue.len() < depth => {
                        clock.mark("idle");
                        match batch {
                            Some(batch) => {
                                let sent = task.send(batch).await;
                                queue.push_back(sent);
                                clock.mark("busy");
                            }
                            None => open = false,
                        }
                    }
                }
            }
        });
        (Claimer { tx, stop: handle_stop }, answers)
    }

    /// Hands one poll batch's claims over.
    pub fn claim(&self, batch: ClaimBatch) {
        let _ = self.tx.send(batch);
    }
}
