//! The delivery stage: runs the jobs of each firing, retries what failed with capped
//! exponential backoff and full jitter (`Retry-After` obeyed), and dead-letters what failed for
//! good or for too long.
//!
//! The first attempts of one firing run in the order of SPEC §2 (reload → exec → cleanup →
//! notify); a failing step is handed to its own retry loop and does not hold back the next.
//! Notifications wait for their channel's token bucket in their own task, so one slow or
//! throttled channel never delays another.

pub mod backlog;
pub mod dead;
pub mod queue;
pub mod ratelimit;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::notify;
use crate::action::{Actions, actions_of};
use crate::channel::{self, Message};
use crate::config::{Group, Rate};
use crate::delivery::backlog::{Lane, Turn, Waiting};
use crate::delivery::dead::{DeadLetter, DeadStore};
use crate::delivery::ratelimit::{Limiter, SharedBucket, TokenBucket};
use crate::firing::{Action, Firing};
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::status::{self, Status};
use queue::{Job, Queue, Window};

/// How failed actions are retried.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub min: Duration,
    pub max: Duration,
    /// Retried for this long after the first failure, then dead-lettered (SPEC §5: 24 h).
    pub give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(300),
            give_up_after: Duration::from_secs(24 * 3600),
        }
    }
}

impl RetryPolicy {
    /// Full jitter over a capped exponential (Vector's `retries.rs`): random in
    /// [min/2, min(max, min·2^attempt)], so retries of a storm spread out.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let cap = self
            .min
            .saturating_mul(2u32.saturating_pow(attempt.min(30)))
            .min(self.max);
        let floor = self.min / 2;
        floor + cap.saturating_sub(floor).mul_f64(fastrand::f64())
    }
}

/// What follows a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Attempt again at this time (unix ms).
    RetryAt(i64),
    /// The retry window is over: dead-letter the job.
    GiveUp,
}

