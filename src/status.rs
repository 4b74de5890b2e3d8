//! What the process knows about itself, for `/readyz` and the status page: which nodes are
//! subscribed, the running rules, the most recent firings with what became of their actions,
//! the most recent dead letters, and per-rule counts.
//!
//! Everything here is in memory and per instance: it is what an on-call engineer looks at, not a
//! record. The counts restart with the process (the Prometheus counters are the durable view).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::firing::{DeadLetter, Firing};

/// How many recent firings the status page shows.
const RECENT: usize = 100;

/// How many recent dead letters the status page shows.
const DEAD: usize = 50;

#[derive(Clone, Debug)]
pub struct RecentFiring {
    pub at: DateTime<Utc>,
    pub rule: String,
    pub event: String,
    pub key: String,
    pub id: String,
    pub recovered: bool,
    /// The latest outcome of each action of the firing, in the order they were first reported.
    pub outcomes: Vec<ActionOutcome>,
}

/// The latest attempt of one action of one firing.
#[derive(Clone, Debug)]
pub struct ActionOutcome {
    /// `reload`, `exec`, `cleanup`, or `notify:CHANNEL`.
    pub action: String,
    /// `sent`, `retry`, `failed` (the `outcome` label of `keywatch_actions_total`) or `dead`.
    pub outcome: String,
    pub attempts: u32,
    /// The target's answer or the failure reason.
    pub detail: String,
}

/// Counts of one rule since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCounts {
    pub matched: u64,
    pub sent: u64,
    pub retried: u64,
    pub failed: u64,
    pub dead: u64,
    /// Rendered and not done (`run --shadow`).
    pub shadow: u64,
}

#[derive(Default)]
pub struct Status {
    // std Mutexes: held for a few instructions, never across an await.
    nodes: Mutex<BTreeMap<String, bool>>,
    /// Why a node is not watched (it is no master), until it is subscribed again.
    refused: Mutex<BTreeMap<String, String>>,
    recent: Mutex<VecDeque<RecentFiring>>,
    dead: Mutex<VecDeque<DeadLetter>>,
    counts: Mutex<BTreeMap<String, RuleCounts>>,
    /// The running rule set; replaced on reload.
    config: Mutex<Option<Arc<Config>>>,
    /// Where firings and outcomes are recorded in Redis, once `run` has started its writer.
    history: std::sync::OnceLock<crate::store::history::Recorder>,
    /// Reasons not to be ready besides the nodes (a grant the rules need is missing), by name.
    blockers: Mutex<BTreeMap<String, String>>,
    /// Whether [`Status::ready`] was true when last looked at, to log its changes once.
    was_ready: std::sync::atomic::AtomicBool,
    /// What each quiet channel holds, as last read from Redis.
    held: Mutex<Vec<crate::store::held::ChannelHeld>>,
}

impl Status {
    /// Records firings and outcomes in Redis from now on, besides the in-memory list.
    pub fn record_to(&self, recorder: crate::store::history::Recorder) {
        let _ = self.history.set(recorder);
    }

