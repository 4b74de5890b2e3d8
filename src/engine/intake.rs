//! The intake: an event this instance takes is in Redis from the moment it is claimed until its
//! jobs are stored and its details removed, so a crash at any point in between leaves it to
//! another instance or to this one's restart, never to nobody.
//!
//! Taking a batch is one script on the state server, atomic per event: the ledger's bookkeeping
//! (the key's deadline leaves the ledger and is remembered as handled), the claim shared by every
//! instance (one firing per event), and, where this instance won the claim, an *intake record*
//! leased to it: the event as it was taken. A crash between these steps cannot happen; a crash
//! after them leaves the record, which comes due when its lease ends.
//!
//! The record then moves on with the jobs: storing the event's jobs and rewriting (or clearing)
//! its record is one transaction (see [`crate::delivery::Delivery::accept`]). A record whose
//! details are still to be removed says so, so a crash between storing and removing leads the
//! next taker to remove them, not to fire again. A record whose details could not be read waits
//! for its retry, with its attempts counted, in the same sorted set.
//!
//! Claims: an expiry whose deadline this script takes out of the ledger (or the poked set, or
//! the field ledger) is claimed by that removal itself: `ZREM` answers one caller only, so no
//! claim is written for it. An instance that hears the same `expired` later finds the deadline
//! in the handled memory instead, and knows that someone took it. Other events with a known
//! deadline are claimed as a field of a hash shared by every deadline in the same minute
//! (`HSETNX`), spread over sixteen hashes by the claim's first hex digit and dropped ten minutes
//! after that minute ends: a key per claim (`SET NX PX`) would make Redis publish an `expire`
//! event per claim to every subscriber. Without a known deadline the claim can only tell copies
//! from repeats by time: a key that lives 5 s. A scanner warning is claimed once per rule, key
//! and deadline, until a minute after the deadline.
//!
//! Handled deadlines are remembered by *when they were handled*, not by deadline: in one hash
//! per minute, which Redis drops ten minutes after that minute ends. An instance that reads an
//! `expired` minutes late still finds the deadline the first instance took and does not fire a
//! second time. One field written per expiry and nothing to trim: a sorted set trimmed by time
//! cost three writes per expiry, which in a mass expiry was a good part of Redis's work.
//!
//! An `expired` taken without a known deadline is remembered as `~T` (taken at `T`): a deadline
//! of that key read before it went but written to the ledger after (a fill's scan, another
//! instance's `expire`) is then recognised as this one and not written back
//! ([`crate::source::ledger::Ledger::record`]), where it would have been found gone and fired a
//! second time as recovered.
//!
//! A caveat of the removal being the claim: an instance whose rules (mid-reload) watch a key only
//! for warnings takes its deadline out of the ledger without firing, and another instance whose
//! rules already fire on it then finds the deadline handled and does not fire either.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::event::{EventKind, KeyEvent};
use crate::keyspace::{Conn, clock};
use crate::store::intake::{Batch, Records};

/// A clock skew allowance: an `expired` for a key whose recorded deadline is further in the
/// future than this belongs to an older incarnation of the key.
pub const SKEW_MS: i64 = 2000;

/// How the take script treats one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// An `expired` of a key the ledger watches: its deadline leaves the ledger; it fires when
    /// `fire` (some rule reacts to it; a key watched only for warnings just leaves the ledger).
    /// `at`: the second the ledger's index says its deadline is in
    /// ([`crate::source::ledger::Ledger::taking`]); without it the take looks in the last
    /// minute's.
    Live { fire: bool, at: Option<i64> },
    /// An expiry the ledger found missed: taken only if still missed (a late `expired` or
    /// another instance may have taken it meanwhile).
    Recovered { fire: bool },
    /// Any other event: its own deadline, if it has one.
    Plain,
    /// A scanner warning for one rule.
    Warning { rule: String },
    /// A hash field found gone at its deadline (`hexpired`): taken only if the field ledger
    /// still holds it, and out of it in the same step ([`crate::source::fields`]).
    Field { fire: bool },
}

/// What the intake needs of an event to run it again after a crash: the event, and for a
/// warning the rule it is for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub kind: EventKind,
    pub db: u32,
    /// Written as its cut view when longer than [`crate::long_key::EXACT`]: the exact bytes
    /// are kept apart ([`Record::key_apart`]) and read back by a taker after a crash.
    #[serde(with = "crate::firing::b64_view")]
    pub key: bytes::Bytes,
    /// A long key's length and SHA-256: where its exact bytes are kept
    /// (docs/reliability.md#bounded-whatever-the-key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_apart: Option<crate::firing::Exact>,
    /// The hash field of a `hexpired` event.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::firing::b64_opt"
    )]
    pub field: Option<Vec<u8>>,
    pub observed_ms: i64,
    #[serde(default)]
    pub ttl_ms: Option<i64>,
    #[serde(default)]
    pub recovered: bool,
    #[serde(default)]
    pub source: String,
    /// A warning's rule; `None`: every rule matching the event.
    #[serde(default)]
    pub rule: Option<String>,
    /// Failed attempts at reading its details.
    #[serde(default)]
    pub attempt: u32,
    #[serde(default)]
    pub failing_since: Option<i64>,
    /// Its jobs are stored; these details remain to be removed.
    #[serde(default)]
    pub remove: Option<Vec<crate::engine::detail::Request>>,
    /// The deadline, when known (kept beside the JSON by the script, see [`encode`]).
    #[serde(skip)]
    pub deadline_ms: Option<i64>,
}

