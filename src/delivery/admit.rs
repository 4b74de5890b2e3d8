//! The admit stage: whether this instance holds a job now, or the job waits for its target in
//! Redis. Two bounds keep a storm's cost in Redis, not here (docs/how-it-works.md#delivery):
//!
//! - **capacity**: at most [`CAPACITY`] jobs in this instance's memory at once, over every target;
//!   each holds a [`Seat`].
//! - **concurrency**: at most `concurrency` requests in flight to one *target* (a channel, a rule's
//!   `reload`, a rule's `exec`), each holding a [`Permit`], and a *line* of jobs waiting in memory
//!   for a permit, as long as the target's concurrency and at least [`LINE_MIN`]. A job that finds
//!   the line full waits for its target in Redis instead (`Queue::wait_for_target`), taken back
//!   from there as permits free up (`Queue::take_waiting`) by whichever instance has free places
//!   for that target. A notification of a channel with a `rate` is bounded by its channel's pace instead
//!   (`super::pace`), and asks for its permit once its token comes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::firing::{Action, Job};

use super::pace::Paces;

/// Jobs held in memory at once by one instance: places for 32 targets at their default
/// `concurrency` with full lines before one more has to wait for another.
pub(super) const CAPACITY: usize = 1024;

/// The shortest line: a whole bundle of waiting jobs (`queue::bundle`, 64 jobs) fits in it
/// while the target is busy. Jobs wait for a narrow target in Redis in bundles as long as its
/// line; with a line only as long as the concurrency (16 by default), bundles of 8 cost the state
/// server about eight calls each to take back, mark and remove — most of what a storm's delivery
/// cost it. A line holds jobs in memory, but never more than [`CAPACITY`] across all targets.
pub(super) const LINE_MIN: usize = 64;

/// How long what the last look said the oldest job waiting in Redis for a target needs is
/// trusted: another instance may have taken it meanwhile.
const NEED_FRESH: Duration = Duration::from_millis(200);

/// Where a job's requests go, bounded by its `concurrency`: a channel, or one rule's `reload`
/// or `exec`. `cleanup` has none: it talks to Redis, whose connection is shared and multiplexed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Target {
    Channel(String),
    Reload(String),
    Exec(String),
}

impl Target {
    pub(super) fn of(rule: &str, action: &Action) -> Option<Target> {
        match action {
            Action::Notify { channel }
            | Action::Alert { channel, .. }
            | Action::Escalate { channel }
            | Action::Resolved { channel } => Some(Target::Channel(channel.clone())),
            Action::Reload => Some(Target::Reload(rule.to_string())),
            Action::Exec => Some(Target::Exec(rule.to_string())),
            Action::Cleanup => None,
        }
    }

    /// Its name in Redis, where jobs wait for it (`channel:oncall`, `reload:RULE`).
    pub(super) fn name(&self) -> String {
        match self {
            Target::Channel(c) => format!("channel:{c}"),
            Target::Reload(r) => format!("reload:{r}"),
            Target::Exec(r) => format!("exec:{r}"),
        }
    }

    /// The target a name in Redis stands for.
    pub(super) fn parse(name: &str) -> Option<Target> {
        let (kind, rest) = name.split_once(':')?;
        let rest = rest.to_string();
        match kind {
            "channel" => Some(Target::Channel(rest)),
            "reload" => Some(Target::Reload(rest)),
            "exec" => Some(Target::Exec(rest)),
            _ => None,
        }
    }

    /// Its `concurrency` under `config`; `None` when the channel or step no longer exists (the
    /// attempt then fails and is dead-lettered; nothing to wait for).
    fn concurrency(&self, config: &Config) -> Option<usize> {
        match self {
            Target::Channel(c) => config.channel(c).map(|c| c.concurrency),
            Target::Reload(r) => config.rule(r)?.reload.as_ref().map(|s| s.concurrency),
            Target::Exec(r) => config.rule(r)?.exec.as_ref().map(|s| s.concurrency),
        }
    }
}

