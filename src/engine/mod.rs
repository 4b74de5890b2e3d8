//! Matching: source signals → firings (one per event and matching rule, with its detail) → the
//! delivery stage.
//!
//! Works in batches: whatever has arrived (up to [`BATCH`] signals) is matched together and its
//! details are read in one pipeline per database, which is what keeps a mass expiry near the
//! pace at which Redis publishes it.

pub mod claims;
pub mod detail;
pub mod silences;

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::config::{Config, LiveConfig};
use crate::delivery::Delivery;
use crate::engine::claims::Claims;
use crate::event::{EventKind, KeyEvent};
use crate::firing::Firing;
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::source::Signal;
use crate::source::ledger::{self, Ledger, Note};
use crate::status::Status;
use crate::template::Context;

pub const BATCH: usize = 1024;

/// PINGs (250 ms apart) that give the command connection time to reconnect before the flags are
/// checked again after a resubscription.
const RECHECK_PINGS: u32 = 8;

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
    /// Event claims shared by every instance watching the same Redis.
    pub claims: Claims,
    /// This process's name in claims.
    pub instance: String,
    /// Silences in force, kept current from Redis.
    pub silenced: Arc<crate::engine::silences::Active>,
    /// The ledger's markers, heard on which nodes (see [`ledger::Markers`]).
    pub markers: std::sync::Mutex<ledger::Markers>,
}

/// One event matched by one rule, on its way to becoming a firing.
struct Matched {
    event: KeyEvent,
    rule: usize,
    captures: Vec<Vec<u8>>,
}

