//! The delivery stage: runs the jobs of each firing, retries what failed with capped
//! exponential backoff and equal jitter (`Retry-After` obeyed), and dead-letters what failed for
//! good or for too long.
//!
//! The first attempts of one firing run in the order of docs/rules.md (reload → exec → cleanup →
//! notify); a failing step is handed to its own retry loop and does not hold back the next.
//! Notifications wait for their channel's token bucket in their own task, so one slow or
//! throttled channel never delays another.

mod attempt;
mod digest;
pub mod lane;
pub mod ratelimit;
pub mod retry;
mod slots;
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

use crate::action::{ActionContext, actions_of, followup};
use crate::config::Group;
use crate::event::EventKind;
use crate::firing::{Action, Firing, Job};
use crate::keyspace::clock::now_ms;
use crate::metrics::Metrics;
use crate::status::Status;

use crate::store::dead::{DeadLetter, DeadStore};
use crate::store::queue::{self, Queue, Window};
use attempt::{dead_letter_unreadable, deliver_held};
use digest::take_windows;
use lane::Limiters;
pub use retry::{Next, RetryPolicy};
use slots::{SlotKey, Slots, Ticket};
use state::{CONCURRENT, Held, Inner, Pace, inflight, windows_inflight};
use work::{Work, by_firing, window_jobs};

#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

impl Delivery {
    pub fn new(
        actions: ActionContext,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: crate::keyspace::Conn,
        shutdown: CancellationToken,
    ) -> Delivery {
        Delivery::with_pace(actions, metrics, policy, state, shutdown, Pace::RUN)
    }

    /// [`Delivery::new`] with its timers at `pace` (tests: short ones).
    fn with_pace(
        actions: ActionContext,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: crate::keyspace::Conn,
        shutdown: CancellationToken,
        pace: Pace,
    ) -> Delivery {
        let prefix = actions.config.state.prefix.clone();
        let limiters = Limiters {
            state: state.clone(),
            prefix: prefix.clone(),
            max_wait: pace.max_wait,
            by_channel: Mutex::new(HashMap::new()),
        };
        let dead = DeadStore::new(state.clone(), &prefix);
        let queue = Queue::new(state, &prefix);
        let wake = Arc::new(Notify::new());
        Delivery {
            inner: Arc::new(Inner {
                actions,
                metrics,
                limiters,
                policy,
                tracker: TaskTracker::new(),
                shutdown,
                concurrent: Arc::new(Semaphore::new(CONCURRENT)),
                slots: Slots::new(wake.clone()),
                backlogged: AtomicBool::new(false),
                wake,
                waiting_targets: Default::default(),
                intake_behind: OnceLock::new(),
                deferral: Default::default(),
                dead,
                queue,
                inflight: Mutex::new(Default::default()),
                windows_inflight: Mutex::new(HashMap::new()),
                status: OnceLock::new(),
                pace,
            }),
        }
    }

