//! History: every firing and what became of each of its actions, kept in Redis by whichever
//! instance did the work, so that `keywatch history`, `GET /api/history` and the status page
//! answer "did the alert for order 42 go out, and what did DingTalk answer?" after a restart
//! and for every instance.
//!
//! Layout under `state.prefix`: one hash per minute of observation, `history:@MINUTE` (the
//! observed ms divided by 60,000), holding the firings of that minute and one field `ID:a:…` per
//! action of each, its latest outcome; and an index, the sorted set `history`. The firings one
//! write stores in a minute are one *group*: one field `@TOKEN` of the minute's hash holding, per
//! firing, its id, a line naming its actions' fields (a JSON array: `a:reload`,
//! `a:notify:oncall`, its follow-ups' `a:escalate:…` too) and its firing JSON (turned into the
//! event JSON of docs/rules.md#event-json when read); and one index entry, `@MINUTE:TOKEN` followed
//! by a line `ID OBSERVED_MS` per firing, scored by the newest of them. In a mass expiry a field
//! and an index entry per firing were two of the state server's largest per-task costs
//! (docs/performance.md#mass-expiry): a batch of a thousand firings is now one of each. Entries
//! written before (member = event id, score = when observed; field `ID` holding the names and
//! the JSON) still read, and are trimmed like groups. One hash per minute rather than per
//! firing: in a storm a key of its own, created and given a TTL per firing and again per outcome,
//! was a quarter of what the state server spent. Memory is bounded twice: each minute's hash
//! lasts `history.keep` after the latest firing in it, and the index is trimmed by time and to
//! [`MAX_FIRINGS`] firings (the trimmed firings' fields removed); `history.count` counts the firings
//! the index holds beyond one per entry, so that the count is its `ZCARD` plus that.
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

/// How many firings the index holds beyond one per entry (each group's firings less one): the
/// field `n` of this hash (`HINCRBY`, which the ACL of docs/redis.md grants already).
fn extra_key(prefix: &str) -> String {
    format!("{prefix}history.count")
}

/// Trims the index by time and count, see `history/trim.lua`.
const TRIM: &str = include_str!("history/trim.lua");

/// The firings of one write in one minute, kept together: one field of the minute's hash and one
/// index entry (see the module's header).
#[derive(Default)]
struct Group {
    /// The newest firing's observed ms: the entry's score.
    newest: i64,
    /// The entry's lines after its first: `\nID OBSERVED_MS` per firing.
    lines: String,
    /// The field's value: `ID\nNAMES\nJSON\n` per firing.
    value: String,
    firings: usize,
}

impl Group {
    fn add(&mut self, id: &str, at_ms: i64, names: &str, event: &str) {
        use std::fmt::Write;
        self.newest = if self.firings == 0 {
            at_ms
        } else {
            self.newest.max(at_ms)
        };
        let _ = write!(self.lines, "\n{id} {at_ms}");
        self.value.reserve(id.len() + names.len() + event.len() + 3);
        for part in [id, names, event] {
            self.value.push_str(part);
            self.value.push('\n');
        }
        self.firings += 1;
    }

    /// The commands that store it in the hash `key` of `minute` (its expiry is the caller's).
    fn cmds(self, prefix: &str, key: &str, minute: i64) -> [redis::Cmd; 3] {
        let token = format!("{:016x}", fastrand::u64(..));
        let mut hset = redis::cmd("HSET");
        hset.arg(key).arg(format!("@{token}")).arg(self.value);
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(index_key(prefix))
            .arg(self.newest)
            .arg(format!("@{minute}:{token}{}", self.lines));
        let mut more = redis::cmd("HINCRBY");
        more.arg(extra_key(prefix))
            .arg("n")
            .arg(self.firings as i64 - 1);
        [hset, zadd, more]
    }
}

/// Where the index says a firing is kept.
#[derive(Clone, Debug, PartialEq)]
enum Kept {
    /// Its own field `ID` (written before groups).
    Own,
    /// In its group's field.
    Group(String),
}