impl Engine {
    /// Runs until every sender of `rx` is gone, and the last batch's firings are handed over.
    ///
    /// A batch's ledger bookkeeping and matching run in order (markers depend on it); its firing
    /// stage — four round trips: claim, read details, store jobs, remove details — runs in a
    /// task of its own, overlapping the next batches' (at most [`FIRING_STAGES`] at once), so
    /// in a storm Redis's answers are waited for side by side rather than one after another.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Signal>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut stages = tokio::task::JoinSet::new();
        while rx.recv_many(&mut batch, BATCH).await > 0 {
            self.metrics.events_waiting.set(rx.len() as i64);
            self.config = self.live.current();
            let taken = self.handle(std::mem::take(&mut batch)).await;
            if taken.candidates.is_empty() && taken.warnings.is_empty() {
                continue;
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
                claims: self.claims.clone(),
                instance: self.instance.clone(),
                silenced: self.silenced.clone(),
            };
            stages.spawn(async move {
                let matched = stage.claim(taken).await;
                if !matched.is_empty() {
                    stage.fire(matched).await;
                }
            });
        }
        while stages.join_next().await.is_some() {}
    }

    /// The ledger, while the rules in force need one (a reload may add or drop the last rule
    /// on expiries).
    fn ledger(&self) -> Option<&Ledger> {
        self.ledger.as_ref().filter(|_| self.config.uses_ledger())
    }

    /// Takes in one batch of signals: ledger bookkeeping, then matching; returns the events
    /// that match rules, to be claimed by the firing stage.
    async fn handle(&self, signals: Vec<Signal>) -> Taken {
        let mut events = Vec::new();
        let mut learn = Vec::new();
        let mut forget = Vec::new();
        let mut markers = Vec::new();
        let mut warnings = Vec::new();
        for s in signals {
            match s {
                Signal::Event(e) => {
                    if self.ledger().is_some()
                        && matches!(e.kind, EventKind::Evicted | EventKind::Deleted)
                    {
                        forget.push((e.db, e.key.clone()));
                    }
                    events.push(e);
                }
                Signal::Deadline { db, key, note } => {
                    if self.ledger().is_some() && self.config.wants_deadline(db, &key) {
                        match note {
                            Note::Expire | Note::RenameTo => learn.push((db, key)),
                            Note::Forget => forget.push((db, key)),
                        }
                    }
                }
                Signal::Warn { event, rules } => warnings.push((event, rules)),
                Signal::Marker { node, payload } => {
                    if let Some((db, seq)) = self.ledger().and_then(|l| l.own_marker(&payload)) {
                        markers.extend(self.markers().heard(&node, db, seq));
                    }
                }
                Signal::Up { node } => {
                    self.markers().up(&node);
                    self.metrics.subscriber(&node, true);
                    self.status.set_subscribed(&node, true);
                    self.recheck_flags(&node).await;
                    self.after_subscribe(&node);
                }
                Signal::Down { node, reason } => {
                    markers.extend(self.markers().down(&node));
                    self.keyspace.suspect();
                    self.metrics.subscriber(&node, false);
                    self.metrics.reconnects.inc();
                    self.status.set_subscribed(&node, false);
                    tracing::warn!(%node, %reason, "Keyspace events published until the subscription is back are lost; expiries of keys with known deadlines will be recovered.");
                }
                Signal::Gone { node } => {
                    markers.extend(self.markers().down(&node));
                    self.metrics.forget_subscriber(&node);
                    self.status.forget_node(&node);
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
            self.attach_deadlines(l, &mut events).await;
        }
        if let Some(l) = self.ledger() {
            for (db, seq) in markers {
                self.recover(l, db, seq, &mut events).await;
            }
        }
        let mut candidates = Vec::new();
        for e in events {
            self.metrics.event(e.kind.as_str(), e.db);
            let rules = self.config.rules_for(e.kind, e.db, &e.key);
            if !rules.is_empty() {
                candidates.push((e, rules));
            }
        }
        Taken {
            candidates,
            warnings,
        }
    }

    fn markers(&self) -> std::sync::MutexGuard<'_, ledger::Markers> {
        // A std Mutex: the guard never lives across an await.
        self.markers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After every (re)subscription events may have been lost: drop deadlines of keys deleted
    /// meanwhile, ask for a marker (whose arrival recovers what was missed), then learn the
    /// deadlines of keys set meanwhile with a paced scan.
    fn after_subscribe(&self, node: &str) {
        let Some(l) = self.ledger().cloned() else {
            return;
        };
        let config = self.config.clone();
        let only = self.keyspace.is_cluster().then(|| node.to_string());
        tokio::spawn(async move {
            for &db in &config.redis.databases {
                match l.reconcile(db).await {
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
        });
    }

    /// Marks `expired` events of ledgered keys as handled and gives them their deadline.
    async fn attach_deadlines(&self, l: &Ledger, events: &mut [KeyEvent]) {
        let mut idx: std::collections::BTreeMap<u32, Vec<usize>> =
            std::collections::BTreeMap::new();
        for (i, e) in events.iter().enumerate() {
            if e.kind == EventKind::Expired && self.config.wants_deadline(e.db, &e.key) {
                idx.entry(e.db).or_default().push(i);
            }
        }
        for (db, positions) in idx {
            let keys: Vec<Vec<u8>> = positions.iter().map(|&i| events[i].key.clone()).collect();
            match l.handled(db, &keys).await {
                Ok(deadlines) => {
                    for (&i, d) in positions.iter().zip(deadlines) {
                        events[i].deadline = d.and_then(chrono::DateTime::from_timestamp_millis);
                    }
                }
                Err(e) => {
                    tracing::warn!(db, error = %e, "Ledger: cannot mark expiries as handled.")
                }
            }
        }
    }

    /// Expiries the ledger knew of but keywatch never saw: fired with `recovered: true`.
    async fn recover(&self, l: &Ledger, db: u32, seq: u64, out: &mut Vec<KeyEvent>) {
        let missed = match l.recover(db, seq).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(db, error = %e, "Ledger: cannot read missed expiries; they stay for the next marker.");
                return;
            }
        };
        for m in missed {
            let event = KeyEvent {
                kind: EventKind::Expired,
                db: m.db,
                key: m.key,
                observed_at: chrono::Utc::now(),
                deadline: chrono::DateTime::from_timestamp_millis(m.deadline_ms),
                ttl_ms: None,
                recovered: true,
                source: self.keyspace.node().to_string(),
            };
            tracing::info!(db, key = %event.key_lossy(), deadline = ?event.deadline, "Recovered an expiry whose notification was missed.");
            out.push(event);
        }
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
        if let Err(msg) = crate::source::flags::ensure(&mut c, &self.config, node).await {
            tracing::error!("{msg}");
        }
    }
}

/// Batches whose firing stages may overlap (see [`Engine::run`]).
const FIRING_STAGES: usize = 4;

/// What the firing stage of one batch needs, owned, so that it can run beside the next batch.
struct FiringStage {
    config: Arc<Config>,
    keyspace: Keyspace,
    status: Arc<Status>,
    delivery: Delivery,
    metrics: Arc<Metrics>,
    claims: Claims,
    instance: String,
    silenced: Arc<crate::engine::silences::Active>,
}

/// A rule's index in the config and the captures of its pattern.
type RuleMatch = (usize, Vec<Vec<u8>>);

/// A batch's events that match rules (with each rule's captures), and the scanner's warnings
/// with the rules they name: what the firing stage claims.
struct Taken {
    candidates: Vec<(KeyEvent, Vec<RuleMatch>)>,
    warnings: Vec<(KeyEvent, Vec<String>)>,
}

impl FiringStage {
    /// Claims the batch's events (one pipeline); returns what fires here: the events this
    /// instance won, for each matching rule not silenced, and the scanner's warnings.
    async fn claim(&self, taken: Taken) -> Vec<Matched> {
        let Taken {
            candidates,
            warnings,
        } = taken;
        let won = self
            .claims
            .claim(
                &candidates.iter().map(|(e, _)| e).collect::<Vec<_>>(),
                &self.instance,
            )
            .await;
        let mut matched = Vec::new();
        for ((e, rules), won) in candidates.into_iter().zip(won) {
            if !won {
                tracing::debug!(key = %e.key_lossy(), event = %e.kind, "Another instance took this event.");
                continue;
            }
            if e.recovered {
                for (rule, _) in &rules {
                    self.metrics.recovered_for(&self.config.rules[*rule].name);
                }
            } else if let Some(late) = e.late_ms() {
                self.metrics.expiry_lateness.observe(late as f64 / 1000.0);
            }
            for (rule, captures) in rules {
                let name = &self.config.rules[rule].name;
                self.metrics.matched(name, e.kind.as_str());
                if self.silenced.mutes(name, &e.key) {
                    self.metrics.silenced_for(name);
                    tracing::info!(rule = %name, key = %e.key_lossy(), "Silenced: counted, not sent.");
                    continue;
                }
                matched.push(Matched {
                    event: e.clone(),
                    rule,
                    captures,
                });
            }
        }
        // Scanner warnings were claimed per key and deadline by the scanner; they fire just the
        // rules they name, through the same silences and delivery.
        for (e, names) in warnings {
            self.metrics.event(e.kind.as_str(), e.db);
            for (rule, captures) in self.config.rules_for(e.kind, e.db, &e.key) {
                let name = &self.config.rules[rule].name;
                if !names.contains(name) {
                    continue;
                }
                self.metrics.matched(name, e.kind.as_str());
                if self.silenced.mutes(name, &e.key) {
                    self.metrics.silenced_for(name);
                    continue;
                }
                matched.push(Matched {
                    event: e.clone(),
                    rule,
                    captures,
                });
            }
        }
        matched
    }

    async fn fire(&self, matched: Vec<Matched>) {
        let config = &self.config;
        // Detail locations, rendered per event; a rule without `detail` has none.
        let mut requests = Vec::new();
        let mut slot = Vec::with_capacity(matched.len());
        for m in &matched {
            let rule = &config.rules[m.rule];
            let ctx = Context::for_event(
                &rule.name,
                &m.event,
                rule.pattern.capture_names(),
                &m.captures,
                None,
            );
            match detail::request(
                &config.templates,
                rule,
                m.event.db,
                &ctx,
                config.state.prefix.as_bytes(),
            ) {
                None => slot.push(None),
                Some(Ok(r)) => {
                    slot.push(Some(requests.len()));
                    requests.push(r);
                }
                Some(Err(e)) => {
                    tracing::error!(rule = %rule.name, key = %m.event.key_lossy(), error = %config.secrets.mask(&e), "Cannot render the detail location; the actions run without it.");
                    slot.push(None);
                }
            }
        }
        let details = if requests.is_empty() {
            Vec::new()
        } else {
            detail::fetch(&self.keyspace, &requests).await
        };

        let mut removable = Vec::new();
        let mut firings = Vec::with_capacity(matched.len());
        for (m, s) in matched.into_iter().zip(slot) {
            let rule = &config.rules[m.rule];
            let value = match s {
                None => None,
                Some(i) => match &details[i] {
                    Ok(Some(bytes)) => {
                        removable.push(&requests[i]);
                        Some(detail::parse(bytes))
                    }
                    Ok(None) => {
                        tracing::warn!(rule = %rule.name, key = %m.event.key_lossy(), "No detail found beside the key; the actions run with `detail` = none.");
                        Some(serde_json::Value::Null)
                    }
                    Err(e) => {
                        tracing::error!(rule = %rule.name, key = %m.event.key_lossy(), error = %e, "Cannot read the detail; the actions run with `detail` = none.");
                        Some(serde_json::Value::Null)
                    }
                },
            };
            let firing = Firing::new(
                &rule.name,
                &m.event,
                rule.pattern.capture_names(),
                m.captures,
                value,
            );
            self.status.record_firing(&firing);
            firings.push(firing);
        }
        self.delivery.accept(firings).await;
        // Only now that every firing's copy is stored with its jobs may the originals go
        // (SPEC §2): a crash before this line leaves the details, not a hole.
        if !removable.is_empty()
            && let Err(e) = detail::remove(&self.keyspace, &removable).await
        {
            tracing::error!(error = %e, "Cannot remove details; they stay in Redis.");
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands the engine sends itself ([`crate::keyspace::commands`]).
    [
        Use::new(Conn::Watched, "ping", "health checks"),
    ]
}