/// One target's concurrency: its permits, and its line.
pub(super) struct Concurrency {
    limit: usize,
    permits: Arc<Semaphore>,
    /// Jobs in the line (each holds an [`InLine`]).
    in_line: AtomicUsize,
    /// Set when this instance sent jobs to wait for this target in Redis: a permit given back
    /// then wakes the take stage to take the next of them at once.
    waiting_in_redis: AtomicBool,
    /// How many jobs the oldest member waiting for this target in Redis holds, when the last look
    /// found it too big for the free places then (`Queue::take_waiting`), and when that was: asking
    /// again with fewer free places brings nothing, and in a storm's delivery those empty asks (a
    /// script call each time a request finished) were most of the calls the state server got.
    need: Mutex<Option<(usize, Instant)>>,
    wake: Arc<Notify>,
}

impl Concurrency {
    fn new(limit: usize, wake: Arc<Notify>) -> Concurrency {
        Concurrency {
            limit,
            permits: Arc::new(Semaphore::new(limit)),
            in_line: AtomicUsize::new(0),
            waiting_in_redis: AtomicBool::new(false),
            need: Mutex::new(None),
            wake,
        }
    }

    /// How many jobs wait in memory for a permit at most.
    pub(super) fn line(&self) -> usize {
        self.limit.max(LINE_MIN)
    }

    /// A permit at once, or a place in the line while it is not full; `None`: the job waits for
    /// this target in Redis instead.
    pub(super) fn admit(self: &Arc<Self>) -> Option<Admission> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(Admission::Permit(Permit::new(self.clone(), p)));
        }
        let mut n = self.in_line.load(Ordering::Acquire);
        loop {
            if n >= self.line() {
                return None;
            }
            match self
                .in_line
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(Admission::InLine(InLine { of: self.clone() })),
                Err(seen) => n = seen,
            }
        }
    }

    /// How many jobs [`Concurrency::admit`] would admit now: free permits and free places in
    /// the line.
    pub(super) fn free(&self) -> usize {
        self.permits.available_permits()
            + self
                .line()
                .saturating_sub(self.in_line.load(Ordering::Acquire))
    }

    /// The most [`Concurrency::free`] ever is.
    pub(super) fn capacity(&self) -> usize {
        self.limit.saturating_add(self.line())
    }

    /// The oldest member waiting for this target in Redis holds `need` jobs and did not fit in
    /// the free places of the last look (0: nothing was too big).
    pub(super) fn set_need(&self, need: usize) {
        *self.need.lock().unwrap_or_else(|p| p.into_inner()) =
            (need > 0).then(|| (need, Instant::now()));
    }

    /// Whether taking jobs back with `free` places may bring any: not while the last look, a moment
    /// ago, found the oldest member bigger than that.
    pub(super) fn worth_asking(&self, free: usize) -> bool {
        match *self.need.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((need, at)) => free >= need || at.elapsed() >= NEED_FRESH,
            None => true,
        }
    }

    /// Jobs of this target now wait in Redis (or no longer do, as far as this instance knows).
    pub(super) fn set_waiting_in_redis(&self, waiting: bool) {
        self.waiting_in_redis.store(waiting, Ordering::Release);
    }

    /// A permit, however long the line: for work bounded elsewhere (a digest).
    async fn acquire(self: &Arc<Self>, shutdown: &CancellationToken) -> Option<Permit> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            p = self.permits.clone().acquire_owned() => p.ok().map(|p| Permit::new(self.clone(), p)),
        }
    }
}

