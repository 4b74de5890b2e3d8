//! The durable work queue: every action job lives in Redis until it succeeded or was
//! dead-lettered, so a job being retried survives a restart, and the jobs of an instance that
//! dies are picked up by the others when their lease runs out.
//!
//! A sorted set (`{prefix}queue`, score = when the job is due, ms) and a hash of payloads
//! (`{prefix}queue:jobs`). An instance takes due jobs by moving their score a lease into the
//! future (atomically, so two instances never take the same job), and on the outcome removes
//! the job (done), or moves it to its next attempt. A job taken by an instance that dies comes
//! due again when its lease ends.
//!
//! Notifications of a rule with `group` wait in a *window* shared by every instance: a sorted
//! set per (rule, channel) (`{prefix}group:RULE:CHANNEL`) whose members are due when the window
//! ends, beside a key holding that end (`…:window`, expiring with it). Whichever instance sees
//! the window due first takes all its jobs (leased, as above) and sends them as one digest, so
//! three instances send one digest per window, and a window open when an instance stops is
//! sent by another, or by the same one after its restart. `{prefix}groups` lists the windows
//! that hold jobs, so a window of a rule removed by a reload is still found (and dead-lettered).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::keyspace::Conn;
use crate::store::lease_end;

use crate::firing::{Action, Job};

mod bundle;
pub(crate) mod keys;
mod waiting;
mod window;
mod writer;
use bundle::Settled;
use writer::Writer;
pub use writer::{Attempting, WriteError};

/// The queue's scripts, one `.lua` file each beside this one.
const TAKE: &str = include_str!("queue/take.lua");
const RESCHEDULE: &str = include_str!("queue/reschedule.lua");
const WAIT: &str = include_str!("queue/wait.lua");
const TAKE_WAITING: &str = include_str!("queue/take_waiting.lua");
const DETACH: &str = include_str!("queue/detach.lua");
const COUNT: &str = include_str!("queue/count.lua");
const SET_ASIDE: &str = include_str!("queue/set_aside.lua");
const GROUP_PUT: &str = include_str!("queue/group_put.lua");
const GROUP_DONE: &str = include_str!("queue/group_done.lua");
const WINDOW_TAKE: &str = include_str!("queue/window_take.lua");
const LOOK: &str = include_str!("queue/look.lua");

/// How many times keywatch may die (or stall past its renewals) while it holds a job before the
/// job is dead-lettered instead of taken again: a job that crashes every instance that takes it
/// (a key too long for the memory it is given) must not keep alerting down
/// (docs/reliability.md#bounded-whatever-the-key).
pub const MAX_TAKEOVERS: u32 = 3;

/// Most notifications of one batch stored as one member of their window (a bundle, see
/// `bundle`): a batch of events is at most this many anyway.
const WINDOW_BUNDLE_MAX: usize = 1024;

/// A digest window: one rule's notifications for one channel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    pub rule: String,
    pub channel: String,
}

impl Window {
    /// Its name in the list of windows: rule and channel names may hold any character.
    fn member(&self) -> String {
        serde_json::to_string(&(&self.rule, &self.channel)).unwrap_or_default()
    }

    /// The window a name in the list stands for.
    fn of_member(m: &str) -> Option<Window> {
        serde_json::from_str::<(String, String)>(m)
            .ok()
            .map(|(rule, channel)| Window { rule, channel })
    }
}

/// What one look at the queue found ([`Queue::look`]).
#[derive(Debug, Default, PartialEq)]
pub struct Look {
    /// When the queue's earliest job is due (or its lease ends), unix ms (Redis's clock).
    pub queue_next: Option<i64>,
    /// The windows with a member due now.
    pub windows_due: Vec<Window>,
    /// When the earliest member of another window is due.
    pub windows_next: Option<i64>,
    /// The targets with jobs waiting for them.
    pub targets_waiting: Vec<String>,
}

/// A member put into the queue, or into a digest window, by something other than the delivery
/// (a dead letter re-driven, see `store::dead`), due at once: written by the caller's script,
/// beside its own writes, with `HSETNX` and `ZADD NX` (putting the same job twice does not
/// move it).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The sorted set it goes in: the queue's, or its window's.
    pub zset: String,
    pub id: String,
    pub payload: String,
    /// Its window's name in the list of windows (`{prefix}groups`), for a window's member.
    pub window: Option<String>,
}

impl Entry {
    /// `job`, in the queue.
    pub fn job(prefix: &str, job: &Job) -> Entry {
        Entry {
            zset: keys::queue(prefix),
            id: job.id(),
            payload: job.payload(),
            window: None,
        }
    }

    /// `jobs`, in the window of `w`, as its members: a bundle of up to [`WINDOW_BUNDLE_MAX`]
    /// each (one alone as itself). The instance that takes them sends them as one digest.
    pub fn window(prefix: &str, w: &Window, jobs: &[Job]) -> Vec<Entry> {
        jobs.chunks(WINDOW_BUNDLE_MAX)
            .map(|chunk| {
                let (id, payload) = match chunk {
                    [job] => (job.id(), job.payload()),
                    _ => {
                        let payloads: Vec<String> = chunk.iter().map(Job::payload).collect();
                        (
                            bundle::id(&chunk[0].id(), chunk.len()),
                            bundle::payload(payloads.iter().map(String::as_str)),
                        )
                    }
                };
                Entry {
                    zset: keys::window(prefix, &w.rule, &w.channel),
                    id,
                    payload,
                    window: Some(w.member()),
                }
            })
            .collect()
    }
}

/// What one take brought: the jobs to attempt, and those this version cannot read (set aside
/// already, to be dead-lettered by the caller).
#[derive(Debug, Default)]
pub struct Taken {
    pub jobs: Vec<Job>,
    pub unreadable: Vec<Unreadable>,
    /// Taken from a waiting set: whether it still holds jobs.
    pub more: bool,
    /// Taken from a waiting set: how many jobs its oldest member left there holds, when that member
    /// did not fit in the free places given (0 otherwise). Asking again with fewer free places is
    /// bound to bring nothing.
    pub need: usize,
    /// Taken from the queue: when its earliest job is due now (or its lease ends), unix ms.
    pub next_due: Option<i64>,
    /// The ids of the jobs taken over [`MAX_TAKEOVERS`] times: keywatch died that often while
    /// it held them. To be dead-lettered, not attempted.
    pub died: std::collections::HashSet<String>,
}

/// One member of a digest window, as taken: a notification, or a bundle of a batch's.
#[derive(Debug, Default)]
pub struct WindowMember {
    /// Its name in the window: what acknowledging, renewing or retrying it names.
    pub id: String,
    /// The notifications it holds that this take brings (one seen in an earlier member of the
    /// same take, stored twice by an event run again after a crash, is left out).
    pub jobs: Vec<Job>,
}

/// What one take of a window brought.
#[derive(Debug, Default)]
pub struct WindowTaken {
    pub members: Vec<WindowMember>,
    /// Whether a member was taken over [`MAX_TAKEOVERS`] times: keywatch died that often while
    /// it held the window's digest. To be dead-lettered, not sent.
    pub died: bool,
    /// Those this version cannot read (set aside already, to be dead-lettered by the caller).
    pub unreadable: Vec<Unreadable>,
}

/// A stored job that does not decode (written by another version, or damaged): what can be
/// told of it from its id and whatever of its JSON still parses.
#[derive(Debug, Clone, PartialEq)]
pub struct Unreadable {
    pub id: String,
    /// The rule named in the payload, when it says.
    pub rule: Option<String>,
    /// The action its id names (`…:reload`, `…:notify:CHANNEL`), when it is one of ours.
    pub action: Option<Action>,
    pub error: String,
}

