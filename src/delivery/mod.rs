//! The delivery stage: every job of every firing, from the durable queue in Redis to its outcome,
//! as one chain of named stages (docs/how-it-works.md#delivery):
//!
//! 1. **take** — new firings' jobs are stored in the queue (with the record of their events, in
//!    one transaction), and what comes due there is taken: retries, follow-ups, digest windows
//!    that ended, jobs of instances that died, jobs waiting for their target ([`take`]);
//! 2. **admit** — within this instance's capacity and each target's `concurrency`, or back to
//!    wait for the target in Redis ([`admit`]);
//! 3. **pace** — a notification of a channel with a `rate` waits for its token, and a backlog
//!    merges into a digest ([`pace`]);
//! 4. **attempt** — the integration, once ([`attempt`]);
//! 5. **record** — acknowledged, rescheduled for its next attempt, or a dead letter, written to
//!    Redis before the target's permit is given back ([`record`]).
//!
//! This file composes them: [`Chain::deliver`] is the path of one job from its admission to
//! its record, [`Chain::take`] the loop that feeds it. The guarantees of
//! docs/reliability.md#guarantees come from the order here: a job is in Redis before its first
//! attempt and leaves it only with its outcome; whatever Redis refuses stays there (a job's
//! lease brings it back); nothing waits in this instance's memory that is not also in Redis.

mod admit;
mod attempt;
mod digest;
mod hold;
mod pace;
mod record;
pub(crate) mod retry;
mod take;
#[cfg(test)]
mod testkit;
mod work;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::{ActionContext, actions_of, followup};
use crate::config::{Config, Group};
use crate::event::EventKind;
use crate::firing::{Action, DeadLetter, Firing, Job};
use crate::internal_events::{DeadLettered, StateError};
use crate::keyspace::clock::now_ms;
use crate::metrics::Metrics;
use crate::status::Status;
use crate::store::dead::DeadStore;
use crate::store::queue::{self, Queue, Unreadable, Window};

use admit::{Admission, Admit, Capacity, Seat, Target, Targets};
use attempt::Attempt;
use digest::{WINDOW_TAKE_MAX, WindowDigest};
use hold::HoldStage;
use pace::{Pace, Paces, Turn, Waiting};
use record::Record;
pub use retry::{Next, RetryPolicy};
use take::{Deferral, Held, NextLook, Read, WaitingTargets};
use work::{Work, by_firing, window_jobs};

/// What delivery is built from: the collaborators `keywatch run` hands it.
pub struct Parts {
    /// The rules in force and what actions need to run.
    pub actions: ActionContext,
    /// Where the queue, windows, rate buckets and dead letters live.
    pub state: crate::keyspace::Conn,
    pub metrics: Arc<Metrics>,
    /// Where outcomes and dead letters are shown (the status page), if anywhere.
    pub status: Option<Arc<Status>>,
    /// Whether the intake is behind (more than a batch of events waits to be taken): jobs
    /// waiting in Redis stay there a little longer meanwhile (see [`take::Deferral`]).
    pub intake_behind: Box<dyn Fn() -> bool + Send + Sync>,
    pub policy: RetryPolicy,
    /// Cancelled at shutdown: no new attempt starts.
    pub shutdown: CancellationToken,
}

/// The delivery stage, started: cheap to clone.
/// The least time between two notices of jobs waiting ([`Chain::tell_others`]).
const NOTICE_EVERY: Duration = Duration::from_millis(100);

#[derive(Clone)]
pub struct Delivery {
    chain: Arc<Chain>,
}

/// The stages, composed.
struct Chain {
    actions: ActionContext,
    queue: Queue,
    capacity: Arc<Capacity>,
    targets: Targets,
    paces: Paces,
    attempt: Attempt,
    record: Record,
    hold: HoldStage,
    /// What this instance holds of the queue.
    held: Arc<Held>,
    /// When the take loop next looks at Redis.
    next: Arc<NextLook>,
    /// When this instance last told the others of jobs waiting ([`Chain::tell_others`]).
    work_noticed: std::sync::Mutex<Option<Instant>>,
    waiting_targets: WaitingTargets,
    deferral: Deferral,
    /// Wakes the take loop: a place came free, or jobs wait that it may take now.
    wake: Arc<Notify>,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

/// Most jobs taken from the queue in one round trip.
const TAKE_MAX: usize = 512;

/// Why a job is dead-lettered when keywatch died too often while it held it.
const DIED: &str = "keywatch died 3 times while it held this job (its lease ran out each time): dead-lettered instead of taken again";

impl Delivery {
    /// Builds the stages from `parts` and starts the take loop.
    pub fn start(parts: Parts) -> Delivery {
        Delivery::start_pacing_within(parts, pace::MAX_WAIT)
    }

