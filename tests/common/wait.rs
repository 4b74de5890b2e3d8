//! Polling with a generous upper bound, for conditions that have no event to wait on.

use std::time::{Duration, Instant};

/// Polls `condition` every 20 ms until it returns true; panics with `what` after `timeout`.
///
/// The timeout is an upper bound that should never be reached on a healthy run, not a
/// performance assertion.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
