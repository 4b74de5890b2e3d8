//! History: every firing and what became of each of its actions, kept in Redis by whichever
//! instance did the work, so that `keywatch history`, `GET /api/history` and the status page
//! answer "did the alert for order 42 go out, and what did DingTalk answer?" after a restart
//! and for every instance.
//!
//! Layout under `state.prefix`: a sorted set `history` (member = event id, score = when it was
//! observed, ms) and one hash per minute of observation, `history:@MINUTE` (the observed ms
//! divided by 60,000), holding for each firing of that minute the field `ID`, the event JSON of
//! SPEC §4, and the field `ID:a`, its actions' latest outcomes as lines `"a:ACTION"<TAB>JSON`
//! (the name as a JSON string: `"a:reload"`, `"a:notify:oncall"`). One hash per minute rather than per firing: in a storm a
//! key of its own, created and given a TTL per firing and again per outcome, was a quarter of
//! what the state server spent. Memory is bounded twice: each minute's hash expires
//! `history.keep` after the latest firing in it, and the index is trimmed by time and to
//! [`MAX_FIRINGS`] entries (the trimmed firings' fields removed). Hashes of one firing each
//! (`history:ID`, fields `event` and `a:ACTION`), written before this layout, are still read.
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

/// Longest the writer waits for more entries to store with the first one.
const LINGER: Duration = Duration::from_millis(20);

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

/// Where a firing's hash was before firings were kept by minute; still read.
fn record_key(prefix: &str, id: &str) -> String {
    format!("{prefix}history:{id}")
}

/// The span of observation whose firings share a hash.
const MINUTE_MS: i64 = 60_000;

/// The hash of the firings observed in the minute of `at_ms`.
fn minute_key(prefix: &str, at_ms: i64) -> String {
    format!("{prefix}history:@{}", at_ms.div_euclid(MINUTE_MS))
}

/// The field of a firing's outcomes in its minute's hash.
fn outcomes_field(id: &str) -> String {
    format!("{id}:a")
}

// Writes a batch into the minutes' hashes KEYS (ARGV[i]: KEYS[i] is to last at least until
// then, unix ms: `keep` after the latest firing of the batch in that minute), then
// entries of four arguments: kind, index of its hash in KEYS, firing id, value. Kind `e`: the
// value is the event JSON. Kind `a`: the value is `"a:ACTION"<TAB>JSON`, the action's latest
// outcome, replacing that action's line in the firing's outcomes; kind `d` likewise, but a dead
// letter whose JSON says `"attempts":0` keeps the attempts its line had. One `HSET` per hash.
const PUT: &str = r#"
local n = #KEYS
local fields = {}
local function current(k, f)
  local t = fields[k]
  if not t then
    t = {}
    fields[k] = t
  end
  if t[f] == nil then
    t[f] = redis.call('HGET', KEYS[k], f) or false
  end
  return t
