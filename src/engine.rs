//! Matching: source signals → firings (one per event and matching rule, with its detail) → the
//! delivery stage.
//!
//! Works in batches: whatever has arrived (up to [`BATCH`] signals) is matched together and its
//! details are read in one pipeline per database, which is what keeps a mass expiry near the
//! pace at which Redis publishes it.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::action::detail;
use crate::config::Config;
use crate::delivery::Delivery;
use crate::event::KeyEvent;
use crate::job::Firing;
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::source::notifications::Signal;
use crate::status::Status;
use crate::template::Context;

pub const BATCH: usize = 1024;

/// PINGs (250 ms apart) that give the command connection time to reconnect before the flags are
/// checked again after a resubscription.
const RECHECK_PINGS: u32 = 8;

pub struct Engine {
    pub config: Arc<Config>,
    pub keyspace: Keyspace,
    pub delivery: Delivery,
    pub metrics: Arc<Metrics>,
    pub status: Arc<Status>,
}

/// One event matched by one rule, on its way to becoming a firing.
struct Matched {
    event: KeyEvent,
    rule: usize,
    captures: Vec<Vec<u8>>,
}

impl Engine {
    /// Runs until every sender of `rx` is gone.
    pub async fn run(self, mut rx: mpsc::Receiver<Signal>) {
        let mut batch = Vec::with_capacity(BATCH);
        while rx.recv_many(&mut batch, BATCH).await > 0 {
            self.handle(std::mem::take(&mut batch)).await;
        }
    }

    async fn handle(&self, signals: Vec<Signal>) {
        let mut matched = Vec::new();
        for s in signals {
            match s {
                Signal::Event(e) => self.match_event(e, &mut matched),
                Signal::Up { node } => {
                    self.metrics.subscriber(&node, true);
                    self.status.set_subscribed(&node, true);
                    self.recheck_flags(&node).await;
                }
                Signal::Down { node, reason } => {
                    self.metrics.subscriber(&node, false);
                    self.metrics.reconnects.inc();
                    self.status.set_subscribed(&node, false);
                    tracing::warn!(%node, %reason, "Keyspace events published until the subscription is back are lost.");
                }
            }
        }
        if matched.is_empty() {
            return;
        }
        self.fire(matched).await;
    }

    /// A Redis that restarted has lost a `CONFIG SET notify-keyspace-events` not written to its
    /// redis.conf: check again after every (re)subscription, and re-add with `enable`.
    async fn recheck_flags(&self, node: &str) {
        let mut c = match self.keyspace.conn(0).await {
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

    fn match_event(&self, e: KeyEvent, out: &mut Vec<Matched>) {
        self.metrics.event(e.kind.as_str(), e.db);
        if let Some(late) = e.late_ms() {
            self.metrics.expiry_lateness.observe(late as f64 / 1000.0);
        }
        for (rule, captures) in self.config.rules_for(e.kind, e.db, &e.key) {
            self.metrics
                .matched(&self.config.rules[rule].name, e.kind.as_str());
            out.push(Matched {
                event: e.clone(),
                rule,
                captures,
            });
        }
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
            match detail::request(&config.templates, rule, m.event.db, &ctx) {
                None => slot.push(None),
                Some(Ok(r)) => {
                    slot.push(Some(requests.len()));
                    requests.push(r);
                }
                Some(Err(e)) => {
                    tracing::error!(rule = %rule.name, key = %m.event.key_lossy(), error = %e, "Cannot render the detail location; the actions run without it.");
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
            self.delivery.submit(firing);
        }
        // Only now that every firing holds its copy may the originals go (SPEC §2).
        if !removable.is_empty()
            && let Err(e) = detail::remove(&self.keyspace, &removable).await
        {
            tracing::error!(error = %e, "Cannot remove details; they stay in Redis.");
        }
    }
}
