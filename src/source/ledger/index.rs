//! The ledger's index: for each key whose deadline this instance recorded or read, the second
//! that deadline falls in, which names the hash it sits in (`store::ledger`). The ledger keeps
//! a deadline once, in the hash of its second; the index is how a moved or deleted key's old
//! entry is found, and where an `expired`'s take removes it (docs/how-it-works.md#the-ledgers-compact-form).
//!
//! It lives in this process's memory, not in Redis: an index in Redis cost 26 bytes per key
//! more, where the ledger's whole budget was 40. So it must never be the only record of
//! anything: it is rebuilt from the hashes at start-up and after every reconnect (the
//! reconcile walk), and a miss is never what decides (the take looks where every instance looks;
//! a stale entry is found when its second comes due).
//!
//! A key is held as a 64-bit hash of its database and name, not the name: 12 bytes per key
//! and a control byte, about 200 MB at 10,000,000 keys where the names alone would take more.
//! Two keys whose hashes collide share an entry; the one that loses it is a miss, as above.
//!
//! The hash is [`crate::key_hash`]'s, seeded per process. Its top 7 bits are what the table
//! compares first (hashbrown's control byte) and its low bits where an entry goes, so the part a
//! key is in is taken from neither: with the part from the top bits, as it was, every key of a
//! part shared 6 of the control byte's 7 bits, and a lookup compared about half the entries of
//! each group it probed, in cache lines of their own
//! (docs/performance.md#the-fills-own-cpu-the-indexs-parts-foldhash-42).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;

/// Independently locked parts: the engine, the poker and a fill use the index at once, and a
/// part that grows reallocates a 64th of the whole, not all of it at once.
const PARTS: usize = 64;

/// A key by its hash: two `u32`s, so an entry with its `u32` second takes 12 bytes, not 16.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Id([u32; 2]);

impl Hash for Id {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(((self.0[0] as u64) << 32) | self.0[1] as u64);
    }
}

/// Ids are hashes already: passed through as they are.
#[derive(Clone, Copy, Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Clone, Copy, Default)]
struct Ids;

impl BuildHasher for Ids {
    type Hasher = PassThrough;
    fn build_hasher(&self) -> PassThrough {
        PassThrough::default()
    }
}

/// Where this instance last knew each key's deadline (see the module).
pub struct LedgerIndex {
    /// Seeds the keys' hashes: a fresh one per process, so no key set can be built to collide.
    seed: crate::key_hash::KeyState,
    parts: Vec<Mutex<HashMap<Id, u32, Ids>>>,
}

impl Default for LedgerIndex {
    fn default() -> Self {
        LedgerIndex {
            seed: Default::default(),
            parts: (0..PARTS).map(|_| Mutex::new(HashMap::default())).collect(),
        }
    }
}

impl LedgerIndex {
    fn id(&self, db: u32, key: &[u8]) -> (usize, Id) {
        let mut h = self.seed.build_hasher();
        db.hash(&mut h);
        key.hash(&mut h);
        let h = h.finish();
        (
            ((h >> 32) as usize) % PARTS,
            Id([(h >> 32) as u32, h as u32]),
        )
    }

    fn part(&self, i: usize) -> std::sync::MutexGuard<'_, HashMap<Id, u32, Ids>> {
        self.parts[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The second `key`'s deadline was last known in.
    pub fn get(&self, db: u32, key: &[u8]) -> Option<i64> {
        let (i, id) = self.id(db, key);
        self.part(i).get(&id).map(|s| i64::from(*s))
    }

    /// `key`'s deadline is in `second` now. A second outside `u32` (before 1970, after 2106)
    /// is not held: a miss, as any.
    pub fn set(&self, db: u32, key: &[u8], second: i64) {
        let (i, id) = self.id(db, key);
        match u32::try_from(second) {
            Ok(s) => self.part(i).insert(id, s),
            Err(_) => self.part(i).remove(&id),
        };
    }

    /// Like [`LedgerIndex::set`], but keeps what is held already: a walk of the ledger must not
    /// undo what this instance recorded while it read.
    pub fn learn(&self, db: u32, key: &[u8], second: i64) {
        let (i, id) = self.id(db, key);
        if let Ok(s) = u32::try_from(second) {
            self.part(i).entry(id).or_insert(s);
        }
    }

    /// Forgets `key`; returns the second it was held in.
    pub fn remove(&self, db: u32, key: &[u8]) -> Option<i64> {
        let (i, id) = self.id(db, key);
        self.part(i).remove(&id).map(i64::from)
    }

    /// Forgets `key` if its deadline is in `second` or earlier; returns the second held.
    pub fn remove_due(&self, db: u32, key: &[u8], second: i64) -> Option<i64> {
        let (i, id) = self.id(db, key);
        let mut part = self.part(i);
        let held = i64::from(*part.get(&id)?);
        if held <= second {
            part.remove(&id);
        }
        Some(held)
    }

    /// How many keys are held.
    pub fn len(&self) -> usize {
        (0..PARTS).map(|i| self.part(i).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_held_per_database_until_removed() {
        let index = LedgerIndex::default();
        index.set(0, b"k", 100);
        assert_eq!(index.get(0, b"k"), Some(100));
        assert_eq!(index.get(1, b"k"), None);
        // A walk does not undo a newer record; a record does replace.
        index.learn(0, b"k", 50);
        assert_eq!(index.get(0, b"k"), Some(100));
        index.set(0, b"k", 200);
        assert_eq!(index.get(0, b"k"), Some(200));
        // Removed only once due.
        assert_eq!(index.remove_due(0, b"k", 199), Some(200));
        assert_eq!(index.get(0, b"k"), Some(200));
        assert_eq!(index.remove_due(0, b"k", 200), Some(200));
        assert_eq!(index.get(0, b"k"), None);
        index.set(0, b"k", 1);
        assert_eq!(index.remove(0, b"k"), Some(1));
        assert_eq!(index.len(), 0);
    }

    #[test]
    fn a_second_out_of_range_is_not_held() {
        let index = LedgerIndex::default();
        index.set(0, b"k", 1);
        index.set(0, b"k", i64::from(u32::MAX) + 1);
        assert_eq!(index.get(0, b"k"), None);
        index.learn(0, b"k", -5);
        assert_eq!(index.get(0, b"k"), None);
    }

    #[test]
    fn a_parts_keys_differ_in_what_the_table_compares_first() {
        // hashbrown's control byte is a hash's top 7 bits: a part whose keys share most of them
        // compares many entries per lookup.
        let index = LedgerIndex::default();
        let mut tops = std::collections::HashSet::new();
        for n in 0..20_000 {
            let key = format!("session:{n:08}");
            let (part, id) = index.id(0, key.as_bytes());
            if part == 0 {
                tops.insert(id.0[0] >> 25);
            }
        }
        assert!(tops.len() > 64, "{} control bytes", tops.len());
    }

    #[test]
    fn an_entry_takes_twelve_bytes() {
        assert_eq!(std::mem::size_of::<(Id, u32)>(), 12);
    }
}