impl RetryPolicy {
    /// The decision after failed attempt number `attempt` (1 for the first) at `now`, for a job
    /// failing since `failing_since` (both unix ms), when the target asked to wait `retry_after`.
    ///
    /// The retry window bounds every wait: a `Retry-After` of two days, or a backoff reaching past
    /// the window, would otherwise hold a job beyond 24 h before its dead letter. Instead the last
    /// attempt comes at the window's end, and if that fails too the job is dead-lettered then.
    pub fn after_failure(
        &self,
        attempt: u32,
        failing_since: i64,
        now: i64,
        retry_after: Option<Duration>,
    ) -> Next {
        let window_end = failing_since.saturating_add(millis(self.give_up_after));
        if now >= window_end {
            return Next::GiveUp;
        }
        let wait = retry_after.unwrap_or_default().max(self.backoff(attempt));
        Next::RetryAt(now.saturating_add(millis(wait)).min(window_end))
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

struct Inner {
    actions: Actions,
    metrics: Arc<Metrics>,
    /// Rate limits and waiting lines (where a backlog merges into digests) per channel.
    limiters: Limiters,
    policy: RetryPolicy,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Bounds the firings whose attempts run at once here. A storm's firings beyond it wait in
    /// the durable queue, not in memory, so ten thousand expiries open no more connections and
    /// hold no more memory than this many.
    concurrent: Arc<Semaphore>,
    /// Set while jobs this instance had no room for may be waiting in the queue: a firing that
    /// finishes then wakes the queue loop to take the next ones at once.
    backlogged: AtomicBool,
    wake: Notify,
    /// Digest windows held in memory, by (rule, channel): only when there is no queue, or Redis
    /// refused to store the notifications in their shared window.
    digests: Mutex<HashMap<DigestKey, Vec<Arc<Firing>>>>,
    /// Where dead letters are kept (Redis); `None` only in tests of this module.
    dead: Option<DeadStore>,
    /// The durable queue of action jobs (Redis); `None` only in tests of this module.
    queue: Option<Queue>,
    /// Jobs this instance is attempting now, handed back at shutdown.
    inflight: Mutex<std::collections::HashSet<String>>,
    /// Jobs of digest windows whose digest this instance is attempting now (leases renewed,
    /// handed back at shutdown).
    windows_inflight: Mutex<HashMap<Window, std::collections::HashSet<String>>>,
    /// Where outcomes and dead letters are shown (the status page); set once by `report_to`
    /// so that the constructor stays the same for callers that have no status page.
    status: OnceLock<Arc<Status>>,
}

/// Firings attempted at once by one instance (see `Inner::concurrent`).
const CONCURRENT: usize = 256;

/// Items listed in a digest of a rule without `group.max_items` (a merged backlog).
const DIGEST_ITEMS: usize = 20;

/// The limiter and waiting line of each channel in force: made on first use, and made anew when a
/// reload changes a channel's rate.
struct Limiters {
    /// `None` only in tests of this module: each limiter is then this instance's own.
    state: Option<crate::keyspace::Conn>,
    prefix: String,
    by_channel: Mutex<HashMap<String, Limited>>,
}

/// A rate-limited channel's limiter and waiting line, at the rate they were made for.
#[derive(Clone)]
struct Limited {
    rate: Rate,
    limiter: Arc<Limiter>,
    lane: Arc<Lane>,
}

impl Limiters {
    fn get(&self, config: &crate::config::Config, channel: &str) -> Option<Limited> {
        let rate = config.channel(channel)?.rate?;
        let mut map = self.by_channel.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = map.get(channel)
            && l.rate == rate
        {
            return Some(l.clone());
        }
        let limiter = Arc::new(match &self.state {
            Some(conn) => {
                Limiter::Shared(SharedBucket::new(conn.clone(), &self.prefix, channel, rate))
            }
            None => Limiter::Local(TokenBucket::new(rate)),
        });
        let limited = Limited {
            rate,
            lane: Arc::new(Lane::new(limiter.clone(), rate)),
            limiter,
        };
        map.insert(channel.to_string(), limited.clone());
        Some(limited)
    }
}

/// A digest window is per (rule, channel).
type DigestKey = (String, String);

/// A unit of delivery: one action of one firing, or one digest message.
#[derive(Clone)]
enum Work {
    Step {
        firing: Arc<Firing>,
        action: Action,
    },
    Digest {
        rule: String,
        channel: String,
        message: Arc<Message>,
        firings: Vec<Arc<Firing>>,
        /// Queued jobs the digest stands for, acknowledged when it is sent or dead-lettered;
        /// empty for a digest held only in memory (no queue, or the queue was unreachable).
        jobs: Vec<String>,
        /// The `group` window the jobs wait in; `None` for a merged backlog (whose jobs are in
        /// the queue itself).
        window: Option<Window>,
    },
}

impl Work {
    fn rule(&self) -> &str {
        match self {
            Work::Step { firing, .. } => &firing.rule,
            Work::Digest { rule, .. } => rule,
        }
    }

    fn action_name(&self) -> &'static str {
        match self {
            Work::Step { action, .. } => action.name(),
            Work::Digest { .. } => "notify",
        }
    }

    fn channel(&self) -> Option<&str> {
        match self {
            Work::Step {
                action: Action::Notify { channel },
                ..
            } => Some(channel),
            Work::Step { .. } => None,
            Work::Digest { channel, .. } => Some(channel),
        }
    }

    /// What the log line names: the key, or how many keys a digest stands for.
    fn subject(&self) -> String {
        match self {
            Work::Step { firing, .. } => String::from_utf8_lossy(&firing.key).into_owned(),
            Work::Digest { message, .. } => format!("{} keys (digest)", message.count),
        }
    }

    /// The job's id in the queue and in-flight set.
    fn job_id(&self) -> String {
        match self {
            Work::Step { firing, action } => action.idempotency_key(&firing.id),
            Work::Digest { message, .. } => message.idempotency_key.clone(),
        }
    }

    fn id(&self) -> &str {
        match self {
            Work::Step { firing, .. } => &firing.id,
            Work::Digest { message, .. } => &message.idempotency_key,
        }
    }

    /// The firing this work belongs to; a digest stands for many.
    fn firing_id(&self) -> Option<&str> {
        match self {
            Work::Step { firing, .. } => Some(&firing.id),
            Work::Digest { .. } => None,
        }
    }

    /// The action as the status page names it: `notify:CHANNEL` for notifications.
    fn status_label(&self) -> String {
        match self.channel() {
            Some(c) => format!("notify:{c}"),
            None => self.action_name().to_string(),
        }
    }
}

impl Delivery {
    pub fn new(
        actions: Actions,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: Option<crate::keyspace::Conn>,
        shutdown: CancellationToken,
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
            let mut steps = Vec::new();
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
                    _ => steps.push(Step::first(action)),
                }
            }
            if steps.is_empty() {
                continue;
            }
            match inner.concurrent.clone().try_acquire_owned() {
                Ok(permit) => now.push((firing, steps, permit)),
                Err(_) => later.push((firing, steps)),
            }
        }
        for (w, (group, firings)) in windows {
            put_in_window(inner, w, group, firings).await;
        }
        if let Some(q) = &inner.queue {
            let leased = jobs_of(now.iter().map(|(f, s, _)| (f, s)));
            let pending = jobs_of(later.iter().map(|(f, s)| (f, s)));
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
        for (firing, steps, permit) in now {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { run_steps(i, firing, steps, permit).await });
        }
        // Only when the queue could not take them (or there is none): in memory, in turn.
        for (firing, steps) in later {
            let i = inner.clone();
            inner.tracker.spawn(async move {
                if let Ok(permit) = i.concurrent.clone().acquire_owned().await {
                    run_steps(i, firing, steps, permit).await;
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

/// Most jobs of one window taken into one digest: a storm's window of 100,000 becomes a few
/// digests of this many, and no Lua call holds Redis for long.
const WINDOW_TAKE_MAX: usize = 5000;

/// Stores the firings' notifications in their shared window (before the caller removes their
/// details); held in this instance's memory only when there is no queue or Redis refused.
async fn put_in_window(inner: &Arc<Inner>, w: Window, group: Group, firings: Vec<Arc<Firing>>) {
    if let Some(q) = &inner.queue {
        let jobs = window_jobs(&firings, &w.channel, 0, None);
        match q.window_put(&w, group.window, &jobs).await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, rule = %w.rule, channel = %w.channel, "Cannot store notifications in their digest window; collecting them in this instance's memory.");
            }
        }
    }
    for f in &firings {
        collect(inner, f, &w.channel, group);
    }
}

/// The notification jobs of `firings` for `channel`, as a digest window keeps them.
fn window_jobs(
    firings: &[Arc<Firing>],
    channel: &str,
    attempt: u32,
    failing_since: Option<i64>,
) -> Vec<Job> {
    firings
        .iter()
        .map(|f| Job {
            firing: (**f).clone(),
            action: Action::Notify {
                channel: channel.to_string(),
            },
            attempt,
            failing_since,
        })
        .collect()
}

/// Sends the digest of every window that has ended (or whose retry is due), as one digest per
/// window (up to [`WINDOW_TAKE_MAX`] events each).
async fn take_windows(inner: &Arc<Inner>, queue: &Queue) {
    let windows = match queue.windows().await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "Cannot read the digest windows; retrying.");
            return;
        }
    };
    for w in windows {
        let jobs = match queue.window_take(&w, WINDOW_TAKE_MAX).await {
            Ok(j) if j.is_empty() => continue,
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, rule = %w.rule, "Cannot take a digest window; retrying.");
                continue;
            }
        };
        let attempt = jobs.iter().map(|j| j.attempt).max().unwrap_or(0);
        let failing_since = jobs.iter().filter_map(|j| j.failing_since).min();
        let ids: Vec<String> = jobs.iter().map(Job::id).collect();
        let firings: Vec<Arc<Firing>> = jobs.into_iter().map(|j| Arc::new(j.firing)).collect();
        match compose_digest_now(inner, &w.rule, &w.channel, &firings) {
            Ok(message) => {
                let work = Work::Digest {
                    rule: w.rule.clone(),
                    channel: w.channel.clone(),
                    message: Arc::new(message),
                    firings,
                    jobs: ids,
                    window: Some(w),
                };
                let i = inner.clone();
                inner
                    .tracker
                    .spawn(async move { deliver(i, work, attempt, failing_since).await });
            }
            Err(e) => {
                let work = Work::Digest {
                    rule: w.rule.clone(),
                    channel: w.channel.clone(),
                    message: Arc::new(Message::uncomposed_digest(
                        &w.rule,
                        firings.first().map_or("", |f| f.id.as_str()),
                        &w.channel,
                        firings.len(),
                    )),
                    firings,
                    jobs: ids.clone(),
                    window: Some(w.clone()),
                };
                dead_letter(inner, &work, &format!("cannot compose the digest: {e}"));
                if let Err(e) = queue.window_done(&w, &ids).await {
                    tracing::warn!(error = %e, rule = %w.rule, "Cannot remove a dead-lettered digest window; it may be dead-lettered again.");
                }
            }
        }
    }
}

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
        let jobs = match queue.take_due(room).await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read the job queue; retrying.");
                return;
            }
        };
        // A full answer means more may be waiting (also another instance's storm): take more
        // as soon as a firing finishes, not only at the next tick.
        let full = jobs.len() == room;
        inner.backlogged.store(full, Ordering::Relaxed);
        for (firing, steps) in by_firing(jobs) {
            let i = inner.clone();
            inner.tracker.spawn(async move {
                if let Ok(permit) = i.concurrent.clone().acquire_owned().await {
                    run_steps(i, firing, steps, permit).await;
                }
            });
        }
        if !full {
            return;
        }
    }
}

