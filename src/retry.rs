//! Waiting out what fails for a while: one way to decide "retry or stop", one backoff,
//! one way to wait that a shutdown can interrupt.
//!
//! Every stage that talks to Kafka, Redis or ClickHouse meets failures of two kinds
//! (ARCHITECTURE.md, failure classes): *transient* ones (a service down, a failover,
//! a timeout), which are waited out with a growing, jittered delay, and *fatal* ones
//! (bad credentials, a missing table, a changed setting), which stop the member with a
//! message naming what to change. Errors say which kind they are ([`Retryable`]); the
//! loops that retry them go through [`Retry`] or [`until_done`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// An error that knows whether retrying can help.
pub trait Retryable: fmt::Display {
    /// Whether no retry can help (the member stops with the message).
    fn is_fatal(&self) -> bool;
}

/// Why a retried step stopped without succeeding.
#[derive(Debug)]
pub enum Stopped<E> {
    /// The step failed in a way no retry fixes.
    Fatal(E),
    /// Shut down (SIGTERM/SIGINT, or its owner gave up) while the step still failed.
    ShutDown,
}

impl<E> Stopped<E> {
    pub fn map<F>(self, f: impl FnOnce(E) -> F) -> Stopped<F> {
        match self {
            Stopped::Fatal(e) => Stopped::Fatal(f(e)),
            Stopped::ShutDown => Stopped::ShutDown,
        }
    }
}

/// Exponential backoff between retries of one failing step: 100 ms doubling up to the
/// maximum, each delay drawn from its upper half so that members failing together do not
/// retry together.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(max: Duration) -> Backoff {
        Backoff { next: Duration::from_millis(100), max }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next.min(self.max);
        self.next = (self.next * 2).min(self.max);
        let half = d / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    pub fn reset(&mut self) {
        self.next = Duration::from_millis(100);
    }
}

/// The retries of one failing step: classifies each failure, waits out the transient
/// ones with [`Backoff`], and stops on a fatal one or a shutdown.
///
/// ```ignore
/// let mut retry = Retry::new(max_backoff, &shutdown);
/// let rows = loop {
///     match sink.read().await {
///         Ok(rows) => break rows,
///         Err(e) => retry.after(e, |e| warn!(error = %e, "reading failed; retrying")).await?,
///     }
/// };
/// ```
pub struct Retry {
    backoff: Backoff,
    stop: CancellationToken,
    failures: u64,
}

impl Retry {
    /// Retries until the step succeeds, fails fatally, or `stop` is cancelled.
    pub fn new(max_backoff: Duration, stop: &CancellationToken) -> Retry {
        Retry { backoff: Backoff::new(max_backoff), stop: stop.clone(), failures: 0 }
    }

    /// After a failure: a fatal one stops; a transient one is reported to `on_transient`
    /// and waited out, unless the wait is interrupted.
    pub async fn after<E: Retryable>(&mut self, e: E, on_transient: impl FnOnce(&E)) -> Result<(), Stopped<E>> {
        if e.is_fatal() {
            return Err(Stopped::Fatal(e));
        }
        self.failures += 1;
        on_transient(&e);
        sleep_or_shutdown(self.backoff.next_delay(), &self.stop).await.map_err(|ShutDown| Stopped::ShutDown)
    }

    /// Transient failures so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The step succeeded: the next failure starts the backoff over.
    pub fn reset(&mut self) {
        self.backoff.reset();
        self.failures = 0;
    }
}

/// Runs `step` until it succeeds: transient failures are logged (as "`what` failed;
/// retrying") and retried with backoff; a fatal one, or a shutdown, ends it.
pub async fn until_done<T, E, F, Fut>(
    what: &str,
    max_backoff: Duration,
    shutdown: &CancellationToken,
    mut step: F,
) -> Result<T, Stopped<E>>
where
    E: Retryable,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut retry = Retry::new(max_backoff, shutdown);
    loop {
        match step().await {
            Ok(v) => return Ok(v),
            Err(e) => retry.after(e, |e| tracing::warn!(error = %e, "{what} failed; retrying")).await?,
        }
    }
}

/// The wait was interrupted by a shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutDown;

/// Sleeps `d`, or less when `shutdown` is cancelled meanwhile.
pub async fn sleep_or_shutdown(d: Duration, shutdown: &CancellationToken) -> Result<(), ShutDown> {
    tokio::select! {
        _ = shutdown.cancelled() => Err(ShutDown),
        _ = tokio::time::sleep(d) => Ok(()),
    }
}

/// A fatal condition reported from another task or a librdkafka callback to the loop
/// that must stop.
#[derive(Clone, Default)]
pub struct FatalSignal {
    token: CancellationToken,
    message: Arc<std::sync::Mutex<Option<String>>>,
}

impl FatalSignal {
    /// Raises it; the first message wins.
    pub fn raise(&self, message: String) {
        self.message.lock().expect("not poisoned").get_or_insert(message);
        self.token.cancel();
    }

    /// Waits until raised; the message.
    pub async fn raised(&self) -> String {
        self.token.cancelled().await;
        self.message.lock().expect("not poisoned").clone().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_maximum_each_drawn_from_its_upper_half() {
        let mut b = Backoff::new(Duration::from_millis(500));
        for ceiling in [100, 200, 400, 500, 500] {
            let d = b.next_delay();
            let ceiling = Duration::from_millis(ceiling);
            assert!(d >= ceiling / 2 && d <= ceiling, "{d:?} outside [{:?}, {ceiling:?}]", ceiling / 2);
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[derive(Debug)]
    struct E(bool);

    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "fatal: {}", self.0)
        }
    }

    impl Retryable for E {
        fn is_fatal(&self) -> bool {
            self.0
        }
    }

    #[tokio::test]
    async fn a_fatal_error_stops_at_once_a_transient_one_is_retried_and_a_shutdown_stops_the_wait() {
        let stop = CancellationToken::new();
        let mut attempts = 0;
        let done: Result<u8, Stopped<E>> = until_done("step", Duration::from_millis(1), &stop, || {
            attempts += 1;
            let result = if attempts < 3 { Err(E(false)) } else { Ok(7) };
            async move { result }
        })
        .await;
        assert!(matches!(done, Ok(7)));
        let fatal: Result<u8, Stopped<E>> =
            until_done("step", Duration::from_millis(1), &stop, || async { Err(E(true)) }).await;
        assert!(matches!(fatal, Err(Stopped::Fatal(E(true)))));
        stop.cancel();
        let mut retry = Retry::new(Duration::from_secs(60), &stop);
        assert!(matches!(retry.after(E(false), |_| {}).await, Err(Stopped::ShutDown)));
        assert_eq!(retry.failures(), 1);
    }
}