impl Unreadable {
    fn new(id: &str, payload: &str, error: String) -> Unreadable {
        let json: Option<serde_json::Value> = serde_json::from_str(payload).ok();
        let rule = json
            .as_ref()
            .and_then(|j| j["firing"]["rule"].as_str())
            .map(str::to_string);
        let action = match id.split_once(':').map(|(_, a)| a) {
            Some("reload") => Some(Action::Reload),
            Some("exec") => Some(Action::Exec),
            Some("cleanup") => Some(Action::Cleanup),
            Some(a) => a.strip_prefix("notify:").map(|c| Action::Notify {
                channel: c.to_string(),
            }),
            None => None,
        };
        Unreadable {
            id: id.to_string(),
            rule,
            action,
            error,
        }
    }
}

#[derive(Clone)]
pub struct Queue {
    conn: Conn,
    prefix: String,
    window_take: redis::Script,
    zset: String,
    jobs: String,
    take: redis::Script,
    reschedule: redis::Script,
    set_aside: redis::Script,
    wait: redis::Script,
    take_waiting: redis::Script,
    detach: redis::Script,
    count: redis::Script,
    look: redis::Script,
    /// The bundles this instance took, and which of their jobs it has yet to finish.
    held: Arc<Mutex<bundle::Held>>,
    /// Payloads of jobs this version cannot read, kept for a person or a later version.
    unreadable: String,
    /// Each job's takeovers (see [`MAX_TAKEOVERS`]).
    takeovers: String,
    /// New and finished jobs, group-committed.
    writer: Writer,
}

pub use crate::keyspace::clock::now_ms;

/// What [`Queue::counts`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Every job: due, taken, waiting for a later round or retry, or in a digest window.
    pub pending: i64,
    /// Those due and not taken: in the queue and due, or waiting for their target's free places.
    pub due: i64,
}

impl Queue {
    pub fn new(conn: Conn, prefix: &str) -> Queue {
        Queue {
            conn: conn.clone(),
            prefix: prefix.to_string(),
            window_take: redis::Script::new(WINDOW_TAKE),
            zset: keys::queue(prefix),
            jobs: keys::jobs(prefix),
            take: redis::Script::new(TAKE),
            reschedule: redis::Script::new(RESCHEDULE),
            set_aside: redis::Script::new(SET_ASIDE),
            wait: redis::Script::new(WAIT),
            take_waiting: redis::Script::new(TAKE_WAITING),
            detach: redis::Script::new(DETACH),
            count: redis::Script::new(COUNT),
            look: redis::Script::new(LOOK),
            held: Arc::default(),
            unreadable: keys::unreadable(prefix),
            takeovers: keys::takeovers(prefix),
            writer: Writer::start(conn, prefix),
        }
    }

    /// Stores new jobs: `leased` ones this instance attempts now (leased to it), `pending` ones it
    /// has no free place for (due now, for whichever instance has free places first), and `waiting`
    /// ones whose target has no free place (straight into that target's waiting set, as
    /// [`Queue::wait_for_target`] would put them after taking them: in a storm, taking a job only
    /// to send it back to wait was most of what the queue cost Redis). Waiting jobs of one target
    /// go in bundles of up to `bundle_sizes[target]` (1 when it does not say; see [`bundle`]). One
    /// round trip at most, shared with whatever other jobs are being stored or finished at the same
    /// time. `also` runs in the same transaction (see [`Writer::put_with`]).
    pub async fn store(
        &self,
        leased: &[Job],
        pending: &[Job],
        waiting: &[(String, Job)],
        bundle_sizes: &HashMap<String, usize>,
        also: Vec<redis::Cmd>,
    ) -> Result<(), WriteError> {
        if leased.is_empty() && pending.is_empty() && waiting.is_empty() && also.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let lease_end = lease_end(now);
        let writes = leased
            .iter()
            .map(|j| (j.id(), j.payload(), lease_end))
            .chain(pending.iter().map(|j| (j.id(), j.payload(), now as f64)))
            .collect();
        let mut also = also;
        also.extend(self.wait_cmds(waiting, bundle_sizes, now));
        self.writer.put_with(writes, also).await
    }

    /// The commands that store `waiting` jobs (target, job) in their targets' waiting sets at
    /// `at`, in order, a target's in bundles of its size: the payloads in one `HSET`, one
    /// `ZADD` per target, and the targets listed.
    fn wait_cmds(
        &self,
        waiting: &[(String, Job)],
        bundle_sizes: &HashMap<String, usize>,
        at: i64,
    ) -> Vec<redis::Cmd> {
        if waiting.is_empty() {
            return Vec::new();
        }
        let mut by_target: std::collections::BTreeMap<&str, Vec<&Job>> = Default::default();
        for (target, job) in waiting {
            by_target.entry(target).or_default().push(job);
        }
        let mut hset = redis::cmd("HSET");
        hset.arg(&self.jobs);
        let mut cmds = Vec::with_capacity(by_target.len() + 2);
        let mut sadd = redis::cmd("SADD");
        sadd.arg(self.waiting_key());
        for (target, jobs) in &by_target {
            let size = bundle_sizes
                .get(*target)
                .copied()
                .unwrap_or(1)
                .clamp(1, bundle::MAX);
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(self.waiting_zset(target));
            for chunk in jobs.chunks(size) {
                let id = match chunk {
                    [job] => {
                        let id = job.id();
                        hset.arg(&id).arg(job.payload());
                        id
                    }
                    _ => {
                        let payloads: Vec<String> = chunk.iter().map(|j| j.payload()).collect();
                        let id = bundle::id(&chunk[0].id(), chunk.len());
                        hset.arg(&id)
                            .arg(bundle::payload(payloads.iter().map(String::as_str)));
                        id
                    }
                };
                zadd.arg(at).arg(id);
            }
            cmds.push(zadd);
            sadd.arg(*target);
        }
        cmds.insert(0, hset);
        cmds.push(sadd);
        cmds
    }

    /// The state connection the queue uses, for commands beside it (follow-ups).
    pub fn conn(&self) -> Conn {
        self.conn.clone()
    }

    /// The commands that store `job` due at `due_ms` (a follow-up), for a caller's transaction.
    /// `NX`: storing the same follow-up again (a record taken over after a crash) does not
    /// move it.
    pub fn due_later_cmds(&self, job: &Job, due_ms: i64) -> [redis::Cmd; 2] {
        let mut hset = redis::cmd("HSETNX");
        hset.arg(&self.jobs).arg(job.id()).arg(job.payload());
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(&self.zset).arg("NX").arg(due_ms).arg(job.id());
        [hset, zadd]
    }

    /// An attempt starts that will acknowledge its jobs with [`Queue::done`]; drop it when the
    /// attempt is over, just before acknowledging (see [`Writer::attempting`]).
    pub fn attempting(&self) -> Attempting {
        self.writer.attempting()
    }

    /// The job is finished (sent, or dead-lettered); group-committed like [`Queue::store`]. A
    /// bundled job is marked done in its bundle, and the last one removes the bundle.
    ///
    /// A write Redis could not take (down, restarting, a master failing over) is written again
    /// for up to half a lease after it first failed: dropped, it left the job queued, and the
    /// job ran a second time when its lease ended (docs/reliability.md#guarantees). Each of
    /// these writes can be written twice to the same effect.
    #[cfg(test)]
    pub async fn done(&self, id: &str) -> Result<(), WriteError> {
        self.done_with(id, &[], &|_| {}).await
    }

