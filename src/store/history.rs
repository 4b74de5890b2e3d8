//! History: every firing and what became of each of its actions, kept in Redis by whichever
//! instance did the work, so that `keywatch history`, `GET /api/history` and the status page
//! answer "did the alert for order 42 go out, and what did DingTalk answer?" after a restart
//! and for every instance.
//!
//! Layout under `state.prefix`: a sorted set `history` (member = event id, score = when it was
//! observed, ms) and one hash per minute of observation, `history:@MINUTE` (the observed ms
//! divided by 60,000), holding for each firing of that minute the field `ID`: a line naming its
//! actions' fields (a JSON array: `a:reload`, `a:notify:oncall`, its follow-ups' `a:escalate:…`
//! too), then the event JSON of docs/rules.md#event-json; and one field `ID:a:…` per action, its latest outcome. One hash per minute rather than per firing, written with plain `HSET`s
//! of many fields: in a storm a key of its own, created and given a TTL per firing and again
//! per outcome, was a quarter of what the state server spent. Memory is bounded twice: each
//! minute's hash lasts `history.keep` after the latest firing in it, and the index is trimmed by
//! time and to [`MAX_FIRINGS`] entries (the trimmed firings' fields removed).
//!
//! A firing whose jobs are stored is kept in history by the same transaction
//! ([`Recorder::firing_cmds`]): whichever instance runs its actions, and whenever the one that
//! stored them dies, their outcomes have their firing to be shown with. The rest of recording
//! never holds up delivery: the pipeline hands outcomes to a bounded channel, and one writer
//! task per instance stores them in batches. When Redis cannot keep up the entries that
//! do not fit are counted and logged, never queued without bound; history is a record, the
//! queue (not this) is what guarantees the actions.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::firing::{Action, Firing, rfc3339};
use crate::keyspace::{Conn, clock};
use crate::outcome::Outcome;
use crate::pattern::Pattern;

/// The most firings kept, whatever `keep` says: a storm of a million expiries must not keep a
/// million hashes for a week.
pub const MAX_FIRINGS: usize = 100_000;

/// Entries waiting for the writer; beyond this they are counted as lost to history.
const BACKLOG: usize = 16 * 1024;

/// Entries the writer stores in one round trip.
const BATCH: usize = 512;

/// Longest the writer waits for more entries to store with the first one.
const LINGER: Duration = Duration::from_millis(20);

/// The outcome of one action of one firing, as `history --json` prints it (docs/commands.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionRecord {
    /// `reload`, `exec`, `cleanup` or `notify`.
    pub action: String,
    /// The channel of a notification.
    pub channel: Option<String>,
    /// Of an alertmanager channel's alert: which of its `urls` (from 0), each its own target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<u32>,
    /// `sent`, `retrying`, `dead`, `skipped` or `held` (by quiet hours, until it is released).
    pub outcome: String,
    pub attempts: u32,
    /// The last failure, secrets masked; `null` once sent.
    pub last_error: Option<String>,
    /// What a shadow (`run --shadow`) would have done, rendered: the channel's text, the
    /// reload's request, the exec's argv, the cleanup's patterns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rendered: Option<String>,
    /// When this outcome was recorded (RFC 3339).
    pub at: String,
}

/// One firing with its actions' outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The event JSON of docs/rules.md#event-json.
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
    /// Only keys this pattern (docs/rules.md#patterns) matches.
    pub key: Option<Pattern>,
    pub rule: Option<String>,
    /// Only the firing with this event id (an Alertmanager alert's `generatorURL`).
    pub id: Option<String>,
    /// Only firings observed this long ago or later.
    pub since: Option<Duration>,
    pub limit: usize,
}

/// The span of observation whose firings share a hash.
const MINUTE_MS: i64 = 60_000;

/// The hash of the firings observed in the minute of `at_ms`.
fn minute_key(prefix: &str, at_ms: i64) -> String {
    format!("{prefix}history:@{}", at_ms.div_euclid(MINUTE_MS))
}

