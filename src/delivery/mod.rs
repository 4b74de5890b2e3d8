//! The delivery stage: runs the jobs of each firing, retries what failed with capped
//! exponential backoff and full jitter (`Retry-After` obeyed), and dead-letters what failed for
//! good or for too long.
//!
//! The first attempts of one firing run in the order of SPEC §2 (reload → exec → cleanup →
//! notify); a failing step is handed to its own retry loop and does not hold back the next.
//! Notifications wait for their channel's token bucket in their own task, so one slow or
//! throttled channel never delays another.

mod attempt;
pub mod dead;
mod digest;
pub mod lane;
pub mod queue;
pub mod ratelimit;
pub mod retry;
mod state;
#[cfg(test)]
mod testkit;
mod work;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::{Actions, actions_of};
use crate::config::Group;
use crate::firing::{Action, Firing, Job};
use crate::metrics::Metrics;
use crate::status::Status;

use attempt::{compose_digest_now, dead_letter_unreadable, deliver};
use dead::{DeadLetter, DeadStore};
use digest::{put_in_window, take_windows};
use lane::Limiters;
use queue::{Queue, Window};
pub use retry::{Next, RetryPolicy};
use state::{CONCURRENT, Clock, Inner, inflight, windows_inflight};
use work::{Work, by_firing};

#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

impl Delivery {
    pub fn new(
        actions: Actions,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: Option<crate::keyspace::Conn>,
        shutdown: CancellationToken,
    ) -> Delivery {
        Delivery::with_clock(actions, metrics, policy, state, shutdown, Clock::Wall)
    }

    /// [`Delivery::new`] reading the retry window from `clock` (tests: tokio's paused clock).
    fn with_clock(
        actions: Actions,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: Option<crate::keyspace::Conn>,
        shutdown: CancellationToken,
        clock: Clock,
    ) -> Delivery {
        let prefix = actions.config.state.prefix.clone();
        let limiters = Limiters {
            state: state.clone(),
            prefix: prefix.clone(),
            by_channel: Mutex::new(HashMap::new()),
        };
        let dead = state.clone().map(|conn| DeadStore::new(conn, &prefix));
        let queue = state.map(|conn| Queue::new(conn, &prefix));
        Delivery {
            inner: Arc::new(Inner {
                actions,
                metrics,
                limiters,
                policy,
                tracker: TaskTracker::new(),
                shutdown,
                concurrent: Arc::new(Semaphore::new(CONCURRENT)),
                backlogged: AtomicBool::new(false),
                wake: Notify::new(),
                digests: Mutex::new(HashMap::new()),
                dead,
                queue,
                inflight: Mutex::new(Default::default()),
                windows_inflight: Mutex::new(HashMap::new()),
                status: OnceLock::new(),
                clock,
            }),
        }
    }