    /// [`Queue::done`], and `also` in the same transaction: a dead letter is kept exactly when
    /// its job leaves the queue. `also` must be as safe to write twice as the rest. `refused`
    /// hears the first error of a write that is written again.
    pub async fn done_with(
        &self,
        id: &str,
        also: &[redis::Cmd],
        refused: Refused<'_>,
    ) -> Result<(), WriteError> {
        let settled = &self.held().settle(id);
        written_again(
            refused,
            || async move {
                match settled {
                    None => self.writer.done(id.to_string(), also).await,
                    Some(Settled::Mark { bundle, index }) => {
                        let marked = self.writer.mark(bundle.clone(), *index, also).await;
                        if marked.is_ok() {
                            crate::drill::pass(crate::drill::Step::Marked);
                        }
                        marked
                    }
                    Some(Settled::Finished { bundle }) => self.finish_bundle(bundle, also).await,
                }
            },
            // Not a writer that has stopped: shutdown is under way.
            |e| matches!(e, WriteError::Redis(_)),
        )
        .await
    }

    async fn finish_bundle(&self, bundle: &str, also: &[redis::Cmd]) -> Result<(), WriteError> {
        self.writer
            .finish_bundle(bundle, &keys::bundle_done(&self.prefix, bundle), also)
            .await
    }

    fn held(&self) -> std::sync::MutexGuard<'_, bundle::Held> {
        // A std Mutex: the guard never lives across an await.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The job's next attempt is due at `due_ms`, on whichever instance takes it; `false` when
    /// the job had left the queue (this instance lost its lease and another finished it), and
    /// it stays gone. A bundled job leaves its bundle for a place of its own.
    pub async fn reschedule(&self, job: &Job, due_ms: i64) -> redis::RedisResult<bool> {
        let id = job.id();
        let member = self.held().get(&id);
        if let Some(m) = member {
            return self
                .detach(&m, &id, &job.payload(), &self.zset, due_ms, None)
                .await;
        }
        let moved = self
            .move_if_present(&self.zset, std::slice::from_ref(job), due_ms)
            .await?;
        Ok(moved > 0)
    }

    /// Moves bundled job `id` out of its bundle into `zset` at `score` (a waiting set when
    /// `target` says, which is then listed), marked done in the bundle, unless the bundle left
    /// the queue; then settles it here.
    async fn detach(
        &self,
        m: &bundle::Member,
        id: &str,
        payload: &str,
        zset: &str,
        score: i64,
        target: Option<&str>,
    ) -> redis::RedisResult<bool> {
        let mut inv = self.detach.prepare_invoke();
        inv.key(&self.zset)
            .key(&self.jobs)
            .key(zset)
            .key(keys::bundle_done(&self.prefix, &m.bundle))
            .key(&self.takeovers);
        if target.is_some() {
            inv.key(self.waiting_key());
        }
        inv.arg(&*m.bundle)
            .arg(m.index)
            .arg(id)
            .arg(payload)
            .arg(score);
        if let Some(t) = target {
            inv.arg(t);
        }
        let moved: i64 = inv.invoke_async(&mut self.conn.clone()).await?;
        let settled = self.held().settle(id);
        if let Some(Settled::Finished { bundle }) = settled {
            self.finish_bundle(&bundle, &[]).await.map_err(|e| {
                redis::RedisError::from((redis::ErrorKind::Io, "queue writer", e.to_string()))
            })?;
        }
        Ok(moved == 1)
    }

