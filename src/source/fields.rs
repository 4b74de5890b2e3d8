//! Hash-field expiry (`on: [hexpired]`): which field expired, on time, and the ones missed.
//!
//! The server's `hexpired` keyevent names only the hash, comes once per expiry cycle for however
//! many fields went, and about 100 ms late at p99; reading a due field (`HPEXPIRETIME`, `HGET`)
//! answers "gone" but neither reclaims it nor publishes anything (checked on Valkey 9.1.2). So,
//! like the key ledger ([`super::ledger`]), keywatch keeps the deadlines of the fields its rules
//! watch in Redis (shared by instances, surviving restarts):
//!
//! - `{prefix}fields:{db}:at:SECOND` (and `…:long`): per second of deadlines, `LEN:KEYFIELD`
//!   members (the key's length, a colon, the key's bytes, the field's bytes) → ms within the
//!   second, with `{prefix}fields:{db}:minutes` listing the minutes that hold some, for the
//!   poker: the key ledger's compact form (docs/how-it-works.md#the-ledgers-compact-form);
//! - `{prefix}fields:{db}:h:KEY`: per watched hash, field → deadline, to find a hash's fields
//!   and where each field's deadline is.
//!
//! Deadlines are learnt when a hash changes (`hexpire`: the hash is walked with `HSCAN … NOVALUES`
//! and its fields' deadlines read with `HPEXPIRETIME`, paced; one walk covers every `hexpire` heard
//! meanwhile), and at start-up and after every resubscription by a paced `SCAN … TYPE hash`.
//! `hpersist`, `hdel`, `del` and `hexpired` make keywatch look again at the fields it knows of
//! that hash only.
//!
//! A known deadline that has come is read again; a field the server calls gone is reported as a
//! `hexpired` event with its field, there and then. Taking it out of the ledger is one step of
//! the intake script ([`crate::engine::intake`], mode `F`) with its claim and record, so a
//! crash between finding it and storing its jobs leaves it in the ledger for the restart, which
//! reports it `recovered` (its deadline came before this instance started).
//!
//! Not seen: a field whose deadline is set and comes before keywatch learns it (shorter than the
//! learning lag), and, without flag `g`, a hash deleted outright (`DEL`) before its fields' deadlines
//! (its fields then look expired at their deadlines).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, LiveConfig};
use crate::event::{EventKind, KeyEvent};
use crate::keyspace::clock::now_ms;
use crate::keyspace::{Conn, Keyspace};
use crate::source::ledger::alarm::{Alarm, until_past};
use crate::source::{Change, Signal};

/// The keyevents that tell about a hash's fields (under flags `h`, `x`, and `g` for `del` and
/// the hash moving: a hash renamed or `MOVE`d takes its fields' deadlines along).
pub const CHANNELS: [&str; 9] = [
    "hexpire",
    "hpersist",
    "hdel",
    "hexpired",
    "del",
    "rename_from",
    "rename_to",
    "move_from",
    "move_to",
];

/// The least time between two rounds of the poker for one database while due fields wait for
/// the engine; otherwise it sleeps until the next deadline (as the key ledger's poker,
/// [`crate::source::ledger::alarm`]).
const POKE_EVERY: Duration = Duration::from_millis(2);
/// Due fields read per round trip.
const POKE_BATCH: usize = 2000;
/// Fields per `HSCAN` page and per `HPEXPIRETIME`.
const PAGE: usize = 1000;
/// A due field reported to the engine is not reported again for this long (the engine takes it
/// out of the ledger meanwhile, or it was lost with a crash and the restart finds it).
const RESEND_AFTER: Duration = Duration::from_secs(5);

/// The `Change` a keyevent name stands for.
pub fn change_of(event: &str) -> Option<Change> {
    match event {
        "hexpire" => Some(Change::Learn),
        "hpersist" | "hdel" | "hexpired" => Some(Change::Check),
        _ => None,
    }
}

use crate::store::fields as store;
pub use crate::store::fields::{HashId, member, split};

/// Fields of one hash with the deadlines the field ledger holds for them.
type Known = Vec<(Vec<u8>, i64)>;

/// A hash the field ledger works on: its name, one copy that its fields' events share, and how
/// the ledger names it ([`HashId`]: by its SHA-256 when the name is long).
#[derive(Clone)]
struct Hash {
    key: bytes::Bytes,
    id: HashId,
}

impl Hash {
    fn of(key: bytes::Bytes) -> Hash {
        Hash {
            id: HashId::of(&key),
            key,
        }
    }

    /// A hash the ledger names by its bytes (`HashId::Bytes`).
    fn named(key: Vec<u8>) -> Hash {
        Hash {
            key: key.clone().into(),
            id: HashId::Bytes(key),
        }
    }
}

/// Whether the server expires hash fields: `Err` says which version is needed and what it runs.
///
/// Valkey reports `redis_version:7.2.4` whatever its own version, so `valkey_version` decides
/// there; a server that reports neither enough is asked `HPEXPIRETIME` itself.
pub async fn support(conn: &mut impl redis::aio::ConnectionLike, node: &str) -> Result<(), String> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let (product, version, enough) = match (field("valkey_version"), field("redis_version")) {
        (Some(v), _) => ("Valkey", v.clone(), at_least(&v, (9, 0))),
        (None, Some(v)) => ("Redis", v.clone(), at_least(&v, (7, 4))),
        (None, None) => ("the server", "of unknown version".to_string(), false),
    };
    if enough {
        return Ok(());
    }
    let tried: redis::RedisResult<redis::Value> = redis::cmd("HPEXPIRETIME")
        .arg("keywatch:doctor:probe")
        .arg("FIELDS")
        .arg(1)
        .arg("f")
        .query_async(conn)
        .await;
    match tried {
        Ok(_) => Ok(()),
        Err(_) => Err(format!(
            "`hexpired` rules need hash-field expiry, which {node} lacks: it runs {product} {version}; Redis 7.4 or later, or Valkey 9.0 or later, is needed (upgrade the server, or remove the `hexpired` rules)"
        )),
    }
}