/// A firing the index names: when it was observed, its id, and where it is kept.
#[derive(Clone, Debug, PartialEq)]
struct Indexed {
    at_ms: i64,
    id: String,
    kept: Kept,
}

impl Indexed {
    fn key(&self, prefix: &str) -> String {
        minute_key(prefix, self.at_ms)
    }
}

/// The firings an index entry names: a group's, or the one firing of an entry written before
/// groups (`score`: when it was observed).
fn entry_firings(member: &str, score: f64) -> Vec<Indexed> {
    let Some(group) = member.strip_prefix('@') else {
        return vec![Indexed {
            at_ms: score as i64,
            id: member.to_string(),
            kept: Kept::Own,
        }];
    };
    let mut lines = group.split('\n');
    let Some((_, token)) = lines.next().and_then(|head| head.split_once(':')) else {
        return Vec::new();
    };
    let field = format!("@{token}");
    lines
        .filter_map(|line| {
            let (id, at) = line.rsplit_once(' ')?;
            Some(Indexed {
                at_ms: at.parse().ok()?,
                id: id.to_string(),
                kept: Kept::Group(field.clone()),
            })
        })
        .collect()
}

/// A group's field as (id, stored) pairs, stored as a firing's own field holds it: the names'
/// line, then the JSON.
fn group_firings(value: &str) -> impl Iterator<Item = (&str, String)> {
    let mut lines = value.split('\n');
    std::iter::from_fn(move || {
        let id = lines.next()?;
        let names = lines.next()?;
        let event = lines.next()?;
        Some((id, format!("{names}\n{event}")))
    })
}

/// Where the index says the firing `id` is: its own entry, else the group naming it.
async fn locate(conn: &mut Conn, prefix: &str, id: &str) -> redis::RedisResult<Option<Indexed>> {
    let index = index_key(prefix);
    let at: Option<f64> = redis::cmd("ZSCORE")
        .arg(&index)
        .arg(id)
        .query_async(conn)
        .await?;
    if let Some(at) = at {
        return Ok(Some(Indexed {
            at_ms: at as i64,
            id: id.to_string(),
            kept: Kept::Own,
        }));
    }
    // Else the group naming it, read a page of entries at a time (a signed link, `history
    // --id`: rare). Read here rather than matched by Redis (`ZSCAN … MATCH`): no command beyond
    // those the ACL of docs/redis.md grants already.
    const PAGE: isize = 1000;
    let needle = format!("\n{id} ");
    let mut from: isize = 0;
    loop {
        let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&index)
            .arg(from)
            .arg(from + PAGE - 1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await?;
        for (member, score) in &page {
            if member.starts_with('@')
                && member.contains(&needle)
                && let Some(f) = entry_firings(member, *score)
                    .into_iter()
                    .find(|f| f.id == id)
            {
                return Ok(Some(f));
            }
        }
        if page.len() < PAGE as usize {
            return Ok(None);
        }
        from += PAGE;
    }
}