/// One job of a firing: its action, and the attempts it has had.
struct Step {
    action: Action,
    attempt: u32,
    failing_since: Option<i64>,
}

impl Step {
    fn first(action: Action) -> Step {
        Step {
            action,
            attempt: 0,
            failing_since: None,
        }
    }
}

/// The jobs of firings, as stored in the queue.
fn jobs_of<'a>(runs: impl Iterator<Item = (&'a Arc<Firing>, &'a Vec<Step>)>) -> Vec<Job> {
    runs.flat_map(|(firing, steps)| {
        steps.iter().map(|s| Job {
            firing: (**firing).clone(),
            action: s.action.clone(),
            attempt: s.attempt,
            failing_since: s.failing_since,
        })
    })
    .collect()
}

/// Jobs taken from the queue, gathered per firing (in the order first seen) and put in the
/// order of SPEC §2 within each.
fn by_firing(jobs: Vec<Job>) -> Vec<(Arc<Firing>, Vec<Step>)> {
    let mut out: Vec<(Arc<Firing>, Vec<Step>)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for job in jobs {
        let step = Step {
            action: job.action,
            attempt: job.attempt,
            failing_since: job.failing_since,
        };
        match at.get(&job.firing.id) {
            Some(&i) => out[i].1.push(step),
            None => {
                at.insert(job.firing.id.clone(), out.len());
                out.push((Arc::new(job.firing), vec![step]));
            }
        }
    }
    for (_, steps) in &mut out {
        steps.sort_by_key(|s| s.action.order());
    }
    out
}

