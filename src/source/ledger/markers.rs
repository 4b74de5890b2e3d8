//! Markers waiting to be heard: when a marker proves every `expired` before it was handled
//! (see [`super`]).

use std::collections::{BTreeMap, BTreeSet};

/// Markers waiting to be heard on every subscribed node.
///
/// On a cluster a PUBLISH reaches every node over the cluster bus, and each node hands it to
/// its subscribers after the `expired` events it published before (those the poker's touches
/// caused on that node, which were answered before the marker was sent). So a marker proves
/// the `expired` of one node only: recovery waits until it was heard on every node subscribed
/// now (a node that is down lost its events anyway). On a single node that is the first copy.
#[derive(Debug, Default)]
pub struct Markers {
    up: BTreeSet<String>,
    heard: BTreeMap<(u32, u64), BTreeSet<String>>,
}

/// Markers kept waiting at most; beyond that the oldest go (a later one recovers as much).
const MARKERS_WAITING: usize = 4096;

impl Markers {
    pub fn up(&mut self, node: &str) {
        self.up.insert(node.to_string());
    }

    /// `node` is down or gone: markers that waited only for it are complete now.
    pub fn down(&mut self, node: &str) -> Vec<(u32, u64)> {
        self.up.remove(node);
        self.complete()
    }

    /// Marker `seq` of `db` was heard on `node`; returns the markers now complete.
    pub fn heard(&mut self, node: &str, db: u32, seq: u64) -> Vec<(u32, u64)> {
        self.heard
            .entry((db, seq))
            .or_default()
            .insert(node.to_string());
        while self.heard.len() > MARKERS_WAITING {
            self.heard.pop_first();
        }
        self.complete()
    }

    /// The latest complete marker per database; earlier ones are covered by it and dropped.
    fn complete(&mut self) -> Vec<(u32, u64)> {
        let mut done: BTreeMap<u32, u64> = BTreeMap::new();
        for ((db, seq), nodes) in &self.heard {
            if self.up.iter().all(|n| nodes.contains(n)) {
                let best = done.entry(*db).or_insert(*seq);
                *best = (*best).max(*seq);
            }
        }
        self.heard
            .retain(|(db, seq), _| done.get(db).is_none_or(|d| seq > d));
        done.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_is_complete_once_every_subscribed_node_heard_it() {
        let mut m = Markers::default();
        m.up("a");
        m.up("b");
        assert_eq!(m.heard("a", 0, 1), []);
        assert_eq!(m.heard("a", 0, 2), []);
        // b's copy of 2 covers 1 as well (recovery takes everything up to the marker).
        assert_eq!(m.heard("b", 0, 2), [(0, 2)]);
        assert_eq!(m.heard("b", 0, 1), []);
        // A node that goes down is not waited for.
        assert_eq!(m.heard("a", 0, 3), []);
        assert_eq!(m.down("b"), [(0, 3)]);
        // One node: the first copy completes.
        assert_eq!(m.heard("a", 0, 4), [(0, 4)]);
    }
}