    /// Picks up dead letters re-driven with `keywatch dead retry`, every second, until shutdown.
    pub fn start_redrive(&self) {
        let Some(store) = self.inner.dead.clone() else {
            return;
        };
        let inner = self.inner.clone();
        self.inner.tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let letters = match store.take_redriven(100).await {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(error = %e, "Cannot read re-driven dead letters.");
                        continue;
                    }
                };
                for d in letters {
                    tracing::info!(id = %d.id, rule = %d.rule, action = d.action.name(), "Re-driving a dead letter.");
                    redrive(&inner, d);
                }
            }
        });
    }

    /// Reports every attempt and dead letter to `status` from now on (the first call wins).
    pub fn report_to(&self, status: Arc<Status>) {
        let _ = self.inner.status.set(status);
    }

    /// Takes the firings of one batch. Their jobs are in the durable queue when this returns,
    /// so the caller may then remove what the firings copied (the details) without a crash in
    /// between losing them. The firings this instance has room for start at once; the others
    /// wait in the queue, due now, for whichever instance has room first — so a storm of
    /// 100,000 expiries costs Redis memory, not ours, and is shared by every instance.
    pub async fn accept(&self, firings: Vec<Firing>) {
        let inner = &self.inner;
        let actions = inner.actions.refreshed();
        let mut now = Vec::new();
        let mut later = Vec::new();
        let mut windows: HashMap<Window, (Group, Vec<Arc<Firing>>)> = HashMap::new();
        for firing in firings {
            let firing = Arc::new(firing);
            let Some(rule) = actions.config.rule(&firing.rule) else {
                continue;
            };
            let group = rule.notify.as_ref().and_then(|n| n.group);
            let mut jobs = Vec::new();
            for action in actions_of(rule) {
                match (&action, group) {
                    (Action::Notify { channel }, Some(g)) => {
                        let w = Window {
                            rule: firing.rule.clone(),
                            channel: channel.clone(),
                        };
                        windows
                            .entry(w)
                            .or_insert((g, Vec::new()))
                            .1
                            .push(firing.clone());
                    }
                    _ => jobs.push(Job::first(firing.clone(), action)),
                }
            }
            if jobs.is_empty() {
                continue;
            }
            match inner.concurrent.clone().try_acquire_owned() {
                Ok(permit) => now.push((jobs, permit)),
                Err(_) => later.push(jobs),
            }
        }
        for (w, (group, firings)) in windows {
            put_in_window(inner, w, group, firings).await;
        }
        if let Some(q) = &inner.queue {
            let leased: Vec<Job> = now.iter().flat_map(|(j, _)| j.iter().cloned()).collect();
            let pending: Vec<Job> = later.iter().flatten().cloned().collect();
            match q.store(&leased, &pending).await {
                Ok(()) if !later.is_empty() => {
                    later.clear();
                    inner.backlogged.store(true, Ordering::Relaxed);
                    inner.wake.notify_one();
                }
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!(error = %e, jobs = leased.len() + pending.len(), "Cannot store jobs in the queue; attempting them from memory.");
                }
            }
        }
        for (jobs, permit) in now {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { run_jobs(i, jobs, permit).await });
        }
        // Only when the queue could not take them (or there is none): in memory, in turn.
        for jobs in later {
            let i = inner.clone();
            inner.tracker.spawn(async move {
                if let Ok(permit) = i.concurrent.clone().acquire_owned().await {
                    run_jobs(i, jobs, permit).await;
                }
            });
        }
    }

    /// Stops retry loops and waits up to `grace` for attempts in flight.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        self.inner.tracker.close();
        self.inner.shutdown.cancel();
        let finished = tokio::time::timeout(grace, self.inner.tracker.wait())
            .await
            .is_ok();
        let left: Vec<String> = self
            .inner
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        let windows: Vec<(Window, Vec<String>)> = self
            .inner
            .windows_inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(w, ids)| (w, ids.into_iter().collect()))
            .collect();
        if let Some(q) = &self.inner.queue {
            for (w, ids) in &windows {
                if let Err(e) = q.window_hand_back(w, ids).await {
                    tracing::warn!(error = %e, rule = %w.rule, "Cannot hand a digest window back; it comes due again when its lease ends.");
                }
            }
        }
        if let (Some(q), false) = (&self.inner.queue, left.is_empty()) {
            match q.hand_back(&left).await {
                Ok(()) => tracing::info!(
                    jobs = left.len(),
                    "Handed unfinished jobs back to the queue."
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot hand jobs back; they come due again when their lease ends.")
                }
            }
        }
        finished
    }

    /// Takes due jobs from the durable queue — retries, jobs of instances that died or stopped,
    /// and the backlog of a storm — as far as this instance has room: every 200 ms, and at once
    /// when a firing finishes while a backlog waits. Stops at shutdown.
    pub fn start_queue(&self) {
        let Some(queue) = self.inner.queue.clone() else {
            return;
        };
        let inner = self.inner.clone();
        self.inner.tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_gauge = Instant::now();
            let mut last_renew = Instant::now();
            loop {
                let ticked = tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tick.tick() => true,
                    _ = inner.wake.notified() => false,
                };
                if last_gauge.elapsed() >= Duration::from_secs(1) {
                    last_gauge = Instant::now();
                    if let Ok(n) = queue.len().await {
                        inner.metrics.queue_pending.set(n);
                    }
                }
                if last_renew.elapsed() >= crate::delivery::queue::RENEW_EVERY {
                    last_renew = Instant::now();
                    let ids: Vec<String> = inflight(&inner).iter().cloned().collect();
                    if let Err(e) = queue.renew(&ids).await {
                        tracing::warn!(error = %e, "Cannot renew job leases; another instance may take them over.");
                    }
                    let windows: Vec<(Window, Vec<String>)> = windows_inflight(&inner)
                        .iter()
                        .map(|(w, ids)| (w.clone(), ids.iter().cloned().collect()))
                        .collect();
                    for (w, ids) in windows {
                        if let Err(e) = queue.window_renew(&w, &ids).await {
                            tracing::warn!(error = %e, rule = %w.rule, "Cannot renew a digest window's lease; another instance may take it over.");
                        }
                    }
                }
                if ticked {
                    take_windows(&inner, &queue).await;
                }
                take_due(&inner, &queue).await;
            }
        });
    }
}

