//! Matching: source signals → taken events → firings (one per event and matching rule, with its
//! detail) → the delivery stage.
//!
//! Works in batches: whatever has arrived (up to [`BATCH`] signals) is matched together, taken
//! in one script (the [`intake`]: ledger bookkeeping, claim and a record of the event, atomic per
//! event), and its details are read in one pipeline per database, which is what keeps a mass
//! expiry near the pace at which Redis publishes it.

pub(crate) mod detail;
pub mod intake;
pub(crate) mod silences;
mod stage;

/// What `recover` decides, asked by `keywatch test` as the firing stage asks it.
pub(crate) use stage::{recovery_skipped, skipped_without_detail};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::{Config, LiveConfig};
use crate::delivery::Delivery;
use crate::event::{EventKind, KeyEvent};
use crate::keyspace::Keyspace;
use crate::metrics::{Metrics, Tally};
use crate::source::Signal;
use crate::source::ledger::{self, Ledger, Note};
use crate::status::Status;
use intake::{Intake, Mode};
use stage::{FiringStage, Item};

pub const BATCH: usize = 1024;

/// PINGs (250 ms apart) that give the command connection time to reconnect before the flags are
/// checked again after a resubscription; and tries of the reconcile walk, as far apart.
const RECHECK_PINGS: u32 = 8;

/// Batches whose firing stages may overlap (see [`Engine::run`]).
const FIRING_STAGES: usize = 4;

/// How a batch of events the state server would not take is tried again: from 100 ms, doubling
/// to 5 s (dropped, events whose deadline nobody knew would be lost).
const TAKE_AGAIN: crate::backoff::Backoff =
    crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// How often records whose lease ended (their taker died, or a detail read waits for its
/// retry) are looked for while events flow: the take-over script, two commands.
const TAKE_OVER_EVERY: Duration = Duration::from_secs(1);

/// No batch for this long, the engine is idle: it asks only when the first lease ends (one
/// command), at most every [`crate::store::renew_every`] (a third of a lease: a record written
/// after one look is seen by the next before its lease can end), and runs the take-over when
/// that time comes (docs/performance.md#an-idle-instance).
const IDLE_AFTER: Duration = Duration::from_secs(15);

/// Records taken over per look (see [`Engine::take_over`]).
const TAKE_OVER_RECORDS: usize = 16;

pub struct Engine {
    /// The rules in force for the batch at hand: one snapshot of `live` per batch.
    pub config: Arc<Config>,
    pub live: LiveConfig,
    pub keyspace: Keyspace,
    pub delivery: Delivery,
    pub metrics: Arc<Metrics>,
    pub status: Arc<Status>,
    /// The deadline ledger; used while a rule reacts to expiries (see [`Engine::ledger`]).
    pub ledger: Option<Ledger>,
    /// Claims and records of taken events, shared by every instance watching the same Redis.
    pub intake: Intake,
    /// Silences in force, kept current from Redis.
    pub silenced: Arc<crate::engine::silences::Active>,
    /// The field ledger of `hexpired` rules; told of every keyevent about a watched hash.
    pub fields: Option<crate::source::fields::FieldLedger>,
    /// The ledger's markers, heard on which nodes (see [`ledger::Markers`]).
    pub markers: std::sync::Mutex<ledger::Markers>,
    /// Per node: a reconcile and fill is running, and whether another was asked for meanwhile
    /// (a flapping subscriber must not stack full scans).
    pub refreshing: Arc<Mutex<HashMap<String, bool>>>,
}

