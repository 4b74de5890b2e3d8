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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::keyspace::Conn;
use tokio::sync::{Notify, mpsc, oneshot};

/// Callers served by one pipeline at most, so one batch never becomes a huge command.
const MAX_BATCH: usize = 2048;

/// How long a batch of acknowledgements alone waits for more before it goes, while attempts
/// that will bring more are under way ([`Writer::attempting`]). In a storm's delivery requests
/// finish a few at a time, and sending each few at once made a transaction per handful of jobs:
/// half of the state server's calls. A request holds its target's permit until its
/// acknowledgement is in Redis (docs/reliability.md#guarantees), so the wait ends as soon as
/// nothing more is under way: lingering then would only hold the target's next requests back.
const ACK_LINGER: Duration = Duration::from_millis(2);

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
    /// Store the payload and score the job `due` (ms; a lease's end, half a millisecond past
    /// a whole one: `store::lease_end`).
    Put {
        id: String,
        payload: String,
        due: f64,
    },
    /// Remove the job (sent or dead-lettered).
    Done { id: String },
    /// A command of the caller's that must take effect with its jobs or not at all (the
    /// intake record of the event the jobs are for).
    Also(redis::Cmd),
    /// Mark job `index` of a bundle done (see [`super::bundle`]): a field of the bundle's mark
    /// hash, written in the batch's transaction beside a read of whether the bundle is still
    /// queued. A mark that found it gone (another instance took it over when this one lost its
    /// lease, and finished it) is removed again at once, so that it leaves nothing behind.
    Mark { bundle: Arc<str>, index: usize },
    /// Remove a finished bundle's marks (`key`).
    Unmark { key: String },
}

/// One caller's writes: they go out in one transaction, never split between two.
struct Request {
    ops: Vec<Op>,
    reply: oneshot::Sender<Result<(), WriteError>>,
}

impl Request {
    /// Whether it only records that jobs are finished (nothing waits to start on it).
    fn acknowledges(&self) -> bool {
        self.ops.iter().all(|o| match o {
            Op::Done { .. } | Op::Mark { .. } | Op::Unmark { .. } => true,
            Op::Put { .. } | Op::Also(_) => false,
        })
    }

    /// Whether it records any job finished.
    fn finishes(&self) -> bool {
        self.ops
            .iter()
            .any(|o| matches!(o, Op::Done { .. } | Op::Mark { .. }))
    }
}

#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Request>,
    under_way: Arc<UnderWay>,
}

/// How many attempts are under way whose acknowledgements will come to this writer.
#[derive(Default)]
struct UnderWay {
    n: AtomicUsize,
    /// Told when the last of them ends.
    none: Notify,
}

impl UnderWay {
    fn start(self: &Arc<Self>) -> Attempting {
        self.n.fetch_add(1, Ordering::AcqRel);
        Attempting(self.clone())
    }
}

/// One attempt under way whose acknowledgement will come to the writer: drop it when the
/// attempt is over, just before acknowledging.
pub struct Attempting(Arc<UnderWay>);

impl Drop for Attempting {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.none.notify_one();
        }
    }
}

impl Writer {
    /// Starts the writing task; it ends when the last clone of the writer is dropped.
    pub fn start(conn: Conn, prefix: &str) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        let under_way = Arc::new(UnderWay::default());
        tokio::spawn(run(conn, prefix.to_string(), rx, under_way.clone()));
        Writer { tx, under_way }
    }

    /// An attempt starts that will acknowledge its jobs here: while it is under way, a batch of
    /// acknowledgements waits for it (up to [`ACK_LINGER`]).
    pub fn attempting(&self) -> Attempting {
        self.under_way.start()
    }

    /// Stores jobs (id, payload, due) and runs `also` in the same transaction: the commands
    /// take effect with the jobs or not at all.
    pub async fn put_with(
        &self,
        jobs: Vec<(String, String, f64)>,
        also: Vec<redis::Cmd>,
    ) -> Result<(), WriteError> {
        let ops = jobs
            .into_iter()
            .map(|(id, payload, due)| Op::Put { id, payload, due })
            .chain(also.into_iter().map(Op::Also))
            .collect();
        self.send(ops).await
    }

    /// Removes a finished job, and runs `also` in the same transaction (a dead letter kept).
    pub async fn done(&self, id: String, also: &[redis::Cmd]) -> Result<(), WriteError> {
        self.send(with(vec![Op::Done { id }], also)).await
    }

    /// Marks job `index` of `bundle` done, with `also` (see [`Writer::done`]).
    pub async fn mark(
        &self,
        bundle: Arc<str>,
        index: usize,
        also: &[redis::Cmd],
    ) -> Result<(), WriteError> {
        self.send(with(vec![Op::Mark { bundle, index }], also))
            .await
    }

    /// Removes a bundle all of whose jobs are done, with its marks (`marks`, their key), and
    /// `also` (see [`Writer::done`]).
    pub async fn finish_bundle(
        &self,
        bundle: &str,
        marks: &str,
        also: &[redis::Cmd],
    ) -> Result<(), WriteError> {
        let ops = vec![
            Op::Done {
                id: bundle.to_string(),
            },
            Op::Unmark {
                key: marks.to_string(),
            },
        ];
        self.send(with(ops, also)).await
    }

    async fn send(&self, ops: Vec<Op>) -> Result<(), WriteError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request { ops, reply })
            .map_err(|_| WriteError::Stopped)?;
        answer.await.unwrap_or(Err(WriteError::Stopped))
    }
}