    /// [`Delivery::start`] whose paces merge what their channel's rate cannot send within
    /// `max_wait` ([`pace::MAX_WAIT`] in `keywatch run`; seconds in the tests of this stage).
    fn start_pacing_within(parts: Parts, max_wait: Duration) -> Delivery {
        let Parts {
            actions,
            state,
            metrics,
            status,
            intake_behind,
            policy,
            shutdown,
        } = parts;
        let prefix = actions.config.state.prefix.clone();
        let queue = Queue::new(state.clone(), &prefix);
        let wake = Arc::new(Notify::new());
        let held = Arc::new(Held::default());
        let next = Arc::new(NextLook::new());
        let chain = Arc::new(Chain {
            queue: queue.clone(),
            capacity: Capacity::new(wake.clone()),
            targets: Targets::new(wake.clone()),
            paces: Paces::new(state.clone(), &prefix, max_wait),
            attempt: Attempt {
                actions: actions.clone(),
                policy,
                metrics: metrics.clone(),
            },
            record: Record {
                queue: queue.clone(),
                dead: DeadStore::new(state.clone(), &prefix),
                status,
                metrics: metrics.clone(),
                held: held.clone(),
                next: next.clone(),
            },
            hold: HoldStage {
                store: crate::store::held::HeldStore::new(state.clone(), &prefix),
                queue: queue.clone(),
                prefix: prefix.clone(),
                metrics: metrics.clone(),
                releasing: Arc::new(Semaphore::new(hold::RELEASING_MAX)),
            },
            actions,
            held,
            next,
            work_noticed: Default::default(),
            waiting_targets: WaitingTargets::default(),
            deferral: Deferral::new(intake_behind),
            wake,
            metrics,
            tracker: TaskTracker::new(),
            shutdown,
        });
        let c = chain.clone();
        chain.tracker.spawn(async move { c.take().await });
        Delivery { chain }
    }

    /// Takes the firings of one batch. Their jobs are in the durable queue when this returns
    /// `Ok`, together with `also` (one transaction: the caller's record of the events these
    /// firings are for moves on with them), so the caller may then remove what the firings
    /// copied (the details) without a crash in between losing them. On `Err` nothing is stored
    /// and nothing starts: the caller's record is still there, and whoever takes it next
    /// fires again. The firings this instance has free places for start at once; the others wait in
    /// the queue, due now, for whichever instance has free places first — so a storm of 100,000
    /// expiries costs Redis memory, not ours, and is shared by every instance.
    pub async fn accept_with(
        &self,
        firings: Vec<Firing>,
        also: Vec<redis::Cmd>,
    ) -> Result<(), queue::WriteError> {
        self.chain.accept(firings, also).await
    }

    /// [`Delivery::accept_with`] with nothing else to store (tests).
    #[cfg(test)]
    pub async fn accept(&self, firings: Vec<Firing>) {
        let _ = self.accept_with(firings, Vec::new()).await;
    }

    /// Another instance, or `keywatch dead retry`, left work waiting in Redis: look at the queue
    /// now rather than at the next safety round ([`crate::store::notices`]).
    pub fn look_now(&self) {
        self.chain.next.look_now();
    }

    /// `key` in `db` was heard existing again (an `expire` event: set again with a TTL): the
    /// follow-ups of an alert of it waiting in the queue become due now, so a resolved notice
    /// does not wait for the end of `within`. Costs a round trip only for keys of rules with
    /// follow-ups.
    pub fn heard_again(&self, config: &Config, db: u32, key: &[u8]) {
        let rules: Vec<crate::config::Rule> = config
            .rules_firing(EventKind::Expired, db, key)
            .into_iter()
            .chain(config.rules_firing(EventKind::Evicted, db, key))
            .map(|i| config.rules[i].clone())
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
        // Named now, so that the task holds no copy of a key of megabytes
        // (docs/reliability.md#bounded-whatever-the-key).
        let markers = followup::markers_of(&prefix, &rules, db, key);
        let key = (!crate::long_key::is_long(key)).then(|| key.to_vec());
        let keyspace = self.chain.actions.keyspace.clone();
        let conn = self.chain.queue.conn();
        let next = self.chain.next.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match followup::bring_forward(
                &keyspace,
                conn,
                &prefix,
                &rules,
                db,
                markers,
                key.as_deref(),
            )
            .await
            {
                Ok(()) => next.job_due_in(0),
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot bring the follow-ups of a key heard again forward; they run at their due time.")
                }
            }
        });
    }

    /// Gives up firings whose actions cannot run (their detail could not be read for the whole
    /// retry window): a dead letter per action, saying why, which `keywatch dead retry` can
    /// re-drive. Returns the commands that keep the letters, for the caller's transaction that
    /// moves the events' records on: the letters are kept exactly when the records go.
    pub fn give_up(&self, firings: Vec<Firing>, reason: &str) -> Vec<redis::Cmd> {
        let config = self.chain.actions.refreshed().config;
        let mut keep = Vec::new();
        for firing in firings {
            let letters = match config.rule(&firing.rule) {
                None => vec![record::rule_gone(&firing)],
                Some(rule) => actions_of(rule)
                    .into_iter()
                    .map(|action| {
                        DeadLetter::new(
                            &firing.rule,
                            String::from_utf8_lossy(&crate::long_key::view(
                                &firing.key,
                                crate::long_key::IN_TEXT,
                            ))
                            .into_owned(),
                            action,
                            reason,
                            vec![firing.clone()],
                            false,
                        )
                    })
                    .collect(),
            };
            for letter in letters {
                keep.extend(self.chain.dead_letter_cmds(&letter, &firing));
            }
        }
        keep
    }

    /// Stops the take loop and attempts, waits up to `grace` for attempts in flight to be
    /// recorded, and hands what this instance still holds back to the queue.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        let c = &self.chain;
        c.tracker.close();
        c.shutdown.cancel();
        let finished = tokio::time::timeout(grace, c.tracker.wait()).await.is_ok();
        let (jobs, failed) = c.held.hand_back(&c.queue).await;
        for e in &failed {
            c.refused(
                "hand_back",
                e,
                jobs,
                "they come due again when their lease ends",
            );
        }
        if failed.is_empty() && jobs > 0 {
            tracing::info!(jobs, "Handed unfinished jobs back to the queue.");
        }
        finished
    }
}

