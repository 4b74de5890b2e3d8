//! What the process knows about itself, for `/readyz` and the status page: which nodes are
//! subscribed, and the most recent firings.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use chrono::{DateTime, Utc};

use crate::job::Firing;

/// How many recent firings the status page shows.
const RECENT: usize = 100;

#[derive(Clone, Debug)]
pub struct RecentFiring {
    pub at: DateTime<Utc>,
    pub rule: String,
    pub event: String,
    pub key: String,
    pub id: String,
}

#[derive(Default)]
pub struct Status {
    // std Mutexes: held for a few instructions, never across an await.
    nodes: Mutex<BTreeMap<String, bool>>,
    recent: Mutex<VecDeque<RecentFiring>>,
}

impl Status {
    /// Declares a node that must be subscribed before keywatch is ready.
    pub fn expect_node(&self, node: &str) {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(node.to_string())
            .or_insert(false);
    }

    pub fn set_subscribed(&self, node: &str, up: bool) {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), up);
    }

    /// Every expected node is subscribed (and there is at least one).
    pub fn ready(&self) -> bool {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        !nodes.is_empty() && nodes.values().all(|up| *up)
    }

    pub fn nodes(&self) -> Vec<(String, bool)> {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    pub fn record_firing(&self, f: &Firing) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == RECENT {
            r.pop_front();
        }
        r.push_back(RecentFiring {
            at: f.observed_at,
            rule: f.rule.clone(),
            event: f.kind.as_str().to_string(),
            key: String::from_utf8_lossy(&f.key).into_owned(),
            id: f.id.clone(),
        });
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
