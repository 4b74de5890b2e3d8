//! Which far hours a fill marks dense (docs/how-it-works.md#dense-hours): an hour whose
//! deadlines the whole keyspace will make dense is marked as early in the fill as a sample says
//! so, and its deadlines are then written without a script. Marking is safe whatever the
//! estimate; a wrong one only costs bytes (a sparse hour in seconds' hashes) or speed (a dense
//! hour through the far buckets' script).
//!
//! A SCAN walks the keyspace's hash table in an order that has nothing to do with deadlines,
//! and its cursor says how far it is: Redis counts it up from the high bit down (reversed), so
//! the cursor's bits reversed, as a fraction of 2^64, are the share of the table's buckets
//! walked so far. The deadlines seen per hour divided by that share are what the hour will hold
//! once the fill is done.

use std::collections::{HashMap, HashSet};

use crate::store::ledger as store;

/// Deadlines an hour must have been seen to hold before its estimate is trusted: the estimate
/// is then within about 6 % (one over the square root), far narrower than the gap between a
/// dense hour and a sparse one.
const SEEN_AT_LEAST: u64 = 256;

/// One fill's count of far deadlines per hour, and the hours it marked.
#[derive(Default)]
pub struct Density {
    seen: HashMap<i64, u64>,
    marked: HashSet<i64>,
}

impl Density {
    /// Counts the far deadlines among `deadlines` (as `PEXPIRETIME` answered) written at
    /// `now_ms`.
    pub fn saw(&mut self, deadlines: &[i64], now_ms: i64) {
        for &d in deadlines {
            if d > 0 && store::goes_far(d, b"", now_ms) {
                *self
                    .seen
                    .entry(d.div_euclid(store::FAR_WIDTH_MS))
                    .or_default() += 1;
            }
        }
    }

    /// The hours that will hold at least [`store::DENSE_HOUR`] deadlines, judged when the SCAN's
    /// next cursor is `cursor`; each is answered once.
    pub fn turned_dense(&mut self, cursor: u64) -> Vec<i64> {
        let walked = walked(cursor);
        if walked <= 0.0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (&hour, &seen) in &self.seen {
            if seen >= SEEN_AT_LEAST
                && seen as f64 / walked >= store::DENSE_HOUR as f64
                && self.marked.insert(hour)
            {
                out.push(hour);
            }
        }
        out.sort_unstable();
        out
    }
}

/// The share of the keyspace's buckets a SCAN has walked when its next cursor is `cursor`.
fn walked(cursor: u64) -> f64 {
    cursor.reverse_bits() as f64 / 2f64.powi(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cursor_says_how_far_a_scan_is() {
        // A table of 16 buckets: Redis walks 0, 8, 4, 12, 2, … (the count reversed in 4 bits),
        // and the next cursor is where it goes on.
        assert_eq!(walked(0), 0.0);
        assert_eq!(walked(8), 1.0 / 16.0);
        assert_eq!(walked(4), 2.0 / 16.0);
        assert_eq!(walked(12), 3.0 / 16.0);
        assert_eq!(walked(2), 4.0 / 16.0);
        assert_eq!(walked(7), 14.0 / 16.0);
    }

    #[test]
    fn an_hour_is_dense_once_its_estimate_says_so() {
        let now = 0;
        let hour = 10;
        let at = hour * store::FAR_WIDTH_MS + 5;
        let mut d = Density::default();
        // 300 deadlines seen after a 32nd of the keyspace: 9,600 in all, sparse.
        d.saw(&vec![at; 300], now);
        assert!(d.turned_dense(1 << 4).is_empty());
        // After a 1,024th: 307,200 in all, dense, and answered once.
        assert_eq!(d.turned_dense(1 << 9), vec![hour]);
        d.saw(&vec![at; 300], now);
        assert!(d.turned_dense(1 << 9).is_empty());
        // Too few seen to trust, near deadlines and keys without one are not counted.
        let mut d = Density::default();
        d.saw(&vec![at; 100], now);
        d.saw(&[-1, -2, 1_000], now);
        assert!(d.turned_dense(1 << 63).is_empty());
        assert_eq!(d.seen.values().sum::<u64>(), 100);
    }
}