    /// What each quiet channel holds now (read from Redis when someone looks).
    pub fn set_held(&self, held: Vec<crate::store::held::ChannelHeld>) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = held;
    }

    /// What each quiet channel held when last read.
    pub fn held(&self) -> Vec<crate::store::held::ChannelHeld> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The history recorder, once `run` started it.
    pub fn history(&self) -> Option<&crate::store::history::Recorder> {
        self.history.get()
    }

    /// Declares a node that must be subscribed before keywatch is ready.
    pub fn expect_node(&self, node: &str) {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(node.to_string())
            .or_insert(false);
        // Logged when it happens (a failover's `+selected-slave`), not when the node left
        // behind is forgotten after the promotion.
        self.note_readiness();
    }

    pub fn set_subscribed(&self, node: &str, up: bool) {
        if up {
            self.refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(node);
        }
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), up);
        self.note_readiness();
    }

    /// Not ready because of `reason` (named `name`), until [`Status::unblock`].
    pub fn block(&self, name: &str, reason: &str) {
        self.blockers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), reason.to_string());
        self.note_readiness();
    }

    pub fn unblock(&self, name: &str) {
        self.blockers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        self.note_readiness();
    }

    /// Why keywatch is not ready, besides its nodes.
    pub fn blockers(&self) -> Vec<String> {
        self.blockers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Logs a change of readiness once: the line an operator (or a drill) looks for.
    fn note_readiness(&self) {
        use std::sync::atomic::Ordering;
        let now = self.ready();
        if self.was_ready.swap(now, Ordering::AcqRel) == now {
            return;
        }
        let down: Vec<String> = self
            .nodes()
            .into_iter()
            .filter(|(_, up)| !up)
            .map(|(n, _)| n)
            .collect();
        crate::internal_events::Readiness {
            ready: now,
            nodes_down: &down.join(" "),
            reasons: &self.blockers().join("; "),
        }
        .emit();
    }

    /// `node` is not watched because of `reason` (it is no master): not subscribed, and
    /// `/readyz` says why.
    pub fn refuse(&self, node: &str, reason: &str) {
        self.set_subscribed(node, false);
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), reason.to_string());
    }

    /// Why `node` is not watched, if it was refused.
    pub fn refusal(&self, node: &str) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .cloned()
    }

    /// A node keywatch no longer watches (a cluster node that stopped being a master).
    pub fn forget_node(&self, node: &str) {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
        self.note_readiness();
    }

    /// Every expected node is subscribed (and there is at least one), and nothing else holds
    /// readiness back ([`Status::block`]).
    pub fn ready(&self) -> bool {
        let nodes_up = {
            let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
            !nodes.is_empty() && nodes.values().all(|up| *up)
        };
        nodes_up
            && self
                .blockers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
    }

    pub fn nodes(&self) -> Vec<(String, bool)> {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    /// A firing whose jobs are stored (its history is kept by the transaction that stores them,
    /// see `store::history::Recorder::firing_cmds`): shown among the recent firings and counted.
    pub fn record_firing(&self, f: &Firing) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == RECENT {
            r.pop_front();
        }
        r.push_back(RecentFiring {
            at: f.observed_at,
            rule: f.rule.clone(),
            event: f.kind.as_str().to_string(),
            // Kept for the page: a long key by its cut view (docs/reliability.md#bounded-whatever-the-key).
            key: String::from_utf8_lossy(&crate::long_key::view(&f.key, crate::long_key::IN_TEXT))
                .into_owned(),
            id: f.id.clone(),
            recovered: f.recovered,
            outcomes: Vec::new(),
        });
        drop(r);
        self.count(&f.rule, |c| c.matched += 1);
    }

    /// One attempt of `action` (`notify:CHANNEL` for notifications) of the firing `id` of
    /// `rule` ended with `outcome` (`sent`, `retry`, `failed`). `id` is `None` for a digest,
    /// which stands for many firings: it is only counted.
    pub fn record_outcome(
        &self,
        rule: &str,
        id: Option<&str>,
        action: &str,
        outcome: &str,
        detail: &str,
    ) {
        self.count(rule, |c| match outcome {
            "sent" => c.sent += 1,
            "retry" => c.retried += 1,
            "shadow" => c.shadow += 1,
            _ => c.failed += 1,
        });
        let Some(id) = id else { return };
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        // Newest last, and outcomes mostly concern recent firings: search from the back.
        let Some(f) = r.iter_mut().rev().find(|f| f.id == id && f.rule == rule) else {
            return;
        };
        match f.outcomes.iter_mut().find(|o| o.action == action) {
            Some(o) => {
                o.outcome = outcome.to_string();
                o.attempts += 1;
                o.detail = detail.to_string();
            }
            None => f.outcomes.push(ActionOutcome {
                action: action.to_string(),
                outcome: outcome.to_string(),
                attempts: 1,
                detail: detail.to_string(),
            }),
        }
    }

    /// An action failed for good; its firing (if still listed) shows it as `dead`.
    pub fn record_dead_letter(&self, d: &DeadLetter) {
        if let Some(h) = self.history() {
            for f in &d.firings {
                h.dead(f, &d.action, &d.reason);
            }
        }
        self.count(&d.rule, |c| c.dead += 1);
        {
            let label = d.label();
            let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(o) = r
                .iter_mut()
                .rev()
                .find(|f| f.rule == d.rule && d.firings.iter().any(|x| x.id == f.id))
                .and_then(|f| f.outcomes.iter_mut().find(|o| o.action == label))
            {
                o.outcome = "dead".to_string();
            }
        }
        let mut dead = self.dead.lock().unwrap_or_else(|p| p.into_inner());
        if dead.len() == DEAD {
            dead.pop_front();
        }
        let mut summary = d.summary();
        // Its key text for the page, a long one by its cut view.
        if summary.key.len() > crate::long_key::IN_TEXT {
            summary.key = String::from_utf8_lossy(&crate::long_key::view(
                summary.key.as_bytes(),
                crate::long_key::IN_TEXT,
            ))
            .into_owned();
        }
        dead.push_back(summary);
    }

    /// Newest first.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        self.dead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .rev()
            .cloned()
            .collect()
    }

    /// Counts of `rule` since start (zero for a rule that has not fired).
    pub fn counts(&self, rule: &str) -> RuleCounts {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(rule)
            .copied()
            .unwrap_or_default()
    }

    fn count(&self, rule: &str, f: impl FnOnce(&mut RuleCounts)) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        match c.get_mut(rule) {
            Some(counts) => f(counts),
            None => f(c.entry(rule.to_string()).or_default()),
        }
    }

    /// Sets the running rule set (at start, and after a successful reload).
    pub fn set_config(&self, config: Arc<Config>) {
        *self.config.lock().unwrap_or_else(|p| p.into_inner()) = Some(config);
    }

    pub fn config(&self) -> Option<Arc<Config>> {
        self.config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Newest first.
    pub fn recent(&self) -> Vec<RecentFiring> {
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .rev()
            .cloned()
            .collect()
    }
}
