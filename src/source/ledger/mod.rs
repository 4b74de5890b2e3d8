//! The deadline ledger: keywatch knows when keys are due, so expiries are handled on time and
//! missed ones are found.
//!
//! Redis publishes `expired` only when it deletes a key — on access, or when its background
//! cycle reaches it, which with many TTL keys is seconds to minutes late — and pub/sub loses
//! whatever is published while keywatch is down or disconnected. So keywatch keeps, in Redis
//! (shared by instances, surviving restarts), the deadlines of the keys its rules watch, learnt
//! from `expire` keyevents and scans: per database, a small hash per second of deadlines
//! (`store::ledger`), and in this process an index of which second each key is in
//! ([`index`]):
//!
//! - **On time**: when a deadline comes, the poker touches the key (`PEXPIRETIME`, pipelined);
//!   Redis then deletes it and publishes `expired` at once. Between deadlines the poker sleeps
//!   ([`alarm`]): until the earliest deadline the ledger holds, or one written earlier.
//! - **Recovery**: a touched key that was already gone moves to a "poked" set tagged with a
//!   sequence number, and the poker publishes that number on keywatch's marker channel. Pub/sub
//!   keeps order, so when the engine reads the marker it has already read every `expired` that
//!   the touch caused; what is still in the poked set then is an expiry keywatch missed. No
//!   timing guess is involved.
//!
//! The poked set is shared by every instance, so its sequence numbers come from one counter in
//! Redis (`INCR`), not from each instance's own: an instance's marker then covers exactly the
//! entries moved before it was numbered, whose touches (by any instance) came before its
//! PUBLISH. With a counter per instance, one instance's marker could cover another's entry
//! moved after it was published, and recover a key whose `expired` it had yet to read.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::keyspace::{Conn, each_key, per_key};
pub(crate) mod alarm;
pub(crate) mod density;
pub(crate) mod emptied;
pub(crate) mod grace;
pub(crate) mod held;
pub(crate) mod index;
pub(crate) mod markers;

use crate::store::ledger::{self as store, Cursor, Deadlines, Entry, second_of};
/// How a far deadline's shard is named (docs/how-it-works.md#far-deadlines), for the drills that
/// check every instance names the same one.
pub use crate::store::ledger::{LONG_KEY, far_hash};
use alarm::{Alarm, until_past};
pub use grace::{GRACE, Grace};
use index::LedgerIndex;
pub use markers::Markers;
use tokio_util::sync::CancellationToken;

use crate::config::LiveConfig;
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;

/// The least time between two rounds of the poker for one database while its ledger holds due
/// deadlines it cannot clear yet (keys in their [`Grace`], a key Redis has yet to expire by a
/// clock a millisecond behind keywatch's estimate, events waiting to be matched). Otherwise it
/// sleeps until the next deadline ([`alarm`]).
pub const POKE_EVERY: Duration = Duration::from_millis(2);
/// Longest the poker trusts what it knows: once a second it reads the earliest deadline the
/// ledger's minutes hold (one command per database), for deadlines written by another instance
/// that this one heard of no other way (its fill at start-up, a field ledger's walk).
pub const SAFETY_EVERY: Duration = Duration::from_secs(1);
/// Every how many safety rounds the poker reads the far buckets' first hour too
/// (docs/how-it-works.md#far-deadlines).
const FAR_SAFETY_EVERY: u64 = 10;
/// How often a marker is published while the poked set holds something: recovers entries whose
/// own marker was lost (published while the subscriber was reconnecting, or never, the instance
/// that moved them having died in between).
const MARK_EVERY: Duration = Duration::from_secs(5);
/// Due keys touched per round trip.
const POKE_BATCH: usize = 2000;
/// Longest the poker holds back while events wait: what a key whose `expired` Redis has not
/// published at all may be kept waiting meanwhile.
const HOLD_AT_MOST: Duration = Duration::from_secs(1);

/// Longest the poker touches without recording the keys it finds gone while events wait (see
/// [`Ledger::poke_round`]): how long recovering an expiry whose event was lost may be put off by
/// a subscriber that never catches up.
const RECORD_AT_MOST: Duration = Duration::from_secs(10);

/// Keys walked per `SCAN` of a fill.
const FILL_COUNT: usize = 1000;
/// A fill's pages whose `PEXPIRETIME`s are read at once (see [`Ledger::fill`]).
const READS_IN_FLIGHT: usize = 2;
/// Pages of due keys all within their grace that one round looks past.
const GRACE_PAGES: usize = 4;

/// What a keyevent says about a deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note {
    /// `expire`: a TTL was set or changed; read it.
    Expire,
    /// `rename_to`, `move_to`: the TTL came with the name, or with the key from another
    /// database; read it.
    RenameTo,
    /// `persist`, `rename_from`, `move_from`, `del`, `evicted`: the deadline is gone (with the
    /// key, to its new name or database).
    Forget,
}

/// A deadline that passed with the key gone and no `expired` seen: a missed expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missed {
    pub db: u32,
    pub key: Vec<u8>,
    pub deadline_ms: i64,
}

#[derive(Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

struct Inner {
    /// The ledger's keys on the state server.
    store: Deadlines,
    keyspace: Keyspace,
    prefix: String,
    instance: String,
    metrics: Arc<Metrics>,
    /// Set once a fill has walked every database: from then on the ledger knows every deadline
    /// the rules want, and the scanner may ask it instead of scanning.
    filled: AtomicBool,
    /// Fills running now (one per cluster master that came up).
    filling: AtomicUsize,
    /// Which second each key's deadline is in, as this instance knows it.
    index: LedgerIndex,
    /// Keys deleted while the index did not know them (before a reconcile walk read their
    /// second), per database: a walk or the poker that finds them gone drops them, as the
    /// `del` would have, rather than recovering them as missed. Cleared by a completed walk.
    forgotten: std::sync::Mutex<HashSet<(u32, Forgotten)>>,
    /// When the poker looks next, and its wake-up for a deadline written earlier than that.
    alarm: Alarm,
    /// Per database, when the earliest far bucket is to be refined (`i64::MAX`: none is
    /// left; absent: not known yet, the poker's next round refines). A far deadline this
    /// instance writes lowers it; the poker's safety round reads it from Redis.
    refine_at: std::sync::Mutex<HashMap<u32, i64>>,
    /// Databases a flush or a swap emptied without a keyevent, and the walk that follows.
    emptied: std::sync::Mutex<emptied::Emptied>,
    /// How many flushes and swaps were heard of: a fill's page read before one is not held
    /// ([`held`]).
    emptied_count: AtomicU64,
    /// The dense hours' deadlines a fill holds back to write together ([`held`]).
    held: std::sync::Mutex<held::Held>,
    /// Whether [`Inner::held`] holds or writes anything: a later word on a key must then drop it.
    holding: AtomicBool,
}