impl Record {
    pub fn of(e: &KeyEvent, rule: Option<String>) -> Record {
        Record {
            kind: e.kind,
            db: e.db,
            key: e.key.clone(),
            key_apart: crate::long_key::is_long(&e.key).then(|| crate::firing::Exact::of(&e.key)),
            field: e.field.clone(),
            observed_ms: e.observed_at.timestamp_millis(),
            ttl_ms: e.ttl_ms,
            recovered: e.recovered,
            source: e.source.clone(),
            rule,
            attempt: 0,
            failing_since: None,
            remove: None,
            deadline_ms: e.deadline.map(|d| d.timestamp_millis()),
        }
    }

    /// The event as it was taken. An expiry is never observed before its deadline: Redis
    /// publishes it at the deadline at the earliest, and an observation stamped earlier is the
    /// error of keywatch's reading of Redis's clock (half a round trip, a millisecond or two
    /// under load; `keyspace::clock`), so it is stamped with the deadline
    /// (docs/rules.md#event-json).
    pub fn event(&self) -> KeyEvent {
        let deadline = self
            .deadline_ms
            .and_then(chrono::DateTime::from_timestamp_millis);
        let observed_at =
            chrono::DateTime::from_timestamp_millis(self.observed_ms).unwrap_or_else(clock::now);
        let observed_at = match deadline {
            Some(d) if matches!(self.kind, EventKind::Expired | EventKind::Hexpired) => {
                observed_at.max(d)
            }
            _ => observed_at,
        };
        KeyEvent {
            kind: self.kind,
            db: self.db,
            key: self.key.clone(),
            field: self.field.clone(),
            observed_at,
            deadline,
            ttl_ms: self.ttl_ms,
            recovered: self.recovered,
            source: self.source.clone(),
            place: None,
        }
    }
}

/// A record of one event as stored: the deadline (or nothing), a newline, the JSON. Records
/// taken one at a time (a detail read waiting for its retry) are stored so.
fn encode(r: &Record) -> String {
    let d = r.deadline_ms.map(|d| d.to_string()).unwrap_or_default();
    format!("{d}\n{}", serde_json::to_string(r).unwrap_or_default())
}

/// A record of several events, as the take script writes it: `B`, then a line per event: its
/// id, a tab, its deadline (or nothing), a tab, its JSON. JSON holds no raw tab or newline.
fn encode_batch<'a>(events: impl IntoIterator<Item = (&'a str, &'a Record)>) -> String {
    let mut out = String::from("B");
    for (id, r) in events {
        push_line(
            &mut out,
            id,
            r.deadline_ms,
            &serde_json::to_string(r).unwrap_or_default(),
        );
    }
    out
}

/// A `B` line: id, deadline (or nothing), JSON, tab separated.
fn push_line(out: &mut String, id: &str, deadline_ms: Option<i64>, json: &str) {
    out.push('\n');
    out.push_str(id);
    out.push('\t');
    if let Some(d) = deadline_ms {
        let _ = std::fmt::Write::write_fmt(out, format_args!("{d}"));
    }
    out.push('\t');
    out.push_str(json);
}

/// A record of events whose jobs are stored, as [`Intake::moved_on`] rewrites it: each event's
/// `B` line as it was taken (its JSON as stored, not written again) with a fourth part, after
/// another tab, the JSON of the details that remain to be removed. Writing each event's JSON
/// again with its removals was a twentieth of the intake's CPU in a mass expiry.
fn encode_removals<'a>(
    events: impl IntoIterator<Item = (&'a Taken, &'a [crate::engine::detail::Request])>,
) -> String {
    let mut out = String::from("B");
    for (t, remove) in events {
        push_line(&mut out, &t.event, t.record.deadline_ms, &t.json);
        out.push('\t');
        out.push_str(&serde_json::to_string(remove).unwrap_or_default());
    }
    out
}

/// A record of one event: the record and its JSON as stored.
fn decode(stored: &str) -> Result<(Record, Arc<str>), String> {
    let (d, json) = stored
        .split_once('\n')
        .ok_or_else(|| "no deadline line".to_string())?;
    let mut r: Record = serde_json::from_str(json).map_err(|e| e.to_string())?;
    r.deadline_ms = parse_deadline(d);
    Ok((r, json.into()))
}

/// One event of a stored record: its id within the record, the record, its JSON as stored.
type Stored = (String, Record, Arc<str>);