/// Whether a field's expiry at `deadline` was reported within [`RESEND_AFTER`].
fn was_sent(sent: Option<&(i64, Instant)>, deadline: i64) -> bool {
    sent.is_some_and(|(d, at)| *d == deadline && at.elapsed() < RESEND_AFTER)
}

/// Whether a dotted version is at least `(major, minor)`.
fn at_least(version: &str, want: (u32, u32)) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= want
}

/// The field ledger of one keywatch instance.
#[derive(Clone)]
pub struct FieldLedger {
    inner: Arc<Inner>,
}

struct Inner {
    state: Conn,
    keyspace: Keyspace,
    prefix: String,
    /// Hashes to look at again, with the most a keyevent asked (a walk covers a check).
    dirty: Mutex<BTreeMap<(u32, bytes::Bytes), Change>>,
    /// Set by a (re)subscription: walk every watched hash again.
    fill: std::sync::atomic::AtomicBool,
    /// Set by a flush or a swap heard ([`FieldLedger::emptied`]): whether by a swap, and the
    /// earliest moment it may have happened (server's clock, ms).
    emptied: Mutex<Option<(bool, i64)>>,
    wake: Notify,
    /// When the poker looks next, and its wake-up for a deadline written earlier.
    alarm: Alarm,
    /// Deadlines before this were due while this instance was not running: found `recovered`.
    started_ms: i64,
    /// Due members reported to the engine: the deadline reported, and when (a new deadline of
    /// the same field is a new expiry, reported at once).
    sent: Mutex<HashMap<Vec<u8>, (i64, Instant)>>,
}

impl FieldLedger {
    pub fn new(state: Conn, keyspace: Keyspace, prefix: &str) -> FieldLedger {
        FieldLedger {
            inner: Arc::new(Inner {
                state,
                keyspace,
                prefix: prefix.to_string(),
                dirty: Mutex::default(),
                fill: std::sync::atomic::AtomicBool::new(false),
                emptied: Mutex::default(),
                wake: Notify::new(),
                alarm: Alarm::default(),
                started_ms: now_ms(),
                sent: Mutex::default(),
            }),
        }
    }

    /// The per-hash index of `key` in `db`: field → deadline.
    pub fn index(prefix: &str, db: u32, key: &[u8]) -> Vec<u8> {
        crate::store::fields::index(prefix, db, &HashId::of(key))
    }

    /// A keyevent about hash `key` (the engine calls this; the work happens in [`FieldLedger::run`]).
    pub fn notice(&self, db: u32, key: bytes::Bytes, change: Change) {
        let mut dirty = self.inner.dirty.lock().unwrap_or_else(|p| p.into_inner());
        let e = dirty.entry((db, key)).or_insert(change);
        *e = (*e).max(change);
        drop(dirty);
        self.inner.wake.notify_one();
    }

    /// Events may have been lost (a resubscription): walk every watched hash again.
    pub fn resync(&self) {
        self.inner
            .fill
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.inner.wake.notify_one();
    }

    /// Hashes may have left the watched databases from `since_ms` on without a keyevent (a
    /// `FLUSHDB`, `FLUSHALL`, or a `SWAPDB` if `swapped`): every hash with known field deadlines
    /// is looked at again, and after a swap the hashes it brought in are learnt
    /// (docs/how-it-works.md#flushes-and-swaps).
    pub fn emptied(&self, swapped: bool, since_ms: i64) {
        let mut e = self.inner.emptied.lock().unwrap_or_else(|p| p.into_inner());
        *e = Some(match *e {
            Some((s, at)) => (s || swapped, at.min(since_ms)),
            None => (swapped, since_ms),
        });
        drop(e);
        if swapped {
            self.resync();
        }
        self.inner.wake.notify_one();
    }

    fn state(&self) -> Conn {
        self.inner.state.clone()
    }

    /// The known deadlines of the fields of `hash`.
    async fn known(&self, db: u32, hash: &HashId) -> redis::RedisResult<HashMap<Vec<u8>, i64>> {
        store::known(&mut self.state(), &self.inner.prefix, db, hash).await
    }