/// `PEXPIRETIME` of each of `keys`, in order (see [`each_key`]).
async fn deadlines<K: AsRef<[u8]>>(conn: &Conn, keys: &[K]) -> redis::RedisResult<Vec<i64>> {
    each_key(conn, "PEXPIRETIME", keys).await
}

/// How [`Inner::forgotten`] remembers a key: by its bytes, or, longer than
/// [`crate::long_key::EXACT`], by their SHA-256, so that deleting long keys over and over cannot
/// make it hold megabytes each (docs/reliability.md#bounded-whatever-the-key).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Forgotten {
    Key(Vec<u8>),
    Long([u8; 32]),
}

impl Forgotten {
    fn of(key: &[u8]) -> Forgotten {
        if crate::long_key::is_long(key) {
            use sha2::Digest;
            Forgotten::Long(sha2::Sha256::digest(key).into())
        } else {
            Forgotten::Key(key.to_vec())
        }
    }
}

/// A fill's task that panicked or was cancelled, as the error its caller logs.
fn joined(e: tokio::task::JoinError) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "a fill's task ended", e.to_string()))
}

/// Keys remembered as deleted-while-unindexed at most (see [`Inner::forgotten`]); past that a
/// deleted key's deadline may be recovered as missed, as before a walk had read it.
const FORGOTTEN_MAX: usize = 100_000;

use crate::keyspace::clock::now_ms;

impl Ledger {
    pub fn new(state: Conn, keyspace: Keyspace, prefix: &str, metrics: Arc<Metrics>) -> Ledger {
        Ledger {
            inner: Arc::new(Inner {
                store: Deadlines::new(state, prefix),
                keyspace,
                prefix: prefix.to_string(),
                instance: format!("{:016x}", fastrand::u64(..)),
                metrics,
                filled: AtomicBool::new(false),
                filling: AtomicUsize::new(0),
                index: LedgerIndex::default(),
                forgotten: std::sync::Mutex::new(HashSet::new()),
                alarm: Alarm::default(),
                refine_at: std::sync::Mutex::new(HashMap::new()),
                emptied: Default::default(),
                emptied_count: AtomicU64::new(0),
                held: Default::default(),
                holding: AtomicBool::new(false),
            }),
        }
    }

    /// The pub/sub channel markers go on (subscribed by the keyevent subscriber).
    pub fn marker_channel(prefix: &str) -> String {
        store::marker_channel(prefix)
    }

    /// The marker payload of this instance for `db` and `seq`.
    fn marker(&self, db: u32, seq: u64) -> String {
        format!("{}:{db}:{seq}", self.inner.instance)
    }

    /// Parses a marker; `None` for another instance's.
    pub fn own_marker(&self, payload: &[u8]) -> Option<(u32, u64)> {
        let s = std::str::from_utf8(payload).ok()?;
        let mut parts = s.splitn(3, ':');
        if parts.next()? != self.inner.instance {
            return None;
        }
        Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
    }