/// The events of the record stored as `id`; `apart`: the lines its take kept apart (see
/// [`crate::store::intake::LINES_APART`]), for a record that names only the events won (`S`).
fn decode_stored(id: &str, stored: &str, apart: &str) -> Result<Vec<Stored>, String> {
    if let Some(rest) = stored.strip_prefix("C\n") {
        return decode_taken(rest);
    }
    if let Some(won) = stored.strip_prefix("S\n") {
        return decode_taken(&format!("{won}\n{apart}"));
    }
    let Some(lines) = stored.strip_prefix("B\n") else {
        let (r, json) = decode(stored)?;
        return Ok(vec![(id.to_string(), r, json)]);
    };
    lines
        .split('\n')
        .map(|line| {
            let mut parts = line.splitn(4, '\t');
            let (Some(event), Some(d), Some(json)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(format!(
                    "a line of the record is not id, deadline, JSON: {line:?}"
                ));
            };
            let mut r: Record = serde_json::from_str(json).map_err(|e| e.to_string())?;
            r.deadline_ms = parse_deadline(d);
            // Details to remove, kept beside the JSON (see `encode_removals`).
            if let Some(remove) = parts.next() {
                r.remove = Some(serde_json::from_str(remove).map_err(|e| e.to_string())?);
            }
            Ok((event.to_string(), r, json.into()))
        })
        .collect()
}

/// A record as the take script writes it: a line of the events won (`N:DEADLINE`, comma
/// separated, `N` counting the lines below from 1), then every event's JSON, a line each.
fn decode_taken(stored: &str) -> Result<Vec<Stored>, String> {
    let (won, lines) = stored
        .split_once('\n')
        .ok_or_else(|| "no line of events won".to_string())?;
    let lines: Vec<&str> = lines.split('\n').collect();
    won.split(',')
        .map(|w| {
            let (n, d) = w
                .split_once(':')
                .ok_or_else(|| format!("not N:DEADLINE: {w:?}"))?;
            let json = n
                .parse::<usize>()
                .ok()
                .and_then(|n| lines.get(n.checked_sub(1)?))
                .ok_or_else(|| format!("no event {n:?} in the record"))?;
            let mut r: Record = serde_json::from_str(json).map_err(|e| e.to_string())?;
            r.deadline_ms = parse_deadline(d).or(r.deadline_ms);
            Ok((n.to_string(), r, (*json).into()))
        })
        .collect()
}

/// A deadline as Redis writes a score or a field: an integer, or a float for a score.
fn parse_deadline(s: &str) -> Option<i64> {
    if s.is_empty() {
        return None;
    }
    s.parse::<i64>()
        .ok()
        .or_else(|| s.parse::<f64>().ok().map(|f| f as i64))
}

/// One event taken by this instance.
#[derive(Clone, Debug)]
pub struct Taken {
    /// The intake record that holds it, with the other events taken beside it: the unit that
    /// is leased, renewed, handed back, taken over and cleared.
    pub id: String,
    /// The event's id within its record.
    pub event: String,
    pub record: Record,
    /// The record's JSON as stored (without the deadline and removals kept beside it): a
    /// record rewritten to "details to remove" keeps it as it is.
    pub json: Arc<str>,
}

/// Where a taken event goes once its batch's firing stage is done with it.
#[derive(Clone, Debug)]
pub enum Next {
    /// Its jobs are stored (in the transaction these commands join); `Some`: these details
    /// remain to be removed, and its record keeps it until they are.
    Stored(Option<Vec<crate::engine::detail::Request>>),
    /// Its details could not be read: it leaves its record for one of its own, due at this
    /// time for whoever takes it then, with its attempts counted.
    RetryAt(i64, Box<Record>),
    /// Nothing more to do for it: given up, its dead letters kept by these commands (in the
    /// same transaction that clears its record).
    GivenUp(Vec<redis::Cmd>),
}

/// Intake record ids are unique per process, whatever the instance's name.
static RECORDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[derive(Clone)]
pub struct Intake {
    /// Where records and claims are kept: leased for [`crate::store::lease`], renewed every
    /// [`crate::store::renew_every`] while in hand.
    store: Records,
    prefix: String,
    instance: String,
    /// When this intake started: with [`RECORDS`], makes record ids unique across restarts
    /// of an instance whose name (host and pid) comes back.
    started_ms: i64,
    /// Records in hand: their leases are renewed until they are cleared.
    held: Arc<Mutex<HashSet<String>>>,
}

