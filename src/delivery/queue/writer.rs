//! Group commit for the queue's hot writes: storing new jobs and removing finished ones.
//!
//! Every job is stored before its first attempt and removed after its last, so a mass expiry
//! of 100,000 tasks owes Redis 200,000 writes. Sent one by one, each costs a round trip and a
//! command dispatch of its own; here every caller hands its write to one task that sends
//! whatever has piled up meanwhile as a single pipeline of multi-key commands (`HSET` with many
//! fields, one `ZADD` of many members, one `ZREM`, one `HDEL`), and answers every caller once
//! Redis has answered. A caller still waits for its own write — a job is stored before its
//! first attempt and acknowledged only after success — but under load one round trip serves
//! hundreds of jobs, and when idle a write goes out at once (no timer adds latency).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::keyspace::Conn;
use tokio::sync::{mpsc, oneshot};

/// Callers served by one pipeline at most, so one batch never becomes a huge command.
const MAX_BATCH: usize = 2048;

/// Why a write did not reach Redis.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    #[error("Redis: {0}")]
    Redis(String),
    #[error("the queue writer has stopped")]
    Stopped,
}

/// One write of one job.
enum Op {
    /// Store the payload and lease the job until `due` (ms).
    Put {
        id: String,
        payload: String,
        due: i64,
    },
    /// Remove the job (sent or dead-lettered).
    Done { id: String },
    /// A command of the caller's that must take effect with its jobs or not at all (the
    /// intake record of the event the jobs are for).
    Also(redis::Cmd),
    /// Mark job `index` of a bundle done (see [`super::bundle`]). Marks go out after the
    /// batch's transaction, in one script call: a mark is written only while its bundle is
    /// still queued, so a late mark of a bundle another instance finished leaves nothing behind.
    Mark { bundle: Arc<str>, index: usize },
}

// Sets completion marks: KEYS[1] is the queue, KEYS[2..] the bundles' mark hashes; ARGV holds,
// per bundle in the order of KEYS, its member, how many marks, and their indexes.
const MARK: &str = r"
local a = 1
for k = 2, #KEYS do
  local n = tonumber(ARGV[a + 1])
  if redis.call('ZSCORE', KEYS[1], ARGV[a]) then
    local f = {}
    for i = a + 2, a + 1 + n do
      f[#f + 1] = ARGV[i]
      f[#f + 1] = '1'
    end
    redis.call('HSET', KEYS[k], unpack(f))
  end
  a = a + 2 + n
end
return 0
";

/// One caller's writes: they go out in one transaction, never split between two.
struct Request {
    ops: Vec<Op>,
    reply: oneshot::Sender<Result<(), WriteError>>,
}

#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Request>,
}

impl Writer {
    /// Starts the writing task; it ends when the last clone of the writer is dropped.
    pub fn start(conn: Conn, prefix: &str) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(conn, prefix.to_string(), rx));
        Writer { tx }
    }

    /// Stores jobs (id, payload, due) and runs `also` in the same transaction: the commands
    /// take effect with the jobs or not at all.
    pub async fn put_with(
        &self,
        jobs: Vec<(String, String, i64)>,
        also: Vec<redis::Cmd>,
    ) -> Result<(), WriteError> {
        let ops = jobs
            .into_iter()
            .map(|(id, payload, due)| Op::Put { id, payload, due })
            .chain(also.into_iter().map(Op::Also))
            .collect();
        self.send(ops).await
    }

    pub async fn done(&self, id: String) -> Result<(), WriteError> {
        self.send(vec![Op::Done { id }]).await
    }

    /// Marks job `index` of `bundle` done.
    pub async fn mark(&self, bundle: Arc<str>, index: usize) -> Result<(), WriteError> {
        self.send(vec![Op::Mark { bundle, index }]).await
    }

    /// Removes a bundle all of whose jobs are done, with its marks (`marks`, their key).
    pub async fn finish_bundle(&self, bundle: &str, marks: &str) -> Result<(), WriteError> {
        let mut del = redis::cmd("DEL");
        del.arg(marks);
        self.send(vec![
            Op::Done {
                id: bundle.to_string(),
            },
            Op::Also(del),
        ])
        .await
    }

    async fn send(&self, ops: Vec<Op>) -> Result<(), WriteError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request { ops, reply })
            .map_err(|_| WriteError::Stopped)?;
        answer.await.unwrap_or(Err(WriteError::Stopped))
    }
}

