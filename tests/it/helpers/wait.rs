//! One way to wait for a condition: poll it until it holds or a deadline passes, then
//! fail with the last thing it observed. Every "eventually" in the suite goes through
//! here, so a slow machine only ever makes a test slower, never wrong.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is re-checked.
const EVERY: Duration = Duration::from_millis(200);

/// How long past the deadline a probe under way may still take.
const PROBE_GRACE: Duration = Duration::from_secs(30);

/// Polls `probe` until it returns `Ok(value)`; panics after `timeout` with `what` and
/// the probe's last `Err(observation)`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let began = Instant::now();
    let deadline = began + timeout;
    // On the output a failing (or, under --nocapture, a hanging) test shows: how far it got.
    eprintln!("waiting up to {timeout:?}: {what}");
    loop {
        // A probe that never answers (a request to a node that hangs) must not make the
        // wait unbounded: it gets what is left of the deadline, and a little more so
        // that a probe started just before the deadline can still report.
        let left = deadline.saturating_duration_since(Instant::now()) + PROBE_GRACE;
        let last = match tokio::time::timeout(left, probe()).await {
            Ok(Ok(v)) => {
                eprintln!("done after {:.1?}: {what}", began.elapsed());
                return v;
            }
            Ok(Err(observed)) => observed,
            Err(_) => format!("the probe itself did not answer within {left:?}"),
        };
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}; last seen: {last}");
        tokio::time::sleep(EVERY).await;
    }
}

/// `Ok(())` when `actual == want`, else an observation naming both.
pub fn equals<T: PartialEq + std::fmt::Debug>(actual: T, want: T) -> Result<(), String> {
    if actual == want {
        Ok(())
    } else {
        Err(format!("{actual:?}, want {want:?}"))
    }
}