    /// Moves dead letters an instance of an earlier version was handed back (`keywatch dead
    /// retry` put them in a list then, see `store::dead`) into the queue, every second, until
    /// shutdown. This version's `dead retry` puts them in the queue itself.
    pub fn start_redrive(&self) {
        let store = self.inner.dead.clone();
        let inner = self.inner.clone();
        self.inner.tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match store.move_handed_back(100).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(letters = n, "Moved re-driven dead letters an earlier version handed back out of its list (into the queue, or dropped where they hold nothing to send)."),
                    // A user still under the ACL of 0.1.0 (`+lpush +rpop`) is told once, not
                    // every second (docs/redis.md#least-privilege-acl).
                    Err(e) if e.code() == Some("NOPERM") => {
                        tracing::warn!(error = %e, "Cannot read the list of dead letters an earlier version handed back (the ACL lacks LRANGE or LREM): letters left there are not re-driven.");
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "Cannot move re-driven dead letters into the queue; retrying."),
                }
            }
        });
    }

    /// Reports every attempt and dead letter to `status` from now on (the first call wins).
    pub fn report_to(&self, status: Arc<Status>) {
        let _ = self.inner.status.set(status);
    }

    /// Jobs waiting in Redis for their targets stay there while `behind` says the intake is
    /// behind (for at most a couple of seconds at a stretch: see `Inner::deferring`). The
    /// first call wins.
    pub fn defer_to(&self, behind: impl Fn() -> bool + Send + Sync + 'static) {
        let _ = self.inner.intake_behind.set(Box::new(behind));
    }

    /// Takes the firings of one batch. Their jobs are in the durable queue when this returns
    /// `Ok`, together with `also` (one transaction: the caller's record of the events these
    /// firings are for moves on with them), so the caller may then remove what the firings
    /// copied (the details) without a crash in between losing them. On `Err` nothing is stored
    /// and nothing starts: the caller's record is still there, and whoever takes it next
    /// fires again. The firings this instance has room for start at once; the others wait in
    /// the queue, due now, for whichever instance has room first — so a storm of 100,000
    /// expiries costs Redis memory, not ours, and is shared by every instance.
    pub async fn accept_with(
        &self,
        firings: Vec<Firing>,
        also: Vec<redis::Cmd>,
    ) -> Result<(), queue::WriteError> {
        let inner = &self.inner;
        let actions = inner.actions.refreshed();
        let mut also = also;
        followups_due_later(&inner.queue, &actions.config, &firings, &mut also);
        let mut now = Vec::new();
        let mut later = Vec::new();
        // Per later firing, where each of its jobs waits (see `wait_targets`).
        let mut later_waits: Vec<Vec<Option<String>>> = Vec::new();
        // The room of each target that this batch's firings already count on.
        let mut counted: HashMap<String, usize> = HashMap::new();
        let mut windows: HashMap<Window, (Group, Vec<Arc<Firing>>)> = HashMap::new();
        for firing in firings {
            let firing = Arc::new(firing);
            let Some(rule) = actions.config.rule(&firing.rule) else {
                attempt::rule_gone(inner, &firing);
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
            let waits = wait_targets(inner, &actions.config, &jobs, &mut counted);
            let permit = if waits.iter().all(Option::is_none) {
                inner
                    .concurrent
                    .clone()
                    .try_acquire_many_owned(permits(&jobs))
                    .ok()
            } else {
                None
            };
            match permit {
                Some(permit) => now.push((jobs, permit)),
                None => {
                    later.push(jobs);
                    later_waits.push(waits);
                }
            }
        }
        // In the same transaction as the jobs and the caller's record: a window Redis refuses
        // leaves the record, so the events are taken again (a window held in this instance's
        // memory was lost with it). A notification put twice (the same events taken again after
        // a crash between the store and the caller's next step) has the same id, and is in its
        // digest once.
        for (w, (group, firings)) in windows {
            let jobs = window_jobs(&firings, &w.channel, 0, None);
            also.push(inner.queue.window_put_cmd(&w, group.window, &jobs));
        }
        let leased: Vec<Job> = now.iter().flat_map(|(j, _)| j.iter().cloned()).collect();
        let mut pending = Vec::new();
        let mut waiting = Vec::new();
        for (jobs, waits) in later.iter().zip(later_waits) {
            for (job, target) in jobs.iter().zip(waits) {
                match target {
                    Some(t) => waiting.push((t, job.clone())),
                    None => pending.push(job.clone()),
                }
            }
        }
        let sizes = bundle_sizes(inner, &actions.config, &waiting);
        if let Err(e) = inner
            .queue
            .store(&leased, &pending, &waiting, &sizes, also)
            .await
        {
            tracing::warn!(error = %e, jobs = leased.len() + pending.len() + waiting.len(), "Cannot store jobs in the queue; their events stay taken and are tried again.");
            return Err(e);
        }
        for (target, _) in &waiting {
            if let Some(slot) =
                SlotKey::from_target(target).and_then(|k| inner.slots.get(&actions.config, &k))
            {
                slot.set_parked(true);
            }
        }
        if !later.is_empty() {
            if !pending.is_empty() {
                inner.backlogged.store(true, Ordering::Relaxed);
            }
            inner.wake.notify_one();
        }
        for (jobs, permit) in now {
            let i = inner.clone();
            inner.tracker.spawn(async move {
                run_jobs(i.clone(), with_rooms(&i, asking(jobs), permit)).await
            });
        }
        Ok(())
    }

    /// `key` in `db` was heard existing again (an `expire` event: set again with a TTL): the
    /// follow-ups of an alert of it waiting in the queue become due now, so a resolved notice
    /// does not wait for the end of `within`. Costs a round trip only for keys of rules with
    /// follow-ups.
    pub fn heard_again(&self, config: &crate::config::Config, db: u32, key: &[u8]) {
        let q = self.inner.queue.clone();
        let rules: Vec<crate::config::Rule> = config
            .rules_for(EventKind::Expired, db, key)
            .into_iter()
            .chain(config.rules_for(EventKind::Evicted, db, key))
            .map(|(i, _)| config.rules[i].clone())
            .filter(|r| r.escalate.is_some() || r.resolved.is_some())
            .collect();
        if rules.is_empty() {
            return;
        }
        // Bounded: a storm of lock acquisitions must not become a storm of tasks. Without a
        // permit the follow-ups still run at their due time; only the resolved notice is later.
        let Ok(permit) = HEARING.try_acquire() else {
            return;
        };
        let prefix = config.state.prefix.clone();
        let key = key.to_vec();
        let keyspace = self.inner.actions.keyspace.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) =
                followup::bring_forward(&keyspace, q.conn(), &prefix, &rules, db, &key).await
            {
                tracing::warn!(error = %e, "Cannot bring the follow-ups of a key heard again forward; they run at their due time.");
            }
        });
    }

    /// [`Delivery::accept_with`] with nothing else to store (tests).
    #[cfg(test)]
    pub async fn accept(&self, firings: Vec<Firing>) {
        let _ = self.accept_with(firings, Vec::new()).await;
    }

    /// Gives up firings whose actions cannot run (their detail could not be read for the whole
    /// retry window): a dead letter per action, saying why, which `keywatch dead retry` can
    /// re-drive.
    pub fn give_up(&self, firings: Vec<Firing>, reason: &str) {
        let actions = self.inner.actions.refreshed();
        for firing in firings {
            let Some(rule) = actions.config.rule(&firing.rule) else {
                attempt::rule_gone(&self.inner, &firing);
                continue;
            };
            for action in actions_of(rule) {
                tracing::error!(rule = %firing.rule, key = %crate::event::printable(&firing.key), action = action.name(), %reason, "Dead letter: the action will not run.");
                attempt::keep_dead_letter(
                    &self.inner,
                    DeadLetter::new(
                        &firing.rule,
                        String::from_utf8_lossy(&firing.key).into_owned(),
                        action,
                        reason,
                        vec![firing.clone()],
                        false,
                    ),
                );
            }
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
        let q = &self.inner.queue;
        for (w, ids) in &windows {
            if let Err(e) = q.window_hand_back(w, ids).await {
                tracing::warn!(error = %e, rule = %w.rule, "Cannot hand a digest window back; it comes due again when its lease ends.");
            }
        }
        if !left.is_empty() {
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
        let queue = self.inner.queue.clone();
        let inner = self.inner.clone();
        self.inner.tracker.spawn(async move {
            let mut tick = tokio::time::interval(inner.pace.tick);
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
                    if let Ok(c) = queue.counts().await {
                        inner.metrics.queue_pending.set(c.pending);
                        inner.metrics.queue_due.set(c.due);
                    }
                }
                if last_renew.elapsed() >= crate::store::renew_every() {
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
                take_waiting(&inner, &queue, ticked).await;
                // Woken because a job finished and jobs wait for its target: that was
                // `take_waiting`'s work. The queue itself is read on the tick, or at once while
                // it holds more than one take brought (a script call per finished job, on a
                // queue that held only leased jobs, was a good part of a storm's Redis work).
                if ticked || inner.backlogged.load(Ordering::Relaxed) {
                    take_due(&inner, &queue).await;
                }
            }
        });
    }
}

