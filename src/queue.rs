//! The durable work queue: every action job lives in Redis until it succeeded or was
//! dead-lettered, so a job being retried survives a restart, and the jobs of an instance that
//! dies are picked up by the others when their lease runs out.
//!
//! A sorted set (`{prefix}queue`, score = when the job is due, ms) and a hash of payloads
//! (`{prefix}queue:jobs`). An instance takes due jobs by moving their score a lease into the
//! future (atomically, so two instances never take the same job), and on the outcome removes
//! the job (done), or moves it to its next attempt. A job taken by an instance that dies comes
//! due again when its lease ends.

use std::time::Duration;

use crate::keyspace::Conn;
use serde::{Deserialize, Serialize};

use crate::job::{Action, Firing};

mod writer;
pub use writer::WriteError;
use writer::Writer;

/// How long a taken job is someone's before it is due again. The instance renews the leases of
/// its jobs in flight every [`RENEW_EVERY`], so a long attempt keeps its job, and a job of an
/// instance that died comes due within this.
pub const LEASE: Duration = Duration::from_secs(15);
pub const RENEW_EVERY: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub firing: Firing,
    pub action: Action,
    /// Attempts made so far.
    pub attempt: u32,
    /// When the first attempt failed (unix ms), for the 24 h retry window.
    pub failing_since: Option<i64>,
}

impl Job {
    pub fn id(&self) -> String {
        self.action.idempotency_key(&self.firing.id)
    }
}

// Takes up to ARGV[2] jobs due at ARGV[1] by moving them to ARGV[3] (the end of the lease).
const TAKE: &str = r"
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return {} end
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[3], id)
end
return redis.call('HMGET', KEYS[2], unpack(ids))
";

#[derive(Clone)]
pub struct Queue {
    conn: Conn,
    zset: String,
    jobs: String,
    take: redis::Script,
    /// New and finished jobs, group-committed.
    writer: Writer,
}

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

impl Queue {
    pub fn new(conn: Conn, prefix: &str) -> Queue {
        Queue {
            conn: conn.clone(),
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

    /// Stores jobs this instance is about to attempt (leased to it). Shares one round trip
    /// with whatever other jobs are being stored or finished at the same time.
    pub async fn put_leased(&self, jobs: &[Job]) -> Result<(), WriteError> {
        if jobs.is_empty() {
            return Ok(());
        }
        let due = now_ms() + LEASE.as_millis() as i64;
        let payloads = jobs
            .iter()
            .map(|j| (j.id(), serde_json::to_string(j).unwrap_or_default()))
            .collect();
        self.writer.put_all(payloads, due).await
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
        let now = now_ms();
        let payloads: Vec<Option<String>> = self
            .take
            .key(&self.zset)
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
        if ids.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("ZADD")
                .arg(&self.zset)
                .arg("XX")
                .arg(now)
                .arg(id)
                .ignore();
        }
        p.exec_async(&mut self.conn.clone()).await
    }

    /// Extends the leases of jobs still being attempted (only those still in the queue).
    pub async fn renew(&self, ids: &[String]) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let due = now_ms() + LEASE.as_millis() as i64;
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("ZADD")
                .arg(&self.zset)
                .arg("XX")
                .arg(due)
                .arg(id)
                .ignore();
        }
        p.exec_async(&mut self.conn.clone()).await
    }

    /// Jobs waiting, being attempted or waiting for a retry.
    pub async fn len(&self) -> redis::RedisResult<i64> {
        redis::cmd("ZCARD")
            .arg(&self.zset)
            .query_async(&mut self.conn.clone())
            .await
    }
}