/// The attempts of one firing's jobs, in the order of SPEC §2. A failing step goes to the
/// queue for its retry and does not hold back the next; a notification waits for its channel's
/// bucket in its own task (without the permit), so a throttled channel holds back nothing else.
async fn run_steps(
    inner: Arc<Inner>,
    firing: Arc<Firing>,
    steps: Vec<Step>,
    permit: OwnedSemaphorePermit,
) {
    // Every step is this instance's from now on: its lease is renewed while earlier steps run
    // (a slow reload must not let another instance take the notification behind it), and
    // shutdown hands back the steps it never reached.
    inflight(&inner).extend(steps.iter().map(|s| s.action.idempotency_key(&firing.id)));
    for step in steps {
        if inner.shutdown.is_cancelled() {
            break;
        }
        let notify = matches!(step.action, Action::Notify { .. });
        let work = Work::Step {
            firing: firing.clone(),
            action: step.action,
        };
        let (n, since) = (step.attempt, step.failing_since);
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

/// Adds a firing to its (rule, channel) digest held in memory (see `Inner::digests`); the first
/// one of a window schedules the send.
fn collect(inner: &Arc<Inner>, firing: &Arc<Firing>, channel: &str, group: Group) {
    let key = (firing.rule.clone(), channel.to_string());
    let first = {
        let mut open = inner.digests.lock().unwrap_or_else(|p| p.into_inner());
        let batch = open.entry(key.clone()).or_default();
        batch.push(firing.clone());
        batch.len() == 1
    };
    if !first {
        return;
    }
    let i = inner.clone();
    inner.tracker.spawn(async move {
        tokio::select! {
            biased;
            _ = i.shutdown.cancelled() => {}
            _ = tokio::time::sleep(group.window) => {}
        }
        let batch = i.digests.lock().unwrap_or_else(|p| p.into_inner()).remove(&key).unwrap_or_default();
        if batch.is_empty() {
            return;
        }
        let (rule, channel) = key;
        let actions = i.actions.refreshed();
        let composed = match (actions.config.rule(&rule), actions.config.channel(&channel)) {
            (Some(r), Some(ch)) => notify::compose_digest(&actions, &batch, r, ch, group.max_items),
            _ => Err("the rule or channel is no longer defined".into()),
        };
        match composed {
            Ok(message) => {
                let work = Work::Digest { rule, channel, message: Arc::new(message), firings: batch, jobs: Vec::new(), window: None };
                deliver(i.clone(), work, 0, None).await
            }
            Err(e) => {
                i.metrics.dead_letters.inc();
                if let Some(s) = i.status.get() {
                    s.record_dead_letter(status::DeadLetter {
                        at: chrono::Utc::now(),
                        rule: rule.clone(),
                        key: format!("{} keys (digest)", batch.len()),
                        action: format!("notify:{channel}"),
                        id: String::new(),
                        reason: format!("cannot compose the digest: {e}"),
                    });
                }
                tracing::error!(%rule, %channel, keys = batch.len(), reason = %e, "Dead letter: cannot compose the digest.");
            }
        }
    });
}

/// One attempt, logged and counted: one line per action sent or failed.
async fn attempt(inner: &Inner, work: &Work, n: u32) -> Outcome {
    let started = Instant::now();
    let outcome = match work {
        Work::Step { firing, action } => inner.actions.run(firing, action).await,
        Work::Digest {
            channel, message, ..
        } => match inner.actions.refreshed().config.channel(channel) {
            Some(ch) => channel::send(&inner.actions.http, ch, message).await,
            None => Outcome::Failed(format!("channel `{channel}` is no longer defined")),
        },
    };
    let secs = started.elapsed().as_secs_f64();
    inner
        .metrics
        .action(work.rule(), work.action_name(), outcome.label(), secs);
    if let Some(s) = inner.status.get() {
        let detail = match &outcome {
            Outcome::Sent(what) => what,
            Outcome::Retry { reason, .. } | Outcome::Failed(reason) => reason,
        };
        s.record_outcome(
            work.rule(),
            work.firing_id(),
            &work.status_label(),
            outcome.label(),
            detail,
        );
    }
    let (rule, key, action, channel) = (
        work.rule(),
        work.subject(),
        work.action_name(),
        work.channel().unwrap_or(""),
    );
    match &outcome {
        Outcome::Sent(what) => {
            tracing::info!(%rule, %key, action, channel, outcome = "sent", attempt = n + 1, answer = %what, "Action done.")
        }
        Outcome::Retry { reason, .. } => {
            tracing::warn!(%rule, %key, action, channel, outcome = "retry", attempt = n + 1, %reason, "Action failed; will retry.")
        }
        Outcome::Failed(reason) => {
            tracing::error!(%rule, %key, action, channel, outcome = "failed", attempt = n + 1, %reason, "Action failed for good.")
        }
    }
    outcome
}

/// Attempts `work` until it is sent or fails for good. A job in the durable queue leaves for
/// the queue between attempts (any instance may take the next one); a digest (held only in
/// memory) waits here. `failing_since` is when the first attempt failed, unix ms.
async fn deliver(inner: Arc<Inner>, work: Work, mut n: u32, mut failing_since: Option<i64>) {
    let id = work.job_id();
    inflight(&inner).insert(id.clone());
    let window = match &work {
        Work::Digest {
            window: Some(w),
            jobs,
            ..
        } => {
            windows_inflight(&inner)
                .entry(w.clone())
                .or_default()
                .extend(jobs.iter().cloned());
            Some(w.clone())
        }
        _ => None,
    };
    // A notification of a rate-limited channel waits in its channel's line, and may come out of
    // it carrying the channel's backlog as a digest.
    let (work, mut token) = match lane_of(&inner, &work) {
        Some(lane) => match take_turn(&inner, &lane, work, &id).await {
            Some(w) => (w, true),
            // Left in flight: shutdown hands it back, or the digest it joined acknowledges it.
            None => return,
        },
        None => (work, false),
    };
    // The queued jobs this work acknowledges when it is finished.
    let jobs: Vec<String> = match (&work, &inner.queue) {
        (_, None) => Vec::new(),
        (Work::Step { .. }, Some(_)) => vec![id.clone()],
        (Work::Digest { jobs, .. }, Some(_)) => jobs.clone(),
    };
    let durable = match (&work, &inner.queue) {
        (Work::Step { .. }, Some(q)) => Some(q.clone()),
        _ => None,
    };
    let finish = |inner: &Inner| {
        let mut set = inflight(inner);
        set.remove(&id);
        for j in &jobs {
            set.remove(j);
        }
        if let Some(w) = &window {
            let mut windows = windows_inflight(inner);
            if let Some(ids) = windows.get_mut(w) {
                for j in &jobs {
                    ids.remove(j);
                }
                if ids.is_empty() {
                    windows.remove(w);
                }
            }
        }
    };
    let limiter = work
        .channel()
        .and_then(|c| inner.limiters.get(&inner.actions.live.current(), c))
        .map(|l| l.limiter);
    loop {
        if let Some(l) = &limiter
            && !std::mem::take(&mut token)
        {
            tokio::select! {
                biased;
                // Left in flight: shutdown hands it back.
                _ = inner.shutdown.cancelled() => return,
                _ = l.take() => {}
            }
        }
        let outcome = attempt(&inner, &work, n).await;
        match outcome {
            Outcome::Sent(_) | Outcome::Failed(_) => {
                if let Outcome::Failed(reason) = &outcome {
                    dead_letter(&inner, &work, reason);
                }
                acknowledge(&inner, window.as_ref(), &jobs).await;
                finish(&inner);
                return;
            }
            Outcome::Retry { after, .. } => {
                let now = queue::now_ms();
                let since = *failing_since.get_or_insert(now);
                n += 1;
                let Next::RetryAt(at) = inner.policy.after_failure(n, since, now, after) else {
                    dead_letter(
                        &inner,
                        &work,
                        "gave up: failing for longer than the retry window",
                    );
                    acknowledge(&inner, window.as_ref(), &jobs).await;
                    finish(&inner);
                    return;
                };
                let wait = Duration::from_millis(u64::try_from(at - now).unwrap_or(0));
                if let (Some(q), Work::Step { firing, action }) = (&durable, &work) {
                    let job = Job {
                        firing: (**firing).clone(),
                        action: action.clone(),
                        attempt: n,
                        failing_since,
                    };
                    // Out of the in-flight set first, so a lease renewal cannot push the retry back.
                    finish(&inner);
                    match q.reschedule(&job, at).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, id = %id, "Cannot requeue the job; retrying from memory.")
                        }
                    }
                }
                // A window's digest leaves for its window: any instance attempts it next.
                if let (
                    Some(q),
                    Some(w),
                    Work::Digest {
                        firings, channel, ..
                    },
                ) = (&inner.queue, &window, &work)
                {
                    let again = window_jobs(firings, channel, n, failing_since);
                    finish(&inner);
                    match q.window_retry(w, &again, at).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, rule = %w.rule, "Cannot requeue the digest; retrying from memory.")
                        }
                    }
                }
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