/// `ops` and then `also`, as one caller's writes.
fn with(mut ops: Vec<Op>, also: &[redis::Cmd]) -> Vec<Op> {
    ops.extend(also.iter().cloned().map(Op::Also));
    ops
}

async fn run(
    mut conn: Conn,
    prefix: String,
    mut rx: mpsc::UnboundedReceiver<Request>,
    under_way: Arc<UnderWay>,
) {
    let names = Names {
        zset: super::keys::queue(&prefix),
        jobs: super::keys::jobs(&prefix),
        takeovers: super::keys::takeovers(&prefix),
        prefix,
    };
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut apart = false;
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        // Its transactions on a connection of their own, not behind the detail reads and
        // removals of the firing stages (docs/performance.md#connections-of-their-own-42),
        // opened at the first write: a queue only read (the endpoint's gauges) opens none. Where
        // none can be opened then, the shared one serves as before.
        if !std::mem::replace(&mut apart, true) {
            match conn.apart().await {
                Ok(c) => conn = c,
                Err(e) => {
                    tracing::debug!(error = %e, "The queue's writer shares the state connection.")
                }
            }
        }
        if batch.iter().all(Request::acknowledges) {
            linger(&mut rx, &mut batch, &under_way).await;
        }
        // A drill's state Redis too loaded to take acknowledgements, see
        // docs/development.md#drills-killing-keywatch-at-an-exact-step-and-a-host-clock-that-is-off
        if let Some(delay) = crate::drill::ack_delay()
            && batch.iter().any(Request::finishes)
        {
            tokio::time::sleep(delay).await;
        }
        // The callers' commands are moved into the pipeline, not copied: a batch's history
        // entry alone is hundreds of kilobytes in a mass expiry.
        let ops = batch.iter_mut().flat_map(|r| std::mem::take(&mut r.ops));
        let (mut pipe, marked) = pipeline(&names, ops);
        // One transaction: a caller's jobs and its `Also` commands land together or not at
        // all (a crash cannot fall between them); Redis runs it as one command batch anyway.
        pipe.atomic();
        let mut result = pipe.query_async::<Vec<Option<f64>>>(&mut conn).await;
        if let Ok(queued) = &result {
            let late: Vec<String> = marked
                .iter()
                .zip(queued)
                .filter(|(_, score)| score.is_none())
                .map(|(bundle, _)| super::keys::bundle_done(&names.prefix, bundle))
                .collect();
            if !late.is_empty()
                && let Err(e) = redis::cmd("DEL").arg(late).exec_async(&mut conn).await
            {
                result = Err(e);
            }
        }
        let result = result
            .map(|_| ())
            .map_err(|e| WriteError::Redis(e.to_string()));
        for r in batch.drain(..) {
            let _ = r.reply.send(result.clone());
        }
    }
}

