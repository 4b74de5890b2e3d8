//! Databases emptied without a keyevent: `FLUSHDB`, `FLUSHALL` and `SWAPDB` publish none, so
//! without this the ledger kept the deadlines of the keys they took away and, when those came
//! due, found the keys gone and recovered them as missed expiries; and the keys a swap brought in
//! were learnt only at the next fill (docs/how-it-works.md#flushes-and-swaps).
//!
//! When the subscriber hears of one ([`crate::source::flushes`]), every watched database gets a
//! *cut-off*: from then until its walk is done, a key found gone whose deadline is at or after the
//! cut-off is dropped from the ledger, by the poker as by the walk, never recorded as missed. Then,
//! one run at a time, each database that lost keys is walked as at a reconnect
//! ([`Ledger::reconcile`]) and, after a swap, the deadlines of the keys it brought are learnt
//! ([`super::fill_all`]). The walk and the run are the ledger's (`Ledger::emptied`); this is their
//! bookkeeping.

use std::collections::HashMap;

/// Deadlines of the soonest keys looked at to tell whether a database lost its keys: a flush
/// takes every key, so one of them gone is enough to walk the whole ledger, and none gone (a
/// flush of a database keywatch does not watch) spares the walk.
pub(super) const SAMPLE: usize = 256;

/// Cut-offs in force, and the run that follows them (one at a time: a script that flushes in a
/// loop must not stack walks).
#[derive(Default)]
pub(super) struct Emptied {
    /// Per database, the earliest deadline a key found gone is dropped from rather than
    /// recovered.
    since: HashMap<u32, i64>,
    /// A run is under way.
    running: bool,
    /// What the next run has to do: `Some(swapped)` when asked for while one ran.
    again: Option<bool>,
}

impl Emptied {
    /// Keys may have left `dbs` from `since_ms` on (`swapped`: by a swap): their cut-offs are set;
    /// `true` when a run is to start now (none runs).
    pub(super) fn begin(&mut self, dbs: &[u32], since_ms: i64, swapped: bool) -> bool {
        for &db in dbs {
            let at = self.since.entry(db).or_insert(since_ms);
            *at = (*at).min(since_ms);
        }
        if self.running {
            self.again = Some(self.again.unwrap_or(false) || swapped);
            return false;
        }
        self.running = true;
        true
    }

    /// A run ended: `Some(swapped)` for the one asked for meanwhile, or `None`, and the cut-offs
    /// are lifted (the walk has dropped what they covered).
    pub(super) fn after_run(&mut self) -> Option<bool> {
        let again = self.again.take();
        if again.is_none() {
            self.running = false;
            self.since.clear();
        }
        again
    }

    /// The cut-off of `db`, if one is in force.
    pub(super) fn cut_off(&self, db: u32) -> Option<i64> {
        self.since.get(&db).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_offs_last_until_the_last_run_asked_for_ends() {
        let mut e = Emptied::default();
        assert!(e.begin(&[1, 2], 1_000, false), "a run starts");
        assert!(!e.begin(&[1], 500, true), "one runs: asked for again");
        assert_eq!(e.cut_off(1), Some(500), "the earlier cut-off holds");
        assert_eq!(e.cut_off(2), Some(1_000));
        assert_eq!(e.after_run(), Some(true), "again, as a swap");
        assert_eq!(e.cut_off(1), Some(500));
        assert_eq!(e.after_run(), None);
        assert_eq!(e.cut_off(1), None, "lifted");
        assert!(e.begin(&[1], 2_000, false), "a new run starts");
    }
}