impl Chain {
    /// Stores the jobs of new firings (see [`Delivery::accept_with`]) and starts those this
    /// instance has free places for.
    async fn accept(
        self: &Arc<Self>,
        firings: Vec<Firing>,
        mut also: Vec<redis::Cmd>,
    ) -> Result<(), queue::WriteError> {
        let actions = self.actions.refreshed();
        let config = &actions.config;
        self.followups_due_later(config, &firings, &mut also);
        // A mass expiry's firings wait for their targets in Redis while the intake is behind:
        // their requests would take CPU from taking the rest over (see `take::Deferral`).
        let mut admit =
            Admit::new(config, &self.targets, &self.paces).deferring(self.deferral.holds_new());
        let mut now: Vec<(Vec<Job>, Vec<Seat>)> = Vec::new();
        // Jobs this instance has no free place for, and where each waits (see `Admit::places_for`).
        let mut later: Vec<(Job, Option<String>)> = Vec::new();
        let mut windows: HashMap<Window, (Group, Vec<Arc<Firing>>)> = HashMap::new();
        for firing in firings {
            let Some(rule) = config.rule(&firing.rule) else {
                also.extend(self.dead_letter_cmds(&record::rule_gone(&firing), &firing));
                continue;
            };
            let firing = Arc::new(firing);
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
            let waits = admit.places_for(&jobs);
            let seats = waits
                .iter()
                .all(Option::is_none)
                .then(|| self.capacity.try_seats(jobs.len()))
                .flatten();
            match seats {
                Some(seats) => now.push((jobs, seats)),
                None => later.extend(jobs.into_iter().zip(waits)),
            }
        }
        // In the same transaction as the jobs and the caller's record: a window Redis refuses
        // leaves the record, so the events are taken again (a window held in this instance's
        // memory was lost with it). A notification put twice (the same events taken again after
        // a crash between the store and the caller's next step) has the same id, and is in its
        // digest once.
        for (w, (group, firings)) in &windows {
            let jobs = window_jobs(firings, &w.channel, 0, None);
            also.push(self.queue.window_put_cmd(w, group.window, &jobs));
        }
        let leased: Vec<Job> = now.iter().flat_map(|(j, _)| j.iter().cloned()).collect();
        let mut waiting: Vec<(String, Job)> = Vec::new();
        let mut pending: Vec<Job> = Vec::new();
        for (job, target) in later {
            match target {
                Some(t) => waiting.push((t, job)),
                None => pending.push(job),
            }
        }
        let sizes: HashMap<String, usize> = waiting
            .iter()
            .map(|(t, _)| (t.clone(), admit.bundle_size(t)))
            .collect();
        if let Err(e) = self
            .queue
            .store(&leased, &pending, &waiting, &sizes, also)
            .await
        {
            let jobs = leased.len() + pending.len() + waiting.len();
            self.refused(
                "store",
                &e,
                jobs,
                "their events stay taken and are tried again",
            );
            return Err(e);
        }
        for (w, (group, _)) in &windows {
            let _ = w;
            self.next
                .window_due_in(i64::try_from(group.window.as_millis()).unwrap_or(i64::MAX));
        }
        for (target, _) in &waiting {
            if let Some(c) = Target::parse(target).and_then(|t| self.targets.get(config, &t)) {
                c.set_waiting_in_redis(true);
            }
        }
        if !pending.is_empty() {
            self.capacity.set_backlogged(true);
        }
        if !pending.is_empty() || !waiting.is_empty() {
            self.wake.notify_one();
        }
        for (jobs, seats) in now {
            let admitted = jobs.into_iter().map(|j| (j, Admission::Later)).collect();
            self.start(admitted, seats);
        }
        Ok(())
    }

    /// Starts the attempts of one firing's admitted jobs, each in its seat.
    fn start(self: &Arc<Self>, jobs: Vec<(Job, Admission)>, seats: Vec<Seat>) {
        let c = self.clone();
        self.tracker
            .spawn(async move { c.run_firing(jobs, seats).await });
    }

