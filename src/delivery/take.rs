//! The take stage's bookkeeping: what this instance holds of the queue (leased to it, renewed
//! while it holds them, handed back at shutdown), when the queue next has something due, and the
//! targets with jobs waiting for them in Redis. The loop that takes work and starts it is the
//! chain's (`super::Delivery`); this is what it asks.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::queue::{Queue, Window};

/// Jobs and digest windows' members this instance holds (leased to it): their leases are renewed
/// while it does, and shutdown hands them back.
#[derive(Default)]
pub(super) struct Held {
    jobs: Mutex<HashSet<String>>,
    windows: Mutex<HashMap<Window, HashSet<String>>>,
}

impl Held {
    pub(super) fn jobs<'a>(&self, ids: impl IntoIterator<Item = &'a String>) {
        self.lock_jobs().extend(ids.into_iter().cloned());
    }

    /// No longer held: finished, gone back to Redis, or rescheduled (a lease renewal must not
    /// push a retry's due time back).
    pub(super) fn release<'a>(&self, ids: impl IntoIterator<Item = &'a String>) {
        let mut set = self.lock_jobs();
        for id in ids {
            set.remove(id);
        }
    }

    pub(super) fn window(&self, w: &Window, members: &[String]) {
        self.lock_windows()
            .entry(w.clone())
            .or_default()
            .extend(members.iter().cloned());
    }

    pub(super) fn release_window(&self, w: &Window, members: &[String]) {
        let mut windows = self.lock_windows();
        if let Some(ids) = windows.get_mut(w) {
            for m in members {
                ids.remove(m);
            }
            if ids.is_empty() {
                windows.remove(w);
            }
        }
    }

    /// Whether anything is held (tests).
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.lock_jobs().is_empty() && self.lock_windows().is_empty()
    }

    /// Renews the leases of everything held; nothing is sent when nothing is held.
    pub(super) async fn renew(&self, queue: &Queue) -> Vec<(&'static str, redis::RedisError)> {
        let ids: Vec<String> = self.lock_jobs().iter().cloned().collect();
        let windows: Vec<(Window, Vec<String>)> = self
            .lock_windows()
            .iter()
            .map(|(w, ids)| (w.clone(), ids.iter().cloned().collect()))
            .collect();
        let mut failed = Vec::new();
        if !ids.is_empty()
            && let Err(e) = queue.renew(&ids).await
        {
            failed.push(("renew", e));
        }
        for (w, ids) in windows {
            if let Err(e) = queue.window_renew(&w, &ids).await {
                failed.push(("renew", e));
            }
        }
        failed
    }

    /// Hands everything held back to the queue, due now for any instance (shutdown); what is
    /// not handed back comes due when its lease ends.
    pub(super) async fn hand_back(&self, queue: &Queue) -> (usize, Vec<redis::RedisError>) {
        let ids: Vec<String> = self.lock_jobs().drain().collect();
        let windows: Vec<(Window, Vec<String>)> = self
            .lock_windows()
            .drain()
            .map(|(w, ids)| (w, ids.into_iter().collect()))
            .collect();
        let mut failed = Vec::new();
        for (w, ids) in &windows {
            if let Err(e) = queue.window_hand_back(w, ids).await {
                failed.push(e);
            }
        }
        if !ids.is_empty()
            && let Err(e) = queue.hand_back(&ids).await
        {
            failed.push(e);
        }
        (ids.len(), failed)
    }

    fn lock_jobs(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // A std Mutex: the guard never lives across an await.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_windows(&self) -> std::sync::MutexGuard<'_, HashMap<Window, HashSet<String>>> {
        self.windows.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// When the take stage next reads the queue: at the earliest due time it knows of, or a
/// safety round after its last full look, whichever comes first. Two kinds of due times: a
/// job's (a retry, a follow-up, what the last read said comes next), for which it takes due jobs
/// (one script that also says when the next one is due); and a digest window's end, for which
/// it looks at everything (windows, targets waiting, the queue). What another instance sends to
/// wait comes with a notice that asks for a look at once ([`crate::store::notices`]); the safety
/// round is for what no notice tells of: the lease of a job whose instance died, a window or a
/// retry it left (docs/performance.md#an-idle-instance).
pub(super) struct NextLook {
    due: Mutex<Due>,
    /// The safety round in force, in ms ([`NextLook::set_round`]).
    round_ms: std::sync::atomic::AtomicU64,
    /// Told when a due time known moves earlier: the take loop sleeps until the one it knew.
    earlier: Notify,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Due {
    /// The earliest job known to come due (tokio's clock).
    jobs: Option<Instant>,
    /// The earliest window end known.
    windows: Option<Instant>,
}

/// What to read when the take stage wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Read {
    /// Nothing is due yet.
    Nothing,
    /// Due jobs only.
    Jobs,
    /// Everything: a window ended, or the safety round came.
    Look,
}

/// The longest the take stage goes without a full look at Redis while some channel has quiet
/// hours: their end releases what they held, found by that look. Otherwise the round is a third
/// of a lease ([`crate::store::renew_every`]): a job whose instance died is taken over at most
/// that long after its lease ends, and a window or retry it left is found that long ahead of its
/// due time (a shorter one as late), as the engine finds the records of a dead instance.
pub(super) const SAFETY_ROUND: Duration = Duration::from_secs(1);

impl NextLook {
    pub(super) fn new() -> NextLook {
        NextLook {
            due: Mutex::new(Due {
                jobs: None,
                windows: Some(Instant::now()),
            }),
            earlier: Notify::new(),
            round_ms: std::sync::atomic::AtomicU64::new(SAFETY_ROUND.as_millis() as u64),
        }
    }

    /// The safety round from now on.
    pub(super) fn set_round(&self, round: Duration) {
        self.round_ms.store(
            round.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    fn round(&self) -> Duration {
        Duration::from_millis(self.round_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Asks for a full look at once (a notice: work waits in Redis).
    pub(super) fn look_now(&self) {
        self.window_due_in(0);
    }

    /// A job comes due `in_ms` from now (Redis's clock; 0 or less: now).
    pub(super) fn job_due_in(&self, in_ms: i64) {
        self.set(in_ms, |d| &mut d.jobs);
    }

    /// A digest window ends `in_ms` from now.
    pub(super) fn window_due_in(&self, in_ms: i64) {
        self.set(in_ms, |d| &mut d.windows);
    }

    fn set(&self, in_ms: i64, which: impl Fn(&mut Due) -> &mut Option<Instant>) {
        let at = Instant::now() + Duration::from_millis(u64::try_from(in_ms).unwrap_or(0));
        let mut due = self.lock();
        let slot = which(&mut due);
        if slot.is_none_or(|d| at < d) {
            *slot = Some(at);
            self.earlier.notify_one();
        }
    }

    /// When to wake next, at most a safety round after the last full look, `last`.
    pub(super) fn at(&self, last: Instant) -> Instant {
        let due = *self.lock();
        let round = last + self.round();
        [due.jobs, due.windows, Some(round)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(round)
    }

    /// What is due now (the last full look was at `last`), forgetting the due times it answers
    /// for: the reads it asks for find what comes next.
    pub(super) fn take(&self, last: Instant) -> Read {
        let now = Instant::now();
        let mut due = self.lock();
        let past = |d: Option<Instant>| d.is_some_and(|d| d <= now);
        let read = if past(due.windows) || last + self.round() <= now {
            Read::Look
        } else if past(due.jobs) {
            Read::Jobs
        } else {
            return Read::Nothing;
        };
        if past(due.windows) || read == Read::Look {
            due.windows = due.windows.filter(|d| *d > now);
        }
        if past(due.jobs) {
            due.jobs = None;
        }
        read
    }

    /// Resolves when a due time known moves earlier.
    pub(super) async fn moved_earlier(&self) {
        self.earlier.notified().await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Due> {
        self.due.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How long the take stage trusts its last read of which targets have jobs waiting in Redis.
pub(super) const TARGETS_FRESH: Duration = Duration::from_millis(50);

/// The targets with jobs waiting in Redis, as last read, and when: the take loop runs each time a
/// request finishes while jobs wait, and a read per request was a good share of what a storm's
/// delivery cost the state server. A target whose jobs another instance sent to wait is seen that
/// much later at most; one this instance sent there had no free place, and waits for a free place
/// anyway.
#[derive(Default)]
pub(super) struct WaitingTargets(Mutex<Option<(Vec<String>, Instant)>>);

impl WaitingTargets {
    /// The last read, if it is fresh.
    pub(super) fn fresh(&self) -> Option<Vec<String>> {
        match &*self.lock() {
            Some((t, at)) if at.elapsed() < TARGETS_FRESH => Some(t.clone()),
            _ => None,
        }
    }

    pub(super) fn set(&self, targets: Vec<String>) {
        *self.lock() = Some((targets, Instant::now()));
    }

    /// `target` was found to have nothing more waiting.
    pub(super) fn forget(&self, target: &str) {
        if let Some((t, _)) = &mut *self.lock() {
            t.retain(|x| x != target);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Vec<String>, Instant)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The longest the take stage holds back jobs waiting in Redis for an intake that is behind,
/// before it takes them anyway until the intake has caught up once.
pub(super) const DEFER_AT_MOST: Duration = Duration::from_secs(2);

/// How often the take loop asks again whether a deferral still holds while new firings' jobs
/// wait in Redis because of it: nothing else wakes it when the intake catches up.
pub(super) const DEFER_RECHECK: Duration = Duration::from_millis(50);

/// Holding back while the intake is behind (more than a batch of events waits to be taken: a
/// mass expiry), never for more than [`DEFER_AT_MOST`] at a stretch: events not yet taken are
/// only in Redis's pub/sub buffers and the subscriber's, jobs in the queue are safe, and every
/// request run meanwhile takes CPU from taking events over. An intake that never catches up must
/// not stop delivery: after the stretch, it does not hold back again until the intake has caught
/// up once. Both what waits in Redis for a target and new firings' jobs are held back: the new
/// ones wait for their targets in Redis meanwhile (docs/how-it-works.md#delivery).
pub(super) struct Deferral {
    behind: Box<dyn Fn() -> bool + Send + Sync>,
    since: Mutex<Option<Instant>>,
    /// New firings' jobs were sent to wait in Redis by a hold that has not been seen to end.
    held_new: std::sync::atomic::AtomicBool,
    /// Rounds of the take loop that found the hold in force (for the tests of the loop).
    rounds_held: std::sync::atomic::AtomicU64,
}

impl Deferral {
    pub(super) fn new(behind: impl Fn() -> bool + Send + Sync + 'static) -> Deferral {
        Deferral {
            behind: Box::new(behind),
            since: Mutex::new(None),
            held_new: Default::default(),
            rounds_held: Default::default(),
        }
    }

    /// Whether to hold back now.
    pub(super) fn holds(&self) -> bool {
        self.hold((self.behind)())
    }

    /// Whether to hold new firings' jobs back now; if so, the take loop asks again every
    /// [`DEFER_RECHECK`] until the hold ends ([`Deferral::held_new`]).
    pub(super) fn holds_new(&self) -> bool {
        let holds = self.holds();
        if holds {
            self.held_new
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        holds
    }

    /// New firings' jobs wait in Redis for a hold that has not been seen to end.
    pub(super) fn held_new(&self) -> bool {
        self.held_new.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the take loop holds back what waits for its targets now: if not, the hold is
    /// seen to end.
    pub(super) fn holds_waiting(&self) -> bool {
        if self.holds() {
            self.rounds_held
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return true;
        }
        self.held_new
            .store(false, std::sync::atomic::Ordering::Relaxed);
        false
    }

    /// Rounds of the take loop that held back.
    #[cfg(test)]
    pub(super) fn rounds_held(&self) -> u64 {
        self.rounds_held.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn hold(&self, behind: bool) -> bool {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if !behind {
            *since = None;
            return false;
        }
        since.get_or_insert_with(Instant::now).elapsed() < DEFER_AT_MOST
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_deferral_holds_back_for_a_stretch_at_most_then_not_until_caught_up() {
        let d = Deferral::new(|| false);
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

    #[tokio::test(start_paused = true)]
    async fn the_take_stage_reads_at_the_earliest_due_time_known_or_a_safety_round_later() {
        let next = NextLook::new();
        let start = Instant::now();
        assert_eq!(next.at(start), start, "a first look at once");
        assert_eq!(next.take(start), Read::Look);
        assert_eq!(next.at(start), start + SAFETY_ROUND);
        assert_eq!(next.take(start), Read::Nothing);
        next.job_due_in(300);
        next.job_due_in(700);
        assert_eq!(next.at(start), start + Duration::from_millis(300));
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(next.take(start), Read::Jobs, "a job's time: due jobs only");
        assert_eq!(next.take(start), Read::Nothing);
        next.window_due_in(200);
        next.job_due_in(-5);
        assert_eq!(next.at(start), Instant::now(), "overdue: now");
        assert_eq!(next.take(start), Read::Jobs);
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(next.take(start), Read::Look, "a window ended: a full look");
        next.job_due_in(5_000);
        assert_eq!(next.at(start), start + SAFETY_ROUND);
        tokio::time::advance(SAFETY_ROUND).await;
        assert_eq!(next.take(start), Read::Look, "the safety round");
    }
}