/// Adds to a batch of acknowledgements whatever else finishes within [`ACK_LINGER`], as long as
/// attempts that will acknowledge are under way: once none is, no more is coming soon.
async fn linger(
    rx: &mut mpsc::UnboundedReceiver<Request>,
    batch: &mut Vec<Request>,
    under_way: &UnderWay,
) {
    let until = tokio::time::Instant::now() + ACK_LINGER;
    while batch.len() < MAX_BATCH {
        // What came meanwhile goes with the batch, whether or not more is coming.
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        if batch.len() >= MAX_BATCH || under_way.n.load(Ordering::Acquire) == 0 {
            return;
        }
        let room = MAX_BATCH - batch.len();
        tokio::select! {
            n = rx.recv_many(batch, room) => {
                if n == 0 {
                    return;
                }
            }
            // `notify_one` keeps the wake-up when no one waits yet: the last attempt ending
            // after the count was read is not missed.
            _ = under_way.none.notified() => {}
            _ = tokio::time::sleep_until(until) => return,
        }
    }
}

/// The keys the writer writes to.
struct Names {
    prefix: String,
    zset: String,
    jobs: String,
    takeovers: String,
}

/// The batch as few commands as keep its order: each run of consecutive puts becomes one
/// `HSET` and one `ZADD`, each run of removals one `ZREM` and one `HDEL`, each run of marks one
/// `HSET` per bundle and a `ZSCORE` of the bundle; other commands go as they are, in their
/// place. Order matters only between writes of one job, which come from one caller that waits
/// for each: keeping runs in order keeps that. Returns the pipeline and, in order, the bundle
/// each of its answers (the `ZSCORE`s; every other command's answer is ignored) is about.
fn pipeline(names: &Names, ops: impl Iterator<Item = Op>) -> (redis::Pipeline, Vec<Arc<str>>) {
    let mut pipe = redis::pipe();
    let mut marked = Vec::new();
    let mut ops = ops.peekable();
    while let Some(first) = ops.next() {
        match first {
            Op::Put { .. } => {
                let mut hset = redis::cmd("HSET");
                let mut zadd = redis::cmd("ZADD");
                hset.arg(&names.jobs);
                zadd.arg(&names.zset);
                let mut add = |op: &Op| {
                    if let Op::Put { id, payload, due } = op {
                        hset.arg(id).arg(payload);
                        zadd.arg(*due).arg(id);
                    }
                };
                add(&first);
                while let Some(op) = ops.next_if(|o| matches!(o, Op::Put { .. })) {
                    add(&op);
                }
                pipe.add_command(hset).ignore();
                pipe.add_command(zadd).ignore();
            }
            Op::Also(cmd) => {
                pipe.add_command(cmd).ignore();
            }
            Op::Unmark { key } => {
                pipe.cmd("DEL").arg(key).ignore();
            }
            Op::Done { .. } => {
                let mut zrem = redis::cmd("ZREM");
                let mut hdel = redis::cmd("HDEL");
                let mut forget = redis::cmd("HDEL");
                zrem.arg(&names.zset);
                hdel.arg(&names.jobs);
                forget.arg(&names.takeovers);
                let mut add = |op: &Op| {
                    if let Op::Done { id } = op {
                        zrem.arg(id);
                        hdel.arg(id);
                        forget.arg(id);
                    }
                };
                add(&first);
                while let Some(op) = ops.next_if(|o| matches!(o, Op::Done { .. })) {
                    add(&op);
                }
                pipe.add_command(zrem).ignore();
                pipe.add_command(hdel).ignore();
                pipe.add_command(forget).ignore();
            }
            Op::Mark { .. } => {
                let mut by_bundle: BTreeMap<Arc<str>, Vec<usize>> = BTreeMap::new();
                let mut add = |op: Op| {
                    if let Op::Mark { bundle, index } = op {
                        by_bundle.entry(bundle).or_default().push(index);
                    }
                };
                add(first);
                while let Some(op) = ops.next_if(|o| matches!(o, Op::Mark { .. })) {
                    add(op);
                }
                for (bundle, indexes) in by_bundle {
                    let mut hset = redis::cmd("HSET");
                    hset.arg(super::keys::bundle_done(&names.prefix, &bundle));
                    for i in indexes {
                        hset.arg(i).arg("1");
                    }
                    pipe.add_command(hset).ignore();
                    pipe.cmd("ZSCORE").arg(&names.zset).arg(&*bundle);
                    marked.push(bundle);
                }
            }
        }
    }
    (pipe, marked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(id: &str) -> Op {
        Op::Put {
            id: id.into(),
            payload: format!("p{id}"),
            due: 7.0,
        }
    }

    fn done(id: &str) -> Op {
        Op::Done { id: id.into() }
    }

    /// The commands of a pipeline as text, one line each.
    fn commands(p: &redis::Pipeline) -> Vec<String> {
        p.cmd_iter().map(crate::keyspace::command_text).collect()
    }

    fn mark(bundle: &str, index: usize) -> Op {
        Op::Mark {
            bundle: bundle.into(),
            index,
        }
    }

    fn names() -> Names {
        Names {
            prefix: "kw:".into(),
            zset: "kw:queue".into(),
            jobs: "kw:queue:jobs".into(),
            takeovers: "kw:queue:takeovers".into(),
        }
    }

    /// An acknowledgement as a caller hands it to the writer.
    fn ack(id: &str) -> Request {
        let (reply, _) = oneshot::channel();
        Request {
            ops: vec![done(id)],
            reply,
        }
    }

    fn ids(batch: &[Request]) -> Vec<String> {
        batch
            .iter()
            .flat_map(|r| &r.ops)
            .map(|o| match o {
                Op::Done { id } => id.clone(),
                _ => unreachable!("acknowledgements only"),
            })
            .collect()
    }

    /// Lingers over a batch of `first` in a task of its own: the batch, and how long it took.
    fn lingering(
        mut rx: mpsc::UnboundedReceiver<Request>,
        first: &str,
        under_way: Arc<UnderWay>,
    ) -> tokio::task::JoinHandle<(Vec<String>, Duration)> {
        let mut batch = vec![ack(first)];
        tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            linger(&mut rx, &mut batch, &under_way).await;
            (ids(&batch), started.elapsed())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn acknowledgements_go_at_once_when_no_attempt_is_under_way() {
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(ack("b")).unwrap();
        let (batch, took) = lingering(rx, "a", Arc::default()).await.unwrap();
        assert_eq!(batch, ["a", "b"], "what had come already goes with them");
        assert_eq!(took, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn acknowledgements_wait_for_the_attempts_under_way_and_go_when_the_last_ends() {
        let under_way = Arc::new(UnderWay::default());
        let (first, second) = (under_way.start(), under_way.start());
        let (tx, rx) = mpsc::unbounded_channel();
        let lingered = lingering(rx, "a", under_way.clone());
        // Tokio's timer counts whole milliseconds: half the linger is one tick.
        let step = ACK_LINGER / 2;
        tokio::time::sleep(step).await;
        drop(first);
        tx.send(ack("b")).unwrap();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!lingered.is_finished(), "one attempt is still under way");
        drop(second);
        tx.send(ack("c")).unwrap();
        let (batch, took) = lingered.await.unwrap();
        assert_eq!(batch, ["a", "b", "c"]);
        assert_eq!(took, step, "gone when the last attempt ended");
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_does_not_end_holds_acknowledgements_back_for_the_linger_at_most() {
        let under_way = Arc::new(UnderWay::default());
        let _hung = under_way.start();
        let (_tx, rx) = mpsc::unbounded_channel();
        let (batch, took) = lingering(rx, "a", under_way).await.unwrap();
        assert_eq!(batch, ["a"]);
        assert_eq!(took, ACK_LINGER);
    }

    #[test]
    fn runs_of_one_kind_become_one_command_each_in_order() {
        let ops = [
            put("a"),
            put("b"),
            done("c"),
            done("d"),
            mark("#2#x", 1),
            mark("#3#y", 0),
            mark("#2#x", 0),
            put("c"),
            mark("#3#y", 2),
        ];
        let (p, marked) = pipeline(&names(), ops.into_iter());
        assert_eq!(
            commands(&p),
            [
                "HSET kw:queue:jobs a pa b pb",
                "ZADD kw:queue 7.0 a 7.0 b",
                "ZREM kw:queue c d",
                "HDEL kw:queue:jobs c d",
                "HDEL kw:queue:takeovers c d",
                "HSET kw:queue:done:#2#x 1 1 0 1",
                "ZSCORE kw:queue #2#x",
                "HSET kw:queue:done:#3#y 0 1",
                "ZSCORE kw:queue #3#y",
                "HSET kw:queue:jobs c pc",
                "ZADD kw:queue 7.0 c",
                "HSET kw:queue:done:#3#y 2 1",
                "ZSCORE kw:queue #3#y",
            ]
        );
        let marked: Vec<&str> = marked.iter().map(|b| &**b).collect();
        assert_eq!(marked, ["#2#x", "#3#y", "#3#y"], "one answer per ZSCORE");
    }
}
