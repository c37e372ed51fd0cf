//! Sealed hours' pure parts: when an hour is due and how a seal is versioned
//! ([`plan`]), how a billing read splits into sealed days, sealed hours and minute
//! rows ([`split`]), and billing periods: their bounds, closes and adjustments
//! ([`period`]). No I/O: `sink` writes and reads what they decide, and `seal`, a
//! layer above both, runs the rounds (the argument for exactness is in `seal`'s docs).

pub mod period;
pub mod plan;
pub mod split;

/// Where a test stops the process with `SIGKILL` (`kill -9`): when the variable
/// `CLICKAGG_TEST_STOP_AT` names this step. Only in debug builds (the ones the
/// integration tests run); a release build never stops here.
#[inline]
pub fn stop_point(step: &'static str) {
    #[cfg(debug_assertions)]
    {
        static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        if AT.get_or_init(|| std::env::var("CLICKAGG_TEST_STOP_AT").ok()).as_deref() == Some(step) {
            tracing::warn!(step, "CLICKAGG_TEST_STOP_AT: stopping with SIGKILL");
            // SAFETY: kill(2) on our own PID; the process ends here, like `kill -9`.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = step;
}