    /// The attempts of one firing's jobs, in the order of docs/rules.md. A failing job goes to the
    /// queue for its retry and does not hold back the next; a notification runs in its own task
    /// (its channel's pace and concurrency are its own), so a throttled channel holds back nothing
    /// else. A step whose target has no free place when its turn comes goes back to wait for it in
    /// Redis, and the steps after it with it.
    async fn run_firing(self: Arc<Self>, jobs: Vec<(Job, Admission)>, seats: Vec<Seat>) {
        // Every job is this instance's from now on: its lease is renewed while earlier jobs run
        // (a slow reload must not let another instance take the notification behind it), and
        // shutdown hands back the jobs it never reached.
        let ids: Vec<String> = jobs.iter().map(|(j, _)| j.id()).collect();
        self.held.jobs(&ids);
        let config = self.actions.live.current();
        let mut admit = Admit::new(&config, &self.targets, &self.paces);
        let mut to_wait: Vec<(String, String)> = Vec::new();
        let mut after: Option<String> = None;
        let mut seats = seats.into_iter();
        for (job, admission) in jobs {
            let seat = seats.next();
            if self.shutdown.is_cancelled() {
                break;
            }
            let notify = job.action.is_notification();
            if let Some(target) = &after {
                to_wait.push((target.clone(), job.id()));
                continue;
            }
            let admission = match admission {
                Admission::Later => match admit.job(&job) {
                    Ok(a) => a,
                    Err(target) => {
                        if !notify {
                            after = Some(target.clone());
                        }
                        to_wait.push((target, job.id()));
                        continue;
                    }
                },
                a => a,
            };
            let (n, since) = (job.attempt, job.failing_since);
            let work = Work::of(job);
            if notify {
                let c = self.clone();
                self.tracker.spawn(async move {
                    c.deliver(work, n, since, admission, seat).await;
                });
            } else {
                self.clone().deliver(work, n, since, admission, seat).await;
            }
        }
        self.wait_for_target(to_wait).await;
    }

    /// The path of one job (or digest) through the chain after its admission: pace, the
    /// target's permit, the attempt, and its record. `n` attempts came before, failing since
    /// `failing_since`. The permit is held until the outcome is recorded in Redis, not just
    /// until the answer came: a kill can send again only what holds one, so it doubles at most
    /// the target's concurrency however far acknowledgements lag
    /// (docs/reliability.md#guarantees).
    async fn deliver(
        self: Arc<Self>,
        work: Work,
        n: u32,
        failing_since: Option<i64>,
        admission: Admission,
        seat: Option<Seat>,
    ) {
        let config = self.actions.live.current();
        // Hold: a message to a channel in its quiet hours leaves for its channel's held
        // messages until they end (or stays where it was, leased, if Redis refuses).
        if let Some(hold) = hold::hold_of(&config, &work, crate::keyspace::clock::now()) {
            let jobs = work.jobs(n, failing_since);
            let _ = self.hold.hold(&self.record, &work, &jobs, &hold).await;
            match work.window() {
                Some(w) => self.held.release_window(w, &work.queued()),
                None => self.held.release(&work.queued()),
            }
            return;
        }
        let pace = work
            .notify_channel()
            .and_then(|c| self.paces.get(&config, c));
        let mut seat = seat;
        // Pace: a notification waits in its channel's backlog for a token, and may come out of
        // it leading a digest of the backlog; a digest takes a token of its own.
        let work = match (&pace, &work) {
            (Some(pace), Work::Job { .. }) => match self.pace(pace, work, &mut seat).await {
                Paced::Go(w) => w,
                // Merged into another's digest (which acknowledges it), or shutdown (which hands
                // it back).
                Paced::Gone => return,
            },
            (Some(pace), Work::Digest { .. }) => {
                tokio::select! {
                    biased;
                    _ = self.shutdown.cancelled() => return,
                    _ = pace.token() => work,
                }
            }
            (None, _) => work,
        };
        // Admit: the target's permit.
        let target = match &work {
            Work::Job { firing, action, .. } => self.targets.of(&config, &firing.rule, action),
            Work::Digest { channel, .. } => {
                self.targets.get(&config, &Target::Channel(channel.clone()))
            }
        };
        let Ok(permit) = admission.permit(target, &self.shutdown).await else {
            // Shutdown came first: held, and handed back.
            return;
        };
        // Attempt. Acknowledged through the queue's writer, which waits for it while it is under
        // way (a window's digest is acknowledged in its window).
        let attempting = work.window().is_none().then(|| self.queue.attempting());
        let tried = self.attempt.run(&work, n, failing_since).await;
        drop(attempting);
        // Record, before the permit and the seat go.
        self.record.outcome(&work, n, tried).await;
        drop(permit);
        drop(seat);
    }