fn inflight(inner: &Inner) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
    inner.inflight.lock().unwrap_or_else(|p| p.into_inner())
}

fn windows_inflight(
    inner: &Inner,
) -> std::sync::MutexGuard<'_, HashMap<Window, std::collections::HashSet<String>>> {
    inner
        .windows_inflight
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Removes finished jobs from the queue, or from their window (one round trip for all).
async fn acknowledge(inner: &Inner, window: Option<&Window>, jobs: &[String]) {
    let Some(q) = &inner.queue else { return };
    if let Some(w) = window {
        if let Err(e) = q.window_done(w, jobs).await {
            tracing::warn!(error = %e, jobs = jobs.len(), rule = %w.rule, "Cannot mark a digest window done; it may be sent again when its lease ends.");
        }
        return;
    }
    let acks = futures_util::future::join_all(jobs.iter().map(|j| q.done(j))).await;
    if let Some(Err(e)) = acks.into_iter().find(|r| r.is_err()) {
        tracing::warn!(error = %e, jobs = jobs.len(), "Cannot mark jobs done; they may run again when their lease ends.");
    }
}

/// The waiting line of a notification's channel, if the channel has a rate.
fn lane_of(inner: &Inner, work: &Work) -> Option<Arc<Lane>> {
    match work {
        Work::Step {
            action: Action::Notify { channel },
            ..
        } => inner
            .limiters
            .get(&inner.actions.live.current(), channel)
            .map(|l| l.lane),
        _ => None,
    }
}