/// Most jobs taken from the queue in one round trip.
const TAKE_MAX: usize = 512;

/// Takes due jobs while there is room, and starts them: the jobs of one firing together, in
/// the order of docs/rules.md. A job whose slot (or rate-limited line) is full goes to wait for its
/// target in Redis ([`Queue::park`]), so that the jobs of other targets behind it are reached
/// and a storm waits in Redis, not here.
async fn take_due(inner: &Arc<Inner>, queue: &Queue) {
    loop {
        let room = inner.concurrent.available_permits().min(TAKE_MAX);
        if room == 0 {
            return;
        }
        let taken = match queue.take_due(room).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read the job queue; retrying.");
                return;
            }
        };
        // A full answer means more may be waiting (also another instance's storm): take more
        // as soon as a job finishes, not only at the next tick.
        let full = taken.jobs.len() + taken.unreadable.len() == room;
        inner.backlogged.store(full, Ordering::Relaxed);
        dead_letter_unreadable(inner, taken.unreadable);
        start_taken(inner, taken.jobs).await;
        if !full {
            return;
        }
    }
}

/// Starts jobs just leased to this instance, as far as their targets have room; sends the others
/// to wait for their targets in Redis.
async fn start_taken(inner: &Arc<Inner>, jobs: Vec<Job>) {
    let config = inner.actions.live.current();
    let mut lanes = HashMap::new();
    let mut later = Vec::new();
    for jobs in by_firing(jobs) {
        let jobs = admit_firing(inner, &config, jobs, &mut lanes, &mut later);
        if jobs.is_empty() {
            continue;
        }
        let n = u32::try_from(jobs.len()).unwrap_or(u32::MAX);
        match inner.concurrent.clone().try_acquire_many_owned(n) {
            Ok(permit) => start(inner, jobs, permit),
            // `accept` took the room meanwhile: wait for it (the jobs are leased to us).
            Err(_) => {
                let i = inner.clone();
                inner.tracker.spawn(async move {
                    if let Ok(permit) = i.concurrent.clone().acquire_many_owned(n).await {
                        start(&i, jobs, permit);
                    }
                });
            }
        }
    }
    attempt::park(inner, later).await;
}