    /// A notification's wait in its paced channel's backlog (giving its seat back meanwhile: the
    /// backlog is bounded on its own).
    async fn pace(
        self: &Arc<Self>,
        pace: &Arc<Pace>,
        work: Work,
        seat: &mut Option<Seat>,
    ) -> Paced {
        let Work::Job { firing, action, .. } = &work else {
            return Paced::Go(work);
        };
        let id = work.job_id();
        if !pace.has_room(0) {
            // The backlog is full: wait for the channel in Redis.
            let target = Target::Channel(action.channel().unwrap_or_default().to_string());
            self.wait_for_target(vec![(target.name(), id)]).await;
            return Paced::Gone;
        }
        drop(seat.take());
        let waiting = Waiting {
            firing: firing.clone(),
            job: id.clone(),
        };
        let others = match pace.wait(waiting, &self.tracker, &self.shutdown).await {
            None | Some(Turn::Merged) => return Paced::Gone,
            Some(Turn::Alone) => return Paced::Go(work),
            Some(Turn::Lead(others)) => others,
        };
        let Action::Notify { channel } = action else {
            return Paced::Go(work);
        };
        let mut firings = vec![firing.clone()];
        let mut jobs = vec![id];
        for w in others {
            firings.push(w.firing);
            jobs.push(w.job);
        }
        match digest::compose(&self.actions, &firing.rule, channel, &firings) {
            Ok(message) => Paced::Go(Work::Digest {
                rule: firing.rule.clone(),
                channel: channel.clone(),
                message: Arc::new(message),
                firings,
                jobs,
                sizes: Vec::new(),
                window: None,
            }),
            Err(e) => {
                // Sent alone, then; the others go back to the queue for their own turns.
                tracing::error!(rule = %firing.rule, %channel, reason = %e, "Cannot merge the channel's backlog into a digest; sending one by one.");
                let back = jobs.split_off(1);
                self.held.release(&back);
                if let Err(e) = self.queue.hand_back(&back).await {
                    self.refused(
                        "hand_back",
                        &e,
                        back.len(),
                        "they come due again when their lease ends",
                    );
                }
                Paced::Go(work)
            }
        }
    }

