//! `concurrency` (docs/rules.md, §5): how many requests one instance has in flight at once to each
//! channel, and for each rule's `reload` and `exec`.
//!
//! Each of them is a *slot*: a semaphore as wide as its `concurrency`, and a line of jobs
//! waiting for it, as long as the slot is wide and at least [`LINE_MIN`]. A job that finds the
//! line full is not kept in memory: it goes to wait for its target in Redis (`Queue::park`), and
//! is taken back from there as the slot frees up (`Queue::unpark`), by whichever instance has
//! room for that target. So a storm of a million notifications costs this instance at most the
//! width and the line of each slot, and a slow target holds no more than that of the room every
//! other target shares.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::firing::Action;

/// What a slot bounds: a channel, or one rule's `reload` or `exec`. `cleanup` has none: it talks
/// to Redis, whose connection is shared and multiplexed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum SlotKey {
    Channel(String),
    Reload(String),
    Exec(String),
}

impl SlotKey {
    pub(super) fn of(rule: &str, action: &Action) -> Option<SlotKey> {
        match action {
            Action::Notify { channel }
            | Action::Alert { channel, .. }
            | Action::Escalate { channel }
            | Action::Resolved { channel } => Some(SlotKey::Channel(channel.clone())),
            Action::Reload => Some(SlotKey::Reload(rule.to_string())),
            Action::Exec => Some(SlotKey::Exec(rule.to_string())),
            Action::Cleanup => None,
        }
    }

    /// Its name as a target that jobs wait for in Redis (`channel:oncall`, `reload:RULE`).
    pub(super) fn target(&self) -> String {
        match self {
            SlotKey::Channel(c) => format!("channel:{c}"),
            SlotKey::Reload(r) => format!("reload:{r}"),
            SlotKey::Exec(r) => format!("exec:{r}"),
        }
    }

    /// The key a target's name stands for.
    pub(super) fn from_target(target: &str) -> Option<SlotKey> {
        let (kind, name) = target.split_once(':')?;
        let name = name.to_string();
        match kind {
            "channel" => Some(SlotKey::Channel(name)),
            "reload" => Some(SlotKey::Reload(name)),
            "exec" => Some(SlotKey::Exec(name)),
            _ => None,
        }
    }

    /// Its `concurrency` under `config`; `None` when the channel or step no longer exists (the
    /// attempt then fails and is dead-lettered; nothing to wait for).
    fn width(&self, config: &Config) -> Option<usize> {
        match self {
            SlotKey::Channel(c) => config.channel(c).map(|c| c.concurrency),
            SlotKey::Reload(r) => config.rule(r)?.reload.as_ref().map(|s| s.concurrency),
            SlotKey::Exec(r) => config.rule(r)?.exec.as_ref().map(|s| s.concurrency),
        }
    }
}

/// The shortest line: a whole bundle of waiting jobs (`queue::bundle`, 64 jobs) fits in it
/// while the slot is busy. Jobs wait for a narrow target in Redis in bundles as long as its
/// line; with a line only as long as the slot is wide (16 by default), bundles of 8 cost the
/// state server about eight calls each to take back, mark and remove — most of what a storm's
/// delivery cost it. A line holds jobs in memory, but never more than the instance's own bound
/// (`state::CONCURRENT`) across all targets.
pub(super) const LINE_MIN: usize = 64;

pub(super) struct Slot {
    width: usize,
    permits: Arc<Semaphore>,
    /// Jobs in the line (each holds a [`LinePlace`]).
    waiting: AtomicUsize,
    /// Set when this instance sent jobs to wait for this target in Redis: a permit given back
    /// then wakes the queue loop to take the next of them at once.
    parked: AtomicBool,
    /// How many jobs the oldest member waiting for this target in Redis holds, when the last
    /// look found it too big for the room then (`Queue::unpark`), and when that was: asking
    /// again with less room brings nothing, and in a storm's delivery those empty asks (a
    /// script call each time a request finished) were most of the calls the state server got.
    need: Mutex<Option<(usize, Instant)>>,
    wake: Arc<Notify>,
}

/// How long a slot trusts what the last look said its oldest waiting member needs: another
/// instance may have taken that member meanwhile.
const NEED_FRESH: Duration = Duration::from_millis(200);