    /// The hash a ledger member names, with its name: a long one's read from where it is kept
    /// (`None` if gone: its fields are forgotten). A long hash an earlier keywatch named by its
    /// bytes is moved to its SHA-256 first, so that the take, which names it so, finds it.
    async fn resolve(&self, db: u32, id: HashId) -> redis::RedisResult<Option<Hash>> {
        match id {
            HashId::Bytes(key) if crate::long_key::is_long(&key) => {
                let old = HashId::Bytes(key.clone());
                let known: Vec<(Vec<u8>, i64)> = self.known(db, &old).await?.into_iter().collect();
                let hash = Hash::of(crate::long_key::shared(key));
                let moved: Vec<_> = known.iter().map(|(f, d)| (f.clone(), Some(*d))).collect();
                self.write(db, &hash, &moved).await?;
                let forget: Vec<_> = known.into_iter().map(|(f, _)| (f, None)).collect();
                store::write(
                    &mut self.state(),
                    &self.inner.prefix,
                    db,
                    &hash.key,
                    &old,
                    &forget,
                )
                .await?;
                Ok(Some(hash))
            }
            HashId::Bytes(key) => Ok(Some(Hash::named(key))),
            HashId::Long { len, ref sha256 } => {
                let name = store::name(&self.state(), &self.inner.prefix, db, len, sha256).await?;
                match name {
                    Some(key) => Ok(Some(Hash {
                        key: crate::long_key::shared(key),
                        id,
                    })),
                    None => {
                        // Its name is kept while its index holds a field: what is left of it
                        // was written by hand or half-deleted by hand.
                        let forget: Vec<_> = self
                            .known(db, &id)
                            .await?
                            .into_keys()
                            .map(|f| (f, None))
                            .collect();
                        // None left: the take of its last field deleted it meanwhile.
                        if !forget.is_empty() {
                            tracing::warn!(
                                db,
                                sha256 = %sha256,
                                fields = forget.len(),
                                "Field ledger: the name of a long hash is gone; its fields are forgotten."
                            );
                        }
                        let empty = bytes::Bytes::new();
                        store::write(
                            &mut self.state(),
                            &self.inner.prefix,
                            db,
                            &empty,
                            &id,
                            &forget,
                        )
                        .await?;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Reads the deadlines of `fields` of `key` (`-2` gone, `-1` none), at most `per_second`
    /// fields a second, each with the server's time just before it was read ([`timed`]).
    async fn deadlines(
        &self,
        db: u32,
        key: &[u8],
        fields: &[Vec<u8>],
        per_second: u64,
    ) -> redis::RedisResult<Vec<(i64, i64)>> {
        if fields.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(fields.len());
        let conn = self.inner.keyspace.conn(db).await?;
        let started = Instant::now();
        for chunk in fields.chunks(PAGE) {
            let should_take = Duration::from_secs_f64(out.len() as f64 / per_second.max(1) as f64);
            if let Some(wait) = should_take.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            let (at, answers) = read_fields(&conn, key, chunk).await?;
            out.extend(answers.into_iter().map(|d| (d, at)));
        }
        Ok(out)
    }

    /// Writes deadlines (`Some`) and forgets fields (`None`) of `hash`.
    async fn write(
        &self,
        db: u32,
        hash: &Hash,
        changes: &[(Vec<u8>, Option<i64>)],
    ) -> redis::RedisResult<()> {
        if changes.is_empty() {
            return Ok(());
        }
        store::write(
            &mut self.state(),
            &self.inner.prefix,
            db,
            &hash.key,
            &hash.id,
            changes,
        )
        .await?;
        if let Some(earliest) = changes.iter().filter_map(|(_, d)| *d).min() {
            self.inner.alarm.learnt(db, earliest);
        }
        Ok(())
    }

    /// The event of a field found gone at or after its deadline: it shares the hash's name.
    fn event(&self, db: u32, hash: &Hash, field: &[u8], deadline_ms: i64) -> Signal {
        Signal::Event(KeyEvent {
            kind: EventKind::Hexpired,
            db,
            key: hash.key.clone(),
            field: Some(field.to_vec()),
            observed_at: crate::keyspace::clock::now(),
            deadline: chrono::DateTime::from_timestamp_millis(deadline_ms),
            ttl_ms: None,
            recovered: deadline_ms < self.inner.started_ms,
            source: self.inner.keyspace.node(),
            place: None,
        })
    }

    /// Whether `m` due at `deadline` may be reported now (not reported within
    /// [`RESEND_AFTER`]); marks it reported.
    fn may_send(&self, m: &[u8], deadline: i64) -> bool {
        let mut sent = self.inner.sent.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if sent.len() > 100_000 {
            sent.retain(|_, (_, at)| now.duration_since(*at) < RESEND_AFTER);
        }
        if was_sent(sent.get(m), deadline) {
            return false;
        }
        sent.insert(m.to_vec(), (deadline, now));
        true
    }

    /// Judges known fields of `key` against what the server says now: gone past the deadline is
    /// an expiry (reported); gone before it was a delete, and no deadline a persist (forgotten);
    /// another deadline is recorded. `now` holds the server's answers, in the order of `known`,
    /// each with the server's own time just before it was read: "past the deadline" is judged on
    /// the server's clock, never on keywatch's estimate of it, which may lag by more than the
    /// time between an expiry and its check (fields expired at their deadline were forgotten as
    /// deleted under load).
    async fn judge(
        &self,
        db: u32,
        hash: &Hash,
        known: &[(Vec<u8>, i64)],
        now: &[(i64, i64)],
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<bool> {
        let mut changes = Vec::new();
        let mut events = Vec::new();
        for ((f, d), (t, at)) in known.iter().zip(now) {
            match *t {
                // Already reported and not yet taken: left alone, not forgotten.
                -2 if *d <= at + SKEW_MS => events.extend(
                    self.may_send(&member(&hash.id, f), *d)
                        .then(|| self.event(db, hash, f, *d)),
                ),
                -2 | -1 => changes.push((f.clone(), None)),
                t if t > 0 && t != *d => changes.push((f.clone(), Some(t))),
                _ => {}
            }
        }
        self.write(db, hash, &changes).await?;
        for e in events {
            if tx.send(e).await.is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Looks at the known fields of `key` again (after `hpersist`, `hdel`, `hexpired`, `del`).
    async fn check(
        &self,
        db: u32,
        hash: &Hash,
        per_second: u64,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<bool> {
        let known: Vec<(Vec<u8>, i64)> = self.known(db, &hash.id).await?.into_iter().collect();
        if known.is_empty() {
            return Ok(true);
        }
        let fields: Vec<Vec<u8>> = known.iter().map(|(f, _)| f.clone()).collect();
        let now = self.deadlines(db, &hash.key, &fields, per_second).await?;
        self.judge(db, hash, &known, &now, tx).await
    }

    /// After a flush or a swap ([`FieldLedger::emptied`]): in each watched database that lost
    /// hashes, every hash with known field deadlines is judged again. A hash the server no
    /// longer holds while one of its known deadlines is still to come was taken by the flush or
    /// the swap, not expired: its fields due from `since_ms` on are forgotten, never reported
    /// (those due earlier expired before it and are judged as usual). After a swap the fill that
    /// follows ([`FieldLedger::emptied`] asks for it) walks every hash still there.
    async fn settle(
        &self,
        config: &Config,
        swapped: bool,
        since_ms: i64,
        per_second: u64,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<bool> {
        for &db in &config.redis.databases {
            if !swapped && !self.lost_hashes(db).await? {
                continue;
            }
            let names = store::names(&self.inner.prefix, db);
            let mut hashes: Vec<HashId> = Vec::new();
            let mut after = None;
            loop {
                let rows = names
                    .between(&mut self.state(), i64::MIN, i64::MAX, &mut after, PAGE)
                    .await?;
                if rows.is_empty() {
                    break;
                }
                hashes.extend(
                    rows.into_iter()
                        .filter_map(|(m, _)| split(&m).map(|(h, _)| h)),
                );
                hashes.sort();
                hashes.dedup();
            }
            let mut taken = 0;
            // One hash at a time, a long one's name read when its turn comes.
            for id in hashes {
                let Some(hash) = self.resolve(db, id).await? else {
                    continue;
                };
                let known: Vec<(Vec<u8>, i64)> =
                    self.known(db, &hash.id).await?.into_iter().collect();
                if known.is_empty() {
                    continue;
                }
                let fields: Vec<Vec<u8>> = known.iter().map(|(f, _)| f.clone()).collect();
                let now = self.deadlines(db, &hash.key, &fields, per_second).await?;
                if was_taken(&known, &now) {
                    let (gone, due): (Vec<_>, Vec<_>) = known
                        .into_iter()
                        .zip(now)
                        .partition(|((_, d), _)| *d >= since_ms);
                    taken += gone.len();
                    let forget: Vec<(Vec<u8>, Option<i64>)> =
                        gone.into_iter().map(|((f, _), _)| (f, None)).collect();
                    self.write(db, &hash, &forget).await?;
                    let (due, now): (Vec<_>, Vec<_>) = due.into_iter().unzip();
                    if !self.judge(db, &hash, &due, &now, tx).await? {
                        return Ok(false);
                    }
                } else if !self.judge(db, &hash, &known, &now, tx).await? {
                    // After a swap a hash still there may be another of the same name: the fill
                    // that follows walks it, with every hash the swap brought in.
                    return Ok(false);
                }
            }
            if taken > 0 {
                tracing::info!(
                    db,
                    dropped = taken,
                    swapped,
                    "Field ledger: dropped the deadlines of fields a flush or a swap took away; none is reported as expired."
                );
            }
        }
        Ok(true)
    }

    /// Whether `db` lost hashes with known field deadlines: one of the soonest future ones
    /// ([`SAMPLE`]) is gone with its hash. A flush takes every hash, so one is enough; none (a
    /// flush of a database keywatch does not watch) spares the walk.
    async fn lost_hashes(&self, db: u32) -> redis::RedisResult<bool> {
        let rows = store::names(&self.inner.prefix, db)
            .between(&mut self.state(), now_ms(), i64::MAX, &mut None, SAMPLE)
            .await?;
        let mut by_hash: BTreeMap<HashId, Vec<(Vec<u8>, i64)>> = BTreeMap::new();
        for (m, d) in rows.into_iter().take(SAMPLE) {
            if let Some((h, f)) = split(&m) {
                by_hash.entry(h).or_default().push((f, d));
            }
        }
        let (short, long) = by_name_length(by_hash);
        let answers = self.now_of(db, &short).await?;
        if short
            .iter()
            .zip(answers)
            .any(|((_, fs), now)| was_taken(fs, &now))
        {
            return Ok(true);
        }
        for (id, fs) in long {
            let Some(hash) = self.resolve(db, id).await? else {
                continue;
            };
            let fields: Vec<Vec<u8>> = fs.iter().map(|(f, _)| f.clone()).collect();
            let now = self.deadlines(db, &hash.key, &fields, u64::MAX).await?;
            if was_taken(&fs, &now) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What the server says now of the fields of each hash of `hashes` (short names, in its
    /// order), in one pipeline: per field its deadline (`-2` gone, `-1` none) with the server's
    /// time just before the read.
    async fn now_of(
        &self,
        db: u32,
        hashes: &[(Hash, Known)],
    ) -> redis::RedisResult<Vec<Vec<(i64, i64)>>> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let conn = self.inner.keyspace.conn(db).await?;
        let cmds = hashes
            .iter()
            .map(|(h, fs)| {
                let mut c = redis::cmd("HPEXPIRETIME");
                c.arg(&h.key[..]).arg("FIELDS").arg(fs.len());
                for (f, _) in fs {
                    c.arg(f);
                }
                c
            })
            .collect();
        let (at, answers) = timed(&conn, cmds).await?;
        Ok(answers
            .into_iter()
            .map(|now| now.into_iter().map(|t| (t, at)).collect())
            .collect())
    }

    /// Walks hash `key` and records the deadlines of the fields the rules watch, at most
    /// `per_second` fields a second; then judges the known fields the walk did not meet.
    async fn learn(
        &self,
        db: u32,
        hash: &Hash,
        config: &Config,
        per_second: u64,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<bool> {
        let key = &hash.key[..];
        let mut known = self.known(db, &hash.id).await?;
        let conn = self.inner.keyspace.conn(db).await?;
        let started = Instant::now();
        let mut walked: u64 = 0;
        let mut cursor: u64 = 0;
        loop {
            let (next, page) = hscan_page(&conn, key, cursor).await?;
            walked += page.len() as u64;
            let fields: Vec<Vec<u8>> = page
                .into_iter()
                .filter(|f| config.wants_field(db, key, f))
                .collect();
            let now = self.deadlines(db, key, &fields, u64::MAX).await?;
            let mut changes = Vec::new();
            for (f, (t, _)) in fields.into_iter().zip(now) {
                match (t, known.get(&f)) {
                    // Gone since the page was read: judged with the rest below.
                    (-2, Some(_)) => continue,
                    (t, had) if t > 0 && had != Some(&t) => changes.push((f.clone(), Some(t))),
                    (-1, Some(_)) => changes.push((f.clone(), None)),
                    _ => {}
                }
                known.remove(&f);
            }
            self.write(db, hash, &changes).await?;
            if next == 0 {
                break;
            }
            cursor = next;
            let should_take = Duration::from_secs_f64(walked as f64 / per_second.max(1) as f64);
            if let Some(wait) = should_take.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        // Known fields the walk did not meet are gone (HSCAN skips a field past its deadline).
        let rest: Vec<(Vec<u8>, i64)> = known.into_iter().collect();
        if rest.is_empty() {
            return Ok(true);
        }
        let fields: Vec<Vec<u8>> = rest.iter().map(|(f, _)| f.clone()).collect();
        let now = self.deadlines(db, key, &fields, per_second).await?;
        self.judge(db, hash, &rest, &now, tx).await
    }

    /// One round of the poker for `db`: reads every due field again and reports those gone.
    /// Returns how many were read (fields reported and not yet taken are not read again), and
    /// the earliest deadline the field ledger may hold after the round.
    async fn poke(
        &self,
        db: u32,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<(usize, Option<i64>)> {
        let crate::store::ledger::Due {
            rows: due, next, ..
        } = store::due(
            &mut self.state(),
            &self.inner.prefix,
            db,
            now_ms() - 1,
            POKE_BATCH,
        )
        .await?;
        let mut by_hash: BTreeMap<HashId, Vec<(Vec<u8>, i64)>> = BTreeMap::new();
        {
            let sent = self.inner.sent.lock().unwrap_or_else(|p| p.into_inner());
            for (m, d) in due {
                if was_sent(sent.get(&m[..]), d) {
                    continue;
                }
                if let Some((h, f)) = split(&m) {
                    by_hash.entry(h).or_default().push((f, d));
                }
            }
        }
        // Only fields read count: a batch of fields waiting for the engine is not a reason to
        // ask again at once.
        let n = by_hash.values().map(Vec::len).sum();
        if n == 0 {
            return Ok((0, next));
        }
        let (short, long) = by_name_length(by_hash);
        let answers = self.now_of(db, &short).await?;
        for ((hash, fs), now) in short.iter().zip(answers) {
            if !self.judge(db, hash, fs, &now, tx).await? {
                return Ok((n, next));
            }
        }
        // A long name is read, and its fields' deadlines, one hash at a time: its events share
        // the one copy (docs/reliability.md#bounded-whatever-the-key).
        for (id, fs) in long {
            let Some(hash) = self.resolve(db, id).await? else {
                continue;
            };
            let fields: Vec<Vec<u8>> = fs.iter().map(|(f, _)| f.clone()).collect();
            let now = self.deadlines(db, &hash.key, &fields, u64::MAX).await?;
            if !self.judge(db, &hash, &fs, &now, tx).await? {
                break;
            }
        }
        // A deadline the judging moved later is in the alarm (`write`); the round's `next` is
        // no later than what is left.
        Ok((n, next))
    }

    /// What the server says now of each (key, field, _) of `known`: its deadline, `-1` none,
    /// `-2` gone (a long hash's on a connection of its own).
    pub async fn deadlines_of(
        conn: &Conn,
        known: &[(Vec<u8>, Vec<u8>, i64)],
    ) -> redis::RedisResult<Vec<i64>> {
        let cmds = known
            .iter()
            .filter(|(k, _, _)| !crate::long_key::is_long(k))
            .map(|(k, f, _)| {
                let mut c = redis::cmd("HPEXPIRETIME");
                c.arg(k).arg("FIELDS").arg(1).arg(f);
                c
            })
            .collect();
        let mut short = conn.each::<Vec<i64>>(cmds).await?.into_iter();
        let mut out = Vec::with_capacity(known.len());
        for (k, f, _) in known {
            let answer = if crate::long_key::is_long(k) {
                read_fields(conn, k, std::slice::from_ref(f)).await?.1
            } else {
                short.next().unwrap_or_default()
            };
            out.push(answer.first().copied().unwrap_or(-2));
        }
        Ok(out)
    }

    /// Walks every hash the `hexpired` rules' key patterns may name (paced `SCAN … TYPE hash`).
    async fn fill(
        &self,
        config: &Config,
        per_second: u64,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<usize> {
        let mut globs: Vec<Vec<u8>> = config
            .rules
            .iter()
            .filter(|r| r.watches_fields())
            .map(|r| r.pattern.scan_glob().to_vec())
            .collect();
        globs.sort();
        globs.dedup();
        let mut hashes = 0;
        for &db in &config.redis.databases {
            // An earlier keywatch's field ledger (one sorted set) first: its deadlines of fields
            // that expired while no instance ran are found only there (docs/operations.md#upgrading).
            while store::convert(&mut self.state(), &self.inner.prefix, db).await? > 0 {}
            for node in self.inner.keyspace.scan_conns(db).await? {
                for glob in &globs {
                    let mut conn = node.clone();
                    let mut cursor: u64 = 0;
                    loop {
                        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(glob)
                            .arg("COUNT")
                            .arg(PAGE)
                            .arg("TYPE")
                            .arg("hash")
                            .query_async(&mut conn)
                            .await?;
                        for k in keys.iter().filter(|k| {
                            !k.starts_with(self.inner.prefix.as_bytes()) && config.wants_hash(db, k)
                        }) {
                            hashes += 1;
                            let hash = Hash::of(k.clone().into());
                            if !self.learn(db, &hash, config, per_second, tx).await? {
                                return Ok(hashes);
                            }
                        }
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                    }
                }
            }
        }
        Ok(hashes)
    }

    /// Pokes, learns and checks until `shutdown` (or the engine is gone), while some rule in
    /// force watches fields. The poker and the learner run side by side: a long walk of a big
    /// hash never holds back a due field. Errors are logged and retried after a pause.
    pub async fn run(
        self,
        live: LiveConfig,
        tx: mpsc::Sender<Signal>,
        shutdown: CancellationToken,
    ) {
        tokio::join!(
            self.poke_all(&live, &tx, &shutdown),
            self.keep(&live, &tx, &shutdown, "learner", Self::learn_dirty),
        );
    }

    /// Runs `step` when woken (a keyevent named a hash, a resubscription asked for a fill)
    /// under the rules in force, until `shutdown` or until `step` says the engine is gone.
    async fn keep<'a, F, Fut>(
        &'a self,
        live: &'a LiveConfig,
        tx: &'a mpsc::Sender<Signal>,
        shutdown: &CancellationToken,
        what: &str,
        step: F,
    ) where
        F: Fn(&'a Self, Arc<Config>, &'a mpsc::Sender<Signal>) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<bool>>,
    {
        loop {
            let config = live.current();
            let pause = if !config.watches_fields() {
                Some(Duration::from_secs(1))
            } else {
                // Cancelled mid-step at shutdown: every step can be cut anywhere (what it wrote
                // stands; what it had not reached is done by the next run).
                let done = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    done = step(self, config, tx) => done,
                };
                match done {
                    Ok(true) => None,
                    Ok(false) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "Field ledger {what}: Redis error; retrying in a second.");
                        Some(Duration::from_secs(1))
                    }
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause.unwrap_or_default()), if pause.is_some() => {}
                _ = self.inner.wake.notified(), if pause.is_none() => {}
            }
        }
    }

    /// Pokes every database's due fields until `shutdown` or the engine is gone, a batch at a
    /// time while whole batches are new, sleeping in between until the earliest deadline the
    /// field ledger holds, a wake-up for an earlier one written, or the safety round
    /// (docs/how-it-works.md#the-poker).
    async fn poke_all(
        &self,
        live: &LiveConfig,
        tx: &mpsc::Sender<Signal>,
        shutdown: &CancellationToken,
    ) {
        use crate::source::ledger::SAFETY_EVERY;
        let alarm = &self.inner.alarm;
        let mut safety = tokio::time::interval_at(Instant::now() + SAFETY_EVERY, SAFETY_EVERY);
        safety.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Per database, the least time of its next round (see POKE_EVERY).
        let mut not_before: HashMap<u32, Instant> = HashMap::new();
        loop {
            let config = live.current();
            if !config.watches_fields() {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                continue;
            }
            let dbs = config.redis.databases.clone();
            alarm.keep(&dbs);
            let now = now_ms();
            let mut failed = false;
            for &db in &dbs {
                if alarm.planned(db).is_some_and(|at| at >= now)
                    || not_before.get(&db).is_some_and(|t| *t > Instant::now())
                {
                    continue;
                }
                loop {
                    alarm.looking(db);
                    // Cancelled mid-round at shutdown: what it wrote stands, the rest is the
                    // next run's.
                    let done = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        done = self.poke(db, tx) => done,
                    };
                    match done {
                        Ok((n, _)) if n == POKE_BATCH => continue,
                        Ok((_, next)) => {
                            if alarm.plan(db, next) < now_ms() {
                                // Due fields wait for the engine to take them.
                                not_before.insert(db, Instant::now() + POKE_EVERY);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "Field ledger poker: Redis error; retrying in a second.");
                            alarm.plan(db, None);
                            failed = true;
                        }
                    }
                    break;
                }
            }
            if tx.is_closed() {
                return;
            }
            if failed {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                for &db in &dbs {
                    alarm.looking(db);
                }
                continue;
            }
            let wait = dbs
                .iter()
                .map(|db| {
                    let planned = alarm.planned(*db).map_or(Duration::ZERO, until_past);
                    let least = not_before.get(db).map_or(Duration::ZERO, |t| {
                        t.saturating_duration_since(Instant::now())
                    });
                    planned.max(least)
                })
                .min()
                .unwrap_or(SAFETY_EVERY);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = alarm.woken() => {}
                _ = safety.tick() => {
                    for &db in &dbs {
                        match store::earliest(&mut self.state(), &self.inner.prefix, db).await {
                            Ok(Some(at)) => alarm.lower(db, at),
                            Ok(None) => {}
                            Err(e) => tracing::debug!(db, error = %e, "Field ledger poker: cannot read the earliest deadline."),
                        }
                    }
                }
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The hashes keyevents named since the last round, one at a time (one put back when Redis
    /// fails on it), then a fill if one was asked for. `Ok(false)`: the engine is gone.
    async fn learn_dirty(
        &self,
        config: Arc<Config>,
        tx: &mpsc::Sender<Signal>,
    ) -> redis::RedisResult<bool> {
        let pace = config
            .scanner
            .as_ref()
            .map_or(50_000, |s| s.max_keys_per_second);
        loop {
            let next = self
                .inner
                .dirty
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_first();
            let Some(((db, key), change)) = next else {
                break;
            };
            let hash = Hash::of(key);
            let done = match change {
                Change::Learn => self.learn(db, &hash, &config, pace, tx).await,
                Change::Check => self.check(db, &hash, pace, tx).await,
            };
            match done {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => {
                    self.notice(db, hash.key, change);
                    return Err(e);
                }
            }
        }
        let emptied = self
            .inner
            .emptied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((swapped, since_ms)) = emptied {
            match self.settle(&config, swapped, since_ms, pace, tx).await {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => {
                    self.emptied(swapped, since_ms);
                    return Err(e);
                }
            }
        }
        if self
            .inner
            .fill
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            let started = Instant::now();
            match self.fill(&config, pace, tx).await {
                Ok(n) => tracing::info!(
                    hashes = n,
                    took_ms = started.elapsed().as_millis() as u64,
                    "Field ledger: learnt the field deadlines of existing hashes."
                ),
                Err(e) => {
                    self.inner
                        .fill
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        Ok(!tx.is_closed())
    }

    /// The next `limit` field deadlines of `db` up to `until_ms`, soonest first (for `upcoming`):
    /// (key, field, deadline).
    pub async fn upcoming(
        state: &mut Conn,
        prefix: &str,
        db: u32,
        until_ms: i64,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, Vec<u8>, i64)>> {
        let mut rows = store::names(prefix, db)
            .between(state, i64::MIN, until_ms, &mut None, limit)
            .await?;
        rows.truncate(limit);
        let mut out = Vec::with_capacity(rows.len());
        for (m, d) in rows {
            let Some((hash, f)) = split(&m) else {
                continue;
            };
            let key = match hash {
                HashId::Bytes(key) => Some(key),
                HashId::Long { len, sha256 } => {
                    store::name(state, prefix, db, len, &sha256).await?
                }
            };
            out.extend(key.map(|k| (k, f, d)));
        }
        Ok(out)
    }
}

/// Known future field deadlines looked at to tell whether a database lost its hashes
/// ([`FieldLedger::emptied`]).
const SAMPLE: usize = 256;

/// Whether a hash whose `known` fields the server answered `now` (deadline, server time) was
/// taken without a keyevent: every field is gone and one was not due yet. A hash whose every
/// field was due is judged as usual: that is what expiring looks like too.
fn was_taken(known: &[(Vec<u8>, i64)], now: &[(i64, i64)]) -> bool {
    now.iter().all(|(t, _)| *t == -2)
        && known
            .iter()
            .zip(now)
            .any(|((_, d), (_, at))| *d > at + SKEW_MS)
}

/// A field read gone this much before its recorded deadline, on the server's clock, still counts
/// as expired: the server's time is read just before the fields, not with them (and on a
/// cluster perhaps on another node), so a field may expire between the two. Gone earlier, it was
/// deleted.
const SKEW_MS: i64 = 5;

/// Splits hashes by the length of their names: the short ones, named by their bytes, and the
/// long ones, each read and worked on in turn (`FieldLedger::resolve`).
#[allow(clippy::type_complexity)]
fn by_name_length(
    by_hash: BTreeMap<HashId, Vec<(Vec<u8>, i64)>>,
) -> (
    Vec<(Hash, Vec<(Vec<u8>, i64)>)>,
    Vec<(HashId, Vec<(Vec<u8>, i64)>)>,
) {
    let mut short = Vec::new();
    let mut long = Vec::new();
    for (id, fs) in by_hash {
        match id {
            HashId::Bytes(key) if !crate::long_key::is_long(&key) => {
                short.push((Hash::named(key), fs))
            }
            id => long.push((id, fs)),
        }
    }
    (short, long)
}

/// The deadlines of `fields` of hash `key` (`-2` gone, `-1` none) and the server's time just
/// before they were read. A long name goes on a connection of its own, after `TIME` on the
/// shared one (docs/reliability.md#bounded-whatever-the-key).
async fn read_fields(
    conn: &Conn,
    key: &[u8],
    fields: &[Vec<u8>],
) -> redis::RedisResult<(i64, Vec<i64>)> {
    if !crate::long_key::is_long(key) {
        let mut read = redis::cmd("HPEXPIRETIME");
        read.arg(key).arg("FIELDS").arg(fields.len()).arg(fields);
        let (at, mut answers) = timed(conn, vec![read]).await?;
        return Ok((at, answers.pop().unwrap_or_default()));
    }
    let (at, _) = timed(conn, Vec::new()).await?;
    let n = fields.len().to_string();
    let mut args: Vec<&[u8]> = vec![b"HPEXPIRETIME", key, b"FIELDS", n.as_bytes()];
    args.extend(fields.iter().map(Vec::as_slice));
    let answer = conn.direct(&args).await?;
    Ok((at, redis::from_redis_value(answer)?))
}

/// One page of `HSCAN key cursor COUNT PAGE NOVALUES`: the next cursor and the fields; a long
/// name on a connection of its own.
async fn hscan_page(
    conn: &Conn,
    key: &[u8],
    cursor: u64,
) -> redis::RedisResult<(u64, Vec<Vec<u8>>)> {
    let (cursor, page) = (cursor.to_string(), PAGE.to_string());
    let args: [&[u8]; 6] = [
        b"HSCAN",
        key,
        cursor.as_bytes(),
        b"COUNT",
        page.as_bytes(),
        b"NOVALUES",
    ];
    if crate::long_key::is_long(key) {
        return Ok(redis::from_redis_value(conn.direct(&args).await?)?);
    }
    let mut cmd = redis::cmd("HSCAN");
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn.clone()).await
}

/// Runs `reads` after `TIME` (in one pipeline on a node): the server's time (unix ms) just
/// before they ran, and their answers.
async fn timed(conn: &Conn, reads: Vec<redis::Cmd>) -> redis::RedisResult<(i64, Vec<Vec<i64>>)> {
    let mut cmds = Vec::with_capacity(reads.len() + 1);
    cmds.push(redis::cmd("TIME"));
    cmds.extend(reads);
    let mut answers: Vec<Vec<i64>> = conn.each(cmds).await?;
    let time = answers.remove(0);
    let at = match time.as_slice() {
        [secs, micros] => secs * 1000 + micros / 1000,
        _ => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Parse,
                "TIME answered something else than seconds and microseconds",
            )));
        }
    };
    Ok((at, answers))
}

crate::keyspace::commands::declare! {
    /// The commands of the field ledger to the watched Redis ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "time", "field ledger: gone before or after the deadline, on the server's clock"),
        Use::new(Server::Watched, "info", "field ledger: does the server expire hash fields?")
            .args("server")
            .when(When::Fields),
        Use::new(Server::Watched, "hscan", "field ledger: walks a hash for its fields")
            .on(Keys::Watched, Access::Read)
            .args("{key} 0 COUNT 10 NOVALUES")
            .when(When::Fields),
        Use::new(Server::Watched, "hpexpiretime", "field ledger: reads field deadlines")
            .on(Keys::Watched, Access::Read)
            .args("{key} FIELDS 1 f")
            .when(When::Fields),
        Use::new(Server::Watched, "scan", "field ledger: finds existing hashes")
            .on(Keys::Watched, Access::Read)
            .args("0 MATCH {glob} COUNT 10 TYPE hash")
            .when(When::Fields),
        // Its keys' commands are declared with them (`store::fields`).
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_taken_when_every_field_is_gone_and_one_was_not_due() {
        let known = |ds: &[i64]| -> Vec<(Vec<u8>, i64)> {
            ds.iter()
                .map(|d| (d.to_string().into_bytes(), *d))
                .collect()
        };
        let at = |ts: &[i64]| -> Vec<(i64, i64)> { ts.iter().map(|t| (*t, 1_000)).collect() };
        assert!(
            was_taken(&known(&[900, 2_000]), &at(&[-2, -2])),
            "one still to come"
        );
        assert!(
            !was_taken(&known(&[900, 1_000]), &at(&[-2, -2])),
            "all due: what expiring looks like"
        );
        assert!(
            !was_taken(&known(&[2_000, 3_000]), &at(&[-2, 3_000])),
            "the hash is still there"
        );
        assert!(
            !was_taken(&known(&[1_004]), &at(&[-2])),
            "within the clock's skew: due"
        );
    }

    #[test]
    fn members_keep_any_bytes_of_key_and_field() {
        for (k, f) in [
            (&b"stock_holds:sh"[..], &b"sku1:o42"[..]),
            (b"a:b", b":"),
            (b"", b""),
            (b"\xff\n", b"12:x"),
        ] {
            let hash = HashId::of(k);
            assert_eq!(split(&member(&hash, f)), Some((hash, f.to_vec())));
        }
        assert_eq!(split(b"9:ab"), None);
        assert_eq!(split(b"x:ab"), None);
    }

    /// A long hash's members and index name it by its SHA-256, whatever its length; a field
    /// after it keeps any bytes, `#` and digits included; a member an earlier keywatch wrote
    /// with a long name whole still reads back.
    #[test]
    fn a_long_hash_is_named_by_its_hash_in_members_and_index() {
        let key = vec![b'k'; crate::long_key::EXACT + 1];
        let hash = HashId::of(&key);
        let HashId::Long { len, sha256 } = &hash else {
            panic!("{hash:?}")
        };
        assert_eq!(*len, key.len());
        for f in [&b""[..], b"f1", b"#12:x", b"\xff"] {
            let m = member(&hash, f);
            assert!(m.len() < 100 + f.len(), "{}", m.len());
            assert_eq!(split(&m), Some((hash.clone(), f.to_vec())));
        }
        assert_eq!(
            store::index("kw:", 3, &hash),
            format!("kw:fields:3:hl:{sha256}").into_bytes()
        );
        let other = HashId::of(&vec![b'j'; crate::long_key::EXACT + 1]);
        assert_ne!(member(&hash, b"f"), member(&other, b"f"));
        let old = HashId::Bytes(key.clone());
        assert_eq!(split(&member(&old, b"f")), Some((old, b"f".to_vec())));
        assert_eq!(split(b"5#abc"), None, "too short for a SHA-256");
        assert_eq!(split(&[b"5#".to_vec(), vec![b'z'; 64]].concat()), None);
    }

    #[test]
    fn versions_compare_by_number() {
        assert!(at_least("7.4.0", (7, 4)));
        assert!(at_least("9.1.2", (9, 0)));
        assert!(!at_least("7.2.4", (7, 4)));
        assert!(!at_least("7.0.15", (7, 4)));
        assert!(at_least("10.0.0", (9, 0)));
        assert!(!at_least("", (7, 4)));
    }
}