    /// Reads the deadlines of `keys` in `db` and records them (or drops keys without one).
    pub async fn learn(&self, db: u32, keys: &[Vec<u8>]) -> redis::RedisResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let deadlines = self.read(db, keys).await?;
        self.record(db, keys, &deadlines).await
    }

    /// The deadlines of `keys` (`PEXPIRETIME`: -1 without a TTL, -2 gone), the first half of
    /// [`Ledger::learn`].
    pub async fn read(&self, db: u32, keys: &[Vec<u8>]) -> redis::RedisResult<Vec<i64>> {
        let conn = self.inner.keyspace.conn(db).await?;
        deadlines(&conn, keys).await
    }

    /// Records deadlines read by [`Ledger::read`], the second half of [`Ledger::learn`]. Between
    /// the two the key may have expired and its `expired` been taken (by this instance's engine
    /// while a fill scans, or by another instance): a deadline already handled is then not
    /// written back, or the poker would find it gone and it would fire again as recovered.
    pub async fn record(
        &self,
        db: u32,
        keys: &[Vec<u8>],
        deadlines: &[i64],
    ) -> redis::RedisResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let index = &self.inner.index;
        // A key given twice keeps its last deadline, as if each were written in turn: the
        // script must not leave one in each of two seconds.
        let mut last: crate::key_hash::HashMap<&[u8], usize> =
            HashMap::with_capacity_and_hasher(keys.len(), Default::default());
        for (i, k) in keys.iter().enumerate() {
            last.insert(k.as_slice(), i);
        }
        let entries: Vec<Entry> = keys
            .iter()
            .zip(deadlines)
            .enumerate()
            .filter(|(i, (k, _))| last.get(k.as_slice()) == Some(i))
            .map(|(_, (k, d))| Entry {
                key: k,
                deadline: *d,
                was: index.get(db, k),
            })
            .collect();
        self.write(db, &entries).await
    }

    /// Writes `entries` to the ledger and keeps this instance's index with them: a key without
    /// a TTL (-1) leaves it, a deadline moves it to its second, a gone key (-2) stays.
    async fn write(&self, db: u32, entries: &[Entry<'_>]) -> redis::RedisResult<()> {
        self.unhold(db, entries.iter().map(|e| e.key));
        self.write_unheld(db, entries).await
    }

    /// [`Ledger::write`] of deadlines a fill held ([`held`]).
    async fn write_unheld(&self, db: u32, entries: &[Entry<'_>]) -> redis::RedisResult<()> {
        let index = &self.inner.index;
        let now = now_ms();
        self.inner.store.record(db, entries, now).await?;
        // The poker looks at a deadline when it is due, or at a far one's refinement.
        let far = entries
            .iter()
            .filter(|e| e.deadline > 0 && store::goes_far(e.deadline, e.key, now))
            .map(|e| store::wake_for(e.deadline, e.key, now))
            .min();
        if let Some(at) = far {
            let mut refine_at = self.refine_at();
            if let Some(r) = refine_at.get_mut(&db) {
                *r = (*r).min(at);
            }
        }
        let earliest = entries
            .iter()
            .filter(|e| e.deadline > 0)
            .map(|e| store::wake_for(e.deadline, e.key, now))
            .min();
        if let Some(earliest) = earliest {
            self.inner.alarm.learnt(db, earliest);
        }
        for e in entries {
            match e.deadline {
                -1 => {
                    index.remove(db, e.key);
                }
                d if d > 0 => index.set(db, e.key, second_of(d)),
                _ => {}
            }
        }
        let mut forgotten = self.forgotten();
        if !forgotten.is_empty() {
            // Set again after a delete: its new deadline is not the deleted one's.
            for e in entries.iter().filter(|e| e.deadline > 0) {
                forgotten.remove(&(db, Forgotten::of(e.key)));
            }
        }
        Ok(())
    }

    /// Drops the deadlines of `keys` (deleted, persisted, renamed away).
    pub async fn forget(&self, db: u32, keys: &[Vec<u8>]) -> redis::RedisResult<()> {
        self.unhold(db, keys.iter().map(|k| k.as_slice()));
        let mut known = Vec::with_capacity(keys.len());
        let mut unknown = Vec::new();
        for k in keys {
            match self.inner.index.remove(db, k) {
                Some(s) => known.push((k.as_slice(), s)),
                None => unknown.push(k),
            }
        }
        if !unknown.is_empty() {
            let mut forgotten = self.forgotten();
            for k in unknown {
                if forgotten.len() < FORGOTTEN_MAX {
                    forgotten.insert((db, Forgotten::of(k)));
                }
            }
        }
        if known.is_empty() {
            return Ok(());
        }
        self.inner.store.forget(db, &known).await
    }

    fn held(&self) -> std::sync::MutexGuard<'_, held::Held> {
        self.inner.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A later word on `keys` of `db` (a keyevent's record or forget, a take, a fill's later
    /// page): deadlines a fill holds for them are not written ([`held`]).
    fn unhold<'a>(&self, db: u32, keys: impl IntoIterator<Item = &'a [u8]>) {
        if !self.inner.holding.load(Ordering::SeqCst) {
            return;
        }
        let mut held = self.held();
        for k in keys {
            held.drop_key(db, k);
        }
        self.inner.holding.store(held.active(), Ordering::SeqCst);
    }

    /// Records a fill's page read when [`Inner::emptied_count`] was `emptied`: as
    /// [`Ledger::record`], but the deadlines of dense far hours are held, to be written with
    /// those of the pages after it a second's hash at a time ([`held`]), unless a flush or a
    /// swap was heard of since the page was read. Returns whether what is held is due to be
    /// written ([`held::Held::due`]).
    async fn record_filled(
        &self,
        db: u32,
        keys: Vec<Vec<u8>>,
        deadlines: Vec<i64>,
        emptied: u64,
    ) -> redis::RedisResult<bool> {
        let now = now_ms();
        let fresh = emptied == self.inner.emptied_count.load(Ordering::SeqCst);
        let holds = match fresh {
            true => self.inner.store.holds(db, &keys, &deadlines, now),
            false => vec![false; keys.len()],
        };
        let (mut rest, mut rest_deadlines) = (Vec::new(), Vec::new());
        let due = {
            let mut held = self.held();
            for ((k, d), holds) in keys.into_iter().zip(deadlines).zip(holds) {
                // Where the index knew it is read when it is written: a key's old deadline
                // leaves then (its own second, if due before, finds it moved).
                if holds {
                    held.hold(db, k, d);
                } else {
                    rest.push(k);
                    rest_deadlines.push(d);
                }
            }
            self.inner.holding.store(held.active(), Ordering::SeqCst);
            held.due()
        };
        // Drops what was held for these keys before: the page read later wins.
        self.record(db, &rest, &rest_deadlines).await?;
        Ok(due)
    }

    /// Whether a fill holds `key`'s deadline in `db`, read and not written yet ([`held`]): for
    /// the drills.
    pub fn is_held(&self, db: u32, key: &[u8]) -> bool {
        self.held().contains(db, key)
    }

    /// Writes what fills hold ([`held`]), of `only` or of every database.
    async fn flush_held(&self, only: Option<u32>) -> redis::RedisResult<()> {
        let taken = {
            let mut held = self.held();
            let taken = held.take(only);
            self.inner.holding.store(held.active(), Ordering::SeqCst);
            taken
        };
        let index = &self.inner.index;
        let written = async {
            for (db, rows) in &taken {
                for slice in rows.chunks(held::FLUSH_SLICE) {
                    let entries: Vec<Entry> = {
                        let held = self.held();
                        slice
                            .iter()
                            .filter(|(k, _)| held.still(*db, k))
                            .map(|(k, d)| Entry {
                                key: k,
                                deadline: *d,
                                was: index.get(*db, k),
                            })
                            .collect()
                    };
                    self.write_unheld(*db, &entries).await?;
                }
            }
            Ok(())
        }
        .await;
        let mut held = self.held();
        held.done();
        self.inner.holding.store(held.active(), Ordering::SeqCst);
        written
    }

    fn refine_at(&self) -> std::sync::MutexGuard<'_, HashMap<u32, i64>> {
        self.inner
            .refine_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Refines `db`'s far buckets due for it (docs/how-it-works.md#far-deadlines); returns when
    /// the next one is due.
    async fn refine(&self, db: u32) -> redis::RedisResult<i64> {
        let now = now_ms();
        let due = self.refine_at().get(&db).copied();
        if due.is_some_and(|at| at > now) {
            return Ok(due.unwrap_or(i64::MAX));
        }
        let next = self.inner.store.refine(db, now).await?.unwrap_or(i64::MAX);
        self.refine_at().insert(db, next);
        Ok(next)
    }

    /// One step of a refinement (docs/how-it-works.md#far-deadlines): moves about `most`
    /// deadlines of `db`'s far hours that start by `until_ms` to their seconds, whole shards at
    /// a time; returns whether some are left. The poker refines an hour
    /// [`store::REFINE_AHEAD_MS`] before it starts; drills choose the hour and the steps.
    pub async fn refine_until(
        &self,
        db: u32,
        until_ms: i64,
        most: usize,
    ) -> redis::RedisResult<bool> {
        Ok(self.inner.store.refine_step(db, until_ms, most).await?.0)
    }

    /// One step of marking `db`'s far hour `hour` dense (docs/how-it-works.md#dense-hours):
    /// marks it and moves about `most` deadlines of its shards to their seconds; returns whether
    /// its shards still hold some. A fill marks the hours it finds dense; drills choose the hour
    /// and the steps.
    pub async fn make_dense(&self, db: u32, hour: i64, most: usize) -> redis::RedisResult<bool> {
        self.inner.store.make_dense_step(db, hour, most).await
    }

    fn forgotten(&self) -> std::sync::MutexGuard<'_, HashSet<(u32, Forgotten)>> {
        self.inner
            .forgotten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The second the index holds `key`'s deadline in, for the take of its `expired`; forgotten
    /// here if that deadline is due (the take removes it from the ledger), kept if it is later
    /// (the `expired` was of an earlier incarnation of the key).
    pub fn taking(&self, db: u32, key: &[u8], due_limit_ms: i64) -> Option<i64> {
        self.unhold(db, [key]);
        self.inner
            .index
            .remove_due(db, key, second_of(due_limit_ms))
    }

    /// How many keys this instance's index holds (the `keywatch_ledger_keys` gauge).
    pub fn indexed(&self) -> usize {
        self.inner.index.len()
    }

    /// Up to `limit` expiries missed up to marker `seq` of `db`, soonest first. Only read: taking
    /// them (out of the poked set, claimed, recorded) is one step of the intake
    /// ([`crate::engine::intake`]), so a crash in between leaves them here for the next marker.
    pub async fn missed(&self, db: u32, seq: u64, limit: usize) -> redis::RedisResult<Vec<Missed>> {
        let poked = self.inner.store.poked(db, seq, limit).await?;
        Ok(poked
            .into_iter()
            .map(|(key, deadline_ms)| Missed {
                db,
                key,
                deadline_ms,
            })
            .collect())
    }

    /// Asks for a marker now: what was poked before it and not handled by the time it arrives
    /// was missed. Used after every (re)subscription, when events may have been lost.
    /// Returns the marker's number.
    pub async fn mark(&self, db: u32) -> redis::RedisResult<u64> {
        let seq = self.inner.store.next_marker(db).await?;
        let mut conn = self.inner.keyspace.conn(db).await?;
        redis::cmd("PUBLISH")
            .arg(Self::marker_channel(&self.inner.prefix))
            .arg(self.marker(db, seq))
            .exec_async(&mut conn)
            .await?;
        Ok(seq)
    }

    /// One round of the poker for `db`: touch every due key; returns how many it touched. Keys
    /// found gone are recorded at once (no [`Grace`]).
    pub async fn poke(&self, db: u32) -> redis::RedisResult<usize> {
        Ok(self.poke_round(db, true, None).await?.0)
    }

    /// A round of the poker; `record_gone`: keys found gone move to the poked set, to be
    /// recovered if their `expired` never comes. While events wait to be matched (a mass expiry:
    /// Redis has expired the keys and their `expired` is on its way), the poker only touches: a
    /// gone key recorded as poked then had its record undone by the take of that very event, a
    /// fifth of a storm's keys paying four writes each for nothing. A key whose event really was
    /// lost stays in the ledger and is found gone again once the events are caught up with.
    ///
    /// With a [`Grace`], a key found gone for the first time is not recorded yet: nearly always
    /// its `expired` was just published (the touch itself expired it) and its take is on its
    /// way, which removes it from the ledger. Recording it meant three writes to the poked set
    /// that the take then undid with two more, for every key expired on time. It is recorded
    /// if it is still in the ledger once [`GRACE`] has passed.
    ///
    /// Returns how many keys it touched, and the earliest deadline the ledger may hold after
    /// the round (`None`: none), which is when the poker looks next.
    pub async fn poke_round(
        &self,
        db: u32,
        record_gone: bool,
        mut grace: Option<&mut Grace>,
    ) -> redis::RedisResult<(usize, Option<i64>)> {
        let store = &self.inner.store;
        // Far buckets whose hour is near move to their seconds first: what they hold is read
        // below like any deadline.
        let refine_at = self.refine(db).await?;
        let mut offset = 0;
        let mut next;
        // Each due key with what its grace knows it by: the key, or a long key's copy's name
        // (read only once it is to be touched, docs/reliability.md#bounded-whatever-the-key).
        let (open, copies) = loop {
            // Redis expires a key when now > deadline, strictly: touch from deadline + 1 ms.
            let read = store.due(db, now_ms() - 1, offset, POKE_BATCH).await?;
            next =
                Some(read.next.map_or(refine_at, |n| n.min(refine_at))).filter(|n| *n < i64::MAX);
            let len = read.rows.len() + read.copies.len();
            let Some(g) = grace.as_deref_mut() else {
                break (read.rows, read.copies);
            };
            let open: Vec<(Bytes, i64)> = read
                .rows
                .into_iter()
                .filter(|(k, deadline)| !g.waiting(db, k, *deadline))
                .collect();
            let copies: Vec<(String, i64, usize)> = read
                .copies
                .into_iter()
                .filter(|(name, deadline, _)| !g.waiting(db, name.as_bytes(), *deadline))
                .collect();
            // A page of keys all within their grace: the due keys behind them must not wait.
            if open.is_empty()
                && copies.is_empty()
                && len == POKE_BATCH
                && offset < GRACE_PAGES * POKE_BATCH
            {
                offset += POKE_BATCH;
                continue;
            }
            break (open, copies);
        };
        // (key, deadline, what the grace knows it by).
        let mut due: Vec<(Bytes, i64, Bytes)> =
            open.into_iter().map(|(k, d)| (k.clone(), d, k)).collect();
        for (name, deadline, len) in copies {
            if let Some(key) = store.read_copy(&name, len).await? {
                due.push((key, deadline, Bytes::from(name)));
            }
        }
        if due.is_empty() {
            return Ok((0, next));
        }
        let mut conn = self.inner.keyspace.conn(db).await?;
        // Reading the TTL makes the master delete a due key and publish `expired` at once.
        // The keys shared, not copied.
        let keys: Vec<Bytes> = due.iter().map(|(k, ..)| k.clone()).collect();
        let now = deadlines(&conn, &keys).await?;
        let mut gone = Vec::new();
        // Corrections, recorded as a read would: the deadline now (-1: none), from the second
        // the poker found it in.
        let mut fixes = Vec::new();
        // A flush or a swap took keys away without a keyevent: those are not missed expiries.
        let cut_off = self.cut_off(db);
        {
            let forgotten = self.forgotten();
            for ((k, deadline, known_as), t) in due.iter().zip(now) {
                let fix = |t| Entry {
                    key: k,
                    deadline: t,
                    was: Some(second_of(*deadline)),
                };
                match t {
                    // Deleted while the index did not know it: dropped, as the `del` would have.
                    -2 if !forgotten.is_empty() && forgotten.contains(&(db, Forgotten::of(k))) => {
                        fixes.push(fix(-1))
                    }
                    -2 if cut_off.is_some_and(|c| *deadline >= c) => fixes.push(fix(-1)),
                    -2 if record_gone => {
                        if grace.as_deref_mut().is_some_and(|g| {
                            let long = crate::long_key::is_long(k);
                            g.begin(
                                db,
                                known_as,
                                *deadline,
                                if long { grace::GRACE_LONG } else { GRACE },
                            )
                        }) {
                            continue;
                        }
                        gone.push((&k[..], *deadline));
                    }
                    -2 => {}
                    // A plain SET dropped the TTL (Redis says nothing about that): no expiry
                    // will come.
                    -1 => fixes.push(fix(-1)),
                    // The deadline moved without us hearing of it.
                    t if t != *deadline => fixes.push(fix(t)),
                    _ => {}
                }
            }
        }
        if !fixes.is_empty() {
            self.write(db, &fixes).await?;
            // A deadline moved later or dropped: whatever the ledger now holds first.
            let moved = fixes.iter().map(|e| e.deadline).filter(|d| *d > 0).min();
            next = match (next, moved) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        if !gone.is_empty() {
            let seq = store.move_poked(db, &gone).await?;
            for (k, _) in &gone {
                self.inner.index.remove(db, k);
            }
            // After the move, so the marker follows every `expired` the touches caused.
            redis::cmd("PUBLISH")
                .arg(Self::marker_channel(&self.inner.prefix))
                .arg(self.marker(db, seq))
                .exec_async(&mut conn)
                .await?;
        }
        Ok((due.len(), next))
    }

    /// The earliest deadline `db`'s ledger may hold, or when its earliest far bucket is to be
    /// refined if that is sooner, read from Redis (the poker's safety round); the far buckets
    /// are read only if `far`, else this instance's plan for them stands.
    pub async fn earliest(&self, db: u32, far: bool) -> redis::RedisResult<Option<i64>> {
        let (seconds, refine) = self.inner.store.earliest(db, far).await?;
        let refine = match refine {
            Some(r) => {
                let r = r.unwrap_or(i64::MAX);
                self.refine_at().insert(db, r);
                r
            }
            None => self.refine_at().get(&db).copied().unwrap_or(i64::MIN),
        };
        Ok(match seconds {
            Some(a) => Some(a.min(refine)),
            None => Some(refine).filter(|r| *r < i64::MAX),
        })
    }

    fn emptied_state(&self) -> std::sync::MutexGuard<'_, emptied::Emptied> {
        self.inner.emptied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cut-off of `db` in force after a flush or a swap ([`emptied`]).
    fn cut_off(&self, db: u32) -> Option<i64> {
        self.emptied_state().cut_off(db)
    }

    /// Keys may have left every database of `live`'s rules from `since_ms` on (a flush, or a swap
    /// if `swapped`), with no keyevent ([`emptied`]): until the walk that follows is done, a key
    /// found gone whose deadline is that late is dropped, not recovered; then each database that
    /// lost keys is walked (all of them after a swap, whose keys are learnt again too). `only`:
    /// the cluster master it was heard on, whose keys alone are learnt again.
    pub fn emptied(&self, live: &LiveConfig, only: Option<String>, swapped: bool, since_ms: i64) {
        // A fill's page read before this is not held past the walk that follows ([`held`]).
        self.inner.emptied_count.fetch_add(1, Ordering::SeqCst);
        let config = live.current();
        if !config.uses_ledger()
            || !self
                .emptied_state()
                .begin(&config.redis.databases, since_ms, swapped)
        {
            return;
        }
        let ledger = self.clone();
        let live = live.clone();
        tokio::spawn(async move {
            let mut swapped = swapped;
            loop {
                ledger.settle(&live, only.as_deref(), swapped).await;
                match ledger.emptied_state().after_run() {
                    Some(s) => swapped = s,
                    None => return,
                }
            }
        });
    }

    /// One run after a flush or a swap: walks what lost keys, learns what came in.
    async fn settle(&self, live: &LiveConfig, only: Option<&str>, swapped: bool) {
        let config = live.current();
        // What fills hold was read before the flush or the swap: written before the walk, which
        // drops what the flush took away, as it does a page recorded before it.
        if let Err(e) = self.flush_held(None).await {
            tracing::warn!(error = %e, "Ledger: cannot write the deadlines a fill held.");
        }
        for &db in &config.redis.databases {
            let lost = match swapped {
                true => Ok(true),
                false => self.lost_keys(db).await,
            };
            let walked = match lost {
                Ok(false) => Ok(0),
                Ok(true) => self.reconcile(db).await,
                Err(e) => Err(e),
            };
            match walked {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    db,
                    dropped = n,
                    swapped,
                    "Ledger: dropped the deadlines of keys a flush or a swap took away; none is reported as expired."
                ),
                // Its cut-off stays until the run ends; what is left is found at its deadline.
                Err(e) => {
                    tracing::warn!(db, error = %e, "Ledger: cannot walk a database after a flush or a swap.")
                }
            }
        }
        if swapped {
            fill_all(self, &config, only).await;
        }
    }

    /// Whether `db` lost keys whose deadlines the ledger holds: one of the soonest future ones
    /// ([`emptied::SAMPLE`]) is gone.
    async fn lost_keys(&self, db: u32) -> redis::RedisResult<bool> {
        let rows = self
            .between(
                db,
                now_ms(),
                i64::MAX,
                &mut Cursor::default(),
                emptied::SAMPLE,
            )
            .await?;
        let keys: Vec<Vec<u8>> = rows
            .into_iter()
            .take(emptied::SAMPLE)
            .map(|(k, _)| k)
            .collect();
        if keys.is_empty() {
            return Ok(false);
        }
        let conn = self.inner.keyspace.conn(db).await?;
        let exists: Vec<i64> = conn.each(per_key("EXISTS", &keys)).await?;
        Ok(exists.contains(&0))
    }

    /// Whether `db`'s poked set holds anything (a marker is then worth publishing).
    async fn any_poked(&self, db: u32) -> redis::RedisResult<bool> {
        self.inner.store.any_poked(db).await
    }

    /// Drops deadlines still in the future whose key is gone: deleted while keywatch was not
    /// listening. Run at start-up and after every reconnect, before those deadlines come. The
    /// same walk rebuilds this instance's index, and first converts an earlier keywatch's
    /// ledger (docs/operations.md#upgrading).
    pub async fn reconcile(&self, db: u32) -> redis::RedisResult<usize> {
        let store = &self.inner.store;
        let mut converted = false;
        while store.convert(db).await? > 0 {
            converted = true;
        }
        if converted {
            tracing::info!(
                db,
                "Ledger: converted an earlier keywatch's ledger to the compact form."
            );
        }
        let mut after = Cursor::default();
        let mut dropped = 0;
        loop {
            let rows = self
                .between(db, i64::MIN, i64::MAX, &mut after, 1000)
                .await?;
            if rows.is_empty() {
                break;
            }
            for (k, d) in &rows {
                self.inner.index.learn(db, k, second_of(*d));
            }
            for page in rows.chunks(1000) {
                dropped += self.drop_deleted(db, page).await?;
            }
        }
        self.forgotten().retain(|(d, _)| *d != db);
        Ok(dropped)
    }

    /// Drops the deadlines of `rows` whose key is gone: those still in the future (due ones are
    /// the poker's to judge), and those of keys deleted while the index did not know them.
    async fn drop_deleted(&self, db: u32, rows: &[(Vec<u8>, i64)]) -> redis::RedisResult<usize> {
        let keys: Vec<&[u8]> = rows.iter().map(|(k, _)| k.as_slice()).collect();
        let conn = self.inner.keyspace.conn(db).await?;
        let exists = each_key(&conn, "EXISTS", &keys).await?;
        let now = now_ms();
        // Due ones too, when a flush or a swap may have taken them (see `emptied`).
        let cut_off = self.cut_off(db).unwrap_or(i64::MAX);
        let stale: Vec<Entry> = {
            let forgotten = self.forgotten();
            rows.iter()
                .zip(&exists)
                .filter(|((k, d), e)| {
                    **e == 0
                        && (*d > now
                            || *d >= cut_off
                            || forgotten.contains(&(db, Forgotten::of(k))))
                })
                .map(|((k, d), _)| Entry {
                    key: k,
                    deadline: -1,
                    was: Some(second_of(*d)),
                })
                .collect()
        };
        if stale.is_empty() {
            return Ok(0);
        }
        self.write(db, &stale).await?;
        Ok(stale.len())
    }

    /// Fills the ledger from a SCAN of `db` (of the cluster node `only`, when given): every key
    /// `wanted` accepts that has a TTL. Paced to `max_per_second` keys so start-up does not
    /// hurt other clients.
    ///
    /// Three steps overlap, each on its own: the SCAN of a page (here, on connections of the
    /// fill's own, [`Keyspace::walk_conns`]: a page may carry a key of megabytes; each page's
    /// cursor is the next one's), the `PEXPIRETIME` of the pages before it ([`READS_IN_FLIGHT`]
    /// at a time), and the records, one page after the other in the order read (a task of their
    /// own, so that a key SCAN returns twice keeps the deadline read last). Each step waiting for
    /// the slowest of the three, as they did, left Redis idle a third of the time
    /// (docs/performance.md#learning-a-big-keyspace).
    ///
    /// A far hour the SCAN's sample says will be dense is marked so as soon as it says so
    /// ([`density`]): its deadlines are then written without a script.
    pub async fn fill(
        &self,
        db: u32,
        only: Option<&str>,
        globs: &[Vec<u8>],
        wanted: &(dyn Fn(&[u8]) -> bool + Send + Sync),
        max_per_second: u64,
    ) -> redis::RedisResult<usize> {
        let mut learnt = 0;
        let started = tokio::time::Instant::now();
        let mut scanned: u64 = 0;
        let nodes = self.inner.keyspace.walk_conns(db, only).await?;
        // A page: its keys, their deadlines, and how many flushes and swaps had been heard of
        // when they were read.
        type Page = (Vec<Vec<u8>>, Vec<i64>, u64);
        type Read = tokio::task::JoinHandle<redis::RedisResult<Page>>;
        let (pages, mut to_record) = tokio::sync::mpsc::channel::<Page>(2);
        let recorder = {
            let ledger = self.clone();
            tokio::spawn(async move {
                // One flush of what is held at a time, beside the pages recorded meanwhile.
                let mut flushing: Option<tokio::task::JoinHandle<redis::RedisResult<()>>> = None;
                loop {
                    // What is held is written within `HOLD_FOR` however slow the pace.
                    let due = match tokio::time::timeout(held::HOLD_FOR, to_record.recv()).await {
                        // A walk ended: what it held is written now, not after the next walk.
                        Ok(Some((keys, _, _))) if keys.is_empty() => true,
                        Ok(Some((keys, deadlines, emptied))) => {
                            ledger.record_filled(db, keys, deadlines, emptied).await?
                        }
                        Ok(None) => break,
                        Err(_) => true,
                    };
                    if due {
                        if let Some(f) = flushing.take() {
                            f.await.map_err(joined)??;
                        }
                        let ledger = ledger.clone();
                        flushing = Some(tokio::spawn(async move { ledger.flush_held(None).await }));
                    }
                }
                if let Some(f) = flushing {
                    f.await.map_err(joined)??;
                }
                Ok::<_, redis::RedisError>(())
            })
        };
        // Hands the oldest read page to the recorder; `false` once the recorder failed.
        let record_oldest = async |reads: &mut std::collections::VecDeque<Read>,
                                   density: &mut density::Density|
               -> redis::RedisResult<bool> {
            let Some(read) = reads.pop_front() else {
                return Ok(true);
            };
            let (keys, deadlines, emptied) = read.await.map_err(joined)??;
            density.saw(&deadlines, now_ms());
            Ok(pages.send((keys, deadlines, emptied)).await.is_ok())
        };
        let walked = async {
            for node in &nodes {
                for glob in globs {
                    let mut conn = node.clone();
                    let mut cursor: u64 = 0;
                    let mut reads: std::collections::VecDeque<Read> = Default::default();
                    let mut density = density::Density::default();
                    loop {
                        let (next, keys) =
                            crate::keyspace::scan_page(&mut conn, cursor, glob, FILL_COUNT).await?;
                        scanned += FILL_COUNT as u64;
                        self.inner.metrics.scan_keys.inc_by(keys.len() as u64);
                        let to_read: Vec<Vec<u8>> = keys
                            .into_iter()
                            .filter(|k| !k.starts_with(self.inner.prefix.as_bytes()) && wanted(k))
                            .collect();
                        learnt += to_read.len();
                        if !to_read.is_empty() {
                            let ledger = self.clone();
                            let emptied = self.inner.emptied_count.load(Ordering::SeqCst);
                            reads.push_back(tokio::spawn(async move {
                                let deadlines = ledger.read(db, &to_read).await?;
                                Ok((to_read, deadlines, emptied))
                            }));
                        }
                        while reads.len() > READS_IN_FLIGHT {
                            if !record_oldest(&mut reads, &mut density).await? {
                                return Ok(());
                            }
                        }
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                        for hour in density.turned_dense(next) {
                            self.inner.store.make_dense(db, hour).await?;
                        }
                        let should_take =
                            Duration::from_secs_f64(scanned as f64 / max_per_second.max(1) as f64);
                        if let Some(wait) = should_take.checked_sub(started.elapsed()) {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    while !reads.is_empty() {
                        if !record_oldest(&mut reads, &mut density).await? {
                            return Ok(());
                        }
                    }
                    // An empty page: the walk is done, what it held is written (a walk of
                    // another glob may find nothing for minutes).
                    if pages.send((Vec::new(), Vec::new(), 0)).await.is_err() {
                        return Ok(());
                    }
                }
            }
            Ok::<_, redis::RedisError>(())
        };
        let walked = walked.await;
        drop(pages);
        let recorded = recorder.await.map_err(joined).and_then(|r| r);
        // What is held is written whatever failed: it was read, and is not read again until the
        // next fill.
        let flushed = self.flush_held(Some(db)).await;
        // The recorder's error first: a page handed to it is lost only if it failed.
        recorded?;
        walked?;
        flushed?;
        Ok(learnt)
    }

    /// Whether `db`'s ledger holds any deadline.
    pub async fn any(&self, db: u32) -> redis::RedisResult<bool> {
        self.inner.store.any(db).await
    }

    /// Whether a fill has completed since the last (re)subscription (see [`fill_all`]).
    pub fn is_filled(&self) -> bool {
        self.inner.filled.load(Ordering::SeqCst)
    }

    /// Deadlines of `db` in `(from_ms, until_ms]`, a page at a time: at least `at_least` unless
    /// none are left, from where `after` says (`Cursor::default()`: the first), which is moved
    /// on; the seconds' soonest first, then the far buckets' an hour at a time (see
    /// [`Deadlines::between`]). An empty page is the end.
    pub async fn between(
        &self,
        db: u32,
        from_ms: i64,
        until_ms: i64,
        after: &mut Cursor,
        at_least: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        self.inner
            .store
            .between(db, from_ms, until_ms, after, at_least)
            .await
    }

    /// The next `limit` deadlines of `db` up to `until_ms`, soonest first (for `upcoming`).
    pub async fn upcoming(
        &self,
        db: u32,
        until_ms: i64,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        let mut rows = self
            .between(db, i64::MIN, until_ms, &mut Cursor::default(), limit)
            .await?;
        rows.truncate(limit);
        Ok(rows)
    }
}

/// Learns the deadlines of keys that exist (set before keywatch started, or while events were
/// lost), with a paced SCAN: one per distinct glob when the rules have few, else one over
/// everything. On a cluster, `only` names the master whose subscriber just came up: the keys of
/// the others were not missed.
pub async fn fill_all(ledger: &Ledger, config: &crate::config::Config, only: Option<&str>) {
    use crate::event::EventKind;
    let mut globs: Vec<Vec<u8>> = config
        .rules
        .iter()
        .filter(|r| r.on.contains(&EventKind::Expired) || r.on.contains(&EventKind::Expiring))
        .map(|r| r.pattern.scan_glob().to_vec())
        .collect();
    globs.sort();
    globs.dedup();
    if globs.len() > 8 || globs.iter().any(|g| g.as_slice() == b"*") {
        globs = vec![b"*".to_vec()];
    }
    let pace = config
        .scanner
        .as_ref()
        .map_or(50_000, |s| s.max_keys_per_second);
    // Events were lost before this fill: until it (and any other running) ends the scanner
    // scans instead.
    ledger.inner.filled.store(false, Ordering::SeqCst);
    ledger.inner.filling.fetch_add(1, Ordering::SeqCst);
    let mut complete = true;
    for &db in &config.redis.databases {
        let wanted = |k: &[u8]| config.wants_deadline(db, k);
        let started = tokio::time::Instant::now();
        let filled = ledger.fill(db, only, &globs, &wanted, pace).await;
        let error = filled.as_ref().err().map(ToString::to_string);
        complete &= error.is_none();
        crate::internal_events::LedgerFilled {
            db,
            keys: *filled.as_ref().unwrap_or(&0),
            took: started.elapsed(),
            error: error.as_deref(),
        }
        .emit();
    }
    let last = ledger.inner.filling.fetch_sub(1, Ordering::SeqCst) == 1;
    if last {
        ledger.inner.filled.store(complete, Ordering::SeqCst);
    }
}

/// Pokes every database until `shutdown`; errors are logged and retried after a pause.
///
/// Between rounds it sleeps until the earliest deadline the ledger holds ([`alarm`]): a round
/// answers that along with what is due, a deadline this instance writes earlier than its plan
/// wakes it, and once every [`SAFETY_EVERY`] one command per database reads the ledger's
/// earliest in case another instance wrote one this instance heard of no other way. While
/// nothing is due it sends the watched Redis nothing else but a marker check now and then
/// (docs/performance.md#an-idle-instance).
///
/// While keyspace events wait to be matched (a mass expiry: Redis is already expiring and
/// publishing faster than keywatch takes them in), the poker holds back, up to
/// [`HOLD_AT_MOST`]: the keys it would find due are mostly gone already, with their `expired`
/// on its way, and recording each as poked (to recover it, were its event lost) is work for
/// the same busy Redis that the matching of those very events then has to undo. What it skips
/// it finds in the next round, if the event really was lost.
///
/// `behind` says whether events wait to be matched; the engine that matches them knows how
/// many is too many, the poker only obeys.
pub async fn run_poker(
    ledger: Ledger,
    live: LiveConfig,
    behind: impl Fn() -> bool,
    shutdown: CancellationToken,
) {
    let alarm = &ledger.inner.alarm;
    let start = tokio::time::Instant::now();
    let mut safety = tokio::time::interval_at(start + SAFETY_EVERY, SAFETY_EVERY);
    safety.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut housekeeping = tokio::time::interval(MARK_EVERY);
    housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_round = tokio::time::Instant::now();
    let mut last_recorded = tokio::time::Instant::now();
    let mut grace = Grace::default();
    let mut safety_rounds: u64 = 0;
    // Per database, the least time of its next round (see POKE_EVERY).
    let mut not_before: HashMap<u32, tokio::time::Instant> = HashMap::new();
    loop {
        // Read each round: a reload may change the databases, or whether a ledger is kept.
        let config = live.current();
        let dbs = if config.uses_ledger() {
            config.redis.databases.clone()
        } else {
            Vec::new()
        };
        alarm.keep(&dbs);
        let held_back = behind() && last_round.elapsed() < HOLD_AT_MOST;
        let now = now_ms();
        let mut failed = false;
        for &db in &dbs {
            if held_back
                || alarm.planned(db).is_some_and(|at| at >= now)
                || not_before
                    .get(&db)
                    .is_some_and(|t| *t > tokio::time::Instant::now())
            {
                continue;
            }
            last_round = tokio::time::Instant::now();
            // Keep poking while whole batches are due, then plan the next look.
            loop {
                alarm.looking(db);
                // Gone keys are recorded once the events are caught up with, and at least
                // every RECORD_AT_MOST however busy: a subscriber always behind must not put
                // off recovering lost expiries for good.
                let record = !behind() || last_recorded.elapsed() >= RECORD_AT_MOST;
                if record {
                    last_recorded = tokio::time::Instant::now();
                }
                match ledger.poke_round(db, record, Some(&mut grace)).await {
                    Ok((n, _)) if n == POKE_BATCH && !behind() => continue,
                    Ok((_, next)) => {
                        let at = alarm.plan(db, next);
                        if at < now_ms() {
                            // Still due: what is left waits for a grace, an event or Redis.
                            not_before.insert(db, tokio::time::Instant::now() + POKE_EVERY);
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(db, error = %e, "Deadline poker: Redis error; retrying in a second.");
                        alarm.plan(db, None);
                        failed = true;
                        break;
                    }
                }
            }
        }
        if failed {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            // Look again at every database: the plans may be stale.
            for &db in &dbs {
                alarm.looking(db);
            }
            continue;
        }
        // Sleep until the earliest plan (or the least time of a round still due), a wake-up,
        // the safety round or housekeeping.
        let wait = if held_back {
            POKE_EVERY
        } else {
            dbs.iter()
                .map(|db| {
                    let planned = alarm.planned(*db).map_or(Duration::ZERO, until_past);
                    let least = not_before.get(db).map_or(Duration::ZERO, |t| {
                        t.saturating_duration_since(tokio::time::Instant::now())
                    });
                    planned.max(least)
                })
                .min()
                .unwrap_or(SAFETY_EVERY)
        };
        let until = tokio::time::Instant::now() + wait;
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = alarm.woken() => {}
            _ = safety.tick() => {
                // The far buckets every FAR_SAFETY_EVERY rounds: another instance's far hour is
                // refined minutes before it starts, so reading it each second would only add a
                // command a second per database to an idle Redis.
                safety_rounds += 1;
                let far = safety_rounds.is_multiple_of(FAR_SAFETY_EVERY);
                for &db in &dbs {
                    match ledger.earliest(db, far).await {
                        Ok(Some(at)) => alarm.lower(db, at),
                        Ok(None) => {}
                        Err(e) => tracing::debug!(db, error = %e, "Deadline poker: cannot read the ledger's earliest deadline."),
                    }
                }
            }
            _ = housekeeping.tick() => {
                ledger.inner.metrics.ledger_keys.set(ledger.indexed() as i64);
                // A marker now and then recovers entries whose marker was lost (published
                // while the subscriber was reconnecting): only when there are any.
                for &db in &dbs {
                    if ledger.any_poked(db).await.unwrap_or(true) {
                        let _ = ledger.mark(db).await;
                    }
                }
            }
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// Groups keys by database, in arrival order.
pub fn by_db(items: impl IntoIterator<Item = (u32, Vec<u8>)>) -> BTreeMap<u32, Vec<Vec<u8>>> {
    let mut out: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
    for (db, k) in items {
        out.entry(db).or_default().push(k);
    }
    out
}

crate::keyspace::commands::declare! {
    /// The commands the ledger sends to the watched Redis ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "scan", "ledger: learns deadlines")
            .on(Keys::Watched, Access::Read)
            .args("0 MATCH {glob} COUNT 10")
            .when(When::Ledger),
        Use::new(Server::Watched, "pexpiretime", "ledger: reads (and pokes) deadlines")
            .on(Keys::Watched, Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::Watched, "exists", "ledger: drops deadlines of deleted keys")
            .on(Keys::Watched, Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::Watched, "publish", "ledger: marker after a poke")
            .access(Access::Write)
            .channel(PubSub::Marker)
            .args("{channel} keywatch-doctor")
            .when(When::Ledger),
        // Its keys' commands are declared with them (`store::ledger`, `store::handled`).
    ]
}