    /// The take loop: sleeps until the next due time it knows of, a wake-up (a place came free,
    /// jobs wait for a target that has free places now), or a safety round (see
    /// [`take::NextLook`]); then takes what is due, as far as this instance has free places. Renews
    /// the leases of what it holds while it holds anything. Stops at shutdown.
    async fn take(self: Arc<Self>) {
        let mut last_look = Instant::now();
        let mut last_renew = Instant::now();
        // The rules the last release of held messages ran under: a reload releases what a window
        // it edited or removed held.
        let mut released_under = self.actions.live.current();
        loop {
            let quiet = self
                .actions
                .live
                .current()
                .channels
                .iter()
                .any(|c| c.quiet.is_some());
            self.next.set_round(match quiet {
                true => take::SAFETY_ROUND,
                false => crate::store::renew_every(),
            });
            let read_at = self.next.at(last_look);
            let renew_at = last_renew + crate::store::renew_every();
            let woken = tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(read_at.min(renew_at)) => false,
                _ = self.wake.notified() => true,
                // Something comes due before the time slept until: sleep until it instead.
                _ = self.next.moved_earlier() => continue,
                // New firings' jobs wait for their targets until the intake catches up, which
                // nothing else tells this loop.
                _ = tokio::time::sleep(take::DEFER_RECHECK), if self.deferral.held_new() => true,
            };
            if last_renew.elapsed() >= crate::store::renew_every() {
                last_renew = Instant::now();
                for (operation, e) in self.held.renew(&self.queue).await {
                    self.refused(operation, &e, 1, "another instance may take the work over");
                }
            }
            let read = self.next.take(last_look);
            match read {
                Read::Look => {
                    last_look = Instant::now();
                    self.look().await;
                    let config = self.actions.live.current();
                    let reloaded = !Arc::ptr_eq(&config, &released_under);
                    if reloaded || config.channels.iter().any(|c| c.quiet.is_some()) {
                        self.release_held(reloaded).await;
                        released_under = config;
                    }
                }
                Read::Jobs => self.take_due().await,
                Read::Nothing => {}
            }
            if woken || read != Read::Nothing {
                self.take_waiting(read == Read::Look).await;
            }
            if self.capacity.is_backlogged() {
                self.take_due().await;
            }
        }
    }

    /// Takes the held messages due for release and releases each group in a task of its own:
    /// the loop goes on renewing this instance's leases and taking due jobs while a digest goes
    /// out, and each group's lease is renewed from the moment it is taken (see `hold`).
    async fn release_held(self: &Arc<Self>, reloaded: bool) {
        for taken in self.hold.take_due(&self.actions, reloaded).await {
            let c = self.clone();
            self.tracker.spawn(async move {
                if c.hold
                    .release(&c.actions, &c.attempt, &c.record, taken)
                    .await
                {
                    c.next.job_due_in(0);
                }
            });
        }
    }

    /// One full look at the queue: takes the digest windows that ended and the due jobs, and
    /// notes when the next of each is due.
    async fn look(self: &Arc<Self>) {
        let look = match self.queue.look().await {
            Ok(l) => l,
            Err(e) => {
                self.refused("look", &e, 1, "the queue is looked at again in a moment");
                return;
            }
        };
        let now = now_ms();
        // What comes due later: sleep until then. What is due now is taken below; what of it finds
        // no free place here wakes the loop when a place comes free (`Capacity::set_backlogged`). A
        // window that ended while the look was on its way is looked at again at once.
        if let Some(at) = look.windows_next {
            self.next.window_due_in(at - now);
        }
        if let Some(at) = look.queue_next.filter(|at| *at > now) {
            self.next.job_due_in(at - now);
        }
        self.waiting_targets.set(look.targets_waiting.clone());
        self.take_windows(&look.windows_due).await;
        if look.queue_next.is_some_and(|at| at <= now) {
            self.take_due().await;
        }
    }

    /// Takes due jobs while there are free seats, and starts them: the jobs of one firing together,
    /// in the order of docs/rules.md. A job whose target has no free place goes to wait for it in
    /// Redis, so that the jobs of other targets behind it are reached and a storm waits in Redis,
    /// not here.
    async fn take_due(self: &Arc<Self>) {
        loop {
            let free = self.capacity.free().min(TAKE_MAX);
            if free == 0 {
                // Taken when a seat comes free.
                self.capacity.set_backlogged(true);
                return;
            }
            let taken = match self.queue.take_due(free).await {
                Ok(t) => t,
                Err(e) => {
                    self.refused("take", &e, free, "the queue is read again in a moment");
                    return;
                }
            };
            // A full answer means more may be waiting (also another instance's storm): take more
            // as soon as a job finishes, not only at the next look.
            let full = taken.jobs.len() + taken.unreadable.len() == free;
            self.capacity.set_backlogged(full);
            let (died, jobs): (Vec<Job>, Vec<Job>) = taken
                .jobs
                .into_iter()
                .partition(|j| taken.died.contains(&j.id()));
            for job in died {
                self.died(job).await;
            }
            // Due while the take was on its way (or later): read again then.
            if let Some(at) = taken.next_due {
                self.next.job_due_in(at - now_ms());
            }
            self.unreadable(taken.unreadable).await;
            self.start_taken(jobs).await;
            if !full {
                return;
            }
        }
    }

    /// Starts jobs just leased to this instance, as far as their targets have free places; sends
    /// the others to wait for their targets in Redis.
    async fn start_taken(self: &Arc<Self>, jobs: Vec<Job>) {
        let config = self.actions.live.current();
        let mut admit = Admit::new(&config, &self.targets, &self.paces);
        let mut to_wait = Vec::new();
        for jobs in by_firing(jobs) {
            let jobs = admit.firing(jobs, &mut to_wait);
            if jobs.is_empty() {
                continue;
            }
            match self.capacity.try_seats(jobs.len()) {
                Some(seats) => self.start(jobs, seats),
                // `accept` took the free places meanwhile: wait for it (the jobs are leased to us).
                None => {
                    let c = self.clone();
                    self.tracker.spawn(async move {
                        let seats = c.capacity.seats(jobs.len()).await;
                        c.start(jobs, seats);
                    });
                }
            }
        }
        self.wait_for_target(to_wait).await;
    }

    /// Takes back the jobs waiting in Redis for each target that has free places here now: as many
    /// as its concurrency (or pace) admits, within this instance's capacity. A target that no
    /// longer exists gets its jobs taken too, to be dead-lettered.
    async fn take_waiting(self: &Arc<Self>, looked: bool) {
        if self.deferral.holds_waiting() {
            return;
        }
        let targets = match self.waiting_targets.fresh() {
            Some(t) => t,
            // Just looked: what the look found is what there is.
            None if looked => return,
            None => match self.queue.waiting_targets().await {
                Ok(t) => {
                    self.waiting_targets.set(t.clone());
                    t
                }
                Err(e) => {
                    self.refused(
                        "take",
                        &e,
                        1,
                        "the waiting targets are read again in a moment",
                    );
                    return;
                }
            },
        };
        let config = self.actions.live.current();
        for name in targets {
            let target = Target::parse(&name);
            let concurrency = target.as_ref().and_then(|t| self.targets.get(&config, t));
            let pace = match &target {
                Some(Target::Channel(c)) => self.paces.get(&config, c),
                _ => None,
            };
            let (free, most) = match (&pace, &concurrency) {
                (Some(p), _) => (p.free(), p.cap()),
                (None, Some(c)) => (c.free(), c.capacity()),
                // Gone from the rules: taken to fail and be dead-lettered.
                (None, None) => (TAKE_MAX, TAKE_MAX),
            };
            let free = free.min(self.capacity.free()).min(TAKE_MAX);
            if free == 0 {
                continue;
            }
            // All the free places the target has: a bundle made when its concurrency was higher
            // (before a reload) goes whole, rather than never.
            let idle = free >= most.min(TAKE_MAX);
            if !idle && concurrency.as_ref().is_some_and(|c| !c.worth_asking(free)) {
                continue;
            }
            let taken = match self.queue.take_waiting(&name, free, idle).await {
                Ok(t) => t,
                Err(e) => {
                    self.refused(
                        "take",
                        &e,
                        free,
                        "the target's jobs are taken again in a moment",
                    );
                    continue;
                }
            };
            if let Some(c) = &concurrency {
                c.set_need(taken.need);
                if !taken.more {
                    c.set_waiting_in_redis(false);
                }
            }
            if !taken.more {
                self.waiting_targets.forget(&name);
            }
            self.unreadable(taken.unreadable).await;
            self.start_taken(taken.jobs).await;
        }
    }

    /// Takes the members of each digest window in `due` and sends them as one digest per window
    /// (up to [`WINDOW_TAKE_MAX`] events each).
    async fn take_windows(self: &Arc<Self>, due: &[Window]) {
        for w in due {
            let taken = match self.queue.window_take(w, WINDOW_TAKE_MAX).await {
                Ok(t) => t,
                Err(e) => {
                    self.refused("take", &e, 1, "the window is taken again in a moment");
                    continue;
                }
            };
            self.unreadable(taken.unreadable).await;
            if taken.members.is_empty() {
                continue;
            }
            let ids: Vec<String> = taken.members.iter().map(|m| m.id.clone()).collect();
            self.held.window(w, &ids);
            let digest = digest::of_window(&self.actions, w, taken.members).map(|d| match d {
                WindowDigest::Send { work, .. } if taken.died => WindowDigest::Unsendable {
                    work,
                    reason: DIED.to_string(),
                },
                d => d,
            });
            match digest {
                // Nothing readable left in them: done.
                None => {
                    let done = self.queue.window_done(w, &ids).await;
                    self.held.release_window(w, &ids);
                    if let Err(e) = done {
                        self.refused(
                            "acknowledge",
                            &e,
                            ids.len(),
                            "they are taken again when their lease ends",
                        );
                    }
                }
                Some(WindowDigest::Send {
                    work,
                    attempt,
                    failing_since,
                }) => {
                    let c = self.clone();
                    self.tracker.spawn(async move {
                        c.deliver(work, attempt, failing_since, Admission::Later, None)
                            .await
                    });
                }
                Some(WindowDigest::Unsendable { work, reason }) => {
                    let tried = attempt::Tried {
                        outcome: crate::outcome::Outcome::Failed(reason),
                        retry_at: None,
                        failing_since: None,
                    };
                    self.record.outcome(&work, 0, tried).await;
                }
            }
        }
    }

    /// Dead-letters a job keywatch died [`queue::MAX_TAKEOVERS`] times while it held it, instead
    /// of attempting it again (docs/reliability.md#bounded-whatever-the-key).
    async fn died(&self, job: Job) {
        let (n, since) = (job.attempt, job.failing_since);
        let work = Work::of(job);
        self.held.jobs(&work.queued());
        let tried = attempt::Tried {
            outcome: crate::outcome::Outcome::Failed(DIED.to_string()),
            retry_at: None,
            failing_since: since,
        };
        self.record.outcome(&work, n, tried).await;
    }

    /// Sends jobs this instance has no free place for to wait for their targets in Redis, as
    /// (target, job id): out of what it holds first, so that a lease renewal cannot touch them. One
    /// Redis refuses stays leased here, and comes due when its lease ends.
    async fn wait_for_target(&self, jobs: Vec<(String, String)>) {
        if jobs.is_empty() {
            return;
        }
        let mut by_target: HashMap<String, Vec<String>> = HashMap::new();
        for (target, id) in jobs {
            by_target.entry(target).or_default().push(id);
        }
        let config = self.actions.live.current();
        for (target, ids) in by_target {
            self.held.release(&ids);
            if let Some(c) = Target::parse(&target).and_then(|t| self.targets.get(&config, &t)) {
                c.set_waiting_in_redis(true);
            }
            if let Err(e) = self.queue.wait_for_target(&target, &ids).await {
                self.refused(
                    "wait",
                    &e,
                    ids.len(),
                    "they come due again when their lease ends",
                );
            }
        }
        self.tell_others().await;
    }

    /// Tells the other instances that jobs wait for a free place (a notice: they look at the
    /// queue at once instead of at their next safety round), at most every [`NOTICE_EVERY`]: an
    /// instance that looked keeps taking what waits as its requests finish.
    async fn tell_others(&self) {
        {
            let mut last = self.work_noticed.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|at| at.elapsed() < NOTICE_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let prefix = self.actions.live.current().state.prefix.clone();
        let published = match self.actions.keyspace.conn(0).await {
            Ok(mut conn) => {
                crate::store::notices::publish(
                    &mut conn,
                    &prefix,
                    crate::store::notices::Notice::Work,
                )
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = published {
            tracing::debug!(error = %e, "Cannot tell the other instances of jobs waiting; they find them at their next look.");
        }
    }

    /// Dead-letters stored jobs this version cannot read, once: the queue has already set them
    /// aside (their payloads kept in `{prefix}queue:unreadable`), so they are never taken again.
    async fn unreadable(&self, unreadable: Vec<Unreadable>) {
        for u in unreadable {
            let rule = u.rule.as_deref().unwrap_or("?");
            let reason = format!(
                "the stored job cannot be read by this version of keywatch ({}); its payload is kept in `{}queue:unreadable`",
                u.error, self.actions.config.state.prefix
            );
            // An action of a kind this version does not know is listed under the id it came
            // with.
            let action = u.action.unwrap_or_else(|| Action::Notify {
                channel: format!("? (job {})", u.id),
            });
            let letter = DeadLetter::new(
                rule,
                format!("job {}", u.id),
                action,
                &reason,
                Vec::new(),
                false,
            );
            self.record.keep(letter, &format!("job {}", u.id)).await;
        }
    }

    /// The commands that keep `letter` for `firing` (whose actions never became jobs), emitted
    /// and shown now; for the caller's transaction.
    fn dead_letter_cmds(&self, letter: &DeadLetter, firing: &Firing) -> Vec<redis::Cmd> {
        DeadLettered {
            rule: &letter.rule,
            key: &crate::event::printable(&firing.key),
            action: letter.action.name(),
            channel: letter.action.channel().unwrap_or(""),
            id: &firing.id,
            reason: &letter.reason,
        }
        .emit(&self.metrics);
        if let Some(s) = &self.record.status {
            s.record_dead_letter(letter);
        }
        self.record.dead.store_cmds(letter)
    }

    /// The follow-up jobs (`escalate`, `resolved`) of alerts of keys that are gone, due later,
    /// and the markers naming them, stored in the same transaction as the alerts' own jobs.
    fn followups_due_later(&self, config: &Config, firings: &[Firing], also: &mut Vec<redis::Cmd>) {
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
                also.extend(
                    self.queue
                        .due_later_cmds(&Job::first(firing.clone(), action), due),
                );
                self.next.job_due_in(due - now);
            }
            // A field's re-creation is no `expire` event of its hash: its follow-ups look for the
            // field when they come due instead of being brought forward.
            if f.field.is_none() {
                also.push(followup::marker_cmd(&config.state.prefix, f, marker_ms));
            }
        }
    }

    fn refused(
        &self,
        operation: &'static str,
        error: &dyn std::fmt::Display,
        items: usize,
        then: &'static str,
    ) {
        StateError {
            operation,
            error,
            items,
            then,
        }
        .emit(&self.metrics);
    }
}

