//! The hasher of keywatch's in-memory tables keyed by Redis keys on a fill's path: the ledger's
//! index of every tracked key, the deadlines a fill holds back, a page's keys. std's SipHash was
//! 10–13 % of a fill's CPU at 10 M keys; foldhash (hashbrown's own default) is several times
//! cheaper on short keys (docs/performance.md#the-fills-own-cpu-the-indexs-parts-foldhash-42).
//!
//! Anyone who can write a key chooses its name, so the tables must not be made to collide by a
//! chosen keyspace: the hash is seeded at random per process, as std's is, and from the same
//! source (std's `RandomState`, the operating system's randomness), not from foldhash's own
//! default seed (addresses and the clock). foldhash is not a cryptographic hash; a seed that
//! cannot be read from outside is what these tables need.

use std::hash::BuildHasher;
use std::sync::OnceLock;

/// Builds the hashers of a table: one seed shared by the process, one more per table.
#[derive(Clone, Debug)]
pub struct KeyState(foldhash::fast::SeedableRandomState);

impl Default for KeyState {
    fn default() -> Self {
        static SHARED: OnceLock<foldhash::SharedSeed> = OnceLock::new();
        let shared = SHARED.get_or_init(|| {
            foldhash::SharedSeed::from_u64(std::hash::RandomState::new().hash_one(0u64))
        });
        let own = std::hash::RandomState::new().hash_one(1u64);
        KeyState(foldhash::fast::SeedableRandomState::with_seed(own, shared))
    }
}

impl BuildHasher for KeyState {
    type Hasher = foldhash::fast::FoldHasher<'static>;
    #[inline]
    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// A map hashed with [`KeyState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, KeyState>;

/// A set hashed with [`KeyState`].
pub type HashSet<T> = std::collections::HashSet<T, KeyState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_seeded_apart() {
        let (a, b) = (KeyState::default(), KeyState::default());
        assert_ne!(a.hash_one(b"session:1"), b.hash_one(b"session:1"));
        assert_eq!(a.hash_one(b"session:1"), a.hash_one(b"session:1"));
    }
}