impl Slot {
    fn new(width: usize, wake: Arc<Notify>) -> Slot {
        Slot {
            width,
            permits: Arc::new(Semaphore::new(width)),
            waiting: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            need: Mutex::new(None),
            wake,
        }
    }

    /// How many jobs wait in memory for this slot at most.
    pub(super) fn line(&self) -> usize {
        self.width.max(LINE_MIN)
    }

    /// A permit at once, or a place in the line while it is not full;
    /// `None`: the job should wait for this target in Redis instead.
    pub(super) fn admit(self: &Arc<Self>) -> Option<Ticket> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(Ticket::Now(SlotPermit::new(self.clone(), p)));
        }
        let mut n = self.waiting.load(Ordering::Acquire);
        loop {
            if n >= self.line() {
                return None;
            }
            match self
                .waiting
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(Ticket::Line(LinePlace { slot: self.clone() })),
                Err(seen) => n = seen,
            }
        }
    }

    /// How many jobs [`Slot::admit`] would admit now: free permits and free places in the line.
    pub(super) fn room(&self) -> usize {
        self.permits.available_permits()
            + self
                .line()
                .saturating_sub(self.waiting.load(Ordering::Acquire))
    }

    /// The most [`Slot::room`] ever is: its width and its line.
    pub(super) fn capacity(&self) -> usize {
        self.width.saturating_add(self.line())
    }

    /// The oldest member waiting for this target in Redis holds `need` jobs and did not fit in
    /// the room of the last look (0: nothing was too big).
    pub(super) fn set_need(&self, need: usize) {
        *self.need.lock().unwrap_or_else(|p| p.into_inner()) =
            (need > 0).then(|| (need, Instant::now()));
    }

    /// Whether taking jobs back with `room` may bring any: not while the last look, a moment
    /// ago, found the oldest member bigger than that.
    pub(super) fn worth_asking(&self, room: usize) -> bool {
        match *self.need.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((need, at)) => room >= need || at.elapsed() >= NEED_FRESH,
            None => true,
        }
    }

    /// Jobs of this target now wait in Redis (or no longer do, as far as this instance knows).
    pub(super) fn set_parked(&self, parked: bool) {
        self.parked.store(parked, Ordering::Release);
    }

    /// A permit, however long the line: for work that is already bounded elsewhere (a digest,
    /// a retry held in memory because the queue would not take it back).
    pub(super) async fn acquire(
        self: &Arc<Self>,
        shutdown: &CancellationToken,
    ) -> Option<SlotPermit> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            p = self.permits.clone().acquire_owned() => p.ok().map(|p| SlotPermit::new(self.clone(), p)),
        }
    }
}

/// The right to make one request, for its duration and until its outcome is recorded in Redis
/// (`attempt::deliver_held`): what a kill can send twice is what holds one.
pub(super) struct SlotPermit {
    slot: Arc<Slot>,
    permit: Option<OwnedSemaphorePermit>,
}

impl SlotPermit {
    fn new(slot: Arc<Slot>, permit: OwnedSemaphorePermit) -> SlotPermit {
        SlotPermit {
            slot,
            permit: Some(permit),
        }
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        drop(self.permit.take());
        if self.slot.parked.load(Ordering::Acquire) {
            self.slot.wake.notify_one();
        }
    }
}

/// A place in a slot's line, given back when it turns into a permit or is dropped.
pub(super) struct LinePlace {
    slot: Arc<Slot>,
}

impl LinePlace {
    /// Waits for the permit; `None` at shutdown.
    pub(super) async fn wait(self, shutdown: &CancellationToken) -> Option<SlotPermit> {
        self.slot.acquire(shutdown).await
    }
}

