//! The crash drill's hook (tests/e2e/crash_drill.rs): a guarantee is only as good as the drill that
//! attacks it, and a kill "between claiming and storing" cannot be timed from outside the
//! process.
//!
//! `KEYWATCH_DRILL_CRASH_AT=STEP[:N]`: the process kills itself (SIGKILL, as `kill -9` would: no
//! destructor, no flush) the N-th time (default 1st) it passes `STEP`. The steps are the
//! boundaries of an event's path, in order: `taken` (claimed, intake recorded), `stored` (jobs
//! stored), `removed` (details removed), `sent` (an action succeeded, not yet acknowledged),
//! `marked` (a job of a bundle acknowledged by its completion mark, others of that bundle not).
//! Off unless the variable is set, and then one relaxed load per step; for drills, never for
//! production (docs/development.md lists it).
//!
//! `KEYWATCH_DRILL_BACKLOG=SIGNALS:BYTES`: the engine's channel holds `SIGNALS` and each
//! subscriber holds `BYTES` beyond it before it lets go of its connection
//! ([`crate::source::notifications::BACKLOG_LIMIT`]), so a drill can make keywatch fall behind
//! with hundreds of events instead of a hundred thousand.
//!
//! `KEYWATCH_DRILL_QUIET_AHEAD=DURATION` (`35s`): quiet hours read the wall clock this much
//! ahead (the held messages' ends are kept in real time), so a drill can have a window end
//! seconds after it starts instead of waiting for a real minute to pass.
//!
//! `KEYWATCH_DRILL_ACK_DELAY=DURATION` (`1s`): the queue's writer holds every batch that records
//! jobs finished this long before sending it, and a sent digest waits as long before its window
//! is marked done, as a state Redis too loaded to answer would, so a drill can show what a kill
//! sends twice when acknowledgements lag far behind the requests, or a Redis that goes down
//! meanwhile.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The boundaries of an event's path a crash can fall between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The event is claimed and its intake record stored; no job yet.
    Taken,
    /// Its jobs are stored; its details not yet removed.
    Stored,
    /// Its details are removed; its intake record not yet cleared.
    Removed,
    /// An action succeeded; its job not yet acknowledged.
    Sent,
    /// A job of a bundle was acknowledged by its completion mark; other jobs of the bundle are
    /// still this instance's (`delivery::queue::bundle`).
    Marked,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Taken => "taken",
            Step::Stored => "stored",
            Step::Removed => "removed",
            Step::Sent => "sent",
            Step::Marked => "marked",
        }
    }
}

struct CrashAt {
    step: &'static str,
    nth: u64,
    passed: AtomicU64,
}

fn crash_at() -> Option<&'static CrashAt> {
    static AT: OnceLock<Option<CrashAt>> = OnceLock::new();
    AT.get_or_init(|| {
        let v = std::env::var("KEYWATCH_DRILL_CRASH_AT").ok()?;
        let (name, nth) = match v.split_once(':') {
            Some((s, n)) => (s.to_string(), n.parse().ok()?),
            None => (v, 1),
        };
        let step = [
            Step::Taken,
            Step::Stored,
            Step::Removed,
            Step::Sent,
            Step::Marked,
        ]
        .into_iter()
        .map(Step::name)
        .find(|s| *s == name)?;
        Some(CrashAt {
            step,
            nth,
            passed: AtomicU64::new(0),
        })
    })
    .as_ref()
}

/// Passes `step`: dies here when the crash drill says so.
pub fn pass(step: Step) {
    let Some(at) = crash_at() else {
        return;
    };
    if at.step == step.name() && at.passed.fetch_add(1, Ordering::SeqCst) + 1 == at.nth {
        eprintln!("drill: crashing at `{}`", at.step);
        // SIGKILL, not abort(): a crash drill must not leave a core dump per run.
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .arg(std::process::id().to_string())
            .status();
        std::process::abort();
    }
}

/// The engine channel's capacity and each subscriber's backlog limit: `defaults` unless
/// `KEYWATCH_DRILL_BACKLOG` says otherwise.
pub fn backlog(defaults: (usize, usize)) -> (usize, usize) {
    static AT: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    AT.get_or_init(|| {
        let v = std::env::var("KEYWATCH_DRILL_BACKLOG").ok()?;
        let (signals, bytes) = v.split_once(':')?;
        Some((signals.parse().ok()?, bytes.parse().ok()?))
    })
    .unwrap_or(defaults)
}

/// How long the queue's writer holds a batch of acknowledgements before sending it: `None`
/// unless `KEYWATCH_DRILL_ACK_DELAY` says.
pub fn ack_delay() -> Option<Duration> {
    static AT: OnceLock<Option<Duration>> = OnceLock::new();
    *AT.get_or_init(|| {
        let v = std::env::var("KEYWATCH_DRILL_ACK_DELAY").ok()?;
        humantime::parse_duration(v.trim())
            .ok()
            .filter(|d| !d.is_zero())
    })
}

/// How far ahead quiet hours read the wall clock: zero unless `KEYWATCH_DRILL_QUIET_AHEAD`
/// says.
pub fn quiet_ahead() -> chrono::Duration {
    static AT: OnceLock<chrono::Duration> = OnceLock::new();
    *AT.get_or_init(|| {
        std::env::var("KEYWATCH_DRILL_QUIET_AHEAD")
            .ok()
            .and_then(|v| humantime::parse_duration(v.trim()).ok())
            .and_then(|d| chrono::Duration::from_std(d).ok())
            .unwrap_or_default()
    })
}