/// Takes back the jobs waiting in Redis for each target that has room here now: as many as its
/// slot (or rate-limited line) admits, within this instance's room. A target that no longer
/// exists gets its jobs taken too, to be dead-lettered.
async fn take_waiting(inner: &Arc<Inner>, queue: &Queue, ticked: bool) {
    if inner.deferring() {
        return;
    }
    let Some(targets) = waiting_targets(inner, queue, ticked).await else {
        return;
    };
    let config = inner.actions.live.current();
    for target in targets {
        let key = SlotKey::from_target(&target);
        let slot = key.as_ref().and_then(|k| inner.slots.get(&config, k));
        let lane = match &key {
            Some(SlotKey::Channel(c)) => inner.limiters.get(&config, c).map(|l| l.lane),
            _ => None,
        };
        let (room, cap) = match (&lane, &slot) {
            (Some(lane), _) => (lane.room(), lane.cap()),
            (None, Some(slot)) => (slot.room(), slot.capacity()),
            // Gone from the rules: taken to fail and be dead-lettered.
            (None, None) => (TAKE_MAX, TAKE_MAX),
        };
        let room = room.min(inner.concurrent.available_permits()).min(TAKE_MAX);
        if room == 0 {
            continue;
        }
        // All the room the target has: a bundle made when it was wider (before a reload) goes
        // whole, rather than never.
        let idle = room >= cap.min(TAKE_MAX);
        if !idle && slot.as_ref().is_some_and(|s| !s.worth_asking(room)) {
            continue;
        }
        let taken = match queue.unpark(&target, room, idle).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, %target, "Cannot take jobs waiting for their target; retrying.");
                continue;
            }
        };
        if let Some(slot) = &slot {
            slot.set_need(taken.need);
            if !taken.more {
                // All of them taken: nothing more to wake up for.
                slot.set_parked(false);
            }
        }
        if !taken.more {
            inner.waiting_targets.forget(&target);
        }
        dead_letter_unreadable(inner, taken.unreadable);
        start_taken(inner, taken.jobs).await;
    }
}

