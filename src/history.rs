//! History: every firing and what became of each of its actions, kept in Redis by whichever
//! instance did the work, so that `keywatch history`, `GET /api/history` and the status page
//! answer "did the alert for order 42 go out, and what did DingTalk answer?" after a restart
//! and for every instance.
//!
//! Layout under `state.prefix`: a sorted set `history` (member = event id, score = when it was
//! observed, ms) and one hash per firing, `history:ID`, whose field `event` is the event JSON of
//! SPEC §4 and whose fields `a:ACTION` (`a:reload`, `a:notify:oncall`) are that action's latest
//! outcome. Memory is bounded twice: each hash expires `history.keep` after it was written, and
//! the index is trimmed by time and to [`MAX_FIRINGS`] entries (the trimmed hashes unlinked).
//!
//! Recording never holds up delivery: the pipeline hands entries to a bounded channel, and one
//! writer task per instance stores them in batches. When Redis cannot keep up the entries that
//! do not fit are counted and logged, never queued without bound; history is a record, the
//! queue (not this) is what guarantees the actions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::firing::{Action, Firing, rfc3339};
use crate::keyspace::{Conn, clock};
use crate::outcome::{CANCELLED, Outcome};
use crate::pattern::Pattern;

/// The most firings kept, whatever `keep` says: a storm of a million expiries must not keep a
/// million hashes for a week.
pub const MAX_FIRINGS: usize = 100_000;

/// Entries waiting for the writer; beyond this they are counted as lost to history.
const BACKLOG: usize = 16 * 1024;

/// Entries the writer stores in one round trip.
const BATCH: usize = 512;

/// The outcome of one action of one firing, as `history --json` prints it (SPEC §1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionRecord {
    /// `reload`, `exec`, `cleanup` or `notify`.
    pub action: String,
    /// The channel of a notification.
    pub channel: Option<String>,
    /// `sent`, `retrying`, `dead` or `skipped`.
    pub outcome: String,
    pub attempts: u32,
    /// The last failure, secrets masked; `null` once sent.
    pub last_error: Option<String>,
    /// When this outcome was recorded (RFC 3339).
    pub at: String,
}

/// One firing with its actions' outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The event JSON of SPEC §4.
    pub event: serde_json::Value,
    pub actions: Vec<ActionRecord>,
}

impl Record {
    /// The event JSON plus `"actions"`: one line of `history --json` and `/api/history`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = self.event.clone();
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "actions".into(),
                serde_json::to_value(&self.actions).unwrap_or_default(),
            );
        }
        v
    }

    pub fn str_field(&self, name: &str) -> &str {
        self.event.get(name).and_then(|v| v.as_str()).unwrap_or("")
    }
}

/// Which firings to list.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only keys this pattern (SPEC §3) matches.
    pub key: Option<Pattern>,
    pub rule: Option<String>,
    /// Only firings observed this long ago or later.
    pub since: Option<Duration>,
    pub limit: usize,
}

/// Where a firing's hash is.
fn record_key(prefix: &str, id: &str) -> String {
    format!("{prefix}history:{id}")
}

fn index_key(prefix: &str) -> String {
    format!("{prefix}history")
}

/// The hash field of an action: `a:reload`, `a:notify:oncall`.
fn action_field(action: &Action) -> String {
    match action.channel() {
        Some(channel) => format!("a:{}:{channel}", action.name()),
        None => format!("a:{}", action.name()),
    }
}

fn channel_of(action: &Action) -> Option<String> {
    action.channel().map(str::to_string)
}

enum Entry {
    Firing {
        id: String,
        at_ms: i64,
        event: String,
    },
    Action {
        id: String,
        field: String,
        record: ActionRecord,
    },
}

/// The pipeline's handle on history: cheap to clone, never blocks.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::Sender<Entry>,
    lost: Arc<AtomicU64>,
}

impl Recorder {
    /// Starts the writer storing under `prefix`, keeping firings `keep`. It stores what is left
    /// and ends once `stop` is cancelled; await the handle to be sure it did.
    pub fn spawn(
        conn: Conn,
        prefix: &str,
        keep: Duration,
        stop: CancellationToken,
    ) -> (Recorder, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(BACKLOG);
        let writer = Writer {
            conn,
            prefix: prefix.to_string(),
            keep_ms: keep.as_millis().min(i64::MAX as u128) as i64,
        };
        let handle = tokio::spawn(writer.run(rx, stop));
        let lost = Arc::new(AtomicU64::new(0));
        (Recorder { tx, lost }, handle)
    }

