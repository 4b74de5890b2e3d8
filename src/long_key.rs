//! Keys too long to carry whole (docs/reliability.md#bounded-whatever-the-key). A key may be as
//! long as Redis allows (512 MB) and anyone who can write a key chooses its name, so what keywatch
//! makes of a key — messages, event JSON, links, log lines, history — is built from a *cut view*
//! of it: its first bytes, then its length and a short hash, `…[16777221 bytes, sha256
//! 3f1c0a9b2d4e]`. Keys that fit are shown whole, as they always were. Actions on Redis
//! (cleanup, the detail) use the exact bytes.

use std::borrow::Cow;

use sha2::{Digest, Sha256};

/// Keys up to this length are carried whole where keywatch hands a key on as data (a webhook's
/// event JSON, history, `reload` and `exec`); beyond it they are cut there too, and `reload` and
/// `exec` refuse them (no URL or argument of 64 KiB works anywhere).
pub const EXACT: usize = 64 * 1024;

/// The longest key (or value) Redis holds, 512 MiB: a length read back from keywatch's state is
/// never trusted beyond it.
pub const MOST: usize = 512 << 20;

/// The most of one key (or any one value of key text) a log line, a terminal or a page shows.
pub const IN_TEXT: usize = 1024;

/// The bytes of keys longer than [`EXACT`] whose firings' actions are worked on at once on one
/// instance ([`crate::action::ActionContext::run`]): an attempt takes its key's length of it (a
/// key longer than this takes all of it), and the others wait for their turn. An attempt holds
/// its key about three times (the exact bytes read again, its captures, the messages' cut views
/// besides): 16 MiB keeps one instance within 100 MiB of its idle memory
/// (docs/reliability.md#bounded-whatever-the-key).
pub const AT_ONCE: usize = 16 << 20;

/// Hex digits of SHA-256 shown in a cut view: 48 bits tell two long keys with the same first
/// bytes apart as well as people need; actions compare the exact bytes.
const HASH_DIGITS: usize = 12;

/// The short hash of `bytes` shown in a cut view.
pub fn short_hash(bytes: &[u8]) -> String {
    let mut hex = hex::encode(Sha256::digest(bytes));
    hex.truncate(HASH_DIGITS);
    hex
}

/// The whole SHA-256 of `bytes`, hex: what a signed link's silence names a key by.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What a cut view ends with: how long the value is and its short hash.
pub fn marker(bytes: &[u8]) -> String {
    format!("…[{} bytes, sha256 {}]", bytes.len(), short_hash(bytes))
}

/// `bytes` when they fit in `limit`, else their cut view: as many first bytes as leave room
/// for the [`marker`] within `limit` (never splitting a UTF-8 character), then the marker.
pub fn view(bytes: &[u8], limit: usize) -> Cow<'_, [u8]> {
    if bytes.len() <= limit {
        return Cow::Borrowed(bytes);
    }
    let mark = marker(bytes);
    let mut end = limit.saturating_sub(mark.len());
    // Back to the start of a character, if the cut falls inside one.
    let mut back = 0;
    while end > 0 && back < 3 && (bytes[end] & 0xC0) == 0x80 {
        end -= 1;
        back += 1;
    }
    let mut out = Vec::with_capacity(end + mark.len());
    out.extend_from_slice(&bytes[..end]);
    out.extend_from_slice(mark.as_bytes());
    Cow::Owned(out)
}

/// Whether `key` is longer than [`EXACT`].
pub fn is_long(key: &[u8]) -> bool {
    key.len() > EXACT
}

/// The long keys in memory now, each once (see [`shared`]).
static IN_MEMORY: std::sync::Mutex<Vec<std::sync::Weak<Vec<u8>>>> =
    std::sync::Mutex::new(Vec::new());

/// A copy of a long key that holds its bytes alive (`Bytes::from_owner`).
struct Shared(std::sync::Arc<Vec<u8>>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// `key` as [`bytes::Bytes`]; a long key shares the copy already in memory when one of the
/// same bytes is, and the new one is dropped at once. The server names a key whole in every
/// message about it: a hash of a 16 MiB name whose fields expire in twelve cycles is twelve
/// `hexpired` of 16 MiB, which redis-rs reads at once when they wait together, and the field
/// ledger reads the name back for each (docs/reliability.md#bounded-whatever-the-key). Costs a
/// `memcmp` per long key in memory, for long keys only.
pub fn shared(key: Vec<u8>) -> bytes::Bytes {
    if !is_long(&key) {
        return key.into();
    }
    let mut in_memory = IN_MEMORY.lock().unwrap_or_else(|p| p.into_inner());
    in_memory.retain(|k| k.strong_count() > 0);
    if let Some(same) = in_memory
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .find(|k| k.as_slice() == key.as_slice())
    {
        return bytes::Bytes::from_owner(Shared(same));
    }
    let key = std::sync::Arc::new(key);
    in_memory.push(std::sync::Arc::downgrade(&key));
    bytes::Bytes::from_owner(Shared(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Long keys of the same bytes share one copy while any is held; another key is a copy of
    /// its own, and nothing is kept once every copy is dropped.
    #[test]
    fn a_long_key_in_memory_is_shared_until_dropped() {
        // Bytes no other test's key has: the copies in memory are the process's.
        let key = |c: u8| {
            let mut k = b"long_key::tests::shared ".to_vec();
            k.resize(EXACT + 1, c);
            k
        };
        let a = shared(key(b'a'));
        let again = shared(key(b'a'));
        assert_eq!(a.as_ptr(), again.as_ptr(), "one copy");
        let b = shared(key(b'b'));
        assert_ne!(a.as_ptr(), b.as_ptr());
        assert_eq!(b, key(b'b'));
        let weak = {
            let in_memory = IN_MEMORY.lock().unwrap();
            in_memory
                .iter()
                .find(|k| k.upgrade().is_some_and(|k| *k == key(b'a')))
                .cloned()
                .unwrap()
        };
        drop((a, again));
        assert_eq!(weak.strong_count(), 0, "dropped with its last copy");
        assert_eq!(shared(b"k:1".to_vec()), &b"k:1"[..]);
    }

    #[test]
    fn a_key_that_fits_is_whole_and_a_long_one_is_cut_and_marked() {
        assert_eq!(view(b"order_lock:42", 64), &b"order_lock:42"[..]);
        let long = [b'k'; 5000];
        let v = view(&long, 1024);
        assert!(v.len() <= 1024, "{}", v.len());
        let text = String::from_utf8(v.into_owned()).unwrap();
        assert!(text.starts_with("kkkk"), "{text}");
        assert!(
            text.ends_with(&format!("…[5000 bytes, sha256 {}]", short_hash(&long))),
            "{text}"
        );
        // Two keys alike in their first bytes are told apart by the hash.
        let mut other = long;
        other[4999] = b'x';
        assert_ne!(view(&long, 1024), view(&other, 1024));
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        let long = "订".repeat(2000);
        for limit in 60..70 {
            let v = view(long.as_bytes(), limit);
            assert!(std::str::from_utf8(&v).is_ok(), "{limit}");
            assert!(v.len() <= limit);
        }
        // A limit smaller than the marker still gives the marker.
        assert!(view(long.as_bytes(), 3).starts_with("…[6000 bytes".as_bytes()));
    }
}