/// The targets that have jobs waiting in Redis: as read at most [`state::TARGETS_FRESH`] ago
/// (and anew on every tick), since the queue loop runs each time a request finishes while jobs
/// wait, and a read per request was a good share of what a storm's delivery cost the state
/// server. A target whose jobs another instance parked is seen that much later at most; one of
/// this instance's was parked because its slot was full, and waits for room anyway.
async fn waiting_targets(inner: &Inner, queue: &Queue, ticked: bool) -> Option<Vec<String>> {
    if !ticked && let Some(t) = inner.waiting_targets.fresh() {
        return Some(t);
    }
    match queue.waiting_targets().await {
        Ok(t) => {
            inner.waiting_targets.set(t.clone());
            Some(t)
        }
        Err(e) => {
            tracing::warn!(error = %e, "Cannot read which targets have jobs waiting; retrying.");
            None
        }
    }
}

/// The bundle size of each target that `waiting` jobs wait for (the queue caps it at its own
/// most): a slot's whole line, or half of a rate-limited line. A bundle taken back never brings
/// more than the target has room for (see `queue::bundle`), so it must fit in what frees up
/// while the target stays busy: a slot's line empties as its requests run, and a slot's line is
/// at least a bundle long (`slots::LINE_MIN`); a rate-limited line is the target's only room.
/// A bundle as big as all of it would be taken only once the target had nothing left to do.
fn bundle_sizes(
    inner: &Inner,
    config: &crate::config::Config,
    waiting: &[(String, Job)],
) -> HashMap<String, usize> {
    let mut sizes = HashMap::new();
    for (target, _) in waiting {
        if sizes.contains_key(target) {
            continue;
        }
        let key = SlotKey::from_target(target);
        let lane = match &key {
            Some(SlotKey::Channel(c)) => inner.limiters.get(config, c).map(|l| l.lane),
            _ => None,
        };
        let size = match (lane, key.and_then(|k| inner.slots.get(config, &k))) {
            (Some(lane), _) => lane.cap() / 2,
            (None, Some(slot)) => slot.line(),
            (None, None) => 1,
        };
        sizes.insert(target.clone(), size.max(1));
    }
    sizes
}

/// How many permits of [`Inner::concurrent`] `jobs` take: one each (and never more than there are).
fn permits(jobs: &[Job]) -> u32 {
    u32::try_from(jobs.len().clamp(1, state::CONCURRENT)).unwrap_or(1)
}

/// Where each job of a new firing waits if it cannot start now: for its target in Redis (the
/// target's name) when that target has no room, as [`admit_firing`] would send it after taking
/// it from the queue; `None` otherwise. All `None`: the firing may start here now. The room of
/// each target is counted across the batch (`counted`), since nothing is reserved until the
/// jobs run: judged one firing at a time against the same free room, a whole storm batch
/// looked as if it fitted, was leased here, and all but a few jobs were then parked one by one.
fn wait_targets(
    inner: &Inner,
    config: &crate::config::Config,
    jobs: &[Job],
    counted: &mut HashMap<String, usize>,
) -> Vec<Option<String>> {
    let first = starting(jobs);
    let mut out = Vec::with_capacity(jobs.len());
    let mut after: Option<String> = None;
    for (i, job) in jobs.iter().enumerate() {
        if after.is_some() || i >= first {
            out.push(after.clone());
            continue;
        }
        let full = count_room(inner, config, job, counted).err();
        if full.is_some() && !job.action.is_notification() {
            after.clone_from(&full);
        }
        out.push(full);
    }
    out
}

/// Counts `job` against the room of its target (its channel's rate-limited line, or its slot)
/// left after what `counted` holds; `Err` with the target's name when there is none.
fn count_room(
    inner: &Inner,
    config: &crate::config::Config,
    job: &Job,
    counted: &mut HashMap<String, usize>,
) -> Result<(), String> {
    if let Some(lined) = count_in_line(inner, config, job, counted) {
        return lined;
    }
    let Some(key) = SlotKey::of(&job.firing.rule, &job.action) else {
        return Ok(());
    };
    let Some(slot) = inner.slots.get(config, &key) else {
        return Ok(());
    };
    let target = key.target();
    let n = counted.entry(target.clone()).or_default();
    if slot.room() <= *n {
        return Err(target);
    }
    *n += 1;
    Ok(())
}