    /// Moves the jobs still in `zset` to `due_ms` with their new payloads; how many moved.
    async fn move_if_present(
        &self,
        zset: &str,
        jobs: &[Job],
        due_ms: i64,
    ) -> redis::RedisResult<usize> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let mut inv = self.reschedule.prepare_invoke();
        inv.key(zset)
            .key(&self.jobs)
            .key(&self.takeovers)
            .arg(due_ms);
        for j in jobs {
            inv.arg(j.id()).arg(j.payload());
        }
        inv.invoke_async(&mut self.conn.clone()).await
    }

    fn waiting_zset(&self, target: &str) -> String {
        keys::waiting(&self.prefix, target)
    }

    fn waiting_key(&self) -> String {
        keys::waits(&self.prefix)
    }

    /// What is due now and next, in one call: the queue's earliest due time, the digest windows
    /// with a member due, and the targets with jobs waiting for them.
    pub async fn look(&self) -> redis::RedisResult<Look> {
        let (queue_next, windows_next, due, targets): (i64, i64, Vec<String>, Vec<String>) = self
            .look
            .key(&self.zset)
            .key(self.windows_key())
            .key(self.waiting_key())
            .arg(now_ms())
            .arg(keys::windows_under(&self.prefix))
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut windows_due: Vec<Window> =
            due.iter().filter_map(|m| Window::of_member(m)).collect();
        windows_due.sort_by(|a, b| (&a.rule, &a.channel).cmp(&(&b.rule, &b.channel)));
        Ok(Look {
            queue_next: (queue_next >= 0).then_some(queue_next),
            windows_next: (windows_next >= 0).then_some(windows_next),
            windows_due,
            targets_waiting: targets,
        })
    }

    /// Takes up to `max` due jobs, leasing them to this instance.
    pub async fn take_due(&self, max: usize) -> redis::RedisResult<Taken> {
        self.take_from(&self.zset, max).await
    }

    async fn take_from(&self, zset: &str, max: usize) -> redis::RedisResult<Taken> {
        let now = now_ms();
        let mut answer: Vec<Option<String>> = self
            .take
            .key(zset)
            .key(&self.jobs)
            .key(&self.takeovers)
            .arg(now)
            .arg(max)
            .arg(lease_end(now))
            .invoke_async(&mut self.conn.clone())
            .await?;
        let next_due = answer
            .first_mut()
            .and_then(Option::take)
            .and_then(|s| s.parse::<f64>().ok())
            .map(|f| f as i64);
        let mut pairs = Vec::new();
        let mut died = HashMap::new();
        for triple in answer[1..].chunks(3) {
            if let [id, payload, over] = triple {
                let over: u32 = over.as_deref().and_then(|o| o.parse().ok()).unwrap_or(0);
                if let (Some(id), true) = (id, over >= MAX_TAKEOVERS) {
                    died.insert(id.clone(), over);
                }
                pairs.push(id.clone());
                pairs.push(payload.clone());
            }
        }
        let mut taken = self.decode(zset, pairs).await?;
        taken.next_due = next_due;
        if !died.is_empty() {
            // A bundle's jobs died with it.
            let held = self.held();
            for job in &taken.jobs {
                let id = job.id();
                let member = held.get(&id).map_or(id.clone(), |m| m.bundle.to_string());
                if died.contains_key(&member) {
                    taken.died.insert(id);
                }
            }
        }
        Ok(taken)
    }

    /// The jobs of id, payload pairs just leased from `zset`; those that do not decode are set
    /// aside. A bundle brings those of its jobs not marked done, and is this instance's to finish.
    async fn decode(&self, zset: &str, pairs: Vec<Option<String>>) -> redis::RedisResult<Taken> {
        let mut taken = Taken::default();
        let mut aside: Vec<(String, String)> = Vec::new();
        let marks = self.marks(&pairs).await?;
        for pair in pairs.chunks(2) {
            let [Some(id), payload] = pair else { continue };
            if let (Some(_), Some(p)) = (bundle::size(id), payload) {
                match self
                    .open_bundle(id, p, marks.get(id.as_str()), &mut taken)
                    .await
                {
                    Ok(()) => continue,
                    Err(e) => {
                        taken.unreadable.push(Unreadable::new(id, p, e.to_string()));
                        aside.push((id.clone(), p.clone()));
                        continue;
                    }
                }
            }
            match payload.as_deref().map(serde_json::from_str::<Job>) {
                Some(Ok(job)) => taken.jobs.push(job),
                Some(Err(e)) => {
                    let payload = payload.clone().unwrap_or_default();
                    taken
                        .unreadable
                        .push(Unreadable::new(id, &payload, e.to_string()));
                    aside.push((id.clone(), payload));
                }
                None => {
                    taken.unreadable.push(Unreadable::new(
                        id,
                        "",
                        "its payload is missing".to_string(),
                    ));
                    aside.push((id.clone(), String::new()));
                }
            }
        }
        if !aside.is_empty() {
            self.set_aside(zset, &aside).await?;
            let marks: Vec<String> = aside
                .iter()
                .filter(|(id, _)| bundle::size(id).is_some())
                .map(|(id, _)| keys::bundle_done(&self.prefix, id))
                .collect();
            if !marks.is_empty() {
                redis::cmd("DEL")
                    .arg(marks)
                    .exec_async(&mut self.conn.clone())
                    .await?;
            }
        }
        Ok(taken)
    }

    /// Moves members that cannot be read (`aside`: id, payload) out of `zset` into
    /// `queue:unreadable`, kept for a person. Should this fail, they stay leased as the others
    /// and come back when their lease ends, to be reported again then.
    async fn set_aside(&self, zset: &str, aside: &[(String, String)]) -> redis::RedisResult<()> {
        let mut inv = self.set_aside.prepare_invoke();
        inv.key(zset)
            .key(&self.jobs)
            .key(&self.unreadable)
            .key(&self.takeovers);
        for (id, payload) in aside {
            inv.arg(id).arg(payload);
        }
        inv.invoke_async(&mut self.conn.clone()).await
    }

    /// The completion marks of the bundles among `pairs` (indexes of the jobs done), read in
    /// one round trip after their lease was taken: a mark written after that is another
    /// instance's that lost its lease, and what it marked it attempted already (the same as a
    /// job it finished after losing its lease).
    async fn marks(
        &self,
        pairs: &[Option<String>],
    ) -> redis::RedisResult<HashMap<String, HashMap<String, String>>> {
        let bundles: Vec<&String> = pairs
            .chunks(2)
            .filter_map(|p| match p {
                [Some(id), Some(_)] if bundle::size(id).is_some() => Some(id),
                _ => None,
            })
            .collect();
        if bundles.is_empty() {
            return Ok(HashMap::new());
        }
        let mut pipe = redis::pipe();
        for b in &bundles {
            pipe.cmd("HGETALL").arg(keys::bundle_done(&self.prefix, b));
        }
        let marks: Vec<HashMap<String, String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(bundles.into_iter().cloned().zip(marks).collect())
    }

    /// Adds the jobs of bundle `id` that are not marked done to `taken`, and holds the bundle;
    /// `Err` when its payload is no bundle this version reads (it is then set aside whole). A
    /// job of it that does not decode is set aside on its own and marked done.
    async fn open_bundle(
        &self,
        id: &str,
        payload: &str,
        marks: Option<&HashMap<String, String>>,
        taken: &mut Taken,
    ) -> Result<(), serde_json::Error> {
        let elements = bundle::elements(payload)?;
        let bundle: Arc<str> = id.into();
        let mut mine = Vec::new();
        let mut bad = Vec::new();
        for (index, element) in elements.iter().enumerate() {
            if marks.is_some_and(|m| m.contains_key(&index.to_string())) {
                continue;
            }
            match serde_json::from_str::<Job>(element.get()) {
                Ok(job) => {
                    mine.push((job.id(), index, Arc::<str>::from(element.get())));
                    taken.jobs.push(job);
                }
                Err(e) => {
                    let at = format!("{id}@{index}");
                    taken
                        .unreadable
                        .push(Unreadable::new(&at, element.get(), e.to_string()));
                    bad.push((at, index, element.get().to_string()));
                }
            }
        }
        let nothing_left = mine.is_empty();
        self.held().hold(bundle.clone(), mine);
        if !bad.is_empty() {
            // Kept for a person beside the other unreadable jobs, and marked done, so that the
            // bundle's next taker does not report it again.
            let mut pipe = redis::pipe();
            let mut hset = redis::cmd("HSET");
            hset.arg(&self.unreadable);
            let mut marks = redis::cmd("HSET");
            marks.arg(keys::bundle_done(&self.prefix, id));
            for (at, index, text) in &bad {
                hset.arg(at).arg(text);
                marks.arg(index).arg("1");
            }
            pipe.add_command(hset).ignore();
            pipe.add_command(marks).ignore();
            if let Err(e) = pipe.exec_async(&mut self.conn.clone()).await {
                tracing::warn!(error = %e, bundle = id, "Cannot set unreadable jobs of a bundle aside; they are reported again when it is taken next.");
            }
        }
        if nothing_left {
            // Every job of it was done: a bundle whose last acknowledgement did not land.
            if let Err(e) = self.finish_bundle(id, &[]).await {
                tracing::warn!(error = %e, bundle = id, "Cannot remove a finished bundle; it is taken and removed again when its lease ends.");
            }
        }
        Ok(())
    }

    /// Hands jobs back at shutdown: due now, for any instance.
    /// A bundled job hands its whole bundle back: the jobs of it finished here are marked.
    pub async fn hand_back(&self, ids: &[String]) -> redis::RedisResult<()> {
        let members = self.held().members(ids);
        if members.is_empty() {
            return Ok(());
        }
        self.set_due(&self.zset, &members, now_ms() as f64).await?;
        // Handed back by a keywatch that stops as it should: no takeover.
        redis::cmd("HDEL")
            .arg(&self.takeovers)
            .arg(&members)
            .exec_async(&mut self.conn.clone())
            .await
    }

    /// Extends the leases of jobs still being attempted (only those still in the queue): of a
    /// bundled job, its bundle's.
    pub async fn renew(&self, ids: &[String]) -> redis::RedisResult<()> {
        let members = self.held().members(ids);
        self.set_due(&self.zset, &members, lease_end(now_ms()))
            .await
    }

    /// Moves jobs still in `zset` to `due` (ms).
    async fn set_due(&self, zset: &str, ids: &[String], due: f64) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(zset).arg("XX");
        for id in ids {
            zadd.arg(due).arg(id);
        }
        zadd.exec_async(&mut self.conn.clone()).await
    }

    fn window_zset(&self, w: &Window) -> String {
        keys::window(&self.prefix, &w.rule, &w.channel)
    }

    fn windows_key(&self) -> String {
        keys::windows(&self.prefix)
    }

    /// Jobs waiting, being attempted or waiting for a retry: the queue's, those waiting for
    /// their target's free places, and those in digest
    /// windows (each notification waiting in a window is a job too, and a window holding
    /// thousands is a backlog as real as the queue's).
    #[cfg(test)]
    pub async fn len(&self) -> redis::RedisResult<i64> {
        Ok(self.counts().await?.pending)
    }

    /// [`Queue::len`], and how many of those jobs are due and not taken: a backlog. The rest
    /// wait by design — an Alertmanager alert's job for its next `resend`, a retry, a
    /// follow-up, a digest window — or are being attempted (docs/operations.md#metrics).
    pub async fn counts(&self) -> redis::RedisResult<Counts> {
        let windows = self.windows().await?;
        let targets = self.waiting_targets().await?;
        // Bundles live in the queue (leased), the waiting sets and the windows: counted by
        // what they hold.
        let mut inv = self.count.prepare_invoke();
        inv.key(&self.zset);
        for t in &targets {
            inv.key(self.waiting_zset(t));
        }
        for w in &windows {
            inv.key(self.window_zset(w));
        }
        inv.arg(now_ms()).arg(targets.len());
        let (pending, due) = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(Counts { pending, due })
    }
}