/// What is stored of each firing (the names' line, then the JSON), `None` where nothing is;
/// a group's field read once for all its firings.
async fn stored_of(
    conn: &mut Conn,
    prefix: &str,
    firings: &[Indexed],
) -> redis::RedisResult<Vec<Option<String>>> {
    let mut fields: Vec<(String, String)> = Vec::new();
    for f in firings {
        let field = match &f.kept {
            Kept::Own => f.id.clone(),
            Kept::Group(g) => g.clone(),
        };
        let at = (f.key(prefix), field);
        if !fields.contains(&at) {
            fields.push(at);
        }
    }
    let mut p = redis::pipe();
    for (key, field) in &fields {
        p.cmd("HGET").arg(key).arg(field);
    }
    let values: Vec<Option<String>> = if fields.is_empty() {
        Vec::new()
    } else {
        p.query_async(conn).await?
    };
    let mut groups: HashMap<&(String, String), HashMap<&str, String>> = HashMap::new();
    let mut own: HashMap<&(String, String), &str> = HashMap::new();
    for (at, value) in fields.iter().zip(&values) {
        let Some(value) = value else { continue };
        if at.1.starts_with('@') {
            groups.insert(at, group_firings(value).collect());
        } else {
            own.insert(at, value);
        }
    }
    Ok(firings
        .iter()
        .map(|f| {
            let key = f.key(prefix);
            match &f.kept {
                Kept::Own => own.get(&(key, f.id.clone())).map(|s| s.to_string()),
                Kept::Group(g) => groups
                    .get(&(key, g.clone()))
                    .and_then(|m| m.get(f.id.as_str()).cloned()),
            }
        })
        .collect())
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
            trim: redis::Script::new(TRIM),
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
        // Per minute's hash: its group, and the latest moment one of them is kept until. A
        // mass expiry stores thousands of firings in one transaction: five commands per
        // minute, not a field and an index entry per firing (docs/performance.md).
        let mut minutes: BTreeMap<i64, (Group, i64)> = BTreeMap::new();
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
            let until = at_ms.saturating_add(self.keep_ms);
            let minute = minutes
                .entry(at_ms.div_euclid(MINUTE_MS))
                .or_insert_with(|| (Group::default(), until));
            minute.0.add(&f.id, at_ms, &names, &event);
            minute.1 = minute.1.max(until);
        }
        let mut cmds = Vec::new();
        for (minute, (group, until)) in minutes {
            let key = minute_key(&self.prefix, minute * MINUTE_MS);
            cmds.extend(group.cmds(&self.prefix, &key, minute));
            // A new hash gets its expiry (NX), one that has an earlier one a later (GT).
            for when in ["NX", "GT"] {
                let mut expire = redis::cmd("PEXPIREAT");
                expire.arg(&key).arg(until).arg(when);
                cmds.push(expire);
            }
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
    trim: redis::Script,
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
        // and its expiry moved only ever later: `keep` after its latest firing. The batch's
        // firings of a minute are one group (see the module's header).
        let mut minutes: BTreeMap<i64, (redis::Cmd, Group, i64)> = BTreeMap::new();
        // Whether the index grew: it is trimmed then.
        let mut indexed = false;
        for e in batch {
            let (id, at_ms) = match e {
                Entry::Firing { id, at_ms, .. } | Entry::Action { id, at_ms, .. } => (id, *at_ms),
                Entry::Indexed => {
                    indexed = true;
                    continue;
                }
            };
            let (hset, group, until) =
                minutes
                    .entry(at_ms.div_euclid(MINUTE_MS))
                    .or_insert_with(|| {
                        let mut c = redis::cmd("HSET");
                        c.arg(minute_key(&self.prefix, at_ms));
                        (c, Group::default(), i64::MIN)
                    });
            *until = (*until).max(at_ms.saturating_add(self.keep_ms));
            match e {
                Entry::Firing { event, names, .. } => group.add(id, at_ms, names, event),
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
        // A group's field, its index entry and the count beside it land together.
        p.atomic();
        for (minute, (hset, group, until)) in minutes {
            let key = minute_key(&self.prefix, minute * MINUTE_MS);
            // An `HSET` of the key alone (a batch of only firings) is no command.
            if hset.args_iter().count() > 2 {
                p.add_command(hset).ignore();
            }
            if group.firings > 0 {
                indexed = true;
                for c in group.cmds(&self.prefix, &key, minute) {
                    p.add_command(c).ignore();
                }
            }
            // A new hash gets its expiry (NX), one that has an earlier one a later (GT).
            for when in ["NX", "GT"] {
                p.cmd("PEXPIREAT").arg(&key).arg(until).arg(when).ignore();
            }
        }
        p.query_async::<()>(&mut self.conn).await?;
        if indexed {
            self.trim(now - self.keep_ms, MAX_FIRINGS).await?;
        }
        Ok(())
    }

    /// Trims the index to the firings observed at `cut` (ms) or later and to `max` firings, the
    /// oldest going first; the entries trimmed by count have their fields removed (those
    /// trimmed by time go with their minute's hash).
    async fn trim(&mut self, cut: i64, max: usize) -> redis::RedisResult<()> {
        let old: Vec<(String, f64)> = self
            .trim
            .key(index_key(&self.prefix))
            .key(extra_key(&self.prefix))
            .arg(cut)
            .arg(max)
            .invoke_async(&mut self.conn)
            .await?;
        if old.is_empty() {
            return Ok(());
        }
        let firings: Vec<Indexed> = old
            .iter()
            .flat_map(|(member, at)| entry_firings(member, *at))
            .collect();
        let stored = stored_of(&mut self.conn, &self.prefix, &firings).await?;
        let mut by_minute: BTreeMap<String, redis::Cmd> = BTreeMap::new();
        let mut groups = std::collections::HashSet::new();
        for (f, stored) in firings.iter().zip(stored) {
            let key = f.key(&self.prefix);
            let hdel = by_minute.entry(key.clone()).or_insert_with_key(|key| {
                let mut c = redis::cmd("HDEL");
                c.arg(key);
                c
            });
            match &f.kept {
                Kept::Own => {
                    hdel.arg(&f.id);
                }
                Kept::Group(g) => {
                    if groups.insert((key, g.clone())) {
                        hdel.arg(g);
                    }
                }
            }
            let (names, _) = split_stored(stored.as_deref().unwrap_or(""));
            for name in names {
                hdel.arg(outcome_field(&f.id, &name));
            }
        }
        let mut p = redis::pipe();
        for hdel in by_minute.into_values() {
            p.add_command(hdel).ignore();
        }
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
    let Some(f) = locate(conn, prefix, id).await? else {
        return Ok(None);
    };
    let stored = stored_of(conn, prefix, &[f]).await?;
    Ok(stored
        .into_iter()
        .next()
        .flatten()
        .and_then(|s| serde_json::from_str(split_stored(&s).1).ok()))
}

/// The firings `filter` selects, newest first, read from what every instance recorded.
pub async fn list(
    conn: &mut Conn,
    prefix: &str,
    filter: &Filter,
) -> redis::RedisResult<Vec<Record>> {
    const PAGE: usize = 256;
    let index = index_key(prefix);
    let since = filter.since.map(|d| clock::now_ms() - d.as_millis() as i64);
    let wanted = |f: &Indexed| since.is_none_or(|s| f.at_ms >= s);
    let mut out = Vec::new();
    // One firing: read where the index says it is.
    if let Some(id) = &filter.id {
        if let Some(f) = locate(conn, prefix, id).await?
            && wanted(&f)
        {
            read_records(conn, prefix, &[f], filter, &mut out).await?;
        }
        return Ok(out);
    }
    let min = since.map_or_else(|| "-inf".to_string(), |s| s.to_string());
    // Firings the index named that are not listed yet. The entries not read yet hold none
    // observed after `bound`, the score of the last entry read (an entry's score is its newest
    // firing's): what is newer than that is next, newest first.
    let mut pending: Vec<Indexed> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut bound = f64::INFINITY;
    let mut read_all = false;
    let mut offset = 0;
    // Entries read per page: a few at first (a group may name a thousand firings), then more.
    let mut page_len = 8;
    while out.len() < filter.limit {
        // Newest first, firings of one millisecond by id, descending: the order the index
        // gives entries of one score.
        pending.sort_by(|a, b| (b.at_ms, &b.id).cmp(&(a.at_ms, &a.id)));
        let ready = if read_all {
            pending.len()
        } else {
            pending
                .iter()
                .take_while(|f| f.at_ms as f64 > bound)
                .count()
        };
        if ready > 0 {
            let next: Vec<Indexed> = pending.drain(..ready.min(PAGE)).collect();
            read_records(conn, prefix, &next, filter, &mut out).await?;
            continue;
        }
        if read_all {
            break;
        }
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(&index)
            .arg("+inf")
            .arg(&min)
            .arg("BYSCORE")
            .arg("REV")
            .arg("LIMIT")
            .arg(offset)
            .arg(page_len)
            .arg("WITHSCORES");
        let page: Vec<(String, f64)> = range.query_async(conn).await?;
        offset += page.len();
        page_len = (page_len * 2).min(PAGE);
        match page.last() {
            Some((_, score)) => bound = *score,
            None => read_all = true,
        }
        for (member, score) in &page {
            for f in entry_firings(member, *score) {
                if wanted(&f) && seen.insert(f.id.clone()) {
                    pending.push(f);
                }
            }
        }
    }
    Ok(out)
}

/// Reads the records of `firings` (in their order) and adds those `filter` selects to `out`,
/// up to its limit.
async fn read_records(
    conn: &mut Conn,
    prefix: &str,
    firings: &[Indexed],
    filter: &Filter,
    out: &mut Vec<Record>,
) -> redis::RedisResult<()> {
    let stored = stored_of(conn, prefix, firings).await?;
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
    for ((f, event), names) in firings.iter().zip(&found).zip(&names) {
        if event.is_some() && !names.is_empty() {
            let mut c = redis::cmd("HMGET");
            c.arg(f.key(prefix));
            for n in names {
                c.arg(outcome_field(&f.id, n));
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
    let mut hashes = Vec::with_capacity(firings.len());
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
    Ok(())
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
    const TRIMMING = "history of firings and outcomes: trimming (script)";
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
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} +inf -inf BYSCORE REV LIMIT 0 1 WITHSCORES"),
        Use::new(Server::State, "zscore", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} id"),
        // A firing's group, by its id (a signed link, `history --id`).
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} 0 999 WITHSCORES"),
        // The firings the index holds beyond one per entry.
        Use::new(Server::State, "hincrby", WHY)
            .on(Keys::State("history.count"), Access::ReadWrite)
            .args("{key} n 1"),
        Use::new(Server::State, "multi", WHY),
        Use::new(Server::State, "exec", WHY),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} id id:a:reload"),
        Use::new(Server::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Server::State, "evalsha", TRIMMING)
            .on(Keys::State("history"), Access::ReadWrite)
            .args("{sha} 2 {prefix}history {prefix}history.count"),
        Use::new(Server::State, "hget", TRIMMING)
            .on(Keys::State("history.count"), Access::Read)
            .args("{key} n"),
        Use::new(Server::State, "hset", TRIMMING)
            .on(Keys::State("history.count"), Access::Write)
            .args("{key} n 0"),
        Use::new(Server::State, "zrange", TRIMMING)
            .on(Keys::State("history"), Access::Read)
            .args("{key} -inf (0 BYSCORE"),
        Use::new(Server::State, "zrem", TRIMMING)
            .on(Keys::State("history"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "zcard", TRIMMING)
            .on(Keys::State("history"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zpopmin", TRIMMING)
            .on(Keys::State("history"), Access::Write)
            .args("{key}"),
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
            trim: redis::Script::new(TRIM),
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
            place: None,
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
        w.trim(now - 3_600_000, 1).await.unwrap();
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

    /// An entry written before groups: the firing's own field and index entry.
    async fn stored_alone(conn: &Conn, id: &str, at_ms: i64) {
        let stored = format!("[\"a:reload\"]\n{}", firing_text(id));
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(minute_key("kw:", at_ms))
            .arg(id)
            .arg(stored)
            .ignore()
            .cmd("ZADD")
            .arg("kw:history")
            .arg(at_ms)
            .arg(id)
            .ignore()
            .query_async(&mut conn.clone())
            .await
            .unwrap();
    }

    fn ids(records: &[Record]) -> Vec<String> {
        records
            .iter()
            .map(|r| r.str_field("id").to_string())
            .collect()
    }

    /// Groups overlap in time (two instances write at once) and sit beside entries written
    /// before groups: the list is newest first all the same, a firing of one millisecond after
    /// another by id (descending, as the index orders entries of one score), and every firing
    /// is found by its id.
    #[tokio::test]
    async fn groups_and_single_entries_list_newest_first_and_each_is_found_by_id() {
        let (_server, mut w, conn) = writer(3_600_000).await;
        let t = clock::now_ms() - 10_000;
        w.try_store(&[fired("a", t + 1), fired("d", t + 4), fired("f", t + 6)])
            .await
            .unwrap();
        w.try_store(&[fired("b", t + 2), fired("e", t + 4), fired("g", t + 7)])
            .await
            .unwrap();
        stored_alone(&conn, "c", t + 3).await;
        stored_alone(&conn, "h", t + 8).await;
        w.try_store(&[outcome("d", t + 4, "a:reload", "sent", 1)])
            .await
            .unwrap();
        let got = all(&conn).await;
        assert_eq!(ids(&got), ["h", "g", "f", "e", "d", "c", "b", "a"]);
        assert_eq!(got[4].actions.len(), 1, "{:?}", got[4]);
        for limit in 1..=8 {
            let filter = Filter {
                limit,
                ..Default::default()
            };
            let page = list(&mut conn.clone(), "kw:", &filter).await.unwrap();
            assert_eq!(ids(&page), ids(&got[..limit]));
        }
        for id in ["a", "c", "e", "h"] {
            let filter = Filter {
                id: Some(id.into()),
                limit: 10,
                ..Default::default()
            };
            let one = list(&mut conn.clone(), "kw:", &filter).await.unwrap();
            assert_eq!(ids(&one), [id]);
            let f = firing(&mut conn.clone(), "kw:", id).await.unwrap().unwrap();
            assert_eq!(f.id, id);
        }
        assert!(
            firing(&mut conn.clone(), "kw:", "*")
                .await
                .unwrap()
                .is_none()
        );
        // Since 5 ms after t: the groups' older firings are left out.
        let filter = Filter {
            since: Some(std::time::Duration::from_millis(
                (clock::now_ms() - (t + 5)) as u64,
            )),
            limit: 10,
            ..Default::default()
        };
        let recent = list(&mut conn.clone(), "kw:", &filter).await.unwrap();
        assert_eq!(ids(&recent), ["h", "g", "f"]);
    }

    /// The bound counts firings, not index entries: groups go whole, oldest first, until at
    /// most `max` firings are left, entries written before groups counting one each.
    #[tokio::test]
    async fn trimming_by_count_counts_a_groups_firings() {
        let (_server, mut w, conn) = writer(3_600_000).await;
        let t = clock::now_ms() - 200_000;
        stored_alone(&conn, "old", t - 60_000).await;
        w.try_store(&[fired("a1", t), fired("a2", t + 1)])
            .await
            .unwrap();
        w.try_store(&[fired("b1", t + 61_000), fired("b2", t + 61_001)])
            .await
            .unwrap();
        w.try_store(&[fired("c1", t + 122_000), fired("c2", t + 122_001)])
            .await
            .unwrap();
        w.trim(t - 120_000, 4).await.unwrap();
        assert_eq!(ids(&all(&conn).await), ["c2", "c1", "b2", "b1"]);
        let left: usize = redis::cmd("HLEN")
            .arg(minute_key("kw:", t))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(left, 0, "the trimmed group's field is gone");
        let extra: i64 = redis::cmd("HGET")
            .arg("kw:history.count")
            .arg("n")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(extra, 2, "two groups of two left");
        // By time: the groups observed before the cut go.
        w.trim(t + 100_000, 100).await.unwrap();
        assert_eq!(ids(&all(&conn).await), ["c2", "c1"]);
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
