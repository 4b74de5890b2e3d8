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

use std::time::Duration;

use crate::keyspace::Conn;

use crate::firing::Job;

mod writer;
pub use writer::WriteError;
use writer::Writer;

/// How long a taken job is someone's before it is due again. The instance renews the leases of
/// its jobs in flight every [`RENEW_EVERY`], so a long attempt keeps its job, and a job of an
/// instance that died comes due within this.
pub const LEASE: Duration = Duration::from_secs(15);
pub const RENEW_EVERY: Duration = Duration::from_secs(5);

// Takes up to ARGV[2] jobs due at ARGV[1] by moving them to ARGV[3] (the end of the lease).
const TAKE: &str = r"
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return {} end
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[3], id)
end
return redis.call('HMGET', KEYS[2], unpack(ids))
";

// Puts jobs (ARGV[4..] as id, payload pairs) into the window of KEYS[1] (its end) and KEYS[2]
// (its jobs), opening a window of ARGV[2] ms at ARGV[1] if none is open; KEYS[3] is the payload
// hash, KEYS[4] the list of windows and ARGV[3] this window's name in it. Returns the end.
const GROUP_PUT: &str = r"
local e = redis.call('GET', KEYS[1])
if not e then
  e = tonumber(ARGV[1]) + tonumber(ARGV[2])
  redis.call('SET', KEYS[1], e, 'PX', ARGV[2])
end
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], 'NX', e, ARGV[i])
end
redis.call('SADD', KEYS[4], ARGV[3])
return tonumber(e)
";

// Removes finished jobs (ARGV[2..]) of the window KEYS[1] and their payloads (KEYS[2]); an
// emptied window leaves the list of windows KEYS[3] (its name there is ARGV[1]).
const GROUP_DONE: &str = r"
for i = 2, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return 0
";

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
}

#[derive(Clone)]
pub struct Queue {
    conn: Conn,
    prefix: String,
    group_put: redis::Script,
    group_done: redis::Script,
    zset: String,
    jobs: String,
    take: redis::Script,
    /// New and finished jobs, group-committed.
    writer: Writer,
}

pub use crate::keyspace::clock::now_ms;

impl Queue {
    pub fn new(conn: Conn, prefix: &str) -> Queue {
        Queue {
            conn: conn.clone(),
            prefix: prefix.to_string(),
            group_put: redis::Script::new(GROUP_PUT),
            group_done: redis::Script::new(GROUP_DONE),
            zset: format!("{prefix}queue"),
            jobs: format!("{prefix}queue:jobs"),
            take: redis::Script::new(TAKE),
            writer: Writer::start(
                conn,
                format!("{prefix}queue"),
                format!("{prefix}queue:jobs"),
            ),
        }
    }

    /// Stores new jobs: `leased` ones this instance attempts now (leased to it), `pending` ones
    /// it has no room for (due now, for whichever instance has room first). One round trip at
    /// most, shared with whatever other jobs are being stored or finished at the same time.
    /// `also` runs in the same transaction (see [`Writer::put_with`]).
    pub async fn store(
        &self,
        leased: &[Job],
        pending: &[Job],
        also: Vec<redis::Cmd>,
    ) -> Result<(), WriteError> {
        if leased.is_empty() && pending.is_empty() && also.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let lease_end = now + LEASE.as_millis() as i64;
        let payload = |j: &Job| serde_json::to_string(j).unwrap_or_default();
        let writes = leased
            .iter()
            .map(|j| (j.id(), payload(j), lease_end))
            .chain(pending.iter().map(|j| (j.id(), payload(j), now)))
            .collect();
        self.writer.put_with(writes, also).await
    }

    /// The job is finished (sent, or dead-lettered); group-committed like [`Queue::put_leased`].
    pub async fn done(&self, id: &str) -> Result<(), WriteError> {
        self.writer.done(id.to_string()).await
    }