impl Drop for LinePlace {
    fn drop(&mut self) {
        self.slot.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a job has of its slot before its first attempt.
#[derive(Default)]
pub(super) enum Ticket {
    /// A permit: the request may start.
    Now(SlotPermit),
    /// A place in the line.
    Line(LinePlace),
    /// Nothing yet: the permit is asked for when the attempt comes (and waited for, however
    /// long the line).
    #[default]
    Ask,
}

impl Ticket {
    /// The permit for the attempt: the one held, the one the line gives, or one asked for now.
    /// `Ok(None)`: the job has no slot; `Err(())`: shutdown came first.
    pub(super) async fn permit(
        self,
        slot: Option<Arc<Slot>>,
        shutdown: &CancellationToken,
    ) -> Result<Option<SlotPermit>, ()> {
        match (self, slot) {
            (Ticket::Now(p), _) => Ok(Some(p)),
            (Ticket::Line(place), _) => place.wait(shutdown).await.map(Some).ok_or(()),
            (Ticket::Ask, Some(slot)) => slot.acquire(shutdown).await.map(Some).ok_or(()),
            (Ticket::Ask, None) => Ok(None),
        }
    }
}

/// The slot of each channel and step in force: made on first use, made anew when a reload
/// changes its width (requests under the old one finish under it).
pub(super) struct Slots {
    by_key: Mutex<HashMap<SlotKey, Arc<Slot>>>,
    /// Wakes the queue loop (see [`Slot::parked`]).
    wake: Arc<Notify>,
}

impl Slots {
    pub(super) fn new(wake: Arc<Notify>) -> Slots {
        Slots {
            by_key: Mutex::new(HashMap::new()),
            wake,
        }
    }

    pub(super) fn get(&self, config: &Config, key: &SlotKey) -> Option<Arc<Slot>> {
        let width = key.width(config)?;
        let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(key)
            && s.width == width
        {
            return Some(s.clone());
        }
        let slot = Arc::new(Slot::new(width, self.wake.clone()));
        map.insert(key.clone(), slot.clone());
        Some(slot)
    }

    /// The slot of `action` of `rule`.
    pub(super) fn of(&self, config: &Config, rule: &str, action: &Action) -> Option<Arc<Slot>> {
        self.get(config, &SlotKey::of(rule, action)?)
    }
}

#[cfg(test)]
mod tests {
    use super::super::RetryPolicy;
    use super::super::testkit::{self, SlowTarget, firings, ms, secs, stage};
    use super::*;

    /// A storm of 200 notifications and 40 reloads and execs against targets that take 20 ms:
    /// never more requests at once than each `concurrency` (a channel's, a rule's reload's), and
    /// every one made; the jobs beyond a slot's width and line wait for their target in Redis.
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
    async fn a_slot_admits_its_width_then_its_line_then_nothing() {
        for (width, line) in [(2, LINE_MIN), (100, 100)] {
            let slot = Arc::new(Slot::new(width, Arc::new(Notify::new())));
            assert_eq!(slot.line(), line);
            assert_eq!(slot.room(), width + line);
            assert_eq!(slot.capacity(), width + line);
            let now: Vec<Ticket> = (0..width).map(|_| slot.admit().unwrap()).collect();
            assert!(now.iter().all(|t| matches!(t, Ticket::Now(_))));
            let mut queued: Vec<Ticket> = (0..line).map(|_| slot.admit().unwrap()).collect();
            assert!(queued.iter().all(|t| matches!(t, Ticket::Line(_))));
            assert!(slot.admit().is_none());
            assert_eq!(slot.room(), 0);
            // Places given up are free again.
            queued.truncate(line - 2);
            assert_eq!(slot.room(), 2);
            assert!(matches!(slot.admit(), Some(Ticket::Line(_))));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_does_not_ask_again_for_less_than_the_oldest_member_needs_for_a_while() {
        let slot = Slot::new(16, Arc::new(Notify::new()));
        assert!(slot.worth_asking(1));
        slot.set_need(64);
        assert!(!slot.worth_asking(63));
        assert!(slot.worth_asking(64));
        tokio::time::advance(NEED_FRESH).await;
        assert!(
            slot.worth_asking(1),
            "another instance may have taken it since"
        );
        slot.set_need(64);
        slot.set_need(0);
        assert!(slot.worth_asking(1));
    }

    #[test]
    fn targets_name_their_slot() {
        for key in [
            SlotKey::Channel("on-call".into()),
            SlotKey::Reload("cache:warm".into()),
            SlotKey::Exec("r".into()),
        ] {
            assert_eq!(SlotKey::from_target(&key.target()), Some(key));
        }
        assert_eq!(SlotKey::from_target("lane"), None);
    }
}