impl Intake {
    pub fn new(conn: Conn, prefix: &str, instance: &str) -> Intake {
        Intake {
            store: Records::new(conn, prefix),
            prefix: prefix.to_string(),
            instance: instance.to_string(),
            started_ms: chrono::Utc::now().timestamp_millis(),
            held: Arc::default(),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record_id(&self) -> String {
        let n = RECORDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("b:{}:{}:{n}", self.instance, self.started_ms)
    }

    /// Takes the events of `db` (with how each is to be treated): one script, which records
    /// every event this instance wins in one intake record. Returns, per event, what this
    /// instance now holds, or `None` where another instance (or an earlier take) has it or
    /// nothing fires.
    pub async fn take(
        &self,
        db: u32,
        events: &[(&KeyEvent, Mode)],
    ) -> redis::RedisResult<Vec<Option<Taken>>> {
        let now = clock::now_ms();
        let batch = self.record_id();
        let mut records = Vec::with_capacity(events.len());
        // Every event's record JSON, a line each (JSON holds no raw newline), as one argument;
        // each line is kept with its event as well (see `Taken::json`).
        let mut blob = String::new();
        let mut jsons: Vec<Arc<str>> = Vec::with_capacity(events.len());
        let mut line = |r: &Record| {
            let json = serde_json::to_string(r).unwrap_or_default();
            if !blob.is_empty() {
                blob.push('\n');
            }
            blob.push_str(&json);
            jsons.push(json.into());
        };
        // Per event: its mode's letter, and its arguments: a live expiry's key and second (the
        // letters `L`, `l`: its kind is `expired`), a recovery's key (`R`, `r`), any other
        // event's kind, key, given deadline and extra. In a storm every event is a live expiry:
        // two arguments each, not five.
        let mut modes = String::with_capacity(events.len());
        let mut args: Vec<bytes::Bytes> = Vec::with_capacity(events.len());
        // A long key is kept before the script, which reads it there: its argument names where
        // (docs/reliability.md#bounded-whatever-the-key). Its record holds its cut view.
        let mut long: Vec<usize> = Vec::new();
        let mut uploads: Vec<(&bytes::Bytes, &str)> = Vec::new();
        let mut key_arg =
            |args: &mut Vec<bytes::Bytes>, r: &Record, e: &'_ KeyEvent| match &r.key_apart {
                Some(x) => {
                    long.push(args.len());
                    args.push(crate::store::long_keys::key(&self.prefix, &x.sha256).into());
                }
                None => args.push(e.key.clone()),
            };
        for (e, mode) in events {
            if let (Mode::Field { fire }, Some(field)) = (mode, &e.field) {
                // The member names the field, so the claim is the field's; the index entry
                // leaves with the member.
                let r = Record::of(e, None);
                line(&r);
                modes.push(if *fire { 'F' } else { 'f' });
                // A long hash by the SHA-256 its record holds (`store::fields::HashId`).
                let hash = match &r.key_apart {
                    Some(x) => crate::store::fields::HashId::Long {
                        len: e.key.len(),
                        sha256: x.sha256.clone(),
                    },
                    None => crate::store::fields::HashId::Bytes(e.key.to_vec()),
                };
                args.push(e.kind.as_str().as_bytes().to_vec().into());
                args.push(crate::store::fields::member(&hash, field).into());
                args.push(field.clone().into());
                args.push(crate::store::fields::index(&self.prefix, db, &hash).into());
                records.push(r);
                continue;
            }
            if let Mode::Live { fire, at } = mode {
                let r = Record::of(e, None);
                line(&r);
                // With its place (`M`, `m`) when the subscriber gave one: the claim if the
                // ledger turns out not to know its deadline.
                modes.push(match (fire, &e.place) {
                    (true, None) => 'L',
                    (false, None) => 'l',
                    (true, Some(_)) => 'M',
                    (false, Some(_)) => 'm',
                });
                key_arg(&mut args, &r, e);
                args.push(
                    at.map(|s| s.to_string().into_bytes())
                        .unwrap_or_default()
                        .into(),
                );
                if let Some(place) = &e.place {
                    args.push(place.to_string().into_bytes().into());
                }
                records.push(r);
                continue;
            }
            let (code, given, extra, rule) = match mode {
                Mode::Live { .. } => unreachable!("taken above"),
                Mode::Recovered { fire: true } => ('R', None, None, None),
                Mode::Recovered { fire: false } => ('r', None, None, None),
                // Without a deadline, its place (if any) names its claim.
                Mode::Plain | Mode::Field { .. } => (
                    'P',
                    e.deadline,
                    Some(
                        e.place
                            .as_ref()
                            .filter(|_| e.deadline.is_none())
                            .map(|p| p.to_string().into_bytes())
                            .unwrap_or_default(),
                    ),
                    None,
                ),
                Mode::Warning { rule } => {
                    let d = e.deadline.map_or(0, |d| d.timestamp_millis());
                    let claim = crate::store::intake::warned(&self.prefix, e.db, rule, d, &e.key);
                    ('W', e.deadline, Some(claim), Some(rule.clone()))
                }
            };
            // The deadline is not in the JSON (the script writes the one it learns beside it).
            let r = Record::of(e, rule);
            line(&r);
            modes.push(code);
            match extra {
                None => key_arg(&mut args, &r, e),
                Some(extra) => {
                    args.push(e.kind.as_str().as_bytes().to_vec().into());
                    key_arg(&mut args, &r, e);
                    args.push(
                        given
                            .map(|d| d.timestamp_millis().to_string().into_bytes())
                            .unwrap_or_default()
                            .into(),
                    );
                    args.push(extra.into());
                }
            }
            records.push(r);
        }
        for ((e, _), r) in events.iter().zip(&records) {
            if let Some(x) = &r.key_apart
                && !uploads.iter().any(|(_, sha)| *sha == x.sha256)
            {
                uploads.push((&e.key, &x.sha256));
            }
        }
        for (exact, sha256) in uploads {
            self.store.keep_long(&self.instance, exact, sha256).await?;
        }
        // The events won, `n:deadline` joined by commas (n counts from 1).
        let won = self
            .store
            .take(&Batch {
                db,
                now_ms: now,
                due_limit_ms: now + SKEW_MS,
                instance: &self.instance,
                id: &batch,
                blob: &blob,
                modes: &modes,
                args: &args,
                long: &long,
            })
            .await?;
        let mut deadlines: Vec<Option<Option<i64>>> = vec![None; records.len()];
        for w in won.split(',').filter(|w| !w.is_empty()) {
            if let Some((n, d)) = w.split_once(':')
                && let Ok(n) = n.parse::<usize>()
                && let Some(slot) = n.checked_sub(1).and_then(|i| deadlines.get_mut(i))
            {
                *slot = Some(parse_deadline(d));
            }
        }
        let mut taken = Vec::with_capacity(events.len());
        for (i, ((deadline, mut record), json)) in
            deadlines.into_iter().zip(records).zip(jsons).enumerate()
        {
            let Some(d) = deadline else {
                taken.push(None);
                continue;
            };
            record.deadline_ms = d.or(record.deadline_ms);
            taken.push(Some(Taken {
                id: batch.clone(),
                event: (i + 1).to_string(),
                record,
                json,
            }));
        }
        if taken.iter().any(Option::is_some) {
            self.held().insert(batch);
        }
        Ok(taken)
    }

    /// Keeps the exact bytes of the long keys and fields of `records` (a key kept at its take is
    /// only renewed, by the hash its record holds), for the jobs and dead letters that name them
    /// by their hash (docs/reliability.md#bounded-whatever-the-key).
    pub async fn keep_long_values(&self, records: &[&Record]) -> redis::RedisResult<()> {
        let mut kept: Vec<String> = Vec::new();
        for r in records {
            let key = r.key_apart.as_ref().map(|x| (&r.key[..], x.sha256.clone()));
            let field = r
                .field
                .as_deref()
                .filter(|f| crate::long_key::is_long(f))
                .map(|f| (f, crate::long_key::sha256_hex(f)));
            for (v, sha) in key.into_iter().chain(field) {
                if !kept.contains(&sha) {
                    self.store.keep_long(&self.instance, v, &sha).await?;
                    kept.push(sha);
                }
            }
        }
        Ok(())
    }

    /// When the first record's lease ends or its retry is due (Redis's clock, ms).
    pub async fn earliest(&self) -> redis::RedisResult<Option<i64>> {
        self.store.earliest().await
    }

    /// Takes over records whose lease ended (their taker died, stopped or is retrying a detail
    /// read), up to `max` records (each may hold a batch of events), leased to this instance.
    /// A record that no longer decodes is cleared with an error in the log: it can never be run.
    pub async fn take_over(&self, max: usize) -> redis::RedisResult<Vec<Taken>> {
        let now = clock::now_ms();
        let triples = self.store.take_over(now, max).await?;
        let mut out = Vec::new();
        let mut broken = Vec::new();
        for pair in triples.chunks_exact(3) {
            let decoded = match decode_stored(&pair[0], &pair[1], &pair[2]) {
                Ok(events) => self.whole_keys(events).await?,
                Err(e) => Err(e),
            };
            match decoded {
                Ok(events) => {
                    self.held().insert(pair[0].clone());
                    out.extend(events.into_iter().map(|(event, record, json)| Taken {
                        id: pair[0].clone(),
                        event,
                        record,
                        json,
                    }));
                }
                Err(e) => {
                    tracing::error!(id = %pair[0], error = %e, "An intake record cannot be read (written by another version?); it is dropped.");
                    broken.push(pair[0].clone());
                }
            }
        }
        if !broken.is_empty() {
            self.clear(&broken).await?;
        }
        Ok(out)
    }

    /// `events` with their long keys read back where their take kept them (their records hold
    /// cut views, docs/reliability.md#bounded-whatever-the-key): `Err` (the record cannot be
    /// run) when one is gone or is not the bytes its record names.
    async fn whole_keys(
        &self,
        events: Vec<Stored>,
    ) -> redis::RedisResult<Result<Vec<Stored>, String>> {
        let mut out = Vec::with_capacity(events.len());
        for (event, mut record, json) in events {
            if let Some(x) = &record.key_apart {
                match self.store.read_long(&x.sha256).await? {
                    Some(exact)
                        if exact.len() == x.len
                            && crate::long_key::sha256_hex(&exact) == x.sha256 =>
                    {
                        record.key = exact.into()
                    }
                    Some(_) => {
                        return Ok(Err(format!(
                            "the long key kept as {} is not the bytes its record names",
                            x.sha256
                        )));
                    }
                    None => {
                        return Ok(Err(format!(
                            "the long key kept as {} is gone (kept {} days after its take)",
                            x.sha256,
                            crate::store::long_keys::KEEP.as_secs() / 86_400
                        )));
                    }
                }
            }
            out.push((event, record, json));
        }
        Ok(Ok(out))
    }

    /// The commands that, run in one transaction with storing the events' jobs, move each
    /// record on. A record whose events are all done is cleared; one with details still to
    /// remove is rewritten to hold just those events (so a crash before the removal leads the
    /// next taker to remove them, not to fire again); an event that waits for a retry moves to a
    /// record of its own, due then. Every event of a record must be given: an event left out is
    /// dropped with it.
    pub fn moved_on(&self, events: &[(&Taken, Next)]) -> Vec<redis::Cmd> {
        let mut by_record: std::collections::BTreeMap<
            &str,
            Vec<(&Taken, &[crate::engine::detail::Request])>,
        > = Default::default();
        let mut split = Vec::new();
        let mut cmds = Vec::new();
        for (t, next) in events {
            let kept = by_record.entry(t.id.as_str()).or_default();
            match next {
                Next::Stored(Some(remove)) => kept.push((*t, remove.as_slice())),
                Next::Stored(None) => {}
                Next::GivenUp(letters) => cmds.extend(letters.iter().cloned()),
                Next::RetryAt(due, record) => {
                    split.push((t.id.as_str(), t.event.as_str(), *due, record))
                }
            }
        }
        let mut cleared = Vec::new();
        for (id, kept) in by_record {
            if kept.is_empty() {
                cleared.push(id);
            } else {
                cmds.push(
                    self.store
                        .rewrite(id, &encode_removals(kept.iter().copied())),
                );
            }
        }
        if !cleared.is_empty() {
            cmds.extend(self.store.clearing(&cleared));
            let mut held = self.held();
            for id in cleared {
                held.remove(id);
            }
        }
        // After the clearing: an event retried again keeps the id of the record it is alone in.
        for (record_id, event, due, record) in split {
            // Named after the record it leaves (event ids are unique only within it); one that
            // is alone in its record already keeps that name.
            let id = if event == record_id {
                event.to_string()
            } else {
                format!("{record_id}/{event}")
            };
            cmds.extend(self.store.putting(&id, &encode(record), due));
        }
        cmds
    }

    /// Runs commands of [`Intake::moved_on`] on their own, when no job is stored with them.
    pub async fn apply(&self, cmds: Vec<redis::Cmd>) -> redis::RedisResult<()> {
        self.store.apply(cmds).await
    }

    /// Clears records whose work is done.
    pub async fn clear(&self, ids: &[String]) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        {
            let mut held = self.held();
            for id in ids {
                held.remove(id);
            }
        }
        self.store.clear(ids).await
    }