    fn send(&self, e: Entry) {
        if self.tx.try_send(e).is_err() {
            // Logged at the first loss and then every thousandth, not once per entry.
            let n = self.lost.fetch_add(1, Ordering::Relaxed);
            if n.is_multiple_of(1000) {
                tracing::warn!(
                    lost = n + 1,
                    "History cannot keep up with the firings (or Redis is unreachable); some are not recorded. The actions themselves are unaffected."
                );
            }
        }
    }

    /// A firing whose jobs are stored.
    pub fn firing(&self, f: &Firing) {
        self.firing_json(f, f.to_json());
    }

    /// A firing with an event JSON of its own (a follow-up adds `"followup"`).
    pub fn firing_json(&self, f: &Firing, event: serde_json::Value) {
        self.send(Entry::Firing {
            id: f.id.clone(),
            at_ms: f.observed_at.timestamp_millis(),
            event: event.to_string(),
        });
    }

    /// One attempt of `action` of the firing `id`, the `attempts`-th, ended with `outcome`.
    pub fn attempt(&self, id: &str, action: &Action, outcome: &Outcome, attempts: u32) {
        let (label, error) = match outcome {
            // A follow-up that had nothing to do (see `action::followup`).
            Outcome::Sent(t) if t.starts_with(CANCELLED) => ("skipped", Some(t.clone())),
            Outcome::Sent(_) => ("sent", None),
            Outcome::Retry { reason, .. } => ("retrying", Some(reason.clone())),
            Outcome::Failed(reason) => ("dead", Some(reason.clone())),
        };
        self.action(id, action, label, attempts, error);
    }

    /// `action` of the firing `id` was given up (a dead letter) for `reason`.
    pub fn dead(&self, id: &str, action: &Action, reason: &str) {
        // 0: the writer keeps the attempts already recorded.
        self.action(id, action, "dead", 0, Some(reason.to_string()));
    }

    /// A firing that does not run its actions (silenced, or a recovery its rule skips): kept
    /// with each action `skipped` and why.
    pub fn skipped(&self, f: &Firing, actions: &[Action], why: &str) {
        self.firing(f);
        for a in actions {
            self.action(&f.id, a, "skipped", 0, Some(why.to_string()));
        }
    }

    fn action(
        &self,
        id: &str,
        action: &Action,
        outcome: &str,
        attempts: u32,
        error: Option<String>,
    ) {
        self.send(Entry::Action {
            id: id.to_string(),
            field: action_field(action),
            record: ActionRecord {
                action: action.name().to_string(),
                channel: channel_of(action),
                outcome: outcome.to_string(),
                attempts,
                last_error: error,
                at: rfc3339(clock::now()),
            },
        });
    }
}