/// The field of one action's latest outcome (`action` is its [`action_field`]).
fn outcome_field(id: &str, action: &str) -> String {
    format!("{id}:{action}")
}

fn index_key(prefix: &str) -> String {
    format!("{prefix}history")
}

/// The hash field of an action: `a:reload`, `a:notify:oncall`.
fn action_field(action: &Action) -> String {
    if let (Some(channel), Some(target)) = (action.channel(), action.target()) {
        return format!("a:{}:{channel}:{target}", action.name());
    }
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
        /// The firing's JSON ([`Firing::text`], shared with its jobs' payloads); readers turn
        /// it into the event JSON.
        event: Arc<str>,
        /// The fields its actions' outcomes go to, as a JSON array.
        names: String,
    },
    Action {
        id: String,
        /// When its firing was observed: the minute whose hash holds it.
        at_ms: i64,
        field: String,
        record: ActionRecord,
    },
    /// Firings were indexed elsewhere (see [`Recorder::firing_cmds`]): trim the index.
    Indexed,
}

/// The pipeline's handle on history: cheap to clone, never blocks.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::Sender<Entry>,
    lost: Arc<AtomicU64>,
    prefix: String,
    keep_ms: i64,
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
        let keep_ms = writer.keep_ms;
        let handle = tokio::spawn(writer.run(rx, stop));
        let lost = Arc::new(AtomicU64::new(0));
        (
            Recorder {
                tx,
                lost,
                prefix: prefix.to_string(),
                keep_ms,
            },
            handle,
        )
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

    /// The commands that keep `firings` in history, for the transaction that stores their jobs:
    /// a firing whose jobs are in the queue is in history, whichever instance then runs them and
    /// whenever the one that stored them dies (an outcome recorded for a firing history lacks is
    /// shown nowhere). With each firing, every action it may record an outcome for (its
    /// follow-ups' included), which is what the readers look up. [`Recorder::indexed`] after
    /// the transaction.
    pub fn firing_cmds<'a>(
        &self,
        firings: impl IntoIterator<Item = (&'a Firing, Vec<Action>)>,
    ) -> Vec<redis::Cmd> {
        // Per minute's hash: its entries, and the latest moment one of them is kept until. A
        // mass expiry stores thousands of firings in one transaction: four commands per minute,
        // not four per firing (docs/performance.md).
        let mut minutes: std::collections::BTreeMap<String, (Vec<(String, String)>, i64)> =
            Default::default();
        let mut index: Vec<(i64, String)> = Vec::new();
        for (f, actions) in firings {
            let names: Vec<String> = actions.iter().map(action_field).collect();
            let at_ms = f.observed_at.timestamp_millis();
            // A key longer than a history entry should hold is kept as its cut view
            // (docs/reliability.md#bounded-whatever-the-key).
            let event = match f.cut(crate::long_key::EXACT) {
                Some(cut) => cut.text(),
                None => f.text(),
            };
            let names = serde_json::to_string(&names).unwrap_or_default();
            let mut stored = String::with_capacity(names.len() + 1 + event.len());
            stored.push_str(&names);
            stored.push('\n');
            stored.push_str(&event);
            let until = at_ms.saturating_add(self.keep_ms);
            let minute = minutes
                .entry(minute_key(&self.prefix, at_ms))
                .or_insert_with(|| (Vec::new(), until));
            minute.0.push((f.id.clone(), stored));
            minute.1 = minute.1.max(until);
            index.push((at_ms, f.id.clone()));
        }
        let mut cmds = Vec::new();
        for (key, (entries, until)) in minutes {
            let mut hset = redis::cmd("HSET");
            hset.arg(&key);
            for (id, stored) in entries {
                hset.arg(id).arg(stored);
            }
            cmds.push(hset);
            // A new hash gets its expiry (NX), one that has an earlier one a later (GT).
            for when in ["NX", "GT"] {
                let mut expire = redis::cmd("PEXPIREAT");
                expire.arg(&key).arg(until).arg(when);
                cmds.push(expire);
            }
        }
        if !index.is_empty() {
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(index_key(&self.prefix));
            for (at_ms, id) in index {
                zadd.arg(at_ms).arg(id);
            }
            cmds.push(zadd);
        }
        cmds
    }

    /// Firings were added to history's index by [`Recorder::firing_cmds`]: it is trimmed (by
    /// `keep` and to [`MAX_FIRINGS`]) by the writer, off the firings' path.
    pub fn indexed(&self) {
        self.send(Entry::Indexed);
    }

    /// A firing that runs none of its actions; `actions`: every action it may record an outcome
    /// for, which is what the readers look up.
    fn firing(&self, f: &Firing, actions: &[Action]) {
        let names: Vec<String> = actions.iter().map(action_field).collect();
        // A key longer than a history entry should hold is kept as its cut view
        // (docs/reliability.md#bounded-whatever-the-key).
        let event = match f.cut(crate::long_key::EXACT) {
            Some(cut) => cut.text(),
            None => f.text(),
        };
        self.send(Entry::Firing {
            id: f.id.clone(),
            at_ms: f.observed_at.timestamp_millis(),
            event,
            names: serde_json::to_string(&names).unwrap_or_default(),
        });
    }

    /// One attempt of `action` of the firing `f`, the `attempts`-th, ended with `outcome`.
    pub fn attempt(&self, f: &Firing, action: &Action, outcome: &Outcome, attempts: u32) {
        let (label, error) = match outcome {
            // A follow-up that had nothing to do (see `action::followup`).
            Outcome::Skipped(_) => ("skipped", Some(outcome.text().into_owned())),
            Outcome::Sent(_) | Outcome::Again { .. } => ("sent", None),
            Outcome::Retry { reason, .. } => ("retrying", Some(reason.clone())),
            Outcome::Failed(reason) => ("dead", Some(reason.clone())),
            Outcome::Shadow(rendered) => {
                let mut record = self.record(action, "shadow", attempts, None);
                record.rendered = Some(rendered.clone());
                return self.send_action(f, action, record);
            }
        };
        self.action(f, action, label, attempts, error);
    }

    /// `action` of the firing `f` was given up (a dead letter) for `reason`.
    pub fn dead(&self, f: &Firing, action: &Action, reason: &str) {
        // 0: the writer keeps the attempts already recorded.
        self.action(f, action, "dead", 0, Some(reason.to_string()));
    }

    /// `action` of the firing `f` is held by the quiet hours `window` of its channel until
    /// `until` (docs/rules.md#quiet-hours); its release records the outcome after it.
    pub fn held(
        &self,
        f: &Firing,
        action: &Action,
        window: &str,
        until: chrono::DateTime<chrono::Utc>,
    ) {
        let why = format!("held by quiet hours \"{window}\" until {}", rfc3339(until));
        self.action(f, action, "held", 0, Some(why));
    }

    /// A firing that does not run its actions (silenced, or a recovery its rule skips): kept
    /// with each action `skipped` and why.
    pub fn skipped(&self, f: &Firing, actions: &[Action], why: &str) {
        self.firing(f, actions);
        for a in actions {
            self.action(f, a, "skipped", 0, Some(why.to_string()));
        }
    }

    fn action(
        &self,
        f: &Firing,
        action: &Action,
        outcome: &str,
        attempts: u32,
        error: Option<String>,
    ) {
        let record = self.record(action, outcome, attempts, error);
        self.send_action(f, action, record);
    }

    fn record(
        &self,
        action: &Action,
        outcome: &str,
        attempts: u32,
        error: Option<String>,
    ) -> ActionRecord {
        ActionRecord {
            action: action.name().to_string(),
            channel: channel_of(action),
            target: action.target(),
            outcome: outcome.to_string(),
            attempts,
            last_error: error,
            rendered: None,
            at: rfc3339(clock::now()),
        }
    }

    fn send_action(&self, f: &Firing, action: &Action, record: ActionRecord) {
        self.send(Entry::Action {
            id: f.id.clone(),
            at_ms: f.observed_at.timestamp_millis(),
            field: action_field(action),
            record,
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
            // Whatever else comes within LINGER goes in the same call: in a storm entries
            // trickle in a few at a time, and a script call per few entries cost more than
            // the entries themselves. History is a record; 20 ms later is as good.
            let until = tokio::time::Instant::now() + LINGER;
            while batch.len() < BATCH {
                let room = BATCH - batch.len();
                let more = tokio::select! {
                    n = rx.recv_many(&mut batch, room) => n,
                    _ = tokio::time::sleep_until(until) => 0,
                    _ = stop.cancelled() => 0,
                };
                if more == 0 {
                    break;
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
        let now = clock::now_ms();
        // A dead letter keeps the attempts already counted: read them first.
        let dead: Vec<(String, String)> = batch
            .iter()
            .filter_map(|e| match e {
                Entry::Action {
                    id,
                    at_ms,
                    field,
                    record,
                } if record.attempts == 0 && record.outcome == "dead" => {
                    Some((minute_key(&self.prefix, *at_ms), outcome_field(id, field)))
                }
                _ => None,
            })
            .collect();
        let mut known: HashMap<(String, String), u32> = HashMap::new();
        if !dead.is_empty() {
            let mut p = redis::pipe();
            for (key, field) in &dead {
                p.cmd("HGET").arg(key).arg(field);
            }
            let old: Vec<Option<String>> = p.query_async(&mut self.conn).await?;
            for (at, old) in dead.into_iter().zip(old) {
                if let Some(a) = old.and_then(|o| serde_json::from_str::<ActionRecord>(&o).ok()) {
                    known.insert(at, a.attempts);
                }
            }
        }
        // One `HSET` per minute's hash, however many firings and outcomes of the batch it holds,
        // and its expiry moved only ever later: `keep` after its latest firing.
        let mut minutes: BTreeMap<String, (redis::Cmd, i64)> = BTreeMap::new();
        let mut index_add = redis::cmd("ZADD");
        index_add.arg(&index);
        // Whether the index grew: it is trimmed then.
        let mut indexed = false;
        let mut firings = 0;
        for e in batch {
            let (id, at_ms) = match e {
                Entry::Firing { id, at_ms, .. } | Entry::Action { id, at_ms, .. } => (id, *at_ms),
                Entry::Indexed => {
                    indexed = true;
                    continue;
                }
            };
            let (hset, until) = minutes
                .entry(minute_key(&self.prefix, at_ms))
                .or_insert_with_key(|key| {
                    let mut c = redis::cmd("HSET");
                    c.arg(key);
                    (c, i64::MIN)
                });
            *until = (*until).max(at_ms.saturating_add(self.keep_ms));
            match e {
                Entry::Firing { event, names, .. } => {
                    firings += 1;
                    index_add.arg(at_ms).arg(id);
                    // JSON holds no raw newline: the first one ends the names.
                    let mut stored = String::with_capacity(names.len() + 1 + event.len());
                    stored.push_str(names);
                    stored.push('\n');
                    stored.push_str(event);
                    hset.arg(id).arg(stored);
                }
                Entry::Indexed => {}
                Entry::Action { field, record, .. } => {
                    let mut record = record.clone();
                    let at = (minute_key(&self.prefix, at_ms), outcome_field(id, field));
                    if record.attempts == 0 {
                        record.attempts = known.get(&at).copied().unwrap_or(0);
                    } else {
                        // A dead letter later in this batch keeps these attempts.
                        known.insert(at.clone(), record.attempts);
                    }
                    let json = serde_json::to_string(&record).unwrap_or_default();
                    hset.arg(&at.1).arg(json);
                }
            }
        }
        let mut p = redis::pipe();
        for (key, (hset, until)) in minutes {
            p.add_command(hset).ignore();
            // A new hash gets its expiry (NX), one that has an earlier one a later (GT).
            for when in ["NX", "GT"] {
                p.cmd("PEXPIREAT").arg(&key).arg(until).arg(when).ignore();
            }
        }
        if firings == 0 && !indexed {
            return p.query_async(&mut self.conn).await;
        }
        if firings > 0 {
            p.add_command(index_add).ignore();
        }
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
        Ok(())
    }

    /// Drops the `excess` oldest firings: their fields in their minutes' hashes.
    async fn trim_count(&mut self, excess: usize) -> redis::RedisResult<()> {
        let index = index_key(&self.prefix);
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(&index)
            .arg(0)
            .arg(excess as i64 - 1)
            .arg("WITHSCORES");
        let old: Vec<(String, f64)> = range.query_async(&mut self.conn).await?;
        if old.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (id, at) in &old {
            p.cmd("HGET")
                .arg(minute_key(&self.prefix, *at as i64))
                .arg(id);
        }
        let stored: Vec<Option<String>> = p.query_async(&mut self.conn).await?;
        let mut by_minute: BTreeMap<String, redis::Cmd> = BTreeMap::new();
        for ((id, at), stored) in old.iter().zip(stored) {
            let hdel = by_minute
                .entry(minute_key(&self.prefix, *at as i64))
                .or_insert_with_key(|key| {
                    let mut c = redis::cmd("HDEL");
                    c.arg(key);
                    c
                });
            hdel.arg(id);
            let (names, _) = split_stored(stored.as_deref().unwrap_or(""));
            for name in names {
                hdel.arg(outcome_field(id, &name));
            }
        }
        let mut p = redis::pipe();
        for hdel in by_minute.into_values() {
            p.add_command(hdel).ignore();
        }
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(&index)
            .arg(old.iter().map(|(id, _)| id).collect::<Vec<_>>());
        p.add_command(zrem).ignore();
        p.query_async(&mut self.conn).await
    }
}

/// A firing's `ID` field as the action fields it names (none when unreadable) and its event
/// JSON.
fn split_stored(stored: &str) -> (Vec<String>, &str) {
    let (names, event) = stored.split_once('\n').unwrap_or(("", stored));
    (serde_json::from_str(names).unwrap_or_default(), event)
}

/// The firing of the event `id` as history keeps it (a key longer than
/// [`crate::long_key::EXACT`] cut), if it still does: what a signed link shows of its event.
pub async fn firing(conn: &mut Conn, prefix: &str, id: &str) -> redis::RedisResult<Option<Firing>> {
    let at: Option<f64> = redis::cmd("ZSCORE")
        .arg(index_key(prefix))
        .arg(id)
        .query_async(conn)
        .await?;
    let Some(at) = at else {
        return Ok(None);
    };
    let stored: Option<String> = redis::cmd("HGET")
        .arg(minute_key(prefix, at as i64))
        .arg(id)
        .query_async(conn)
        .await?;
    Ok(stored.and_then(|s| serde_json::from_str(split_stored(&s).1).ok()))
}

/// The firings `filter` selects, newest first, read from what every instance recorded.
pub async fn list(
    conn: &mut Conn,
    prefix: &str,
    filter: &Filter,
) -> redis::RedisResult<Vec<Record>> {
    const PAGE: usize = 256;
    let index = index_key(prefix);
    let mut min = match filter.since {
        Some(d) => (clock::now_ms() - d.as_millis() as i64).to_string(),
        None => "-inf".to_string(),
    };
    let mut max = "+inf".to_string();
    // One firing: only the firings observed in its millisecond are read.
    if let Some(id) = &filter.id {
        let at: Option<f64> = redis::cmd("ZSCORE")
            .arg(&index)
            .arg(id)
            .query_async(conn)
            .await?;
        let Some(at) = at else {
            return Ok(Vec::new());
        };
        min = at.to_string();
        max = at.to_string();
    }
    let mut out = Vec::new();
    let mut offset = 0;
    while out.len() < filter.limit {
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(&index)
            .arg(&max)
            .arg(&min)
            .arg("BYSCORE")
            .arg("REV")
            .arg("LIMIT")
            .arg(offset)
            .arg(PAGE)
            .arg("WITHSCORES");
        let page: Vec<(String, f64)> = range.query_async(conn).await?;
        if page.is_empty() {
            break;
        }
        offset += page.len();
        let mut p = redis::pipe();
        for (id, at) in &page {
            p.cmd("HGET").arg(minute_key(prefix, *at as i64)).arg(id);
        }
        let stored: Vec<Option<String>> = p.query_async(conn).await?;
        // Each firing's event, and the names of its actions' outcome fields.
        let (found, names): (Vec<Option<String>>, Vec<Vec<String>>) = stored
            .into_iter()
            .map(|s| match s {
                Some(s) => {
                    let (names, event) = split_stored(&s);
                    (Some(event.to_string()), names)
                }
                None => (None, Vec::new()),
            })
            .unzip();
        let mut p = redis::pipe();
        let mut asked = 0;
        for (((id, at), event), names) in page.iter().zip(&found).zip(&names) {
            if event.is_some() && !names.is_empty() {
                let mut c = redis::cmd("HMGET");
                c.arg(minute_key(prefix, *at as i64));
                for n in names {
                    c.arg(outcome_field(id, n));
                }
                p.add_command(c);
                asked += 1;
            }
        }
        let mut outcomes: std::vec::IntoIter<Vec<Option<String>>> = if asked > 0 {
            let got: Vec<Vec<Option<String>>> = p.query_async(conn).await?;
            got.into_iter()
        } else {
            Vec::new().into_iter()
        };
        let mut hashes = Vec::with_capacity(page.len());
        for (event, names) in found.into_iter().zip(names) {
            let Some(event) = event else { continue };
            let got = if names.is_empty() {
                Vec::new()
            } else {
                outcomes.next().unwrap_or_default()
            };
            hashes.push(stored_fields(event, names, got));
        }
        for fields in hashes {
            let Some(r) = parse_record(fields) else {
                continue;
            };
            if filter
                .rule
                .as_deref()
                .is_some_and(|rule| r.str_field("rule") != rule)
                || filter
                    .id
                    .as_deref()
                    .is_some_and(|id| r.str_field("id") != id)
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

/// A firing's fields in its minute's hash, as the fields of a hash of its own (what
/// [`parse_record`] reads): `event`, and each named action's outcome that was recorded.
fn stored_fields(
    event: String,
    names: Vec<String>,
    outcomes: Vec<Option<String>>,
) -> Vec<(String, String)> {
    let mut fields = vec![("event".to_string(), event)];
    fields.extend(
        names
            .into_iter()
            .zip(outcomes)
            .filter_map(|(name, json)| Some((name, json?))),
    );
    fields
}

/// The event JSON of docs/rules.md#event-json of a stored firing, kept as the firing's own
/// JSON (what its jobs embed, so that it is written once).
fn event_json(stored: &str) -> Option<serde_json::Value> {
    serde_json::from_str::<Firing>(stored)
        .ok()
        .map(|f| f.to_json())
}

/// A firing's hash as a record; `None` when only outcomes are left of it (its event was
/// trimmed, or its writer has not stored it yet).
fn parse_record(fields: Vec<(String, String)>) -> Option<Record> {
    let mut event = None;
    let mut actions = Vec::new();
    for (name, value) in fields {
        if name == "event" {
            event = event_json(&value);
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
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} 0 id"),
        Use::new(Server::State, "hset", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} id json"),
        Use::new(Server::State, "hget", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "pexpireat", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} 1000 NX"),
        Use::new(Server::State, "zremrangebyscore", WHY)
            .on(Keys::State("history"), Access::ReadWrite)
            .args("{key} -inf 0"),
        Use::new(Server::State, "zcard", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} 0 0 WITHSCORES"),
        Use::new(Server::State, "zscore", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} id id:a:reload"),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "hmget", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key} id:a:reload"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local_redis::LocalRedis;

    /// A writer on a throwaway redis-server (kept alive by the returned server).
    async fn writer(keep_ms: i64) -> (LocalRedis, Writer, Conn) {
        let (server, conn) = crate::local_redis::throwaway().await;
        let w = Writer {
            conn: conn.clone(),
            prefix: "kw:".into(),
            keep_ms,
        };
        (server, w, conn)
    }

    fn fired(id: &str, at_ms: i64) -> Entry {
        Entry::Firing {
            id: id.into(),
            at_ms,
            event: firing_text(id),
            names: r#"["a:reload","a:notify:c"]"#.into(),
        }
    }

    /// A firing's JSON as history keeps it: rule `r`, key `k:ID`, event id `ID`.
    fn firing_text(id: &str) -> Arc<str> {
        let mut f = crate::firing::expiry("r", &format!("k:{id}"), "2026-01-01T00:00:00Z");
        f.id = id.into();
        f.text()
    }

    fn outcome(id: &str, at_ms: i64, field: &str, outcome: &str, attempts: u32) -> Entry {
        Entry::Action {
            id: id.into(),
            at_ms,
            field: field.into(),
            record: ActionRecord {
                action: field.trim_start_matches("a:").into(),
                channel: None,
                target: None,
                outcome: outcome.into(),
                attempts,
                last_error: None,
                rendered: None,
                at: "2026-12-02T00:00:00.000Z".into(),
            },
        }
    }

    async fn all(conn: &Conn) -> Vec<Record> {
        let filter = Filter {
            limit: 100,
            ..Default::default()
        };
        list(&mut conn.clone(), "kw:", &filter).await.unwrap()
    }

    /// A held message is `held`, saying until when and by which window.
    #[tokio::test]
    async fn a_held_message_is_recorded_with_its_window_and_end() {
        let (tx, mut rx) = mpsc::channel(4);
        let r = Recorder {
            tx,
            lost: Arc::default(),
            prefix: "kw:".into(),
            keep_ms: 60_000,
        };
        let f = crate::firing::expiry("r", "k:1", "2026-12-07T15:00:00Z");
        let action = Action::Notify {
            channel: "team".into(),
        };
        r.held(
            &f,
            &action,
            "night",
            "2026-12-08T00:00:00Z".parse().unwrap(),
        );
        let Some(Entry::Action { field, record, .. }) = rx.recv().await else {
            panic!("an outcome");
        };
        assert_eq!(field, "a:notify:team");
        assert_eq!(
            (
                record.outcome.as_str(),
                record.attempts,
                record.last_error.as_deref()
            ),
            (
                "held",
                0,
                Some("held by quiet hours \"night\" until 2026-12-08T00:00:00.000Z")
            )
        );
    }

    #[tokio::test]
    async fn outcomes_land_beside_their_firing_and_a_dead_letter_keeps_the_attempts() {
        let (_server, mut w, conn) = writer(3_600_000).await;
        let now = clock::now_ms();
        w.try_store(&[
            fired("x", now),
            outcome("x", now, "a:reload", "retrying", 3),
        ])
        .await
        .unwrap();
        // Another batch: the dead letter says 0 attempts, the 3 recorded stay.
        w.try_store(&[
            outcome("x", now, "a:reload", "dead", 0),
            outcome("x", now, "a:notify:c", "sent", 1),
        ])
        .await
        .unwrap();
        let got = all(&conn).await;
        assert_eq!(got.len(), 1);
        let a: Vec<(&str, &str, u32)> = got[0]
            .actions
            .iter()
            .map(|a| (a.action.as_str(), a.outcome.as_str(), a.attempts))
            .collect();
        assert_eq!(a, [("reload", "dead", 3), ("notify:c", "sent", 1)]);
    }

    #[tokio::test]
    async fn a_firing_kept_as_its_own_json_reads_as_its_event_json() {
        let (_server, mut w, conn) = writer(3_600_000).await;
        let now = clock::now_ms();
        let at = chrono::DateTime::from_timestamp_millis(now).unwrap();
        let e = crate::event::KeyEvent {
            kind: crate::event::EventKind::Expired,
            db: 3,
            key: bytes::Bytes::from(b"order:\xff\n*<!channel>".to_vec()),
            field: None,
            observed_at: at,
            deadline: Some(at - chrono::Duration::milliseconds(7)),
            ttl_ms: None,
            recovered: true,
            source: "127.0.0.1:1".into(),
        };
        let f = Firing::new(
            "orders \u{1f512}",
            &e,
            &["id".into()],
            vec![b"\xfe@all".to_vec().into()],
            Some(serde_json::json!({"user": "u\n1", "n": [1, 2.5, null]}).into()),
        );
        w.try_store(&[Entry::Firing {
            id: f.id.clone(),
            at_ms: now,
            event: f.text(),
            names: r#"["a:reload"]"#.into(),
        }])
        .await
        .unwrap();
        let got = all(&conn).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].event, f.to_json());
        assert_eq!(got[0].str_field("key"), String::from_utf8_lossy(&f.key));
    }

    #[tokio::test]
    async fn a_minutes_hash_lasts_keep_after_its_latest_firing_whatever_comes_after() {
        let keep = 3_600_000;
        let (_server, mut w, conn) = writer(keep).await;
        let minute = clock::now_ms().div_euclid(MINUTE_MS) * MINUTE_MS;
        w.try_store(&[fired("a", minute + 10), fired("b", minute + 20)])
            .await
            .unwrap();
        // An outcome of the earlier firing, later: the expiry does not move back.
        w.try_store(&[outcome("a", minute + 10, "a:reload", "sent", 1)])
            .await
            .unwrap();
        let at: i64 = redis::cmd("PEXPIRETIME")
            .arg(minute_key("kw:", minute))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(at, minute + 20 + keep);
    }

    #[tokio::test]
    async fn trimming_by_count_removes_the_oldest_firings_fields_and_index_entries() {
        let (_server, mut w, conn) = writer(3_600_000).await;
        let now = clock::now_ms();
        w.try_store(&[
            fired("old", now - 120_000),
            outcome("old", now - 120_000, "a:reload", "sent", 1),
            fired("new", now),
        ])
        .await
        .unwrap();
        w.trim_count(1).await.unwrap();
        let got = all(&conn).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].event["id"], "new");
        let left: usize = redis::cmd("HLEN")
            .arg(minute_key("kw:", now - 120_000))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(
            left, 0,
            "the old firing's event and outcome fields are gone"
        );
    }

    #[test]
    fn a_firings_outcomes_are_those_of_the_actions_it_names_that_were_recorded() {
        let (names, event) = split_stored("[\"a:reload\",\"a:notify:odd\\tname\"]\n{\"id\":\"x\"}");
        assert_eq!(names, ["a:reload", "a:notify:odd\tname"]);
        assert_eq!(event, r#"{"id":"x"}"#);
        assert_eq!(outcome_field("x", &names[1]), "x:a:notify:odd\tname");
        let fields = stored_fields(event.into(), names, vec![None, Some("{\"y\":2}".into())]);
        assert_eq!(
            fields,
            [
                ("event".to_string(), r#"{"id":"x"}"#.to_string()),
                ("a:notify:odd\tname".to_string(), r#"{"y":2}"#.to_string()),
            ]
        );
        assert!(split_stored("not json\n{}").0.is_empty());
    }

    #[test]
    fn a_record_is_the_event_json_plus_its_actions_in_spec_order() {
        let a = |action: &str, channel: Option<&str>| {
            serde_json::to_string(&ActionRecord {
                action: action.into(),
                channel: channel.map(Into::into),
                target: None,
                outcome: "sent".into(),
                attempts: 1,
                last_error: None,
                rendered: None,
                at: "2026-11-29T10:15:00.000Z".into(),
            })
            .unwrap()
        };
        let r = parse_record(vec![
            ("a:notify:oncall".into(), a("notify", Some("oncall"))),
            ("event".into(), firing_text("x").to_string()),
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