/// Waits for the channel's token; the work to send with it (this notification, or a digest of
/// it and the backlog of its rule), or `None` when there is nothing more to do here.
async fn take_turn(inner: &Arc<Inner>, lane: &Arc<Lane>, work: Work, id: &str) -> Option<Work> {
    let Work::Step { firing, action } = &work else {
        return Some(work);
    };
    let waiting = Waiting {
        firing: firing.clone(),
        job: id.to_string(),
    };
    let others = match lane.wait(waiting, &inner.tracker, &inner.shutdown).await? {
        Turn::Alone => return Some(work),
        Turn::Merged => return None,
        Turn::Lead(others) => others,
    };
    let Action::Notify { channel } = action else {
        return Some(work);
    };
    let mut firings = vec![firing.clone()];
    let mut jobs = vec![id.to_string()];
    for w in others {
        firings.push(w.firing);
        jobs.push(w.job);
    }
    match compose_digest_now(inner, &firing.rule, channel, &firings) {
        Ok(message) => Some(Work::Digest {
            rule: firing.rule.clone(),
            channel: channel.clone(),
            message: Arc::new(message),
            firings,
            jobs,
            window: None,
        }),
        Err(e) => {
            // Sent alone, then; the others go back to the queue for their own turns.
            tracing::error!(rule = %firing.rule, %channel, reason = %e, "Cannot merge the channel's backlog into a digest; sending one by one.");
            let back = jobs.split_off(1);
            if let Some(q) = &inner.queue
                && let Err(e) = q.hand_back(&back).await
            {
                tracing::warn!(error = %e, "Cannot hand jobs back; they come due again when their lease ends.");
            }
            let mut set = inflight(inner);
            for j in &back {
                set.remove(j);
            }
            Some(work)
        }
    }
}