struct Writer {
    conn: Conn,
    prefix: String,
    keep_ms: i64,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Entry>, stop: CancellationToken) {
        loop {
            let first = tokio::select! {
                e = rx.recv() => e,
                _ = stop.cancelled() => None,
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) => break,
                }
            }
            self.store(batch).await;
        }
        // Stopping: what was handed over before the stop is still stored.
        let mut rest = Vec::new();
        while let Ok(e) = rx.try_recv() {
            rest.push(e);
        }
        while !rest.is_empty() {
            let chunk: Vec<Entry> = rest.drain(..rest.len().min(BATCH)).collect();
            self.store(chunk).await;
        }
    }

    async fn store(&mut self, batch: Vec<Entry>) {
        if let Err(e) = self.try_store(&batch).await {
            tracing::warn!(error = %e, entries = batch.len(), "Cannot record history; these entries are not kept (the actions are unaffected).");
        }
    }

    async fn try_store(&mut self, batch: &[Entry]) -> redis::RedisResult<()> {
        let index = index_key(&self.prefix);
        // A dead letter keeps the attempts already counted: read them first.
        let mut known: std::collections::HashMap<(String, String), u32> = Default::default();
        let dead: Vec<(&str, &str)> = batch
            .iter()
            .filter_map(|e| match e {
                Entry::Action { id, field, record }
                    if record.attempts == 0 && record.outcome == "dead" =>
                {
                    Some((id.as_str(), field.as_str()))
                }
                _ => None,
            })
            .collect();
        if !dead.is_empty() {
            let mut p = redis::pipe();
            for (id, field) in &dead {
                p.add_command(hget(&record_key(&self.prefix, id), field));
            }
            let old: Vec<Option<String>> = p.query_async(&mut self.conn).await?;
            for ((id, field), old) in dead.iter().zip(old) {
                if let Some(a) = old.and_then(|o| serde_json::from_str::<ActionRecord>(&o).ok()) {
                    known.insert((id.to_string(), field.to_string()), a.attempts);
                }
            }
        }
        let now = clock::now_ms();
        let mut p = redis::pipe();
        let mut firings = 0;
        // One `HSET` (and one `PEXPIRE`) per firing's hash and one `ZADD` of every new firing,
        // however many entries of the batch they hold: in a storm each firing comes with its
        // outcomes, and a command per entry was most of what history cost Redis.
        let mut index_add = redis::cmd("ZADD");
        index_add.arg(&index);
        let mut hashes: Vec<(String, redis::Cmd)> = Vec::new();
        let mut at: std::collections::HashMap<String, usize> = Default::default();
        let prefix = self.prefix.clone();
        let mut hset = |id: &str, field: &str, value: &str| {
            let key = record_key(&prefix, id);
            let i = *at.entry(key.clone()).or_insert_with(|| {
                let mut c = redis::cmd("HSET");
                c.arg(&key);
                hashes.push((key, c));
                hashes.len() - 1
            });
            hashes[i].1.arg(field).arg(value);
        };
        for e in batch {
            match e {
                Entry::Firing { id, at_ms, event } => {
                    firings += 1;
                    index_add.arg(*at_ms).arg(id);
                    hset(id, "event", event);
                }
                Entry::Action { id, field, record } => {
                    let mut record = record.clone();
                    let at = (id.clone(), field.clone());
                    if record.attempts == 0 {
                        record.attempts = known.get(&at).copied().unwrap_or(0);
                    } else {
                        // A dead letter later in this batch keeps these attempts.
                        known.insert(at, record.attempts);
                    }
                    let json = serde_json::to_string(&record).unwrap_or_default();
                    hset(id, field, &json);
                }
            }
        }
        for (key, hset) in hashes {
            p.add_command(hset).ignore();
            p.add_command(pexpire(&key, self.keep_ms)).ignore();
        }
        if firings > 0 {
            p.add_command(index_add).ignore();
        }
        if firings > 0 {
            let mut trim = redis::cmd("ZREMRANGEBYSCORE");
            trim.arg(&index)
                .arg("-inf")
                .arg(format!("({}", now - self.keep_ms));
            p.add_command(trim).ignore();
            let mut card = redis::cmd("ZCARD");
            card.arg(&index);
            p.add_command(card);
            let (count,): (usize,) = p.query_async(&mut self.conn).await?;
            if count > MAX_FIRINGS {
                self.trim_count(count - MAX_FIRINGS).await?;
            }
        } else {
            let _: () = p.query_async(&mut self.conn).await?;
        }
        Ok(())
    }

    /// Drops the `excess` oldest firings and their hashes.
    async fn trim_count(&mut self, excess: usize) -> redis::RedisResult<()> {
        let index = index_key(&self.prefix);
        let mut range = redis::cmd("ZRANGE");
        range.arg(&index).arg(0).arg(excess as i64 - 1);
        let ids: Vec<String> = range.query_async(&mut self.conn).await?;
        if ids.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        let mut unlink = redis::cmd("UNLINK");
        for id in &ids {
            unlink.arg(record_key(&self.prefix, id));
        }
        p.add_command(unlink).ignore();
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(&index).arg(&ids);
        p.add_command(zrem).ignore();
        p.query_async(&mut self.conn).await
    }
}

fn hget(key: &str, field: &str) -> redis::Cmd {
    let mut c = redis::cmd("HGET");
    c.arg(key).arg(field);
    c
}

fn pexpire(key: &str, ms: i64) -> redis::Cmd {
    let mut c = redis::cmd("PEXPIRE");
    c.arg(key).arg(ms.max(1));
    c
}