/// Most jobs taken from the queue in one round trip.
const TAKE_MAX: usize = 512;

/// Takes due jobs while there is room, and starts them: the jobs of one firing together, in
/// the order of SPEC §2.
async fn take_due(inner: &Arc<Inner>, queue: &Queue) {
    loop {
        let room = inner.concurrent.available_permits().min(TAKE_MAX);
        if room == 0 {
            return;
        }
        // As many jobs as there are free firings: a firing has one to four jobs, so a full
        // answer leaves at most a few firings waiting briefly for a permit below.
        let taken = match queue.take_due(room).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read the job queue; retrying.");
                return;
            }
        };
        // A full answer means more may be waiting (also another instance's storm): take more
        // as soon as a firing finishes, not only at the next tick.
        let full = taken.jobs.len() + taken.unreadable.len() == room;
        dead_letter_unreadable(inner, taken.unreadable);
        let jobs = taken.jobs;
        inner.backlogged.store(full, Ordering::Relaxed);
        for jobs in by_firing(jobs) {
            let i = inner.clone();
            inner.tracker.spawn(async move {
                if let Ok(permit) = i.concurrent.clone().acquire_owned().await {
                    run_jobs(i, jobs, permit).await;
                }
            });
        }
        if !full {
            return;
        }
    }
}

/// The attempts of one firing's jobs, in the order of SPEC §2. A failing job goes to the
/// queue for its retry and does not hold back the next; a notification waits for its channel's
/// bucket in its own task (without the permit), so a throttled channel holds back nothing else.
async fn run_jobs(inner: Arc<Inner>, jobs: Vec<Job>, permit: OwnedSemaphorePermit) {
    // Every job is this instance's from now on: its lease is renewed while earlier jobs run
    // (a slow reload must not let another instance take the notification behind it), and
    // shutdown hands back the jobs it never reached.
    inflight(&inner).extend(jobs.iter().map(Job::id));
    for job in jobs {
        if inner.shutdown.is_cancelled() {
            break;
        }
        let notify = matches!(job.action, Action::Notify { .. });
        let (n, since) = (job.attempt, job.failing_since);
        let work = Work::Job {
            firing: job.firing,
            action: job.action,
        };
        if notify {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { deliver(i, work, n, since).await });
        } else {
            deliver(inner.clone(), work, n, since).await;
        }
    }
    drop(permit);
    if inner.backlogged.load(Ordering::Relaxed) {
        inner.wake.notify_one();
    }
}

/// Gives a dead letter a second life: the same firings, the same action, from attempt one.
fn redrive(inner: &Arc<Inner>, d: DeadLetter) {
    let firings: Vec<Arc<Firing>> = d.firings.into_iter().map(Arc::new).collect();
    let i = inner.clone();
    if d.digest {
        let Action::Notify { channel } = d.action else {
            return;
        };
        inner.tracker.spawn(async move {
            match compose_digest_now(&i, &d.rule, &channel, &firings) {
                Ok(message) => {
                    let work = Work::Digest {
                        rule: d.rule,
                        channel,
                        message: Arc::new(message),
                        firings,
                        jobs: Vec::new(),
                        window: None,
                    };
                    deliver(i.clone(), work, 0, None).await
                }
                Err(e) => {
                    tracing::error!(rule = %d.rule, reason = %e, "Cannot re-drive the digest.");
                }
            }
        });
    } else if let Some(firing) = firings.into_iter().next() {
        let work = Work::Job {
            firing,
            action: d.action,
        };
        inner
            .tracker
            .spawn(async move { deliver(i, work, 0, None).await });
    }
}