/// The right to make one request to a target, for its duration and until its outcome is
/// recorded in Redis (`super::record`): what a kill can send twice is what holds one.
pub(super) struct Permit {
    of: Arc<Concurrency>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Permit {
    fn new(of: Arc<Concurrency>, permit: OwnedSemaphorePermit) -> Permit {
        Permit {
            of,
            permit: Some(permit),
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        drop(self.permit.take());
        if self.of.waiting_in_redis.load(Ordering::Acquire) {
            self.of.wake.notify_one();
        }
    }
}

/// A place in a target's line, given back when it turns into a permit or is dropped.
pub(super) struct InLine {
    of: Arc<Concurrency>,
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.of.in_line.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a job has of its target's concurrency before its attempt.
#[derive(Default)]
pub(super) enum Admission {
    /// A permit: the request may start.
    Permit(Permit),
    /// A place in the line.
    InLine(InLine),
    /// Nothing yet: the permit is asked for when the attempt comes (and waited for, however
    /// long the line): a notification of a paced channel, a job after its firing's first step,
    /// a digest.
    #[default]
    Later,
}

impl Admission {
    /// The permit for the attempt: the one held, the one the line gives, or one asked for now.
    /// `Ok(None)`: the job has no target; `Err(())`: shutdown came first.
    pub(super) async fn permit(
        self,
        of: Option<Arc<Concurrency>>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Permit>, ()> {
        match (self, of) {
            (Admission::Permit(p), _) => Ok(Some(p)),
            (Admission::InLine(place), _) => {
                let of = place.of.clone();
                let permit = of.acquire(shutdown).await.ok_or(())?;
                drop(place);
                Ok(Some(permit))
            }
            (Admission::Later, Some(of)) => of.acquire(shutdown).await.map(Some).ok_or(()),
            (Admission::Later, None) => Ok(None),
        }
    }
}

/// The concurrency of each target in force: made on first use, made anew when a reload
/// changes its limit (requests under the old one finish under it).
pub(super) struct Targets {
    by_target: Mutex<HashMap<Target, Arc<Concurrency>>>,
    /// Wakes the take stage (see [`Concurrency::waiting_in_redis`]).
    wake: Arc<Notify>,
}

impl Targets {
    pub(super) fn new(wake: Arc<Notify>) -> Targets {
        Targets {
            by_target: Mutex::new(HashMap::new()),
            wake,
        }
    }

    pub(super) fn get(&self, config: &Config, target: &Target) -> Option<Arc<Concurrency>> {
        let limit = target.concurrency(config)?;
        let mut map = self.by_target.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(target)
            && c.limit == limit
        {
            return Some(c.clone());
        }
        let c = Arc::new(Concurrency::new(limit, self.wake.clone()));
        map.insert(target.clone(), c.clone());
        Some(c)
    }

    /// The concurrency of `action` of `rule`.
    pub(super) fn of(
        &self,
        config: &Config,
        rule: &str,
        action: &Action,
    ) -> Option<Arc<Concurrency>> {
        self.get(config, &Target::of(rule, action)?)
    }
}

/// This instance's capacity: [`CAPACITY`] seats, one per job held in memory.
pub(super) struct Capacity {
    seats: Arc<Semaphore>,
    /// Set while jobs this instance had no free place for may be waiting in the queue: a seat given
    /// back then wakes the take stage to take the next ones at once.
    backlogged: AtomicBool,
    wake: Arc<Notify>,
}

/// One job's seat in this instance's capacity. Given back when the job is done, goes back to
/// Redis, or starts waiting for its pace's token (the pace's backlog is bounded on its own);
/// while a backlog waits in the queue, that wakes the take stage to take the next job at once.
pub(super) struct Seat {
    permit: Option<OwnedSemaphorePermit>,
    capacity: Arc<Capacity>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        drop(self.permit.take());
        if self.capacity.backlogged.load(Ordering::Relaxed) {
            self.capacity.wake.notify_one();
        }
    }
}

impl Capacity {
    pub(super) fn new(wake: Arc<Notify>) -> Arc<Capacity> {
        Arc::new(Capacity {
            seats: Arc::new(Semaphore::new(CAPACITY)),
            backlogged: AtomicBool::new(false),
            wake,
        })
    }

    /// Seats free now.
    pub(super) fn free(&self) -> usize {
        self.seats.available_permits()
    }

    pub(super) fn is_backlogged(&self) -> bool {
        self.backlogged.load(Ordering::Relaxed)
    }

    pub(super) fn set_backlogged(&self, backlogged: bool) {
        self.backlogged.store(backlogged, Ordering::Relaxed);
    }

    /// `n` seats now (at most [`CAPACITY`] are asked), or `None`.
    pub(super) fn try_seats(self: &Arc<Self>, n: usize) -> Option<Vec<Seat>> {
        let n = n.clamp(1, CAPACITY);
        let permit = self
            .seats
            .clone()
            .try_acquire_many_owned(u32::try_from(n).unwrap_or(1))
            .ok()?;
        Some(self.split(permit, n))
    }

    /// `n` seats, waited for.
    pub(super) async fn seats(self: &Arc<Self>, n: usize) -> Vec<Seat> {
        let n = n.clamp(1, CAPACITY);
        match self
            .seats
            .clone()
            .acquire_many_owned(u32::try_from(n).unwrap_or(1))
            .await
        {
            Ok(permit) => self.split(permit, n),
            // The semaphore is never closed.
            Err(_) => Vec::new(),
        }
    }

    fn split(self: &Arc<Self>, permit: OwnedSemaphorePermit, n: usize) -> Vec<Seat> {
        let mut out = Vec::with_capacity(n);
        let mut rest = Some(permit);
        for _ in 0..n {
            let one = match rest.as_mut() {
                Some(p) if p.num_permits() > 1 => p.split(1),
                _ => rest.take(),
            };
            let Some(one) = one else { break };
            out.push(Seat {
                permit: Some(one),
                capacity: self.clone(),
            });
        }
        out
    }
}

/// How many of a firing's jobs (in the order of docs/rules.md) start at once: the first step,
/// or every notification when there is nothing before them. The steps after the first run
/// after it, in order.
pub(super) fn starting(jobs: &[Job]) -> usize {
    match jobs.first() {
        Some(j) if !j.action.is_notification() => 1,
        _ => jobs.len(),
    }
}

/// The targets' admission of jobs, counted per round: nothing is reserved until a job runs, so
/// jobs admitted in one round are counted against the free places they will take.
pub(super) struct Admit<'a> {
    pub(super) config: &'a Config,
    pub(super) targets: &'a Targets,
    pub(super) paces: &'a Paces,
    /// The places of each target that this round's jobs already count on.
    counted: HashMap<String, usize>,
    /// Every target counts as full: the intake is behind (a mass expiry), and new firings' jobs
    /// wait for their targets in Redis meanwhile (see `take::Deferral`).
    deferring: bool,
}

impl<'a> Admit<'a> {
    pub(super) fn new(config: &'a Config, targets: &'a Targets, paces: &'a Paces) -> Admit<'a> {
        Admit {
            config,
            targets,
            paces,
            counted: HashMap::new(),
            deferring: false,
        }
    }

    /// This round's jobs wait for their targets in Redis, whatever places are free.
    pub(super) fn deferring(mut self, deferring: bool) -> Admit<'a> {
        self.deferring = deferring;
        self
    }

    /// Where each job of a new firing waits if it cannot start now: for its target in Redis
    /// (the target's name) when that target has no free place, as [`Admit::firing`] would send it
    /// after taking it from the queue; `None` otherwise. All `None`: the firing may start here
    /// now. A first step without a free place takes the later steps with it.
    pub(super) fn places_for(&mut self, jobs: &[Job]) -> Vec<Option<String>> {
        let first = starting(jobs);
        let mut out = Vec::with_capacity(jobs.len());
        let mut after: Option<String> = None;
        for (i, job) in jobs.iter().enumerate() {
            if after.is_some() || i >= first {
                out.push(after.clone());
                continue;
            }
            let full = self.count(job).err();
            if full.is_some() && !job.action.is_notification() {
                after.clone_from(&full);
            }
            out.push(full);
        }
        out
    }

    /// Counts `job` against its target's free places (its pace's backlog for a paced notification)
    /// left after what this round counted; `Err` with the target's name when there is none.
    fn count(&mut self, job: &Job) -> Result<(), String> {
        if let Some(paced) = self.count_paced(job) {
            return paced;
        }
        let Some(target) = Target::of(&job.firing.rule, &job.action) else {
            return Ok(());
        };
        let Some(c) = self.targets.get(self.config, &target) else {
            return Ok(());
        };
        let name = target.name();
        let n = self.counted.entry(name.clone()).or_default();
        if self.deferring || c.free() <= *n {
            return Err(name);
        }
        *n += 1;
        Ok(())
    }

    /// For a notification of a channel with a `rate` (`None` otherwise): its pace's backlog
    /// bounds it, counted against the free places left after what this round counted.
    fn count_paced(&mut self, job: &Job) -> Option<Result<(), String>> {
        let Action::Notify { channel } = &job.action else {
            return None;
        };
        let pace = self.paces.get(self.config, channel)?;
        let name = Target::Channel(channel.clone()).name();
        let n = self.counted.entry(name.clone()).or_default();
        if self.deferring || !pace.has_room(*n) {
            return Some(Err(name));
        }
        *n += 1;
        Some(Ok(()))
    }

    /// `job`'s admission now, or the target it should wait for in Redis.
    pub(super) fn job(&mut self, job: &Job) -> Result<Admission, String> {
        // A paced notification is bounded by its backlog; its permit is asked once its token
        // comes.
        if let Some(paced) = self.count_paced(job) {
            return paced.map(|()| Admission::Later);
        }
        let target = Target::of(&job.firing.rule, &job.action);
        match target
            .as_ref()
            .and_then(|t| self.targets.get(self.config, t))
        {
            Some(c) => c
                .admit()
                .ok_or_else(|| target.map(|t| t.name()).unwrap_or_default()),
            None => Ok(Admission::Later),
        }
    }

    /// The jobs of one firing taken from the queue that this instance holds now, with their
    /// admissions; those whose target has no free place are added to `to_wait` (target, job id). A
    /// first step without a free place takes the firing's later steps with it (they run after it,
    /// docs/rules.md); notifications are independent of one another.
    pub(super) fn firing(
        &mut self,
        jobs: Vec<Job>,
        to_wait: &mut Vec<(String, String)>,
    ) -> Vec<(Job, Admission)> {
        let first = starting(&jobs);
        let mut out = Vec::with_capacity(jobs.len());
        let mut after: Option<String> = None;
        for (i, job) in jobs.into_iter().enumerate() {
            if let Some(target) = &after {
                to_wait.push((target.clone(), job.id()));
                continue;
            }
            if i >= first {
                out.push((job, Admission::Later));
                continue;
            }
            match self.job(&job) {
                Ok(a) => out.push((job, a)),
                Err(target) => {
                    if !job.action.is_notification() {
                        after = Some(target.clone());
                    }
                    to_wait.push((target, job.id()));
                }
            }
        }
        out
    }

    /// How many jobs waiting in Redis for `target` to take back into each bundle: a target's
    /// whole line, or half of a paced channel's backlog. A bundle taken back never brings more
    /// than the target has free places for (see `queue::bundle`), so it must fit in what frees up
    /// while the target stays busy.
    pub(super) fn bundle_size(&self, target: &str) -> usize {
        let target = Target::parse(target);
        let paced = match &target {
            Some(Target::Channel(c)) => self.paces.get(self.config, c),
            _ => None,
        };
        let size = match (
            paced,
            target.and_then(|t| self.targets.get(self.config, &t)),
        ) {
            (Some(pace), _) => pace.cap() / 2,
            (None, Some(c)) => c.line(),
            (None, None) => 1,
        };
        size.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::RetryPolicy;
    use super::super::testkit::{self, SlowTarget, firings, ms, secs, stage};
    use super::*;

    /// A storm of 200 notifications and 40 reloads and execs against targets that take 20 ms:
    /// never more requests at once than each `concurrency` (a channel's, a rule's reload's), and
    /// every one made; the jobs beyond a target's concurrency and line wait for it in Redis.
    #[tokio::test]
    async fn requests_in_flight_stay_within_each_concurrency() {
        let hook = SlowTarget::start(ms(20)).await;
        let reload = SlowTarget::start(ms(20)).await;
        let config = testkit::config(&format!(
            "channels:\n  hook: {{ type: webhook, url: \"{}\", timeout: 1h, concurrency: 4 }}\n  other: {{ type: webhook, url: \"{}\", timeout: 1h }}\nrules:\n  - name: storm\n    match: 's:*'\n    notify: {{ to: [hook] }}\n  - name: warm\n    match: 'w:*'\n    reload: {{ url: \"{}\", timeout: 1h, concurrency: 2 }}\n    exec: {{ command: [\"true\"], concurrency: 3 }}\n",
            hook.url, hook.url, reload.url
        ));
        let s = stage(config, RetryPolicy::default()).await;
        let keys: Vec<String> = (0..200).map(|i| format!("s:{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        s.delivery.accept(firings("storm", &keys)).await;
        let warm: Vec<String> = (0..40).map(|i| format!("w:{i}")).collect();
        let warm: Vec<&str> = warm.iter().map(String::as_str).collect();
        s.delivery.accept(firings("warm", &warm)).await;

        assert_eq!(hook.served(200, secs(30)).await, 200);
        assert_eq!(reload.served(40, secs(30)).await, 40);
        s.settled().await;
        assert_eq!(hook.most(), 4, "the channel's requests at once");
        assert_eq!(reload.most(), 2, "the rule's reloads at once");
        assert_eq!(hook.holding() + reload.holding(), 0);
        assert_eq!(s.status.counts("storm").sent, 200);
        assert_eq!(s.metrics.dead_letters.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_target_admits_its_concurrency_then_its_line_then_nothing() {
        for (limit, line) in [(2, LINE_MIN), (100, 100)] {
            let c = Arc::new(Concurrency::new(limit, Arc::new(Notify::new())));
            assert_eq!(c.line(), line);
            assert_eq!(c.free(), limit + line);
            assert_eq!(c.capacity(), limit + line);
            let now: Vec<Admission> = (0..limit).map(|_| c.admit().unwrap()).collect();
            assert!(now.iter().all(|a| matches!(a, Admission::Permit(_))));
            let mut queued: Vec<Admission> = (0..line).map(|_| c.admit().unwrap()).collect();
            assert!(queued.iter().all(|a| matches!(a, Admission::InLine(_))));
            assert!(c.admit().is_none());
            assert_eq!(c.free(), 0);
            // Places given up are free again.
            queued.truncate(line - 2);
            assert_eq!(c.free(), 2);
            assert!(matches!(c.admit(), Some(Admission::InLine(_))));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_target_is_not_asked_again_for_less_than_its_oldest_waiting_member_needs_for_a_while()
    {
        let c = Concurrency::new(16, Arc::new(Notify::new()));
        assert!(c.worth_asking(1));
        c.set_need(64);
        assert!(!c.worth_asking(63));
        assert!(c.worth_asking(64));
        tokio::time::advance(NEED_FRESH).await;
        assert!(
            c.worth_asking(1),
            "another instance may have taken it since"
        );
        c.set_need(64);
        c.set_need(0);
        assert!(c.worth_asking(1));
    }

    #[test]
    fn a_target_is_named_in_redis_as_it_is_parsed() {
        for t in [
            Target::Channel("on-call".into()),
            Target::Reload("cache:warm".into()),
            Target::Exec("r".into()),
        ] {
            assert_eq!(Target::parse(&t.name()), Some(t));
        }
        assert_eq!(Target::parse("lane"), None);
    }
}
