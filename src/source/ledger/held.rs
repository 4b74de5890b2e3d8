//! The deadlines of dense hours a fill holds back to write together
//! (docs/how-it-works.md#dense-hours): a fill's page of 1,000 random deadlines falls in 1,000
//! different seconds, one `HSET` each, and Redis's cost per `HSET` is mostly the command's own
//! (parsing it, finding the hash in a keyspace of millions, a listpack cold in the cache), not
//! the field's. Held until half a million of them are, they are written a second's hash at a
//! time, several fields per `HSET` (docs/performance.md#learning-a-big-keyspace).
//!
//! Only deadlines that cannot be due for minutes are held (their hour is far and dense), and for
//! [`HOLD_FOR`] at most. A later word on a held key wins, as if the held deadline had been
//! written when it was read: a keyevent's record or forget, a take, a later page of the fill
//! drops it ([`Held::drop_key`]), and while a flush is under way such a key is noted so that
//! the flush skips it. A database that a flush or a swap emptied does not get deadlines read
//! before that held past it: they are written before its walk (`Ledger::settle`), and a page
//! read before it is written at once, as without holding.

use std::collections::HashMap;

use crate::key_hash::{HashMap as KeyMap, HashSet as KeySet};
use std::time::{Duration, Instant};

/// How many deadlines a fill holds before writing them: at 10 M keys over a day (25 dense hours,
/// 90,000 seconds) about six fields per `HSET`. Each held deadline costs this process about 70
/// bytes until written.
pub const HOLD_MAX: usize = 524_288;

/// Longest a deadline is held: a held deadline's hour starts more than six minutes after it was
/// read (`store::ledger::goes_far`), so it is written long before it can be due.
pub const HOLD_FOR: Duration = Duration::from_secs(20);

/// Held deadlines written per round trip of a flush, sorted by second: what one page of a fill
/// wrote before, so a keyevent racing a flush races no more than it raced a page.
pub const FLUSH_SLICE: usize = 16_384;

/// A database's held deadlines taken for a flush: (key, deadline), sorted by second.
pub type Taken = (u32, Vec<(Vec<u8>, i64)>);

/// What a fill holds back (see the module).
#[derive(Default)]
pub struct Held {
    by_db: HashMap<u32, KeyMap<Vec<u8>, i64>>,
    len: usize,
    /// When the oldest deadline still held was.
    since: Option<Instant>,
    /// Flushes under way.
    flushing: usize,
    /// Keys a later word dropped while a flush was under way: the flush skips them.
    cancelled: KeySet<(u32, Vec<u8>)>,
}

impl Held {
    /// Holds `key`'s `deadline` in `db`, in place of any held before.
    pub fn hold(&mut self, db: u32, key: Vec<u8>, deadline: i64) {
        if self
            .by_db
            .entry(db)
            .or_default()
            .insert(key, deadline)
            .is_none()
        {
            self.len += 1;
        }
        self.since.get_or_insert_with(Instant::now);
    }

    /// A later word on `key` in `db`: its held deadline (if any) is not written.
    pub fn drop_key(&mut self, db: u32, key: &[u8]) {
        if let Some(m) = self.by_db.get_mut(&db)
            && m.remove(key).is_some()
        {
            self.len -= 1;
        }
        if self.flushing > 0 {
            self.cancelled.insert((db, key.to_vec()));
        }
    }

    /// Whether what is held should be written now: [`HOLD_MAX`] of them, or one held for
    /// [`HOLD_FOR`].
    pub fn due(&self) -> bool {
        self.len >= HOLD_MAX || self.since.is_some_and(|s| s.elapsed() >= HOLD_FOR)
    }

    /// Whether `key`'s deadline in `db` is held.
    pub fn contains(&self, db: u32, key: &[u8]) -> bool {
        self.by_db.get(&db).is_some_and(|m| m.contains_key(key))
    }

    /// Whether anything is held or being written: a later word must then be looked up.
    pub fn active(&self) -> bool {
        self.len > 0 || self.flushing > 0
    }

    /// How many deadlines are held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Takes what is held (of `only`, or of every database) for a flush, each database's sorted
    /// by second; [`Held::done`] must follow.
    pub fn take(&mut self, only: Option<u32>) -> Vec<Taken> {
        self.flushing += 1;
        let dbs: Vec<u32> = match only {
            Some(db) => vec![db],
            None => self.by_db.keys().copied().collect(),
        };
        let mut out = Vec::new();
        for db in dbs {
            let Some(m) = self.by_db.remove(&db) else {
                continue;
            };
            self.len -= m.len();
            let mut rows: Vec<(Vec<u8>, i64)> = m.into_iter().collect();
            rows.sort_unstable_by_key(|(_, d)| d.div_euclid(1000));
            out.push((db, rows));
        }
        if self.len == 0 {
            self.since = None;
        }
        out
    }

    /// Whether `key` of `db`, taken by a flush, is still to be written.
    pub fn still(&self, db: u32, key: &[u8]) -> bool {
        self.cancelled.is_empty() || !self.cancelled.contains(&(db, key.to_vec()))
    }

    /// A flush ended.
    pub fn done(&mut self) {
        self.flushing -= 1;
        if self.flushing == 0 {
            self.cancelled.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_word_wins_over_a_held_deadline() {
        let mut h = Held::default();
        h.hold(0, b"a".to_vec(), 5_000);
        h.hold(0, b"b".to_vec(), 3_000);
        h.hold(0, b"a".to_vec(), 7_000);
        h.hold(1, b"a".to_vec(), 9_000);
        assert_eq!(h.len(), 3);
        h.drop_key(0, b"b");
        assert_eq!(h.len(), 2);
        let taken = h.take(Some(0));
        assert_eq!(taken, vec![(0, vec![(b"a".to_vec(), 7_000)])]);
        assert!(h.active());
        // Dropped while its flush is under way: the flush skips it.
        h.drop_key(0, b"a");
        assert!(!h.still(0, b"a"));
        assert!(h.still(1, b"a"));
        h.done();
        assert!(h.still(0, b"a"));
        assert_eq!(h.len(), 1);
        let all = h.take(None);
        assert_eq!(all, vec![(1, vec![(b"a".to_vec(), 9_000)])]);
        h.done();
        assert!(!h.active());
    }
}