/// For a notification of a rate-limited channel (`None` otherwise): its line bounds it, so it
/// is counted against the line's room left after what `counted` (by target) holds already.
fn count_in_line(
    inner: &Inner,
    config: &crate::config::Config,
    job: &Job,
    counted: &mut HashMap<String, usize>,
) -> Option<Result<(), String>> {
    let Action::Notify { channel } = &job.action else {
        return None;
    };
    let l = inner.limiters.get(config, channel)?;
    let target = SlotKey::Channel(channel.clone()).target();
    let n = counted.entry(target.clone()).or_default();
    if !l.lane.has_room(*n) {
        return Some(Err(target));
    }
    *n += 1;
    Some(Ok(()))
}

/// How many of a firing's jobs (in the order of docs/rules.md) start at once: the first step, or every
/// notification when there is nothing before them.
fn starting(jobs: &[Job]) -> usize {
    match jobs.first() {
        Some(j) if !j.action.is_notification() => 1,
        _ => jobs.len(),
    }
}

/// A ticket for `job`'s slot now, or the target it should wait for in Redis. `lanes` counts
/// the notifications already let into each rate-limited line in this round.
fn admit(
    inner: &Inner,
    config: &crate::config::Config,
    job: &Job,
    lanes: &mut HashMap<String, usize>,
) -> Result<Ticket, String> {
    // A rate-limited line bounds it; the slot is asked for once its token comes.
    if let Some(lined) = count_in_line(inner, config, job, lanes) {
        return lined.map(|()| Ticket::Ask);
    }
    let key = SlotKey::of(&job.firing.rule, &job.action);
    match key.as_ref().and_then(|k| inner.slots.get(config, k)) {
        Some(slot) => slot
            .admit()
            .ok_or_else(|| key.map(|k| k.target()).unwrap_or_default()),
        None => Ok(Ticket::Ask),
    }
}

/// The jobs of one firing taken from the queue that start now, with their tickets; those whose
/// target has no room are added to `later` with the target to wait for. A first step without
/// room takes the firing's later steps with it (they run after it, docs/rules.md); notifications are
/// independent of one another.
fn admit_firing(
    inner: &Inner,
    config: &crate::config::Config,
    jobs: Vec<Job>,
    lanes: &mut HashMap<String, usize>,
    later: &mut Vec<(String, String)>,
) -> Vec<(Job, Ticket)> {
    let first = starting(&jobs);
    let mut out = Vec::with_capacity(jobs.len());
    let mut after: Option<String> = None;
    for (i, job) in jobs.into_iter().enumerate() {
        if let Some(target) = &after {
            later.push((target.clone(), job.id()));
            continue;
        }
        if i >= first {
            out.push((job, Ticket::Ask));
            continue;
        }
        match admit(inner, config, &job, lanes) {
            Ok(t) => out.push((job, t)),
            Err(target) => {
                if !job.action.is_notification() {
                    after = Some(target.clone());
                }
                later.push((target, job.id()));
            }
        }
    }
    out
}

/// `jobs` with no ticket yet: each asks for its slot when its turn comes.
fn asking(jobs: Vec<Job>) -> Vec<(Job, Ticket)> {
    jobs.into_iter().map(|j| (j, Ticket::Ask)).collect()
}

fn with_rooms(
    inner: &Arc<Inner>,
    jobs: Vec<(Job, Ticket)>,
    permit: OwnedSemaphorePermit,
) -> Vec<(Job, Held)> {
    let mut rooms = state::rooms(inner, permit, jobs.len()).into_iter();
    jobs.into_iter()
        .map(|(job, ticket)| {
            let room = rooms.next();
            (job, Held { room, ticket })
        })
        .collect()
}

/// Starts the attempts of one firing's admitted jobs.
fn start(inner: &Arc<Inner>, jobs: Vec<(Job, Ticket)>, permit: OwnedSemaphorePermit) {
    let jobs = with_rooms(inner, jobs, permit);
    let i = inner.clone();
    inner.tracker.spawn(async move { run_jobs(i, jobs).await });
}

