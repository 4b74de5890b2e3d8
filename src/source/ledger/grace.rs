//! The poker's grace: a due key found gone is recorded as poked only if it is still in the
//! ledger a moment later, when its `expired`'s take has had time to remove it (see
//! [`super::Ledger::poke_round`]).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;

/// How long the poker waits, after finding a due key gone, before it records that key as
/// poked (see [`Ledger::poke_round`]): time for the take of its `expired` to reach the ledger.
/// A key whose event really was lost is recovered this much later.
pub const GRACE: Duration = Duration::from_millis(100);
/// The grace of a key longer than [`crate::long_key::EXACT`]: its take is slower (its exact bytes
/// are kept first, a MiB per command), and recording it meanwhile sent its megabytes to the poked
/// set through the shared connection (docs/reliability.md#bounded-whatever-the-key). A long key
/// whose event really was lost is recovered this much later.
pub const GRACE_LONG: Duration = Duration::from_secs(5);
/// Most keys the poker holds in their grace; beyond, gone keys are recorded at once (the
/// memory stays bounded in a storm).
const GRACE_MAX: usize = 20_000;

/// The due keys the poker found gone and has not recorded yet, with when it found them.
#[derive(Default)]
pub struct Grace {
    /// Per database, by key: the key shared with the poker's read, and looked up by its bytes,
    /// so that a key of megabytes is neither copied nor held twice
    /// (docs/reliability.md#bounded-whatever-the-key).
    found: HashMap<u32, HashMap<Bytes, (i64, std::time::Instant, Duration)>>,
    last_sweep: Option<std::time::Instant>,
}

impl Grace {
    /// Whether `key`, due at `deadline`, is within its grace: it is then neither touched nor
    /// recorded this round.
    pub(super) fn waiting(&mut self, db: u32, key: &[u8], deadline: i64) -> bool {
        self.sweep();
        self.found
            .get(&db)
            .and_then(|keys| keys.get(key))
            .is_some_and(|(d, at, grace)| *d == deadline && at.elapsed() < *grace)
    }

    /// `key` was found gone: `true` if that begins its grace (not recorded now), `false` if
    /// it is to be recorded (its grace is over, or no room is left for it).
    /// `grace`: [`GRACE`], or [`GRACE_LONG`] for a long key.
    pub(super) fn begin(&mut self, db: u32, key: &Bytes, deadline: i64, grace: Duration) -> bool {
        let held: usize = self.found.values().map(HashMap::len).sum();
        let keys = self.found.entry(db).or_default();
        match keys.get(&key[..]) {
            Some((d, ..)) if *d == deadline => {
                keys.remove(&key[..]);
                if keys.is_empty() {
                    self.found.remove(&db);
                }
                false
            }
            _ if held >= GRACE_MAX => false,
            _ => {
                keys.insert(key.clone(), (deadline, std::time::Instant::now(), grace));
                true
            }
        }
    }

    /// Forgets the keys found long enough ago that their take (or their record) happened.
    fn sweep(&mut self) {
        let now = std::time::Instant::now();
        if self
            .last_sweep
            .is_some_and(|t| now.duration_since(t) < GRACE)
        {
            return;
        }
        self.last_sweep = Some(now);
        for keys in self.found.values_mut() {
            keys.retain(|_, found| now.duration_since(found.1) < 4 * found.2);
        }
        self.found.retain(|_, keys| !keys.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gone_key_is_recorded_only_when_found_gone_again_after_its_grace() {
        let mut g = Grace::default();
        // Found gone: its grace begins, it is neither recorded nor touched meanwhile.
        assert!(g.begin(0, &Bytes::from_static(b"k"), 10, GRACE));
        assert!(g.waiting(0, b"k", 10));
        // Another database, or a new deadline of the same key, is another expiry.
        assert!(!g.waiting(1, b"k", 10));
        assert!(!g.waiting(0, b"k", 11));
        std::thread::sleep(GRACE);
        assert!(!g.waiting(0, b"k", 10));
        // Still in the ledger after its grace, and gone: recorded now, and forgotten.
        assert!(!g.begin(0, &Bytes::from_static(b"k"), 10, GRACE));
        assert!(g.found.is_empty());
    }

    #[test]
    fn a_full_grace_records_gone_keys_at_once() {
        let mut g = Grace::default();
        for i in 0..GRACE_MAX {
            assert!(g.begin(0, &Bytes::from(i.to_string()), 1, GRACE));
        }
        assert!(!g.begin(0, &Bytes::from_static(b"one more"), 1, GRACE));
        // Entries are dropped some time after their grace, taken or recorded.
        std::thread::sleep(4 * GRACE);
        g.last_sweep = None;
        assert!(!g.waiting(0, b"0", 1));
        assert!(g.found.is_empty());
    }
}