/// The firings `filter` selects, newest first, read from what every instance recorded.
pub async fn list(
    conn: &mut Conn,
    prefix: &str,
    filter: &Filter,
) -> redis::RedisResult<Vec<Record>> {
    const PAGE: usize = 256;
    let index = index_key(prefix);
    let min = match filter.since {
        Some(d) => (clock::now_ms() - d.as_millis() as i64).to_string(),
        None => "-inf".to_string(),
    };
    let mut out = Vec::new();
    let mut offset = 0;
    while out.len() < filter.limit {
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(&index)
            .arg("+inf")
            .arg(&min)
            .arg("BYSCORE")
            .arg("REV")
            .arg("LIMIT")
            .arg(offset)
            .arg(PAGE);
        let ids: Vec<String> = range.query_async(conn).await?;
        if ids.is_empty() {
            break;
        }
        offset += ids.len();
        let mut p = redis::pipe();
        for id in &ids {
            let mut c = redis::cmd("HGETALL");
            c.arg(record_key(prefix, id));
            p.add_command(c);
        }
        let hashes: Vec<Vec<(String, String)>> = p.query_async(conn).await?;
        for fields in hashes {
            let Some(r) = parse_record(fields) else {
                continue;
            };
            if filter
                .rule
                .as_deref()
                .is_some_and(|rule| r.str_field("rule") != rule)
            {
                continue;
            }
            if let Some(p) = &filter.key
                && !p.is_match(r.str_field("key").as_bytes())
            {
                continue;
            }
            out.push(r);
            if out.len() == filter.limit {
                break;
            }
        }
    }
    Ok(out)
}

/// A firing's hash as a record; `None` when only outcomes are left of it (its event was
/// trimmed, or its writer has not stored it yet).
fn parse_record(fields: Vec<(String, String)>) -> Option<Record> {
    let mut event = None;
    let mut actions = Vec::new();
    for (name, value) in fields {
        if name == "event" {
            event = serde_json::from_str(&value).ok();
        } else if name.starts_with("a:")
            && let Ok(a) = serde_json::from_str::<ActionRecord>(&value)
        {
            actions.push(a);
        }
    }
    actions.sort_by_key(|a| {
        let order = match a.action.as_str() {
            "reload" => 0,
            "exec" => 1,
            "cleanup" => 2,
            "notify" => 3,
            _ => 4,
        };
        (order, a.channel.clone())
    });
    Some(Record {
        event: event?,
        actions,
    })
}

crate::keyspace::commands::declare! {
    /// The commands history sends ([`crate::keyspace::commands`]).
    const WHY = "history of firings and outcomes";
    [
        Use::new(Conn::State, "zadd", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} 0 id"),
        Use::new(Conn::State, "hset", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} event json"),
        Use::new(Conn::State, "hget", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key} event"),
        Use::new(Conn::State, "pexpire", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} 1000"),
        Use::new(Conn::State, "zremrangebyscore", WHY)
            .on(Keys::State("history"), Access::ReadWrite)
            .args("{key} -inf 0"),
        Use::new(Conn::State, "zcard", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "zrange", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} 0 0"),
        Use::new(Conn::State, "unlink", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key}"),
        Use::new(Conn::State, "zrem", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} id"),
        Use::new(Conn::State, "hgetall", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_the_event_json_plus_its_actions_in_spec_order() {
        let a = |action: &str, channel: Option<&str>| {
            serde_json::to_string(&ActionRecord {
                action: action.into(),
                channel: channel.map(Into::into),
                outcome: "sent".into(),
                attempts: 1,
                last_error: None,
                at: "2026-11-29T10:15:00.000Z".into(),
            })
            .unwrap()
        };
        let r = parse_record(vec![
            ("a:notify:oncall".into(), a("notify", Some("oncall"))),
            (
                "event".into(),
                r#"{"id": "x", "rule": "r", "key": "k"}"#.into(),
            ),
            ("a:reload".into(), a("reload", None)),
        ])
        .unwrap();
        let j = r.to_json();
        assert_eq!(j["id"], "x");
        assert_eq!(j["actions"][0]["action"], "reload");
        assert_eq!(j["actions"][1]["channel"], "oncall");
        assert_eq!(j["actions"][1]["last_error"], serde_json::Value::Null);
        assert!(parse_record(vec![("a:reload".into(), a("reload", None))]).is_none());
    }
}