    /// The job's next attempt is due at `due_ms`, on whichever instance takes it.
    pub async fn reschedule(&self, job: &Job, due_ms: i64) -> redis::RedisResult<()> {
        let id = job.id();
        redis::pipe()
            .cmd("HSET")
            .arg(&self.jobs)
            .arg(&id)
            .arg(serde_json::to_string(job).unwrap_or_default())
            .ignore()
            .cmd("ZADD")
            .arg(&self.zset)
            .arg(due_ms)
            .arg(&id)
            .ignore()
            .exec_async(&mut self.conn.clone())
            .await
    }

    /// Takes up to `max` due jobs, leasing them to this instance.
    pub async fn take_due(&self, max: usize) -> redis::RedisResult<Vec<Job>> {
        self.take_from(&self.zset, max).await
    }

    async fn take_from(&self, zset: &str, max: usize) -> redis::RedisResult<Vec<Job>> {
        let now = now_ms();
        let payloads: Vec<Option<String>> = self
            .take
            .key(zset)
            .key(&self.jobs)
            .arg(now)
            .arg(max)
            .arg(now + LEASE.as_millis() as i64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(payloads
            .into_iter()
            .flatten()
            .filter_map(|p| serde_json::from_str(&p).ok())
            .collect())
    }

    /// Hands jobs back at shutdown: due now, for any instance.
    pub async fn hand_back(&self, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(&self.zset, ids, now_ms()).await
    }

    /// Extends the leases of jobs still being attempted (only those still in the queue).
    pub async fn renew(&self, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(&self.zset, ids, now_ms() + LEASE.as_millis() as i64)
            .await
    }

    /// Moves jobs still in `zset` to `due` (ms).
    async fn set_due(&self, zset: &str, ids: &[String], due: i64) -> redis::RedisResult<()> {
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
        format!("{}group:{}:{}", self.prefix, w.rule, w.channel)
    }

    fn windows_key(&self) -> String {
        format!("{}groups", self.prefix)
    }

    /// Puts notification jobs into the open window of `w`, opening one of `length` if none is
    /// open (the first event of a window starts it, for every instance alike); returns when
    /// the window ends (unix ms).
    pub async fn window_put(
        &self,
        w: &Window,
        length: Duration,
        jobs: &[Job],
    ) -> redis::RedisResult<i64> {
        let zset = self.window_zset(w);
        let mut inv = self.group_put.prepare_invoke();
        inv.key(format!("{zset}:window"))
            .key(&zset)
            .key(&self.jobs)
            .key(self.windows_key())
            .arg(now_ms())
            .arg(u64::try_from(length.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(w.member());
        for j in jobs {
            inv.arg(j.id())
                .arg(serde_json::to_string(j).unwrap_or_default());
        }
        inv.invoke_async(&mut self.conn.clone()).await
    }

    /// The windows that hold jobs.
    pub async fn windows(&self) -> redis::RedisResult<Vec<Window>> {
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.windows_key())
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(members
            .iter()
            .filter_map(|m| serde_json::from_str::<(String, String)>(m).ok())
            .map(|(rule, channel)| Window { rule, channel })
            .collect())
    }

    /// Takes up to `max` jobs of `w` whose window has ended (or whose retry is due), leased.
    pub async fn window_take(&self, w: &Window, max: usize) -> redis::RedisResult<Vec<Job>> {
        self.take_from(&self.window_zset(w), max).await
    }

    /// The digest of these jobs of `w` was sent or dead-lettered.
    pub async fn window_done(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        let mut inv = self.group_done.prepare_invoke();
        inv.key(self.window_zset(w))
            .key(&self.jobs)
            .key(self.windows_key())
            .arg(w.member())
            .arg(ids);
        inv.invoke_async(&mut self.conn.clone()).await
    }

    /// The digest of these jobs of `w` failed: they come due again at `due_ms` with their
    /// attempts counted, for whichever instance takes them.
    pub async fn window_retry(
        &self,
        w: &Window,
        jobs: &[Job],
        due_ms: i64,
    ) -> redis::RedisResult<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        let mut hset = redis::cmd("HSET");
        hset.arg(&self.jobs);
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(self.window_zset(w)).arg("XX");
        for j in jobs {
            hset.arg(j.id())
                .arg(serde_json::to_string(j).unwrap_or_default());
            zadd.arg(due_ms).arg(j.id());
        }
        redis::pipe()
            .add_command(hset)
            .ignore()
            .add_command(zadd)
            .ignore()
            .exec_async(&mut self.conn.clone())
            .await
    }

    /// Extends the leases of window jobs whose digest is being attempted.
    pub async fn window_renew(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(
            &self.window_zset(w),
            ids,
            now_ms() + LEASE.as_millis() as i64,
        )
        .await
    }

    /// Hands window jobs back at shutdown: due now.
    pub async fn window_hand_back(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(&self.window_zset(w), ids, now_ms()).await
    }

    /// Jobs waiting, being attempted or waiting for a retry: the queue's and those in digest
    /// windows (each notification waiting in a window is a job too, and a window holding
    /// thousands is a backlog as real as the queue's).
    pub async fn len(&self) -> redis::RedisResult<i64> {
        let windows = self.windows().await?;
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD").arg(&self.zset);
        for w in &windows {
            pipe.cmd("ZCARD").arg(self.window_zset(w));
        }
        let counts: Vec<i64> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(counts.iter().sum())
    }
}

crate::keyspace::commands::declare! {
    /// The commands the job queue and digest windows send, the writer's and the scripts' included
    /// ([`crate::keyspace::commands`]).
    const QUEUE = "job queue";
    const WINDOWS = "digest windows";
    const SCRIPTS = "job queue and digest windows (scripts)";
    [
        Use::new(Conn::State, "hset", QUEUE)
            .on(Keys::State("queue:jobs"), Access::Write)
            .args("{key} id job"),
        Use::new(Conn::State, "zadd", QUEUE)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} XX 0 id"),
        Use::new(Conn::State, "zrem", QUEUE)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} id"),
        Use::new(Conn::State, "hdel", QUEUE)
            .on(Keys::State("queue:jobs"), Access::ReadWrite)
            .args("{key} id"),
        // Storing jobs is one transaction with the intake records they move on.
        Use::new(Conn::State, "multi", QUEUE),
        Use::new(Conn::State, "exec", QUEUE),
        Use::new(Conn::State, "zcard", QUEUE)
            .on(Keys::State("queue"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "smembers", WINDOWS)
            .on(Keys::State("groups"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "script|load", SCRIPTS)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Conn::State, "evalsha", "job queue: take")
            .on(Keys::State("queue"), Access::ReadWrite)
            .args("{sha} 2 {prefix}queue {prefix}queue:jobs"),
        Use::new(Conn::State, "evalsha", WINDOWS)
            .on(Keys::State("group:*:*:window"), Access::ReadWrite)
            .args("{sha} 4 {key} {prefix}group:r:c {prefix}queue:jobs {prefix}groups"),
        Use::new(Conn::State, "zrange", SCRIPTS)
            .on(Keys::State("queue"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1"),
        Use::new(Conn::State, "hmget", SCRIPTS)
            .on(Keys::State("queue:jobs"), Access::Read)
            .args("{key} id"),
        Use::new(Conn::State, "get", SCRIPTS)
            .on(Keys::State("group:*:*:window"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "set", SCRIPTS)
            .on(Keys::State("group:*:*:window"), Access::Write)
            .args("{key} 0 PX 1000"),
        Use::new(Conn::State, "zadd", SCRIPTS)
            .on(Keys::State("group:*:*"), Access::Write)
            .args("{key} NX 0 id"),
        Use::new(Conn::State, "sadd", SCRIPTS)
            .on(Keys::State("groups"), Access::Write)
            .args("{key} w"),
        Use::new(Conn::State, "srem", SCRIPTS)
            .on(Keys::State("groups"), Access::Write)
            .args("{key} w"),

    ]
}
