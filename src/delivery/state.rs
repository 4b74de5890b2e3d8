//! What the delivery stage's tasks share: the actions, the queue, the limits, and what this
//! instance has in flight (handed back at shutdown).

use std::collections::HashMap;
use std::sync::Arc;

use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, OnceLock};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::ActionContext;
use crate::metrics::Metrics;
use crate::status::Status;

use super::lane::Limiters;
use super::retry::RetryPolicy;
use super::slots::{Slots, Ticket};
use crate::store::dead::DeadStore;
use crate::store::queue::{Queue, Window};

pub(super) struct Inner {
    pub(super) actions: ActionContext,
    pub(super) metrics: Arc<Metrics>,
    /// Rate limits and waiting lines (where a backlog merges into digests) per channel.
    pub(super) limiters: Limiters,
    pub(super) policy: RetryPolicy,
    pub(super) tracker: TaskTracker,
    pub(super) shutdown: CancellationToken,
    /// Bounds the jobs this instance holds in memory at once (attempting, or waiting in a
    /// slot's line); each holds one permit, a [`Room`]. A storm's jobs beyond it wait in the
    /// durable queue, not in memory. A job waiting for a rate token gives its permit back (its
    /// channel's line is bounded on its own), so a throttled channel does not hold it.
    pub(super) concurrent: Arc<Semaphore>,
    /// The `concurrency` of each channel and of each rule's reload and exec.
    pub(super) slots: Slots,
    /// Set while jobs this instance had no room for may be waiting in the queue: a firing that
    /// finishes then wakes the queue loop to take the next ones at once.
    pub(super) backlogged: AtomicBool,
    pub(super) wake: Arc<Notify>,
    /// The targets with jobs waiting in Redis, as last read (see `take_waiting`).
    pub(super) waiting_targets: WaitingTargets,
    /// Where dead letters are kept (Redis).
    pub(super) dead: DeadStore,
    /// The durable queue of action jobs and digest windows (Redis).
    pub(super) queue: Queue,
    /// Jobs this instance is attempting now, handed back at shutdown.
    pub(super) inflight: Mutex<std::collections::HashSet<String>>,
    /// Jobs of digest windows whose digest this instance is attempting now (leases renewed,
    /// handed back at shutdown).
    pub(super) windows_inflight: Mutex<HashMap<Window, std::collections::HashSet<String>>>,
    /// Where outcomes and dead letters are shown (the status page); set once by `report_to`
    /// so that the constructor stays the same for callers that have no status page.
    pub(super) status: OnceLock<Arc<Status>>,
    /// Whether the intake is behind (set once by `defer_to`), and the queue loop's holding
    /// back for it (see [`Inner::deferring`]).
    pub(super) intake_behind: OnceLock<Box<dyn Fn() -> bool + Send + Sync>>,
    pub(super) deferral: Deferral,
    pub(super) pace: Pace,
}

/// The stage's own timers. `keywatch run` runs at [`Pace::RUN`]; the tests of this module
/// shorten them, so that waits of minutes pass in a fraction of a second against a real Redis
/// in real time (the queue's due times and a shared rate's tokens follow Redis's clock, which no
/// paused tokio clock moves).
#[derive(Clone, Copy, Debug)]
pub(super) struct Pace {
    /// How often the queue loop reads the queue and the digest windows when nothing wakes it.
    pub(super) tick: std::time::Duration,
    /// The longest a notification should wait for its channel's rate before it is merged
    /// ([`super::lane::MAX_WAIT`]).
    pub(super) max_wait: std::time::Duration,
}

impl Pace {
    pub(super) const RUN: Pace = Pace {
        tick: std::time::Duration::from_millis(200),
        max_wait: super::lane::MAX_WAIT,
    };
}

/// The longest the queue loop holds back jobs waiting in Redis for an intake that is behind,
/// before it takes them anyway until the intake has caught up once.
pub(super) const DEFER_AT_MOST: std::time::Duration = std::time::Duration::from_secs(2);

impl Inner {
    /// Whether jobs waiting in Redis should stay there a little longer, because the intake is
    /// behind (more than a batch of events waits to be taken: a mass expiry). Events not yet
    /// taken are only in Redis's pub/sub buffers and the subscriber's; jobs in the queue are
    /// safe, and every request run meanwhile takes CPU from taking events over.
    pub(super) fn deferring(&self) -> bool {
        self.deferral
            .hold(self.intake_behind.get().is_some_and(|f| f()))
    }
}

