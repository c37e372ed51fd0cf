//! One way to wait for a condition: poll it until it holds or a deadline passes, then
//! fail with the last thing it observed. Every "eventually" in the suite goes through
//! here, so a slow machine only ever makes a test slower, never wrong.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is re-checked.
const EVERY: Duration = Duration::from_millis(200);

/// Polls `probe` until it returns `Ok(value)`; panics after `timeout` with `what` and
/// the probe's last `Err(observation)`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(v) => return v,
            Err(observed) => observed,
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