impl Engine {
    /// Runs until every sender of `rx` is gone, and the last batch's firings are handed over;
    /// then hands back the records still in hand (a detail read waiting for its retry), due at
    /// once for whoever runs next.
    ///
    /// A batch's ledger bookkeeping, matching and taking run in order (markers and the ledger
    /// depend on it); its firing stage — read details, store jobs, remove details — runs in a
    /// task of its own, overlapping the next batches' (at most [`FIRING_STAGES`] at once), so
    /// in a storm Redis's answers are waited for side by side rather than one after another.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Signal>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut stages = tokio::task::JoinSet::new();
        let mut recovering: Vec<(u32, u64)> = Vec::new();
        let mut renew = tokio::time::interval(crate::store::renew_every());
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut take_over_at = tokio::time::Instant::now();
        let mut last_batch = tokio::time::Instant::now();
        loop {
            tokio::select! {
                n = rx.recv_many(&mut batch, BATCH) => {
                    if n == 0 {
                        break;
                    }
                    last_batch = tokio::time::Instant::now();
                    // Events flow again: take-overs are looked for at the busy pace.
                    take_over_at = take_over_at.min(last_batch + TAKE_OVER_EVERY);
                    self.metrics.events_waiting.set(rx.len() as i64);
                    self.config = self.live.current();
                    let taken = self.handle(std::mem::take(&mut batch), &mut recovering).await;
                    self.start_stage(&mut stages, taken).await;
                    // A marker's recovery, a page at a time through the same path.
                    while let Some((db, seq)) = recovering.pop() {
                        let (taken, more) = self.recover_page(db, seq).await;
                        self.start_stage(&mut stages, taken).await;
                        if more {
                            recovering.push((db, seq));
                        }
                    }
                }
                _ = renew.tick() => {
                    if let Err(e) = self.intake.renew().await {
                        tracing::warn!(error = %e, "Cannot renew the leases of taken events; another instance may take them over.");
                    }
                }
                _ = tokio::time::sleep_until(take_over_at) => {
                    let now = tokio::time::Instant::now();
                    take_over_at = now + TAKE_OVER_EVERY;
                    if stages.len() >= FIRING_STAGES {
                        continue;
                    }
                    if last_batch.elapsed() >= IDLE_AFTER {
                        // Idle: one command says when the first lease ends.
                        let look_again = now + crate::store::renew_every();
                        match self.intake.earliest().await {
                            Ok(Some(at)) if at > crate::keyspace::clock::now_ms() => {
                                let until = Duration::from_millis(
                                    (at - crate::keyspace::clock::now_ms()) as u64,
                                );
                                take_over_at = look_again.min(now + until);
                                continue;
                            }
                            Ok(None) => {
                                take_over_at = look_again;
                                continue;
                            }
                            // Due now, or unknown: look.
                            Ok(Some(_)) | Err(_) => {}
                        }
                    }
                    self.config = self.live.current();
                    match self.take_over().await {
                        Ok(taken) => {
                            if !taken.is_empty() {
                                last_batch = tokio::time::Instant::now();
                            }
                            let items = taken.into_iter().map(|t| self.item(t, None)).collect();
                            self.start_stage(&mut stages, items).await;
                        }
                        Err(e) => tracing::warn!(error = %e, "Cannot look for taken events left by others."),
                    }
                }
            }
            while stages.try_join_next().is_some() {}
        }
        while stages.join_next().await.is_some() {}
        match self.intake.hand_back().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                events = n,
                "Handed taken events back: whoever runs next takes them."
            ),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot hand taken events back; they come due when their lease ends.")
            }
        }
    }

    /// Records whose lease ended, a few at a time until about a batch of events: a record holds
    /// up to a batch (a take's), or one event (waiting for a detail read's retry).
    async fn take_over(&self) -> redis::RedisResult<Vec<intake::Taken>> {
        let mut taken = Vec::new();
        loop {
            let more = self.intake.take_over(TAKE_OVER_RECORDS).await?;
            let records = more
                .iter()
                .map(|t| t.id.as_str())
                .collect::<std::collections::HashSet<_>>()
                .len();
            taken.extend(more);
            if records < TAKE_OVER_RECORDS || taken.len() >= BATCH {
                return Ok(taken);
            }
        }
    }

    /// Starts the firing stage of `items` once fewer than [`FIRING_STAGES`] run.
    async fn start_stage(&self, stages: &mut tokio::task::JoinSet<()>, items: Vec<Item>) {
        if items.is_empty() {
            return;
        }
        while stages.len() >= FIRING_STAGES {
            stages.join_next().await;
        }
        let stage = FiringStage {
            config: self.config.clone(),
            keyspace: self.keyspace.clone(),
            status: self.status.clone(),
            delivery: self.delivery.clone(),
            metrics: self.metrics.clone(),
            intake: self.intake.clone(),
            silenced: self.silenced.clone(),
        };
        stages.spawn(async move { stage.fire(items).await });
    }

    /// A taken event with the rules it fires now: those given, or (taken over) those that
    /// match it under the rules in force — just its own rule for a warning.
    fn item(&self, taken: intake::Taken, rules: Option<Vec<stage::RuleMatch>>) -> Item {
        let rules = rules.unwrap_or_else(|| {
            let r = &taken.record;
            self.config
                .rules_for_event(&r.event())
                .into_iter()
                .filter(|(i, _)| {
                    r.rule
                        .as_ref()
                        .is_none_or(|name| &self.config.rules[*i].name == name)
                })
                .collect()
        });
        Item { taken, rules }
    }

    /// The ledger, while the rules in force need one (a reload may add or drop the last rule
    /// on expiries).
    fn ledger(&self) -> Option<&Ledger> {
        self.ledger.as_ref().filter(|_| self.config.uses_ledger())
    }

    /// Takes in one batch of signals: ledger bookkeeping, matching, then taking what fires
    /// here. Markers whose recovery is due are added to `recovering`.
    async fn handle(&self, signals: Vec<Signal>, recovering: &mut Vec<(u32, u64)>) -> Vec<Item> {
        let mut events = Vec::new();
        let mut learn = Vec::new();
        let mut forget = Vec::new();
        let mut markers = Vec::new();
        let mut warnings = Vec::new();
        for s in signals {
            match s {
                Signal::Event(e) => {
                    if e.kind == EventKind::Deleted {
                        self.notice_hash(e.db, e.key.clone(), crate::source::Change::Check);
                    }
                    if self.ledger().is_some()
                        && matches!(e.kind, EventKind::Evicted | EventKind::Deleted)
                    {
                        forget.push((e.db, e.key.to_vec()));
                    }
                    events.push(e);
                }
                Signal::Deadline { db, key, note } => {
                    if matches!(note, Note::Expire | Note::RenameTo) {
                        // The key exists (again): follow-ups of an alert of it may be due.
                        self.delivery.heard_again(&self.config, db, &key);
                    }
                    // A hash renamed or moved takes its fields' deadlines along: walked where
                    // it came, its known fields looked at again where it left (gone before
                    // their deadlines: forgotten, not expired).
                    match note {
                        Note::RenameTo => {
                            self.notice_hash(db, key.clone().into(), crate::source::Change::Learn)
                        }
                        Note::Forget => {
                            self.notice_hash(db, key.clone().into(), crate::source::Change::Check)
                        }
                        Note::Expire => {}
                    }
                    if self.ledger().is_some() && self.config.wants_deadline(db, &key) {
                        match note {
                            Note::Expire | Note::RenameTo => learn.push((db, key)),
                            Note::Forget => forget.push((db, key)),
                        }
                    }
                }
                Signal::Hash { db, key, change } => self.notice_hash(db, key, change),
                Signal::Warn { event, rules } => warnings.push((event, rules)),
                Signal::Marker { node, payload } => {
                    if let Some(notice) = crate::store::notices::Notice::parse(&payload) {
                        self.noticed(notice);
                    } else if let Some((db, seq)) =
                        self.ledger().and_then(|l| l.own_marker(&payload))
                    {
                        markers.extend(self.markers().heard(&node, db, seq));
                    }
                }
                Signal::Up { node } => {
                    self.markers().up(&node);
                    self.metrics.subscriber(&node, true);
                    // Ready only once the flags are there: a promoted replica (or a restarted
                    // server) lacks them until `enable` adds them, and a `del` or `evicted` in
                    // between is not published at all.
                    self.recheck_flags(&node).await;
                    self.status.set_subscribed(&node, true);
                    // Notices published while it was away are lost: read what they tell of.
                    self.noticed(crate::store::notices::Notice::Silences);
                    self.noticed(crate::store::notices::Notice::Work);
                    self.after_subscribe(&node);
                    if let Some(f) = self
                        .fields
                        .as_ref()
                        .filter(|_| self.config.watches_fields())
                    {
                        f.resync();
                    }
                }
                // The subscriber emitted `subscription_lost`, with the reason, and counted it.
                Signal::Down { node, .. } => {
                    markers.extend(self.markers().down(&node));
                    self.keyspace.suspect();
                    self.metrics.subscriber(&node, false);
                    self.status.set_subscribed(&node, false);
                }
                Signal::NotMaster { node, reason } => {
                    // The subscriber logged the reason; a follower of the topology may find
                    // the master elsewhere.
                    markers.extend(self.markers().down(&node));
                    self.keyspace.suspect();
                    self.metrics.subscriber(&node, false);
                    self.status.refuse(&node, &reason);
                }
                Signal::Gone { node } => {
                    markers.extend(self.markers().down(&node));
                    self.metrics.forget_subscriber(&node);
                    self.status.forget_node(&node);
                }
                // A flush or a swap took keys away without a keyevent: the ledger drops their
                // deadlines rather than recover them (docs/how-it-works.md#flushes-and-swaps).
                Signal::Emptied {
                    node,
                    swapped,
                    since_ms,
                } => {
                    if let Some(f) = self
                        .fields
                        .as_ref()
                        .filter(|_| self.config.watches_fields())
                    {
                        f.emptied(swapped, since_ms);
                    }
                    if let Some(l) = self.ledger() {
                        let only = self.keyspace.is_cluster().then_some(node);
                        l.emptied(&self.live, only, swapped, since_ms);
                    }
                }
            }
        }
        if let Some(l) = self.ledger() {
            for (db, keys) in ledger::by_db(forget) {
                if let Err(e) = l.forget(db, &keys).await {
                    tracing::warn!(db, error = %e, "Ledger: cannot forget deadlines.");
                }
            }
            for (db, keys) in ledger::by_db(learn) {
                if let Err(e) = l.learn(db, &keys).await {
                    tracing::warn!(db, error = %e, "Ledger: cannot record deadlines.");
                }
            }
            recovering.extend(markers);
        }
        let mut candidates = Vec::new();
        let mut counted = Tally::default();
        for e in events {
            counted.add((e.kind, e.db));
            let rules = self.config.rules_for_event(&e);
            let mode = if e.kind == EventKind::Hexpired {
                Mode::Field {
                    fire: !rules.is_empty(),
                }
            } else if e.kind == EventKind::Expired
                && self.ledger().is_some()
                && self.config.wants_deadline(e.db, &e.key)
            {
                // Its deadline leaves the ledger even when no rule fires on it (a key watched
                // only for warnings), or the poker would take it for missed.
                Mode::Live {
                    fire: !rules.is_empty(),
                    at: self.ledger().and_then(|l| {
                        l.taking(
                            e.db,
                            &e.key,
                            crate::keyspace::clock::now_ms() + intake::SKEW_MS,
                        )
                    }),
                }
            } else if rules.is_empty() {
                continue;
            } else {
                Mode::Plain
            };
            candidates.push((e, mode, rules));
        }
        // Scanner warnings: one claim per rule, key and deadline.
        for (e, names) in warnings {
            counted.add((e.kind, e.db));
            for (rule, captures) in self.config.rules_for(e.kind, e.db, &e.key) {
                let name = &self.config.rules[rule].name;
                if names.contains(name) {
                    candidates.push((
                        e.clone(),
                        Mode::Warning { rule: name.clone() },
                        vec![(rule, captures)],
                    ));
                }
            }
        }
        for ((kind, db), n) in counted.0 {
            self.metrics.events_by(kind.as_str(), db, n);
        }
        self.take(candidates).await
    }

    /// Takes `candidates` (one script per database); returns what this instance now holds.
    /// While the state server cannot be reached the batch is tried again, with backoff: dropping
    /// it would lose events whose deadline nobody knew. Meanwhile events wait in the channel,
    /// then in Redis's output buffer, until Redis cuts the subscriber off; what the ledger knew
    /// is recovered after that, and the rest is what docs/reliability.md#guarantees counts as lost with the state.
    async fn take(&self, candidates: Vec<(KeyEvent, Mode, Vec<stage::RuleMatch>)>) -> Vec<Item> {
        let mut by_db: BTreeMap<u32, Vec<(KeyEvent, Mode, Vec<stage::RuleMatch>)>> =
            BTreeMap::new();
        for c in candidates {
            by_db.entry(c.0.db).or_default().push(c);
        }
        let mut items = Vec::new();
        for (db, cands) in by_db {
            let refs: Vec<(&KeyEvent, Mode)> =
                cands.iter().map(|(e, m, _)| (e, m.clone())).collect();
            let mut waits = TAKE_AGAIN.waits();
            let taken = loop {
                match self.intake.take(db, &refs).await {
                    Ok(t) => break t,
                    Err(e) => {
                        tracing::warn!(db, error = %e, events = refs.len(), "Cannot take events (claim and record them) in Redis; trying again.");
                        tokio::time::sleep(waits.next()).await;
                    }
                }
            };
            for ((e, _, rules), t) in cands.into_iter().zip(taken) {
                match t {
                    Some(t) => items.push(Item { taken: t, rules }),
                    None => {
                        tracing::debug!(key = %e.key_lossy(), event = %e.kind, "Taken by another instance, or nothing fires.")
                    }
                }
            }
        }
        if !items.is_empty() {
            crate::drill::pass(crate::drill::Step::Taken);
        }
        items
    }

    /// One page (at most [`BATCH`]) of the expiries missed up to marker `seq` of `db`, taken
    /// as recovered; and whether more may remain.
    async fn recover_page(&self, db: u32, seq: u64) -> (Vec<Item>, bool) {
        let Some(l) = self.ledger() else {
            return (Vec::new(), false);
        };
        let missed = match l.missed(db, seq, BATCH).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(db, error = %e, "Ledger: cannot read missed expiries; they stay for the next marker.");
                return (Vec::new(), false);
            }
        };
        let full = missed.len() == BATCH;
        let mut candidates = Vec::new();
        for m in missed {
            let event = KeyEvent {
                kind: EventKind::Expired,
                db: m.db,
                key: m.key.into(),
                field: None,
                observed_at: crate::keyspace::clock::now(),
                deadline: chrono::DateTime::from_timestamp_millis(m.deadline_ms),
                ttl_ms: None,
                recovered: true,
                source: self.keyspace.node(),
                place: None,
            };
            let rules = self.config.rules_for(event.kind, event.db, &event.key);
            tracing::info!(db, key = %event.key_lossy(), deadline = ?event.deadline, "Recovered an expiry whose notification was missed.");
            let mode = Mode::Recovered {
                fire: !rules.is_empty(),
            };
            candidates.push((event, mode, rules));
        }
        let n = candidates.len();
        let taken = self.take(candidates).await;
        // Every entry read leaves the poked set when taken (fired or not); a page that took
        // nothing (another instance is on it) is not read again at once.
        (taken, full && n > 0)
    }

    /// Acts on a notice of another instance, or of `keywatch silence` ([`crate::store::notices`]).
    fn noticed(&self, notice: crate::store::notices::Notice) {
        match notice {
            crate::store::notices::Notice::Silences => self.silenced.read_again(),
            crate::store::notices::Notice::Work => self.delivery.look_now(),
        }
    }

    /// Tells the field ledger of a keyevent about a hash some `hexpired` rule watches (the name
    /// shared, not copied: it may be megabytes long).
    fn notice_hash(&self, db: u32, key: bytes::Bytes, change: crate::source::Change) {
        if let Some(f) = &self.fields
            && self.config.wants_hash(db, &key)
        {
            f.notice(db, key, change);
        }
    }

    fn markers(&self) -> std::sync::MutexGuard<'_, ledger::Markers> {
        // A std Mutex: the guard never lives across an await.
        self.markers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After every (re)subscription events may have been lost: drop deadlines of keys deleted
    /// meanwhile, ask for a marker (whose arrival recovers what was missed), then learn the
    /// deadlines of keys set meanwhile with a paced scan. One at a time per node: a
    /// resubscription while one runs asks for one more run after it, not a second scan beside it.
    fn after_subscribe(&self, node: &str) {
        let Some(l) = self.ledger().cloned() else {
            return;
        };
        {
            let mut running = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(again) = running.get_mut(node) {
                *again = true;
                return;
            }
            running.insert(node.to_string(), false);
        }
        let live = self.live.clone();
        let refreshing = self.refreshing.clone();
        let node = node.to_string();
        let only = self.keyspace.is_cluster().then(|| node.clone());
        tokio::spawn(async move {
            loop {
                let config = live.current();
                for &db in &config.redis.databases {
                    // The command connections may have been cut with the subscriber's: one
                    // finds out at its first command, then reconnects. Given up on, the walk
                    // left the deadlines of keys deleted meanwhile to be recovered as expiries.
                    let mut tries = 1;
                    let walked = loop {
                        match l.reconcile(db).await {
                            Err(e) if tries < RECHECK_PINGS => {
                                tracing::debug!(db, error = %e, "Ledger: reconcile failed; trying again.");
                                tries += 1;
                                tokio::time::sleep(Duration::from_millis(250)).await;
                            }
                            walked => break walked,
                        }
                    };
                    match walked {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(
                            db,
                            dropped = n,
                            "Ledger: dropped deadlines of keys deleted while keywatch was not listening."
                        ),
                        Err(e) => tracing::warn!(db, error = %e, "Ledger: reconcile failed."),
                    }
                    if let Err(e) = l.mark(db).await {
                        tracing::warn!(db, error = %e, "Ledger: cannot publish a marker.");
                    }
                }
                ledger::fill_all(&l, &config, only.as_deref()).await;
                let mut running = refreshing.lock().unwrap_or_else(|p| p.into_inner());
                match running.get_mut(&node) {
                    Some(again) if *again => *again = false,
                    _ => {
                        running.remove(&node);
                        return;
                    }
                }
            }
        });
    }

    /// A Redis that restarted has lost a `CONFIG SET notify-keyspace-events` not written to its
    /// redis.conf: check again after every (re)subscription, and re-add with `enable`.
    async fn recheck_flags(&self, node: &str) {
        let mut c = match self.keyspace.node_conn(node).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(%node, error = %e, "Cannot check notify-keyspace-events after subscribing.");
                return;
            }
        };
        // After a restart the command connection finds out it is broken only when a command
        // fails on it (then it reconnects): without this, that command was the CONFIG GET, and
        // a restarted Redis stayed without the flags keywatch needs.
        for attempt in 1..=RECHECK_PINGS {
            match redis::cmd("PING").query_async::<()>(&mut c).await {
                Ok(()) => break,
                Err(e) if attempt == RECHECK_PINGS => {
                    tracing::warn!(%node, error = %e, "Cannot check notify-keyspace-events after subscribing.");
                    return;
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(250)).await,
            }
        }
        let checked = crate::source::flags::ensure(&mut c, &self.config, node).await;
        self.metrics.notify_flags(node, matches!(checked, Ok(true)));
        if let Err(msg) = checked {
            tracing::error!("{msg}");
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands the engine sends itself ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "ping", "health checks"),
    ]
}