/// What a notification's wait in its channel's pace came to.
enum Paced {
    /// Send this: the notification, or a digest of it and the backlog of its rule.
    Go(Work),
    /// Nothing more to do here: merged into another's digest, gone to wait in Redis, or shutdown.
    Gone,
}

/// Keys heard again being looked up for follow-ups at once (see [`Delivery::heard_again`]).
static HEARING: Semaphore = Semaphore::const_new(64);

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::RetryPolicy;
    use super::testkit::{self, Recorder, firing, replace_integration, stage};
    use crate::channel::Integration;

    /// A firing matched under the rules before a reload reaches delivery after the reload
    /// removed its rule: a dead letter that says so (nothing is dropped silently), and the
    /// other firings of the batch go on.
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

    /// While the intake is behind (a mass expiry being taken), new firings' jobs wait for their
    /// targets in Redis rather than start, however many places are free; once it has caught
    /// up, the take loop finds out by itself (nothing else wakes it) and runs them, each once.
    #[tokio::test]
    async fn new_firings_wait_in_redis_while_the_intake_is_behind_and_run_once_it_caught_up() {
        let mut config = testkit::config(
            "channels:\n  chat: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [chat] }\n",
        );
        let rec = Recorder::answering(|_| crate::outcome::Outcome::Sent("ok".into()));
        let r = rec.clone();
        replace_integration(&mut config, "chat", move |_| r as Arc<dyn Integration>);
        let behind = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let s = testkit::stage_behind(config, behind.clone()).await;
        s.delivery
            .accept(testkit::firings("r", &["k:1", "k:2", "k:3"]))
            .await;
        // Stored as waiting for the channel, not leased to this instance to run.
        assert_eq!(
            s.delivery.chain.queue.waiting_targets().await.unwrap(),
            vec!["channel:chat"]
        );
        assert!(s.delivery.chain.held.is_empty(), "no job held here");
        assert!(rec.received().is_empty());
        // The take loop has been woken by the jobs sent to wait, and held them back: it sleeps
        // until its next round (seconds away) unless it asks again by itself.
        testkit::wait_until("the take loop held back twice", || {
            s.delivery.chain.deferral.rounds_held() >= 2
        })
        .await;
        behind.store(false, std::sync::atomic::Ordering::Relaxed);
        rec.count_from_now();
        rec.wait_for(3).await;
        let caught_up_after = rec.elapsed();
        assert!(
            caught_up_after < crate::store::renew_every() / 2,
            "{caught_up_after:?}: run at the take loop's next round, not when it caught up"
        );
        s.settled().await;
        let mut keys: Vec<String> = rec.received().into_iter().flat_map(|m| m.keys).collect();
        keys.sort();
        assert_eq!(keys, ["k:1", "k:2", "k:3"]);
    }
}
