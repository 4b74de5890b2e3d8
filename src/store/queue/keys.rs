//! The job queue's key names, one function each (see
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`).

/// The queue: job ids scored by when they are due (or their lease ends), ms.
pub fn queue(prefix: &str) -> String {
    format!("{prefix}queue")
}

/// The jobs' payloads: id → payload (a job, or a bundle of them).
pub fn jobs(prefix: &str) -> String {
    format!("{prefix}queue:jobs")
}

/// How many times each job's lease ran out before its outcome was recorded (its taker died, or
/// stalled): id → count. At [`super::MAX_TAKEOVERS`] the job is dead-lettered, not taken again.
pub fn takeovers(prefix: &str) -> String {
    format!("{prefix}queue:takeovers")
}

/// Payloads this version cannot read, set aside for a person: id → payload.
pub fn unreadable(prefix: &str) -> String {
    format!("{prefix}queue:unreadable")
}

/// The waiting line of `target`: job ids scored by when they began to wait.
pub fn waiting(prefix: &str, target: &str) -> String {
    format!("{prefix}queue:wait:{target}")
}

/// The targets that have a waiting line.
pub fn waits(prefix: &str) -> String {
    format!("{prefix}queue:waits")
}

/// The completion marks of `bundle`: index of a job done → 1.
pub fn bundle_done(prefix: &str, bundle: &str) -> String {
    format!("{prefix}queue:done:{bundle}")
}

/// The digest window of `rule` and `channel`: job ids scored by when the window ends (or their lease ends),
/// beside `…:window`, which holds that end and expires with it.
pub fn window(prefix: &str, rule: &str, channel: &str) -> String {
    format!("{}{rule}:{channel}", windows_under(prefix))
}

/// What every digest window's name starts with (`look.lua` builds them from it).
pub fn windows_under(prefix: &str) -> String {
    format!("{prefix}group:")
}

/// When the digest window named `window` ends (ms), expiring then.
pub fn window_end(window: &str) -> String {
    format!("{window}:window")
}

/// The windows that hold jobs.
pub fn windows(prefix: &str) -> String {
    format!("{prefix}groups")
}