async fn run(mut conn: Conn, prefix: String, mut rx: mpsc::UnboundedReceiver<Request>) {
    let zset = format!("{prefix}queue");
    let jobs = format!("{prefix}queue:jobs");
    let mark = redis::Script::new(MARK);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let ops = || batch.iter().flat_map(|r: &Request| &r.ops);
        let mut result = Ok(());
        if ops().any(|o| !matches!(o, Op::Mark { .. })) {
            let mut pipe = pipeline(
                &zset,
                &jobs,
                ops().filter(|o| !matches!(o, Op::Mark { .. })),
            );
            // One transaction: a caller's jobs and its `Also` commands land together or not at
            // all (a crash cannot fall between them); Redis runs it as one command batch anyway.
            pipe.atomic();
            result = pipe.exec_async(&mut conn).await;
        }
        if result.is_ok()
            && let Some(inv) = marks(&mark, &zset, &prefix, ops())
        {
            result = inv.invoke_async::<()>(&mut conn).await;
        }
        let result = result.map_err(|e| WriteError::Redis(e.to_string()));
        for r in batch.drain(..) {
            let _ = r.reply.send(result.clone());
        }
    }
}

/// The batch's completion marks as one call of [`MARK`], grouped by bundle; `None` without any.
fn marks<'a>(
    script: &'a redis::Script,
    zset: &str,
    prefix: &str,
    ops: impl Iterator<Item = &'a Op>,
) -> Option<redis::ScriptInvocation<'a>> {
    let mut by_bundle: BTreeMap<&Arc<str>, Vec<usize>> = BTreeMap::new();
    for op in ops {
        if let Op::Mark { bundle, index } = op {
            by_bundle.entry(bundle).or_default().push(*index);
        }
    }
    if by_bundle.is_empty() {
        return None;
    }
    let mut inv = script.prepare_invoke();
    inv.key(zset);
    for (bundle, indexes) in &by_bundle {
        inv.key(super::bundle::done_key(prefix, bundle));
        inv.arg(&***bundle).arg(indexes.len()).arg(indexes);
    }
    Some(inv)
}

/// The batch as few commands as keep its order: each run of consecutive puts becomes one
/// `HSET` and one `ZADD`, each run of removals one `ZREM` and one `HDEL`; other commands go
/// as they are, in their place. Order matters only
/// between writes of one job, which come from one caller that waits for each: keeping runs in
/// order keeps that.
fn pipeline<'a>(zset: &str, jobs: &str, ops: impl Iterator<Item = &'a Op>) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    let mut ops = ops.peekable();
    while let Some(first) = ops.next() {
        match first {
            Op::Put { .. } => {
                let mut hset = redis::cmd("HSET");
                let mut zadd = redis::cmd("ZADD");
                hset.arg(jobs);
                zadd.arg(zset);
                let mut add = |op: &Op| {
                    if let Op::Put { id, payload, due } = op {
                        hset.arg(id).arg(payload);
                        zadd.arg(*due).arg(id);
                    }
                };
                add(first);
                while let Some(op) = ops.next_if(|o| matches!(o, Op::Put { .. })) {
                    add(op);
                }
                pipe.add_command(hset).ignore();
                pipe.add_command(zadd).ignore();
            }
            Op::Also(cmd) => {
                pipe.add_command(cmd.clone()).ignore();
            }
            Op::Done { .. } => {
                let mut zrem = redis::cmd("ZREM");
                let mut hdel = redis::cmd("HDEL");
                zrem.arg(zset);
                hdel.arg(jobs);
                let mut add = |op: &Op| {
                    if let Op::Done { id } = op {
                        zrem.arg(id);
                        hdel.arg(id);
                    }
                };
                add(first);
                while let Some(op) = ops.next_if(|o| matches!(o, Op::Done { .. })) {
                    add(op);
                }
                pipe.add_command(zrem).ignore();
                pipe.add_command(hdel).ignore();
            }
            // Sent apart, after the transaction (see `run`).
            Op::Mark { .. } => {}
        }
    }
    pipe
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(id: &str) -> Op {
        Op::Put {
            id: id.into(),
            payload: format!("p{id}"),
            due: 7,
        }
    }

    fn done(id: &str) -> Op {
        Op::Done { id: id.into() }
    }

    /// The commands of a pipeline as text, one line each.
    fn commands(p: &redis::Pipeline) -> Vec<String> {
        p.cmd_iter().map(crate::keyspace::command_text).collect()
    }

    #[test]
    fn runs_of_one_kind_become_one_command_each_in_order() {
        let ops = [put("a"), put("b"), done("c"), done("d"), put("c")];
        let p = pipeline("q", "q:jobs", ops.iter());
        assert_eq!(
            commands(&p),
            [
                "HSET q:jobs a pa b pb",
                "ZADD q 7 a 7 b",
                "ZREM q c d",
                "HDEL q:jobs c d",
                "HSET q:jobs c pc",
                "ZADD q 7 c",
            ]
        );
    }
}