/// Runs `write` until Redis takes it, for up to half a lease after it first failed, with
/// [`WRITE_AGAIN`]'s waits: an acknowledgement Redis could not take (down, restarting, a master
/// failing over) left its job queued, and the job ran a second time when its lease ended
/// (docs/reliability.md#guarantees). Only for writes that can be written twice to the same
/// effect; an error `again` turns down ends it at once. `refused` hears the first error that is
/// written again (the caller's `state_error`, docs/operations.md#internal-events).
async fn written_again<E: std::fmt::Display, W: Future<Output = Result<(), E>>>(
    refused: Refused<'_>,
    write: impl Fn() -> W,
    again: impl Fn(&E) -> bool,
) -> Result<(), E> {
    let mut give_up = None;
    let mut waits = WRITE_AGAIN.waits();
    loop {
        match write().await {
            Err(e) if again(&e) => {
                let now = tokio::time::Instant::now();
                let first = give_up.is_none();
                let wait = waits.next();
                if now + wait >= *give_up.get_or_insert(now + crate::store::lease() / 2) {
                    return Err(e);
                }
                if first {
                    refused(&e);
                }
                tokio::time::sleep(wait).await;
            }
            other => return other,
        }
    }
}

/// Told the first error of a write [`written_again`].
pub type Refused<'a> = &'a (dyn Fn(&dyn std::fmt::Display) + Sync);

/// Soon after Redis is back: the job's lease is running out meanwhile. From 100 ms, doubling
/// to 500 ms (waits of 50 to 500 ms).
const WRITE_AGAIN: crate::backoff::Backoff =
    crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_millis(500));