/// The attempts of one firing's jobs, in the order of docs/rules.md. A failing job goes to the
/// queue for its retry and does not hold back the next; a notification runs in its own task
/// (its channel's line, rate and slot are its own), so a throttled channel holds back nothing
/// else. A step whose slot has no room when its turn comes goes back to the queue, and the
/// steps after it with it.
async fn run_jobs(inner: Arc<Inner>, jobs: Vec<(Job, Held)>) {
    // Every job is this instance's from now on: its lease is renewed while earlier jobs run
    // (a slow reload must not let another instance take the notification behind it), and
    // shutdown hands back the jobs it never reached.
    inflight(&inner).extend(jobs.iter().map(|(j, _)| j.id()));
    let config = inner.actions.live.current();
    let mut later: Vec<(String, String)> = Vec::new();
    let mut after: Option<String> = None;
    for (job, mut held) in jobs {
        if inner.shutdown.is_cancelled() {
            break;
        }
        let notify = job.action.is_notification();
        if let Some(target) = &after {
            later.push((target.clone(), job.id()));
            continue;
        }
        if matches!(held.ticket, Ticket::Ask) {
            match admit(&inner, &config, &job, &mut HashMap::new()) {
                Ok(t) => held.ticket = t,
                Err(target) => {
                    if !notify {
                        after = Some(target.clone());
                    }
                    later.push((target, job.id()));
                    continue;
                }
            }
        }
        let (n, since) = (job.attempt, job.failing_since);
        let work = Work::Job {
            firing: job.firing,
            action: job.action,
        };
        if notify {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { deliver_held(i, work, n, since, held).await });
        } else {
            deliver_held(inner.clone(), work, n, since, held).await;
        }
    }
    attempt::park(&inner, later).await;
}

/// Keys heard again being looked up for follow-ups at once (see [`Delivery::heard_again`]).
static HEARING: Semaphore = Semaphore::const_new(64);

/// The follow-up jobs (`escalate`, `resolved`) of alerts of keys that are gone, due later, and
/// the markers naming them, stored in the same transaction as the alerts' own jobs.
fn followups_due_later(
    q: &queue::Queue,
    config: &crate::config::Config,
    firings: &[Firing],
    also: &mut Vec<redis::Cmd>,
) {
    let now = now_ms();
    for f in firings {
        if !matches!(
            f.kind,
            EventKind::Expired | EventKind::Evicted | EventKind::Hexpired
        ) {
            continue;
        }
        let Some(rule) = config.rule(&f.rule) else {
            continue;
        };
        let (jobs, marker_ms) = followup::jobs_of(rule, now);
        if jobs.is_empty() {
            continue;
        }
        let firing = Arc::new(f.clone());
        for (action, due) in jobs {
            also.extend(q.due_later_cmds(&Job::first(firing.clone(), action), due));
        }
        // A field's re-creation is no `expire` event of its hash: its follow-ups look for the
        // field when they come due instead of being brought forward.
        if f.field.is_none() {
            also.push(followup::marker_cmd(&config.state.prefix, f, marker_ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RetryPolicy;
    use super::testkit::{self, firing, stage};

    /// A firing matched under the rules before a reload reaches delivery after the reload
    /// removed its rule: a dead letter that says so (the README promises nothing is dropped
    /// silently), and the other firings of the batch go on.
    #[tokio::test]
    async fn a_firing_of_a_rule_a_reload_removed_is_dead_lettered() {
        let config = testkit::config(
            "channels:\n  log: { type: log }\nrules:\n  - name: kept\n    match: 'k:*'\n    notify: { to: [log] }\n",
        );
        let s = stage(config, RetryPolicy::default()).await;
        s.delivery
            .accept(vec![firing("removed", "r:1"), firing("kept", "k:1")])
            .await;
        s.settled().await;
        assert_eq!(s.metrics.dead_letters.get(), 1);
        let dead = s.status.dead_letters();
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0].rule, "removed");
        assert_eq!(dead[0].key, "r:1");
        assert_eq!(dead[0].reason, "rule `removed` no longer exists");
        assert_eq!(s.status.counts("kept").sent, 1);
    }
}
