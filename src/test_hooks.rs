//! Test machinery the integration tests reach through the real binary, compiled only
//! with the `test-hooks` feature (the crate's tests turn it on: `Cargo.toml`). Without
//! it, [`stop_point!`] is nothing at all: a product build has no kill switch.

/// Stops the process with `SIGKILL` (`kill -9`) at `step` when the variable
/// `CLICKAGG_TEST_STOP_AT` names it: how the tests kill a flush, a seal round or a
/// close between two of its writes.
macro_rules! stop_point {
    ($step:literal) => {
        $crate::test_hooks::stop_at($step)
    };
}

/// What [`stop_point!`] calls.
pub(crate) fn stop_at(step: &'static str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT.get_or_init(|| std::env::var("CLICKAGG_TEST_STOP_AT").ok()).as_deref() == Some(step) {
        tracing::warn!(step, "CLICKAGG_TEST_STOP_AT: stopping with SIGKILL");
        // SAFETY: kill(2) on our own PID; the process ends here, like `kill -9`.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}