end
for i = n + 1, #ARGV, 4 do
  local kind, k, id, value = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  if kind == 'e' then
    fields[k] = fields[k] or {}
    fields[k][id] = value
  else
    local f = id .. ':a'
    local t = current(k, f)
    local name = string.match(value, '^[^\t]*\t')
    local kept = {}
    if t[f] then
      for line in string.gmatch(t[f], '[^\n]+') do
        if string.sub(line, 1, #name) == name then
          local attempts = string.match(line, '"attempts":(%d+)')
          if kind == 'd' and attempts then
            value = (string.gsub(value, '"attempts":0', '"attempts":' .. attempts, 1))
          end
        else
          kept[#kept + 1] = line
        end
      end
    end
    kept[#kept + 1] = value
    t[f] = table.concat(kept, '\n')
  end
end
for k = 1, n do
  local args = {}
  for f, v in pairs(fields[k] or {}) do
    if v then
      args[#args + 1] = f
      args[#args + 1] = v
    end
  end
  for j = 1, #args, 1000 do
    redis.call('HSET', KEYS[k], unpack(args, j, math.min(j + 999, #args)))
  end
  -- Only ever later: a batch of outcomes of older firings must not cut newer ones short.
  local left = redis.call('PTTL', KEYS[k])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if left < 0 or now + left < tonumber(ARGV[k]) then
    redis.call('PEXPIREAT', KEYS[k], ARGV[k])
  end
end
return 0
"#;

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
        /// When its firing was observed: the minute whose hash holds it.
        at_ms: i64,
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
            put: redis::Script::new(PUT),
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

    /// One attempt of `action` of the firing `f`, the `attempts`-th, ended with `outcome`.
    pub fn attempt(&self, f: &Firing, action: &Action, outcome: &Outcome, attempts: u32) {
        let (label, error) = match outcome {
            // A follow-up that had nothing to do (see `action::followup`).
            Outcome::Sent(t) if t.starts_with(CANCELLED) => ("skipped", Some(t.clone())),
            Outcome::Sent(_) => ("sent", None),
            Outcome::Retry { reason, .. } => ("retrying", Some(reason.clone())),
            Outcome::Failed(reason) => ("dead", Some(reason.clone())),
        };
        self.action(f, action, label, attempts, error);
    }

    /// `action` of the firing `f` was given up (a dead letter) for `reason`.
    pub fn dead(&self, f: &Firing, action: &Action, reason: &str) {
        // 0: the writer keeps the attempts already recorded.
        self.action(f, action, "dead", 0, Some(reason.to_string()));
    }

    /// A firing that does not run its actions (silenced, or a recovery its rule skips): kept
    /// with each action `skipped` and why.
    pub fn skipped(&self, f: &Firing, actions: &[Action], why: &str) {
        self.firing(f);
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
        self.send(Entry::Action {
            id: f.id.clone(),
            at_ms: f.observed_at.timestamp_millis(),
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
    put: redis::Script,
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
        // The minutes' hashes this batch writes to, each expiring `keep` after its minute.
        let mut minutes: Vec<String> = Vec::new();
        let keep_ms = self.keep_ms;
        let mut minute_of = |at_ms: i64, expires: &mut Vec<i64>| {
            let key = minute_key(&self.prefix, at_ms);
            let until = at_ms.saturating_add(keep_ms);
            match minutes.iter().position(|m| *m == key) {
                Some(i) => {
                    expires[i] = expires[i].max(until);
                    i + 1
                }
                None => {
                    minutes.push(key);
                    expires.push(until);
                    minutes.len()
                }
            }
        };
        let mut expires = Vec::new();
        let mut entries: Vec<(&str, usize, &str, String)> = Vec::with_capacity(batch.len());
        let mut index_add = redis::cmd("ZADD");
        index_add.arg(&index);
        let mut firings = 0;
        for e in batch {
            match e {
                Entry::Firing { id, at_ms, event } => {
                    firings += 1;
                    index_add.arg(*at_ms).arg(id);
                    let k = minute_of(*at_ms, &mut expires);
                    entries.push(("e", k, id, event.clone()));
                }
                Entry::Action {
                    id,
                    at_ms,
                    field,
                    record,
                } => {
                    let k = minute_of(*at_ms, &mut expires);
                    // A dead letter says 0 attempts: the script keeps those already recorded.
                    let kind = if record.attempts == 0 && record.outcome == "dead" {
                        "d"
                    } else {
                        "a"
                    };
                    let json = serde_json::to_string(record).unwrap_or_default();
                    // The name as a JSON string: neither part then holds a tab or a newline,
                    // whatever a channel is called.
                    let name = serde_json::to_string(field).unwrap_or_default();
                    entries.push((kind, k, id, format!("{name}\t{json}")));
                }
            }
        }
        let mut put = self.put.prepare_invoke();
        for m in &minutes {
            put.key(m);
        }
        put.arg(&expires);
        for (kind, k, id, value) in &entries {
            put.arg(*kind).arg(*k).arg(*id).arg(value);
        }
        put.invoke_async::<()>(&mut self.conn).await?;
        if firings == 0 {
            return Ok(());
        }
        let mut p = redis::pipe();
        p.add_command(index_add).ignore();
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

    /// Drops the `excess` oldest firings: their fields in their minutes' hashes (and a hash
    /// of their own, from before the minutes' hashes).
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
        let mut by_minute: std::collections::BTreeMap<String, redis::Cmd> = Default::default();
        let mut unlink = redis::cmd("UNLINK");
        for (id, at) in &old {
            by_minute
                .entry(minute_key(&self.prefix, *at as i64))
                .or_insert_with_key(|key| {
                    let mut c = redis::cmd("HDEL");
                    c.arg(key);
                    c
                })
                .arg(id)
                .arg(outcomes_field(id));
            unlink.arg(record_key(&self.prefix, id));
        }
        let mut p = redis::pipe();
        for hdel in by_minute.into_values() {
            p.add_command(hdel).ignore();
        }
        p.add_command(unlink).ignore();
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(&index)
            .arg(old.iter().map(|(id, _)| id).collect::<Vec<_>>());
        p.add_command(zrem).ignore();
        p.query_async(&mut self.conn).await
    }
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
            .arg(PAGE)
            .arg("WITHSCORES");
        let page: Vec<(String, f64)> = range.query_async(conn).await?;
        if page.is_empty() {
            break;
        }
        offset += page.len();
        let mut p = redis::pipe();
        for (id, at) in &page {
            let mut c = redis::cmd("HMGET");
            c.arg(minute_key(prefix, *at as i64))
                .arg(id)
                .arg(outcomes_field(id));
            p.add_command(c);
        }
        let found: Vec<(Option<String>, Option<String>)> = p.query_async(conn).await?;
        // Firings kept before the minutes' hashes, in a hash of their own.
        let older: Vec<&str> = page
            .iter()
            .zip(&found)
            .filter(|(_, (event, _))| event.is_none())
            .map(|((id, _), _)| id.as_str())
            .collect();
        let mut legacy: std::collections::HashMap<&str, Vec<(String, String)>> = Default::default();
        if !older.is_empty() {
            let mut p = redis::pipe();
            for id in &older {
                let mut c = redis::cmd("HGETALL");
                c.arg(record_key(prefix, id));
                p.add_command(c);
            }
            let hashes: Vec<Vec<(String, String)>> = p.query_async(conn).await?;
            legacy.extend(older.into_iter().zip(hashes));
        }
        let hashes = page
            .iter()
            .zip(found)
            .map(|((id, _), (event, outcomes))| match event {
                Some(event) => stored_fields(event, outcomes),
                None => legacy.remove(id.as_str()).unwrap_or_default(),
            });
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

/// A firing's fields in its minute's hash, as the fields of a hash of its own (what
/// [`parse_record`] reads): `event`, and one `a:ACTION` per line of its outcomes.
fn stored_fields(event: String, outcomes: Option<String>) -> Vec<(String, String)> {
    let mut fields = vec![("event".to_string(), event)];
    for line in outcomes.as_deref().unwrap_or("").lines() {
        if let Some((name, json)) = line.split_once('\t')
            && let Ok(name) = serde_json::from_str::<String>(name)
        {
            fields.push((name, json.to_string()));
        }
    }
    fields
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
    /// The commands history sends, its script's included ([`crate::keyspace::commands`]).
    const WHY = "history of firings and outcomes";
    const SCRIPT = "history of firings and outcomes (script)";
    [
        Use::new(Conn::State, "zadd", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} 0 id"),
        Use::new(Conn::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Conn::State, "evalsha", WHY)
            .on(Keys::State("history:*"), Access::ReadWrite)
            .args("{sha} 1 {prefix}history:@0"),
        Use::new(Conn::State, "hget", SCRIPT)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key} id:a"),
        Use::new(Conn::State, "hset", SCRIPT)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} id json"),
        Use::new(Conn::State, "pexpireat", SCRIPT)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} 1000"),
        Use::new(Conn::State, "pttl", SCRIPT)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "time", SCRIPT),
        Use::new(Conn::State, "zremrangebyscore", WHY)
            .on(Keys::State("history"), Access::ReadWrite)
            .args("{key} -inf 0"),
        Use::new(Conn::State, "zcard", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "zrange", WHY)
            .on(Keys::State("history"), Access::Read)
            .args("{key} 0 0 WITHSCORES"),
        Use::new(Conn::State, "hdel", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key} id id:a"),
        Use::new(Conn::State, "unlink", WHY)
            .on(Keys::State("history:*"), Access::Write)
            .args("{key}"),
        Use::new(Conn::State, "zrem", WHY)
            .on(Keys::State("history"), Access::Write)
            .args("{key} id"),
        Use::new(Conn::State, "hmget", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key} id id:a"),
        Use::new(Conn::State, "hgetall", WHY)
            .on(Keys::State("history:*"), Access::Read)
            .args("{key}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_lines_name_their_action_as_a_json_string_whatever_the_channel_is_called() {
        let name = serde_json::to_string("a:notify:odd\tname\nhere").unwrap();
        let lines = format!("{name}\t{{\"x\":1}}\n\"a:reload\"\t{{\"y\":2}}");
        let fields = stored_fields("{}".into(), Some(lines));
        assert_eq!(
            fields,
            [
                ("event".to_string(), "{}".to_string()),
                (
                    "a:notify:odd\tname\nhere".to_string(),
                    r#"{"x":1}"#.to_string()
                ),
                ("a:reload".to_string(), r#"{"y":2}"#.to_string()),
            ]
        );
    }

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