/// Holding back while something else is behind, never for more than [`DEFER_AT_MOST`] at a
/// stretch: an intake that never catches up must not stop delivery. After that, it does not
/// hold back again until the intake has caught up once.
#[derive(Default)]
pub(super) struct Deferral(Mutex<Option<tokio::time::Instant>>);

impl Deferral {
    /// Whether to hold back now, `behind` being whether the other side is behind now.
    pub(super) fn hold(&self, behind: bool) -> bool {
        let mut since = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !behind {
            *since = None;
            return false;
        }
        since
            .get_or_insert_with(tokio::time::Instant::now)
            .elapsed()
            < DEFER_AT_MOST
    }
}

/// How long the queue loop trusts its last read of which targets have jobs waiting in Redis.
pub(super) const TARGETS_FRESH: std::time::Duration = std::time::Duration::from_millis(50);

/// The targets with jobs waiting in Redis, as last read, and when.
#[derive(Default)]
pub(super) struct WaitingTargets(Mutex<Option<(Vec<String>, tokio::time::Instant)>>);

impl WaitingTargets {
    /// The last read, if it is fresh.
    pub(super) fn fresh(&self) -> Option<Vec<String>> {
        match &*self.lock() {
            Some((t, at)) if at.elapsed() < TARGETS_FRESH => Some(t.clone()),
            _ => None,
        }
    }

    pub(super) fn set(&self, targets: Vec<String>) {
        *self.lock() = Some((targets, tokio::time::Instant::now()));
    }

    /// `target` was found to have nothing more waiting.
    pub(super) fn forget(&self, target: &str) {
        if let Some((t, _)) = &mut *self.lock() {
            t.retain(|x| x != target);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Vec<String>, tokio::time::Instant)>> {
        // A std Mutex: the guard never lives across an await.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Jobs held in memory at once by one instance (see `Inner::concurrent`): room for 32 targets
/// at their default `concurrency` with full lines before one more has to wait for another.
pub(super) const CONCURRENT: usize = 1024;

/// One job's permit of [`Inner::concurrent`]. Given back when the job is done, goes back to the
/// queue, or starts waiting for a rate token; while a backlog waits in the queue, that wakes the
/// queue loop to take the next job at once.
pub(super) struct Room {
    permit: Option<OwnedSemaphorePermit>,
    inner: Arc<Inner>,
}

impl Drop for Room {
    fn drop(&mut self) {
        drop(self.permit.take());
        if self
            .inner
            .backlogged
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.inner.wake.notify_one();
        }
    }
}

/// What a job holds when it is handed to its attempts: its room in this instance, and its
/// ticket for its slot.
#[derive(Default)]
pub(super) struct Held {
    pub(super) room: Option<Room>,
    pub(super) ticket: Ticket,
}

/// `permit` (of as many permits as it holds) as one [`Room`] per job, in order; jobs beyond the
/// permits it holds get none.
pub(super) fn rooms(inner: &Arc<Inner>, permit: OwnedSemaphorePermit, jobs: usize) -> Vec<Room> {
    let mut out = Vec::with_capacity(jobs);
    let mut rest = Some(permit);
    for _ in 0..jobs {
        let one = match rest.as_mut() {
            Some(p) if p.num_permits() > 1 => p.split(1),
            _ => rest.take(),
        };
        let Some(one) = one else { break };
        out.push(Room {
            permit: Some(one),
            inner: inner.clone(),
        });
    }
    out
}

/// Items listed in a digest of a rule without `group.max_items` (a merged backlog).
pub(super) const DIGEST_ITEMS: usize = 20;

pub(super) fn inflight(
    inner: &Inner,
) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
    inner.inflight.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn windows_inflight(
    inner: &Inner,
) -> std::sync::MutexGuard<'_, HashMap<Window, std::collections::HashSet<String>>> {
    inner
        .windows_inflight
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_deferral_holds_back_for_a_stretch_at_most_then_not_until_caught_up() {
        let d = Deferral::default();
        assert!(!d.hold(false));
        assert!(d.hold(true));
        tokio::time::advance(DEFER_AT_MOST / 2).await;
        assert!(d.hold(true));
        tokio::time::advance(DEFER_AT_MOST / 2).await;
        assert!(
            !d.hold(true),
            "behind for the whole stretch: delivery goes on"
        );
        tokio::time::advance(DEFER_AT_MOST * 10).await;
        assert!(!d.hold(true), "still behind: still going on");
        assert!(!d.hold(false));
        assert!(d.hold(true), "caught up once: it may hold back again");
    }
}