/// A digest of `firings` of `rule` for `channel` under the rules in force now, listing the rule's
/// `group.max_items` (or [`DIGEST_ITEMS`] for a merged backlog of a rule without `group`).
fn compose_digest_now(
    inner: &Inner,
    rule: &str,
    channel: &str,
    firings: &[Arc<Firing>],
) -> Result<Message, String> {
    let actions = inner.actions.refreshed();
    match (actions.config.rule(rule), actions.config.channel(channel)) {
        (Some(r), Some(ch)) => {
            let max = r
                .notify
                .as_ref()
                .and_then(|n| n.group)
                .map_or(DIGEST_ITEMS, |g| g.max_items);
            notify::compose_digest(&actions, firings, r, ch, max)
        }
        _ => Err("the rule or channel is no longer defined".into()),
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
        let work = Work::Step {
            firing,
            action: d.action,
        };
        inner
            .tracker
            .spawn(async move { deliver(i, work, 0, None).await });
    }
}

fn dead_letter(inner: &Inner, work: &Work, reason: &str) {
    inner.metrics.dead_letters.inc();
    if let Some(s) = inner.status.get() {
        s.record_dead_letter(status::DeadLetter {
            at: chrono::Utc::now(),
            rule: work.rule().to_string(),
            key: work.subject(),
            action: work.status_label(),
            id: work.id().to_string(),
            reason: reason.to_string(),
        });
    }
    if let Some(store) = inner.dead.clone() {
        let (action, firings, digest) = match work {
            Work::Step { firing, action } => (action.clone(), vec![(**firing).clone()], false),
            Work::Digest {
                channel, firings, ..
            } => (
                Action::Notify {
                    channel: channel.clone(),
                },
                firings.iter().map(|f| (**f).clone()).collect(),
                true,
            ),
        };
        let letter = DeadLetter {
            id: format!("{:012x}", fastrand::u64(..) >> 16),
            at: chrono::Utc::now(),
            rule: work.rule().to_string(),
            key: work.subject(),
            action,
            reason: reason.to_string(),
            firings,
            digest,
        };
        tokio::spawn(async move {
            if let Err(e) = store.store(&letter).await {
                tracing::error!(id = %letter.id, error = %e, "Cannot store the dead letter in Redis; it is only in this log.");
            }
        });
    }
    tracing::error!(rule = %work.rule(), key = %work.subject(), action = work.action_name(), channel = work.channel().unwrap_or(""), id = %work.id(), %reason, "Dead letter: the action will not be retried.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_capped() {
        let p = RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
            give_up_after: Duration::from_secs(3600),
        };
        for attempt in 0..40 {
            let b = p.backoff(attempt);
            assert!(b >= Duration::from_millis(500), "{attempt}: {b:?}");
            assert!(b <= Duration::from_secs(60), "{attempt}: {b:?}");
        }
        let late: Duration = (0..200).map(|_| p.backoff(10)).sum::<Duration>() / 200;
        assert!(late > Duration::from_secs(20), "{late:?}");
    }

    const HOUR_MS: i64 = 3_600_000;
    const DAY_MS: i64 = 24 * HOUR_MS;

    /// Replays the retry schedule of one job against a target that fails every attempt before
    /// `down_until` (ms after the first attempt): when it was delivered or dead-lettered, and
    /// after how many attempts. Virtual time: a day of retries runs in microseconds.
    fn replay(down_until: i64, retry_after: Option<Duration>) -> (Result<i64, i64>, u32) {
        let p = RetryPolicy::default();
        let (mut now, mut n, mut since) = (0i64, 0u32, None);
        loop {
            n += 1;
            if now >= down_until {
                return (Ok(now), n);
            }
            let first_failure = *since.get_or_insert(now);
            match p.after_failure(n, first_failure, now, retry_after) {
                Next::RetryAt(at) => {
                    assert!(at > now, "attempt {n} at {now} ms retried at {at} ms");
                    assert!(
                        at - now <= 300_000 || retry_after.is_some(),
                        "waited {} ms",
                        at - now
                    );
                    now = at;
                }
                Next::GiveUp => return (Err(now), n),
            }
        }
    }

    #[test]
    fn a_target_down_for_an_hour_gets_its_alert_once_within_five_minutes_of_coming_back() {
        for _ in 0..200 {
            let (outcome, attempts) = replay(HOUR_MS, None);
            let at = outcome.expect("never dead-lettered within the 24 h window");
            assert!(
                (HOUR_MS..=HOUR_MS + 300_000).contains(&at),
                "delivered at {at} ms"
            );
            // 1 s doubling to the 5 min cap, with jitter: about 12–25 attempts in an hour.
            assert!((12..=60).contains(&attempts), "{attempts} attempts");
        }
    }

    #[test]
    fn nothing_is_dead_lettered_before_24_hours_and_everything_at_24_hours() {
        for _ in 0..50 {
            // Back just before the window closes: still delivered, by the attempt at its end.
            let (outcome, _) = replay(DAY_MS - 1, None);
            assert!(outcome.is_ok_and(|at| at <= DAY_MS), "{outcome:?}");
            // Never back: dead-lettered exactly when the window closes, not a backoff later.
            let (outcome, attempts) = replay(i64::MAX, None);
            assert_eq!(outcome, Err(DAY_MS), "after {attempts} attempts");
        }
    }

    #[test]
    fn a_retry_after_beyond_the_window_does_not_hold_the_dead_letter_back() {
        let p = RetryPolicy::default();
        let two_days = Some(Duration::from_secs(2 * 24 * 3600));
        assert_eq!(p.after_failure(1, 0, 0, two_days), Next::RetryAt(DAY_MS));
        assert_eq!(p.after_failure(2, 0, DAY_MS, two_days), Next::GiveUp);
        // Within the window, Retry-After is obeyed even when it is longer than the backoff.
        assert_eq!(
            p.after_failure(1, 0, 1000, Some(Duration::from_secs(3600))),
            Next::RetryAt(1000 + HOUR_MS)
        );
        assert_eq!(replay(i64::MAX, two_days), (Err(DAY_MS), 2));
    }
}
