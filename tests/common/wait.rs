//! Waiting: polling with a generous upper bound, for conditions that have no event to wait on.

use std::time::{Duration, Instant};

/// Generous upper bound for anything to happen; a healthy run never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `condition` every 20 ms until it returns true; panics with `what` after `timeout`.
///
/// The timeout is an upper bound that should never be reached on a healthy run, not a
/// performance assertion.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    poll(what, timeout, || condition().then_some(()), String::new);
}

/// Polls `probe` every 20 ms until it returns `Some`, and returns that. Panics after `timeout`
/// with `what` and `context()` (say, the daemon's logs).
pub fn poll<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        if Instant::now() >= deadline {
            panic!(
                "timed out after {timeout:?} waiting until {what}\n{}",
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