    /// Puts the records of `events` back as they were taken, due at `due_ms` (whoever takes
    /// them then); only those still in the intake. Every event of a record must be given.
    pub async fn put_back(&self, events: &[&Taken], due_ms: i64) -> redis::RedisResult<()> {
        let mut by_record: std::collections::BTreeMap<&str, Vec<(&str, &Record)>> =
            Default::default();
        for t in events {
            by_record
                .entry(t.id.as_str())
                .or_default()
                .push((t.event.as_str(), &t.record));
        }
        for (id, events) in by_record {
            self.held().remove(id);
            self.store.retry(id, due_ms, &encode_batch(events)).await?;
        }
        Ok(())
    }

    /// Stops renewing records this instance cannot move on: they come due when their lease
    /// ends, for whoever takes them then.
    pub fn release(&self, ids: &[String]) {
        let mut held = self.held();
        for id in ids {
            held.remove(id);
        }
    }

    /// Extends the leases of the records in hand.
    pub async fn renew(&self) -> redis::RedisResult<()> {
        let ids: Vec<String> = self.held().iter().cloned().collect();
        self.store
            .set_due(&ids, clock::now_ms() + crate::store::lease_ms())
            .await
    }

    /// Hands the records in hand back at shutdown: due now, for any instance. Returns how
    /// many records (each may hold several events).
    pub async fn hand_back(&self) -> redis::RedisResult<usize> {
        let ids: Vec<String> = self.held().drain().collect();
        self.store.set_due(&ids, clock::now_ms()).await?;
        Ok(ids.len())
    }