crate::keyspace::commands::declare! {
    /// The commands the job queue and digest windows send, the writer's and the scripts' included
    /// ([`crate::keyspace::commands`]).
    const QUEUE = "job queue";
    const WINDOWS = "digest windows";
    const SCRIPTS = "job queue and digest windows (scripts)";
    [
        Use::new(Server::State, "hset", QUEUE)
            .on(Keys::State("queue:jobs"), Access::Write)
            .args("{key} id job"),
        Use::new(Server::State, "hsetnx", "job queue: follow-ups due later")
            .on(Keys::State("queue:jobs"), Access::Write)
            .args("{key} id job"),
        Use::new(Server::State, "zadd", QUEUE)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} XX 0 id"),
        Use::new(Server::State, "zrem", QUEUE)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "hdel", QUEUE)
            .on(Keys::State("queue:jobs"), Access::ReadWrite)
            .args("{key} id"),
        // Storing jobs is one transaction with the intake records they move on.
        Use::new(Server::State, "multi", QUEUE),
        Use::new(Server::State, "exec", QUEUE),
        Use::new(Server::State, "zcard", QUEUE)
            .on(Keys::State("queue"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "smembers", WINDOWS)
            .on(Keys::State("groups"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "script|load", SCRIPTS)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Server::State, "evalsha", "job queue: take")
            .on(Keys::State("queue"), Access::ReadWrite)
            .args("{sha} 2 {prefix}queue {prefix}queue:jobs"),
        Use::new(Server::State, "evalsha", WINDOWS)
            .on(Keys::State("group:*:*:window"), Access::ReadWrite)
            .args("{sha} 4 {key} {prefix}group:r:c {prefix}queue:jobs {prefix}groups"),
        // Putting notifications into their window, inside the transaction that stores the
        // jobs (see `Queue::window_put_cmd`).
        Use::new(Server::State, "eval", WINDOWS)
            .on(Keys::State("group:*:*:window"), Access::ReadWrite)
            .args("return(1) 4 {key} {prefix}group:r:c {prefix}queue:jobs {prefix}groups"),
        Use::new(Server::State, "zrange", SCRIPTS)
            .on(Keys::State("queue"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1"),
        Use::new(Server::State, "hmget", SCRIPTS)
            .on(Keys::State("queue:jobs"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "get", SCRIPTS)
            .on(Keys::State("group:*:*:window"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "set", SCRIPTS)
            .on(Keys::State("group:*:*:window"), Access::Write)
            .args("{key} 0 PXAT 1000"),
        Use::new(Server::State, "zadd", SCRIPTS)
            .on(Keys::State("group:*:*"), Access::Write)
            .args("{key} NX 0 id"),
        Use::new(Server::State, "sadd", SCRIPTS)
            .on(Keys::State("groups"), Access::Write)
            .args("{key} w"),
        Use::new(Server::State, "srem", SCRIPTS)
            .on(Keys::State("groups"), Access::Write)
            .args("{key} w"),
        Use::new(Server::State, "smembers", QUEUE)
            .on(Keys::State("queue:waits"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zcard", QUEUE)
            .on(Keys::State("queue:wait:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "evalsha", "job queue: targets' waiting sets")
            .on(Keys::State("queue:wait:*"), Access::ReadWrite)
            .args("{sha} 3 {prefix}queue {key} {prefix}queue:waits"),
        Use::new(Server::State, "zscore", SCRIPTS)
            .on(Keys::State("queue"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "hset", SCRIPTS)
            .on(Keys::State("queue:unreadable"), Access::Write)
            .args("{key} id job"),
        // Takeovers (see `MAX_TAKEOVERS`): counted by the takes, forgotten with an outcome.
        Use::new(Server::State, "hincrby", SCRIPTS)
            .on(Keys::State("queue:takeovers"), Access::ReadWrite)
            .args("{key} id 1"),
        Use::new(Server::State, "hdel", "job queue: takeovers")
            .on(Keys::State("queue:takeovers"), Access::ReadWrite)
            .args("{key} id"),
        // Bundles (see `bundle`): their completion marks.
        Use::new(Server::State, "hset", "job queue: bundles' completion marks")
            .on(Keys::State("queue:done:*"), Access::Write)
            .args("{key} 0 1"),
        Use::new(Server::State, "hgetall", "job queue: bundles' completion marks")
            .on(Keys::State("queue:done:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "del", "job queue: bundles' completion marks")
            .on(Keys::State("queue:done:*"), Access::Write)
            .args("{key}"),
        // A mark is written beside a read of whether its bundle is still queued (`writer`).
        Use::new(Server::State, "zscore", "job queue: bundles' completion marks")
            .on(Keys::State("queue"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "zrange", SCRIPTS)
            .on(Keys::State("queue:wait:*"), Access::Read)
            .args("{key} 0 -1"),
        Use::new(Server::State, "zcard", SCRIPTS)
            .on(Keys::State("queue:wait:*"), Access::Read)
            .args("{key}"),

    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::local_redis::LocalRedis;

    /// A queue on a throwaway redis-server (kept alive by the returned server).
    async fn queue() -> (LocalRedis, Queue, Conn) {
        let (server, conn) = crate::local_redis::throwaway().await;
        (server, Queue::new(conn.clone(), "kw:"), conn)
    }

    fn job(key: &str, action: Action) -> Job {
        let firing = crate::firing::expiry("r", key, "2026-01-01T00:00:00Z");
        Job::first(Arc::new(firing), action)
    }

    /// Rule `r`'s digest window for channel `c`, and a notification to it.
    fn window_rc() -> Window {
        Window {
            rule: "r".into(),
            channel: "c".into(),
        }
    }

    fn notify_c() -> Action {
        Action::Notify {
            channel: "c".into(),
        }
    }

    /// Every member of a sorted set, lowest score first.
    async fn members(conn: &Conn, zset: &str) -> Vec<String> {
        redis::cmd("ZRANGE")
            .arg(zset)
            .arg(0)
            .arg(-1)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    async fn score(conn: &Conn, zset: &str, id: &str) -> Option<f64> {
        redis::cmd("ZSCORE")
            .arg(zset)
            .arg(id)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    async fn payload(conn: &Conn, id: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg("kw:queue:jobs")
            .arg(id)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    /// This instance lost its lease while attempting a job; another took it over and finished
    /// it. This one's failed attempt must not put the job back: it would run a second time.
    #[tokio::test]
    async fn a_retry_does_not_bring_back_a_job_another_instance_finished() {
        let (_server, q, conn) = queue().await;
        let j = job("k:1", Action::Reload);
        q.store(
            &[],
            std::slice::from_ref(&j),
            &[],
            &HashMap::new(),
            Vec::new(),
        )
        .await
        .unwrap();
        assert_eq!(q.take_due(10).await.unwrap().jobs, vec![j.clone()]);
        // Still ours: the retry is stored, due when it says.
        let mut again = j.clone();
        again.attempt = 1;
        assert!(q.reschedule(&again, 42).await.unwrap());
        assert_eq!(score(&conn, "kw:queue", &j.id()).await, Some(42.0));
        assert!(
            payload(&conn, &j.id())
                .await
                .unwrap()
                .contains("\"attempt\":1")
        );
        // Finished elsewhere meanwhile: nothing comes back, neither due time nor payload.
        q.done(&j.id()).await.unwrap();
        again.attempt = 2;
        assert!(!q.reschedule(&again, 43).await.unwrap());
        assert_eq!(score(&conn, "kw:queue", &j.id()).await, None);
        assert_eq!(payload(&conn, &j.id()).await, None);
        assert_eq!(q.len().await.unwrap(), 0);
    }

    /// `keywatch_queue_due` counts what waits to be taken now: jobs due in the queue and jobs
    /// waiting for their target's free places; not a job being attempted, one waiting for its next
    /// round or retry (an Alertmanager alert's `resend`), nor a notification in a digest window.
    #[tokio::test]
    async fn due_counts_only_jobs_due_and_not_taken() {
        let (_server, q, _conn) = queue().await;
        let jobs: Vec<Job> = (1..=4)
            .map(|i| job(&format!("k:{i}"), Action::Reload))
            .collect();
        q.store(&[], &jobs, &[], &HashMap::new(), Vec::new())
            .await
            .unwrap();
        let taken = q.take_due(3).await.unwrap().jobs;
        assert_eq!(taken.len(), 3);
        // One is being attempted (leased), one waits for its next round, one for a free place.
        q.reschedule(&taken[1], now_ms() + 3_600_000).await.unwrap();
        q.wait_for_target("reload:r", &[taken[2].id()])
            .await
            .unwrap();
        q.window_put(
            &window_rc(),
            Duration::from_secs(3600),
            &[job("k:5", notify_c())],
        )
        .await
        .unwrap();
        assert_eq!(q.counts().await.unwrap(), Counts { pending: 5, due: 2 });
        assert_eq!(q.len().await.unwrap(), 5);
    }

    /// The same for a digest window's members: a digest sent by another instance stays sent.
    #[tokio::test]
    async fn a_digest_retry_does_not_bring_back_jobs_another_instance_sent() {
        let (_server, q, conn) = queue().await;
        let w = window_rc();
        let (a, b) = (job("k:1", notify_c()), job("k:2", notify_c()));
        // Two batches: two members.
        for j in [&a, &b] {
            q.window_put(&w, Duration::from_millis(1), std::slice::from_ref(j))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let taken = q.window_take(&w, 10).await.unwrap();
        let ids: Vec<&str> = taken.members.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, [a.id(), b.id()]);
        // Another instance sent `a` (after this one's lease ran out); `b` is still the window's.
        q.window_done(&w, &[a.id()]).await.unwrap();
        q.window_retry(
            &w,
            &[(a.id(), vec![a.clone()]), (b.id(), vec![b.clone()])],
            42,
        )
        .await
        .unwrap();
        assert_eq!(score(&conn, "kw:group:r:c", &a.id()).await, None);
        assert_eq!(payload(&conn, &a.id()).await, None);
        assert_eq!(score(&conn, "kw:group:r:c", &b.id()).await, Some(42.0));
    }

    /// A batch's notifications are one member of their window: taken whole (however many),
    /// counted as what they hold, and retried whole with their attempts counted. A notification
    /// stored twice (an event run again after a crash) is in the digest once.
    #[tokio::test]
    async fn a_batch_is_one_member_of_its_window() {
        let (_server, q, conn) = queue().await;
        let w = window_rc();
        let jobs: Vec<Job> = (0..3).map(|i| job(&format!("k:{i}"), notify_c())).collect();
        q.window_put(&w, Duration::from_millis(1), &jobs)
            .await
            .unwrap();
        q.window_put(&w, Duration::from_millis(1), &jobs[2..])
            .await
            .unwrap();
        let members = members(&conn, "kw:group:r:c").await;
        // One score (the window's end): by name, a bundle's `#` first.
        assert_eq!(members, [bundle::id(&jobs[0].id(), 3), jobs[2].id()]);
        assert_eq!(q.len().await.unwrap(), 4);
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Room for two: the bundle alone (the first member is taken whatever its size)...
        let taken = q.window_take(&w, 2).await.unwrap();
        assert!(taken.unreadable.is_empty());
        let got: Vec<(String, Vec<Job>)> =
            taken.members.into_iter().map(|m| (m.id, m.jobs)).collect();
        assert_eq!(got, [(bundle::id(&jobs[0].id(), 3), jobs.clone())]);
        // ...and once more with free places: the lone copy, which this take did not see before.
        let rest = q.window_take(&w, 10).await.unwrap();
        assert_eq!(rest.members.len(), 1);
        assert_eq!(rest.members[0].jobs, jobs[2..]);
        // Both together: the copy is left out of the second member.
        let both = [
            (bundle::id(&jobs[0].id(), 3), jobs.clone()),
            (jobs[2].id(), jobs[2..].to_vec()),
        ];
        let again: Vec<(String, Vec<Job>)> = both
            .iter()
            .map(|(id, js)| {
                let js = js
                    .iter()
                    .map(|j| Job {
                        attempt: 1,
                        ..j.clone()
                    })
                    .collect();
                (id.clone(), js)
            })
            .collect();
        q.window_retry(&w, &again, 0).await.unwrap();
        let taken = q.window_take(&w, 10).await.unwrap();
        let jobs_back: Vec<&Job> = taken.members.iter().flat_map(|m| &m.jobs).collect();
        assert_eq!(jobs_back.len(), 3, "the copy once");
        assert!(jobs_back.iter().all(|j| j.attempt == 1));
        assert_eq!(taken.members[1].jobs, []);
        // A member left with nothing goes when retried; done, the rest goes too.
        let ids: Vec<String> = taken.members.iter().map(|m| m.id.clone()).collect();
        q.window_retry(
            &w,
            &[
                (ids[0].clone(), taken.members[0].jobs.clone()),
                (ids[1].clone(), Vec::new()),
            ],
            0,
        )
        .await
        .unwrap();
        assert_eq!(q.len().await.unwrap(), 3);
        q.window_done(&w, &ids).await.unwrap();
        assert_eq!(q.len().await.unwrap(), 0);
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("kw:*")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert!(keys.iter().all(|k| k.ends_with(":window")), "{keys:?}");
    }

    /// A job stored by a version that wrote something this one cannot read (or whose payload
    /// went missing) is set aside with what can be told of it, once: not leased and skipped
    /// again every 15 s forever. The readable job taken with it is unaffected.
    #[tokio::test]
    async fn a_job_that_does_not_decode_is_set_aside_once() {
        let (_server, q, conn) = queue().await;
        let good = job("k:1", Action::Exec);
        q.store(
            &[],
            std::slice::from_ref(&good),
            &[],
            &HashMap::new(),
            Vec::new(),
        )
        .await
        .unwrap();
        let future =
            r#"{"firing":{"id":"f1","rule":"orders","shape":"v2"},"action":{"action":"sms"}}"#;
        let mut c = conn.clone();
        redis::pipe()
            .cmd("HSET")
            .arg("kw:queue:jobs")
            .arg("f1:notify:team")
            .arg(future)
            .cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg("f1:notify:team")
            .cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg("f2:reload")
            .exec_async(&mut c)
            .await
            .unwrap();

        let taken = q.take_due(10).await.unwrap();
        assert_eq!(taken.jobs, vec![good]);
        let mut unreadable = taken.unreadable;
        unreadable.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(unreadable.len(), 2, "{unreadable:?}");
        assert_eq!(unreadable[0].id, "f1:notify:team");
        assert_eq!(unreadable[0].rule.as_deref(), Some("orders"));
        assert_eq!(
            unreadable[0].action,
            Some(Action::Notify {
                channel: "team".into()
            })
        );
        assert!(!unreadable[0].error.is_empty());
        assert_eq!(unreadable[1].id, "f2:reload");
        assert_eq!(unreadable[1].rule, None);
        assert_eq!(unreadable[1].action, Some(Action::Reload));
        assert_eq!(unreadable[1].error, "its payload is missing");

        // Out of the queue, the payload kept aside; the next take (after any lease) finds nothing.
        assert_eq!(score(&conn, "kw:queue", "f1:notify:team").await, None);
        assert_eq!(payload(&conn, "f1:notify:team").await, None);
        let kept: Option<String> = redis::cmd("HGET")
            .arg("kw:queue:unreadable")
            .arg("f1:notify:team")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(kept.as_deref(), Some(future));
        q.hand_back(&[good_id()]).await.unwrap();
        let again = q.take_due(10).await.unwrap();
        assert!(again.unreadable.is_empty(), "{again:?}");
        assert_eq!(again.jobs.len(), 1);
    }

    /// Jobs whose target has no free place wait in the target's own set, oldest first, out of the
    /// way of the queue; a job another instance finished meanwhile does not wait; taking them
    /// back leases them in the queue, and an emptied set is no longer listed.
    #[tokio::test]
    async fn jobs_wait_for_their_target_in_its_own_set() {
        let (_server, q, conn) = queue().await;
        let notify = || Action::Notify {
            channel: "slow".into(),
        };
        let jobs: Vec<Job> = (0..3).map(|i| job(&format!("k:{i}"), notify())).collect();
        let other = job("o:1", Action::Reload);
        q.store(&[], &jobs, &[], &HashMap::new(), Vec::new())
            .await
            .unwrap();
        q.store(
            &[],
            std::slice::from_ref(&other),
            &[],
            &HashMap::new(),
            Vec::new(),
        )
        .await
        .unwrap();
        assert_eq!(q.take_due(10).await.unwrap().jobs.len(), 4);
        // Finished elsewhere after this instance lost its lease: it stays finished.
        q.done(&jobs[2].id()).await.unwrap();
        let ids: Vec<String> = jobs.iter().map(Job::id).collect();
        q.wait_for_target("channel:slow", &ids).await.unwrap();
        assert_eq!(q.waiting_targets().await.unwrap(), vec!["channel:slow"]);
        assert_eq!(score(&conn, "kw:queue", &ids[0]).await, None);
        assert_eq!(
            score(&conn, "kw:queue:wait:channel:slow", &ids[2]).await,
            None
        );
        assert_eq!(q.len().await.unwrap(), 3, "two waiting, one leased");
        // The other target's job is still where it was.
        assert!(score(&conn, "kw:queue", &other.id()).await.is_some());

        let first = q.take_waiting("channel:slow", 1, false).await.unwrap();
        assert_eq!(first.jobs.len(), 1);
        assert!(score(&conn, "kw:queue", &first.jobs[0].id()).await.unwrap() > now_ms() as f64);
        let rest = q.take_waiting("channel:slow", 10, false).await.unwrap();
        assert_eq!(rest.jobs.len(), 1);
        assert!(q.waiting_targets().await.unwrap().is_empty());
        assert_eq!(q.len().await.unwrap(), 3);
    }

    async fn exists(conn: &Conn, key: &str) -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    /// Five jobs waiting for one target, in bundles of two: two bundles and one job on its own.
    async fn bundled(q: &Queue) -> Vec<Job> {
        let jobs: Vec<Job> = (0..5)
            .map(|i| job(&format!("k:{i}"), Action::Reload))
            .collect();
        let waiting: Vec<(String, Job)> = jobs
            .iter()
            .map(|j| ("reload:r".to_string(), j.clone()))
            .collect();
        let sizes = HashMap::from([("reload:r".to_string(), 2)]);
        q.store(&[], &[], &waiting, &sizes, Vec::new())
            .await
            .unwrap();
        jobs
    }

    /// Waiting jobs go in bundles as big as their target says; a bundle is taken back whole,
    /// only when it fits the free places (or the target is idle), and counts as the jobs it holds.
    #[tokio::test]
    async fn waiting_jobs_are_bundled_and_taken_back_as_the_room_allows() {
        let (_server, q, conn) = queue().await;
        let jobs = bundled(&q).await;
        let members = members(&conn, "kw:queue:wait:reload:r").await;
        assert_eq!(members.len(), 3, "{members:?}");
        assert_eq!(q.len().await.unwrap(), 5);
        // Room for one: the first bundle holds two, and the target is busy.
        let none = q.take_waiting("reload:r", 1, false).await.unwrap();
        assert!(none.jobs.is_empty() && none.more);
        assert_eq!(none.need, 2, "the free places the oldest bundle needs");
        // Idle with free places for one (a bundle made for a target of higher concurrency): taken
        // whole.
        let first = q.take_waiting("reload:r", 1, true).await.unwrap();
        assert_eq!(first.jobs, jobs[..2]);
        assert!(first.more);
        assert_eq!(
            first.need, 0,
            "it looked at no member beyond the free places"
        );
        // Room for two: the next bundle fits, the job after it does not.
        let second = q.take_waiting("reload:r", 2, false).await.unwrap();
        assert_eq!(second.jobs, jobs[2..4]);
        assert!(second.more);
        assert_eq!(second.need, 1);
        let third = q.take_waiting("reload:r", 3, false).await.unwrap();
        assert_eq!(third.jobs, jobs[4..]);
        assert!(!third.more);
        assert_eq!(third.need, 0);
        assert!(q.waiting_targets().await.unwrap().is_empty());
        assert_eq!(q.len().await.unwrap(), 5, "all leased");
        for j in &jobs {
            q.done(&j.id()).await.unwrap();
        }
        assert_eq!(q.len().await.unwrap(), 0);
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("kw:*")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert!(keys.is_empty(), "left behind: {keys:?}");
    }

    /// The crash the marks are for: an instance finished one job of a bundle and died; whoever
    /// takes the bundle over when its lease ends attempts only the other one, and removes the
    /// bundle with its marks when that is done.
    #[tokio::test]
    async fn a_bundle_taken_over_brings_only_the_jobs_nobody_finished() {
        let (_server, q, conn) = queue().await;
        let jobs = bundled(&q).await;
        let taken = q.take_waiting("reload:r", 2, false).await.unwrap();
        assert_eq!(taken.jobs, jobs[..2]);
        q.done(&jobs[0].id()).await.unwrap();
        let bundle = bundle::id(&jobs[0].id(), 2);
        assert!(exists(&conn, &keys::bundle_done("kw:", &bundle)).await);
        // The instance dies; its lease ends.
        redis::cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg(&bundle)
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let other = Queue::new(conn.clone(), "kw:");
        let again = other.take_due(10).await.unwrap();
        assert_eq!(again.jobs, jobs[1..2]);
        // Renewing and handing back a bundled job touch its bundle.
        other.renew(&[jobs[1].id()]).await.unwrap();
        assert!(score(&conn, "kw:queue", &bundle).await.unwrap() > now_ms() as f64);
        other.done(&jobs[1].id()).await.unwrap();
        assert_eq!(score(&conn, "kw:queue", &bundle).await, None);
        assert_eq!(payload(&conn, &bundle).await, None);
        assert!(!exists(&conn, &keys::bundle_done("kw:", &bundle)).await);
    }

    /// This instance lost a bundle's lease; another took it over and finished it. This one's
    /// late acknowledgement must not leave marks behind (nothing would ever remove them), and
    /// its retry of a job must not bring the job back.
    #[tokio::test]
    async fn late_writes_to_a_bundle_finished_elsewhere_leave_nothing() {
        let (_server, q, conn) = queue().await;
        let jobs = bundled(&q).await;
        q.take_waiting("reload:r", 2, false).await.unwrap();
        let bundle = bundle::id(&jobs[0].id(), 2);
        let other = Queue::new(conn.clone(), "kw:");
        redis::cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg(&bundle)
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(other.take_due(10).await.unwrap().jobs.len(), 2);
        other.done(&jobs[0].id()).await.unwrap();
        other.done(&jobs[1].id()).await.unwrap();
        q.done(&jobs[0].id()).await.unwrap();
        assert!(!exists(&conn, &keys::bundle_done("kw:", &bundle)).await);
        let mut again = jobs[1].clone();
        again.attempt = 1;
        assert!(!q.reschedule(&again, 42).await.unwrap());
        assert_eq!(score(&conn, "kw:queue", &again.id()).await, None);
        assert_eq!(payload(&conn, &again.id()).await, None);
    }

    /// A bundled job that fails, or finds no free place after all, leaves its bundle for a place of
    /// its own (marked done in the bundle, so a taker of the bundle does not run it again).
    #[tokio::test]
    async fn a_bundled_job_retried_or_sent_to_wait_leaves_its_bundle() {
        let (_server, q, conn) = queue().await;
        let jobs = bundled(&q).await;
        q.take_waiting("reload:r", 4, false).await.unwrap();
        let mut again = jobs[0].clone();
        again.attempt = 1;
        assert!(q.reschedule(&again, 42).await.unwrap());
        assert_eq!(score(&conn, "kw:queue", &again.id()).await, Some(42.0));
        assert!(
            payload(&conn, &again.id())
                .await
                .unwrap()
                .contains("\"attempt\":1")
        );
        q.wait_for_target("reload:r", &[jobs[2].id()])
            .await
            .unwrap();
        assert!(
            score(&conn, "kw:queue:wait:reload:r", &jobs[2].id())
                .await
                .is_some()
        );
        assert_eq!(payload(&conn, &jobs[2].id()).await, Some(jobs[2].payload()));
        // Their bundles, taken over now, bring only the others.
        redis::cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg(bundle::id(&jobs[0].id(), 2))
            .arg(0)
            .arg(bundle::id(&jobs[2].id(), 2))
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let other = Queue::new(conn.clone(), "kw:");
        let mut ids: Vec<String> = other
            .take_due(10)
            .await
            .unwrap()
            .jobs
            .iter()
            .map(Job::id)
            .collect();
        ids.sort();
        // The retry (due at 42, long past) comes too, as a job of its own.
        let mut want = vec![jobs[0].id(), jobs[1].id(), jobs[3].id()];
        want.sort();
        assert_eq!(ids, want);
    }

    /// One job of a bundle that this version cannot read is set aside on its own (and marked
    /// done); the others run. A bundle that is no bundle at all is set aside whole.
    #[tokio::test]
    async fn an_unreadable_job_in_a_bundle_is_set_aside_alone() {
        let (_server, q, conn) = queue().await;
        let good = job("k:1", Action::Reload);
        let bad = r#"{"firing":{"id":"f9","rule":"orders","shape":"v2"},"action":"sms"}"#;
        let bundle = bundle::id(&good.id(), 2);
        let broken = "#3#f8:reload";
        redis::pipe()
            .cmd("HSET")
            .arg("kw:queue:jobs")
            .arg(&bundle)
            .arg(bundle::payload([good.payload().as_str(), bad].into_iter()))
            .arg(broken)
            .arg("[not json")
            .cmd("ZADD")
            .arg("kw:queue")
            .arg(0)
            .arg(&bundle)
            .arg(0)
            .arg(broken)
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let taken = q.take_due(10).await.unwrap();
        assert_eq!(taken.jobs, vec![good.clone()]);
        let mut unreadable: Vec<String> = taken.unreadable.iter().map(|u| u.id.clone()).collect();
        unreadable.sort();
        let mut want = [broken.to_string(), format!("{bundle}@1")];
        want.sort();
        assert_eq!(unreadable, want);
        let kept: Option<String> = redis::cmd("HGET")
            .arg("kw:queue:unreadable")
            .arg(format!("{bundle}@1"))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(kept.as_deref(), Some(bad));
        assert_eq!(score(&conn, "kw:queue", broken).await, None);
        q.done(&good.id()).await.unwrap();
        assert_eq!(q.len().await.unwrap(), 0);
        assert!(!exists(&conn, &keys::bundle_done("kw:", &bundle)).await);
    }

    /// The same in a digest window: one notification of a batch's member that this version
    /// cannot read is kept for a person on its own and the digest goes on without it; a member
    /// that is no bundle at all is set aside whole.
    #[tokio::test]
    async fn an_unreadable_notification_in_a_window_member_is_set_aside_alone() {
        let (_server, q, conn) = queue().await;
        let w = window_rc();
        let good = job("k:1", notify_c());
        let bad = r#"{"firing":{"id":"f9","rule":"r","shape":"v2"},"action":"sms"}"#;
        let member = bundle::id(&good.id(), 2);
        let broken = "#3#f8:notify";
        redis::pipe()
            .cmd("HSET")
            .arg("kw:queue:jobs")
            .arg(&member)
            .arg(bundle::payload([good.payload().as_str(), bad].into_iter()))
            .arg(broken)
            .arg("[not json")
            .cmd("ZADD")
            .arg("kw:group:r:c")
            .arg(0)
            .arg(&member)
            .arg(0)
            .arg(broken)
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let taken = q.window_take(&w, 10).await.unwrap();
        let got: Vec<(String, Vec<Job>)> =
            taken.members.into_iter().map(|m| (m.id, m.jobs)).collect();
        assert_eq!(got, [(member.clone(), vec![good])]);
        let mut unreadable: Vec<String> = taken.unreadable.iter().map(|u| u.id.clone()).collect();
        unreadable.sort();
        let mut want = [broken.to_string(), format!("{member}@1")];
        want.sort();
        assert_eq!(unreadable, want);
        let kept: Option<String> = redis::cmd("HGET")
            .arg("kw:queue:unreadable")
            .arg(format!("{member}@1"))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(kept.as_deref(), Some(bad));
        assert_eq!(score(&conn, "kw:group:r:c", broken).await, None);
        assert!(score(&conn, "kw:group:r:c", &member).await.is_some());
    }

    fn good_id() -> String {
        job("k:1", Action::Exec).id()
    }
}