    /// Records waiting or in hand, for the metrics.
    pub async fn len(&self) -> redis::RedisResult<i64> {
        self.store.len().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long key crosses to Redis once, kept apart: its record holds the cut view, and a taker
    /// after a crash reads the exact bytes back; a record whose kept key is gone is dropped
    /// saying so, not run with the cut view (docs/reliability.md#bounded-whatever-the-key).
    #[tokio::test]
    async fn a_long_keys_record_holds_its_cut_view_and_a_taker_reads_the_key_back() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let long = bytes::Bytes::from([b"big:".as_slice(), &[b'k'; 3 << 20]].concat());
        let e = KeyEvent {
            kind: EventKind::Deleted,
            db: 0,
            key: long.clone(),
            field: None,
            observed_at: chrono::Utc::now(),
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: "here".into(),
            place: None,
        };
        let a = Intake::new(conn.clone(), "kw:", "a");
        let taken = a.take(0, &[(&e, Mode::Plain)]).await.unwrap();
        let t = taken[0].as_ref().expect("taken");
        assert_eq!(t.record.key, long, "the taker keeps the exact key");
        let mut c = conn.clone();
        let stored: Vec<String> = records(&conn, "HVALS").await;
        assert!(
            stored[0].len() < 4096,
            "the record holds the cut view: {} bytes",
            stored[0].len()
        );
        // The taker dies; another takes the record over with the exact key.
        a.hand_back().await.unwrap();
        let b = Intake::new(conn.clone(), "kw:", "b");
        let over = b.take_over(10).await.unwrap();
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].record.key, long);
        // Its kept key gone (a week later), the record cannot be run: dropped, not run cut.
        b.hand_back().await.unwrap();
        let sha = crate::long_key::sha256_hex(&long);
        let _: () = redis::cmd("DEL")
            .arg(crate::store::long_keys::key("kw:", &sha))
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(a.take_over(10).await.unwrap().is_empty());
        let left: usize = records(&conn, "HLEN").await;
        assert_eq!(left, 0);
    }

    /// `COMMAND kw:intake:events` (`HKEYS`, `HVALS`, `HLEN`): the intake's records as stored.
    async fn records<T: redis::FromRedisValue>(conn: &Conn, command: &str) -> T {
        redis::cmd(command)
            .arg("kw:intake:events")
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    /// A storm's batch keeps its events' lines apart from the record (`ID:b`, written beside the
    /// take script: Redis's Lua hashes every byte it is given): a taker after a crash gets every
    /// event won with its deadline, a take that wins nothing leaves no lines behind, and
    /// clearing the record takes its lines with it.
    #[tokio::test]
    async fn a_storms_lines_kept_apart_come_back_with_its_record_and_go_with_it() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let events: Vec<KeyEvent> = (0..300)
            .map(|i| {
                let mut e = expired(0, format!("delay:task:{i}").as_bytes());
                e.kind = EventKind::Deleted;
                e.deadline = chrono::DateTime::from_timestamp_millis(4_000 + i);
                e
            })
            .collect();
        let batch: Vec<(&KeyEvent, Mode)> = events.iter().map(|e| (e, Mode::Plain)).collect();
        let a = Intake::new(conn.clone(), "kw:", "a");
        let taken = a.take(0, &batch).await.unwrap();
        assert!(taken.iter().all(Option::is_some), "every event is won");
        let id = taken[0].as_ref().unwrap().id.clone();
        let fields: Vec<String> = records(&conn, "HKEYS").await;
        assert_eq!(
            fields.len(),
            2,
            "the record and its lines apart: {fields:?}"
        );
        assert!(fields.contains(&format!("{id}:b")), "{fields:?}");
        // Taken again by another instance: nothing is won, and nothing is left behind.
        let b = Intake::new(conn.clone(), "kw:", "b");
        let again = b.take(0, &batch).await.unwrap();
        assert!(again.iter().all(Option::is_none));
        let left: usize = records(&conn, "HLEN").await;
        assert_eq!(left, 2, "a take that wins nothing keeps no lines");
        // The taker dies; another takes the record over whole.
        a.hand_back().await.unwrap();
        let over = b.take_over(10).await.unwrap();
        assert_eq!(over.len(), events.len());
        for (t, e) in over.iter().zip(&events) {
            assert_eq!(t.id, id);
            assert_eq!(t.record.key, e.key);
            assert_eq!(
                t.record.deadline_ms,
                e.deadline.map(|d| d.timestamp_millis())
            );
        }
        b.clear(std::slice::from_ref(&id)).await.unwrap();
        let left: usize = records(&conn, "HLEN").await;
        assert_eq!(left, 0, "the lines go with their record");
    }

    #[test]
    fn a_record_keeps_the_deadline_beside_its_json_and_any_key_bytes() {
        let e = KeyEvent {
            kind: EventKind::Expired,
            db: 3,
            key: bytes::Bytes::from(b"k\n\xff\0".to_vec()),
            field: None,
            observed_at: chrono::DateTime::from_timestamp_millis(5_000).unwrap(),
            deadline: chrono::DateTime::from_timestamp_millis(4_990),
            ttl_ms: None,
            recovered: true,
            source: "n:1".into(),
            place: None,
        };
        let (r, json) = decode(&encode(&Record::of(&e, None))).unwrap();
        assert_eq!(r.event(), e);
        assert_eq!(
            &*json,
            serde_json::to_string(&Record::of(&e, None)).unwrap()
        );
        let mut plain = e.clone();
        plain.deadline = None;
        assert_eq!(
            decode(&encode(&Record::of(&plain, None)))
                .unwrap()
                .0
                .event(),
            plain
        );
    }

    #[test]
    fn a_batch_record_keeps_each_event_its_id_and_deadline() {
        let mut a = Record::of(
            &KeyEvent {
                kind: EventKind::Expired,
                db: 0,
                key: bytes::Bytes::from(b"a\t\nb".to_vec()),
                field: None,
                observed_at: chrono::DateTime::from_timestamp_millis(5_000).unwrap(),
                deadline: chrono::DateTime::from_timestamp_millis(4_990),
                ttl_ms: None,
                recovered: false,
                source: "n:1".into(),
                place: None,
            },
            None,
        );
        let mut b = a.clone();
        b.deadline_ms = None;
        b.rule = Some("warn\tme".into());
        a.remove = Some(Vec::new());
        let stored = encode_batch([("e1", &a), ("e2", &b)]);
        let back = decode_stored("b:x", &stored, "").unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].0, "e1");
        assert_eq!(back[0].1.event(), a.event());
        assert_eq!(back[0].1.remove, Some(Vec::new()));
        assert_eq!(back[1].0, "e2");
        assert_eq!(back[1].1.deadline_ms, None);
        assert_eq!(back[1].1.rule.as_deref(), Some("warn\tme"));
        // A record of one event (a retry's) is its own event.
        let one = decode_stored("e3", &encode(&a), "").unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].0, "e3");
        assert_eq!(one[0].1.event(), a.event());
        assert!(decode_stored("b:y", "B\nno tabs here", "").is_err());
    }

    /// An `expired` of `key` observed at 5 s, without a deadline.
    fn expired(db: u32, key: &[u8]) -> KeyEvent {
        KeyEvent {
            kind: EventKind::Expired,
            db,
            key: bytes::Bytes::from(key.to_vec()),
            field: None,
            observed_at: chrono::DateTime::from_timestamp_millis(5_000).unwrap(),
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: "n:1".into(),
            place: None,
        }
    }

    /// An expiry heard a millisecond "before" its deadline (keywatch's reading of Redis's clock
    /// is off by half a round trip) is stamped with its deadline: `late_ms` 0, never a negative
    /// lateness. A warning is heard before its deadline by design, and keeps its instant.
    #[test]
    fn an_expiry_is_never_observed_before_its_deadline() {
        let at = |ms| chrono::DateTime::from_timestamp_millis(ms).unwrap();
        let mut r = Record::of(&expired(0, b"k"), None);
        r.deadline_ms = Some(5_001);
        let e = r.event();
        assert_eq!((e.observed_at, e.deadline), (at(5_001), Some(at(5_001))));
        assert_eq!(e.late_ms(), Some(0));
        r.deadline_ms = Some(4_990);
        assert_eq!(r.event().observed_at, at(5_000), "heard after it: as heard");
        let mut warning = expired(0, b"k");
        warning.kind = EventKind::Expiring;
        let mut w = Record::of(&warning, Some("r".into()));
        w.deadline_ms = Some(65_000);
        assert_eq!(w.event().observed_at, at(5_000));
    }

    #[test]
    fn a_taken_record_holds_only_the_events_won_with_the_deadlines_learnt() {
        let e = |key: &str| Record::of(&expired(0, key.as_bytes()), None);
        let blob = [e("a"), e("b"), e("c")]
            .iter()
            .map(|r| serde_json::to_string(r).unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        let back = decode_stored("b:z", &format!("C\n1:4990,3:\n{blob}"), "").unwrap();
        let got: Vec<(&str, &[u8], Option<i64>)> = back
            .iter()
            .map(|(id, r, _)| (id.as_str(), &r.key[..], r.deadline_ms))
            .collect();
        assert_eq!(got, [("1", &b"a"[..], Some(4990)), ("3", &b"c"[..], None)]);
        assert!(decode_stored("b:z", &format!("C\n4:1\n{blob}"), "").is_err());
    }

    #[test]
    fn a_record_rewritten_with_its_removals_keeps_each_events_json_as_it_was_taken() {
        let taken = |event: &str, key: &[u8], deadline: Option<i64>| {
            let mut record = Record::of(&expired(2, key), None);
            record.deadline_ms = deadline;
            record.attempt = 2;
            Taken {
                id: "b:1".into(),
                event: event.into(),
                json: serde_json::to_string(&record).unwrap().into(),
                record,
            }
        };
        let a = taken("1", b"order:\t\n\xff", Some(4_990));
        let b = taken("3", b"*", None);
        let at = |key: &[u8], field: &[u8]| crate::engine::detail::Request {
            db: 2,
            at: crate::engine::detail::Location::Hash {
                key: key.to_vec(),
                field: field.to_vec(),
            },
            remove: true,
        };
        let ra = vec![at(b"d\tetail", b"\n\xfe"), at(b"x", b"y")];
        let rb = vec![at(b"d", b"*")];
        let stored = encode_removals([(&a, ra.as_slice()), (&b, rb.as_slice())]);
        // The events' JSON is in the record as it was taken, byte for byte.
        assert!(stored.contains(&*a.json) && stored.contains(&*b.json));
        let back = decode_stored("b:1", &stored, "").unwrap();
        let got: Vec<(&str, Option<i64>, u32, &Option<Vec<_>>)> = back
            .iter()
            .map(|(id, r, _)| (id.as_str(), r.deadline_ms, r.attempt, &r.remove))
            .collect();
        assert_eq!(
            got,
            [
                ("1", Some(4_990), 2, &Some(ra.clone())),
                ("3", None, 2, &Some(rb.clone()))
            ]
        );
        assert_eq!(back[0].1.event(), a.record.event());
        assert_eq!(back[1].1.key, &b"*"[..]);
        assert_eq!(&*back[0].2, &*a.json);
        assert!(decode_stored("b:1", "B\n1\t\t{}\tnot json", "").is_err());
    }

    #[test]
    fn deadlines_read_from_scores_and_fields() {
        assert_eq!(parse_deadline("1733000000123"), Some(1_733_000_000_123));
        assert_eq!(parse_deadline("1.733000000123e12"), Some(1_733_000_000_123));
        assert_eq!(parse_deadline(""), None);
    }
}
