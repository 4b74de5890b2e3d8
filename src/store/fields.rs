//! The field ledger's keys: per watched database, the deadlines of the hash fields the rules
//! watch in the key ledger's compact form ([`crate::store::ledger::Names`]: a hash per second of
//! deadlines, member [`member`] of key and field → ms within the second, and the minutes that
//! hold some), and per hash an index of its fields' deadlines (field → deadline), which is where
//! a field's second is found. What the field ledger does with them is [`crate::source`]'s; see
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use std::collections::HashMap;

use crate::keyspace::Conn;
use crate::store::ledger::{BUCKET, Due, Names};

/// Writes deadlines of one hash's fields, moving them between seconds.
static WRITE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!("{BUCKET}{}", include_str!("fields/write.lua")))
});

/// The field ledger's names in `db`: `{prefix}fields:DB:minutes`, `{prefix}fields:DB:at:SECOND`.
pub fn names(prefix: &str, db: u32) -> Names {
    Names::under(&old_ledger(prefix, db))
}

/// An earlier keywatch's field ledger of `db`, one sorted set (converted at start-up).
pub fn old_ledger(prefix: &str, db: u32) -> String {
    format!("{prefix}fields:{db}")
}

/// A watched hash as the field ledger names it: by its bytes, or, for a name longer than
/// [`crate::long_key::EXACT`], by its length and SHA-256 (hex), its bytes kept once under
/// [`name_key`] for as long as its index holds fields. A long name written into every member
/// and into the index's name held it once per field in Redis, and in every command that wrote
/// or read one (docs/reliability.md#bounded-whatever-the-key).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HashId {
    /// A name of at most `long_key::EXACT` bytes (or one an earlier keywatch wrote whole).
    Bytes(Vec<u8>),
    /// A longer name: its length and SHA-256.
    Long { len: usize, sha256: String },
}

impl HashId {
    /// How the field ledger names the hash `key`.
    pub fn of(key: &[u8]) -> HashId {
        if crate::long_key::is_long(key) {
            HashId::Long {
                len: key.len(),
                sha256: crate::long_key::sha256_hex(key),
            }
        } else {
            HashId::Bytes(key.to_vec())
        }
    }
}

/// The per-hash index of `hash` in `db`: `{prefix}fields:DB:h:KEY`, or for a long name
/// `{prefix}fields:DB:hl:SHA256`; field → deadline.
pub fn index(prefix: &str, db: u32, hash: &HashId) -> Vec<u8> {
    match hash {
        HashId::Bytes(key) => {
            let mut k = format!("{prefix}fields:{db}:h:").into_bytes();
            k.extend_from_slice(key);
            k
        }
        HashId::Long { sha256, .. } => format!("{prefix}fields:{db}:hl:{sha256}").into_bytes(),
    }
}

/// Where the name of a long hash (SHA-256 `sha256`) of `db` is kept:
/// `{prefix}fields:DB:name:SHA256`, a string, deleted with the last field of its index.
pub fn name_key(prefix: &str, db: u32, sha256: &str) -> String {
    format!("{prefix}fields:{db}:name:{sha256}")
}

/// The ledger member of `field` of `hash`: the name's length, a colon and the name, or for a
/// long name its length, `#` and its SHA-256; then the field's bytes.
pub fn member(hash: &HashId, field: &[u8]) -> Vec<u8> {
    let mut m = match hash {
        HashId::Bytes(key) => {
            let mut m = format!("{}:", key.len()).into_bytes();
            m.extend_from_slice(key);
            m
        }
        HashId::Long { len, sha256 } => format!("{len}#{sha256}").into_bytes(),
    };
    m.extend_from_slice(field);
    m
}

/// A member back into its hash and field; `None` for bytes no [`member`] wrote.
pub fn split(m: &[u8]) -> Option<(HashId, Vec<u8>)> {
    let at = m.iter().position(|b| *b == b':' || *b == b'#')?;
    let len: usize = std::str::from_utf8(&m[..at]).ok()?.parse().ok()?;
    let rest = &m[at + 1..];
    if m[at] == b'#' {
        const HEX: usize = 64;
        let sha256 = std::str::from_utf8(rest.get(..HEX)?).ok()?;
        if !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let hash = HashId::Long {
            len,
            sha256: sha256.to_string(),
        };
        return Some((hash, rest[HEX..].to_vec()));
    }
    (rest.len() >= len).then(|| (HashId::Bytes(rest[..len].to_vec()), rest[len..].to_vec()))
}

/// The name of the long hash `sha256` (`len` bytes) of `db`, read a MiB at a time; `None` once
/// its last field left the ledger (or it was deleted by hand).
pub async fn name(
    state: &Conn,
    prefix: &str,
    db: u32,
    len: usize,
    sha256: &str,
) -> redis::RedisResult<Option<Vec<u8>>> {
    // Read from the member: never trusted for an allocation larger than a key can be.
    if len > crate::long_key::MOST {
        return Ok(None);
    }
    let mut conn = state.clone();
    let name =
        crate::store::long_keys::read_at(&mut conn, &name_key(prefix, db, sha256), len).await?;
    // Checked as `firing` checks the long keys it reads: a name is its hash.
    Ok(name.filter(|n| crate::long_key::sha256_hex(n) == sha256))
}

/// The known deadlines of the fields of `hash`.
pub async fn known(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    hash: &HashId,
) -> redis::RedisResult<HashMap<Vec<u8>, i64>> {
    let all: Vec<(Vec<u8>, i64)> = redis::cmd("HGETALL")
        .arg(index(prefix, db, hash))
        .query_async(state)
        .await?;
    Ok(all.into_iter().collect())
}

/// What [`WRITE`] answers when a long hash's name is not kept (yet, or any more).
const NO_NAME: i64 = -1;

/// How long an upload of a long hash's name lives if nothing writes a field of it: a crash
/// between the upload and the write leaves nothing for good ([`write`]).
const UPLOAD_KEEP_MS: u64 = 3_600_000;

/// Writes deadlines (`Some`) and forgets fields (`None`) of hash `key` (named `hash`), in one
/// round trip, and the name of a long hash first when it is not kept yet: the script refuses
/// to index a field of a long hash whose name is not there (and keeps the name for good once it
/// does), and deletes the name with the index's last field, so that while a long hash's index
/// holds a field, its name is kept.
pub async fn write(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    key: &[u8],
    hash: &HashId,
    changes: &[(Vec<u8>, Option<i64>)],
) -> redis::RedisResult<()> {
    let names = names(prefix, db);
    let invoke = |state: &mut Conn| {
        let mut inv = WRITE.prepare_invoke();
        inv.key(index(prefix, db, hash)).key(&names.minutes);
        if let HashId::Long { sha256, .. } = hash {
            inv.key(name_key(prefix, db, sha256));
        }
        inv.arg(&names.seconds);
        for (f, d) in changes {
            inv.arg(f).arg(member(hash, f)).arg(d.unwrap_or(-1));
        }
        let mut state = state.clone();
        async move { inv.invoke_async::<i64>(&mut state).await }
    };
    if invoke(state).await? != NO_NAME {
        return Ok(());
    }
    if let HashId::Long { sha256, .. } = hash {
        keep_name(state, prefix, db, key, sha256).await?;
    }
    match invoke(state).await? {
        // Its last field left between the upload and the write: written again next time.
        NO_NAME => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the long hash's name left the field ledger meanwhile",
        ))),
        _ => Ok(()),
    }
}

/// Uploads the name of a long hash, a [`crate::store::long_keys::CHUNK`] at a time under a
/// name of this upload's own, which takes the kept name's place only if there is none
/// (`RENAMENX`): a crash midway leaves a partial upload that expires, never a partial name.
async fn keep_name(
    state: &Conn,
    prefix: &str,
    db: u32,
    key: &[u8],
    sha256: &str,
) -> redis::RedisResult<()> {
    static UPLOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // Unique across instances, whatever host they run on (a process id is not): two uploads of
    // one name side by side must not append to each other's.
    static UPLOADER: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        use std::hash::BuildHasher;
        std::hash::RandomState::new().hash_one(std::process::id())
    });
    let name = name_key(prefix, db, sha256);
    let n = UPLOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let upload = format!("{name}:up:{:016x}:{n}", *UPLOADER);
    let mut conn = state.clone();
    crate::store::long_keys::upload_to(&mut conn, &upload, key, UPLOAD_KEEP_MS).await?;
    let renamed: bool = redis::cmd("RENAMENX")
        .arg(&upload)
        .arg(&name)
        .query_async(&mut conn)
        .await?;
    if !renamed {
        redis::cmd("DEL").arg(&upload).exec_async(&mut conn).await?;
    }
    Ok(())
}

/// Up to `limit` members of `db` due by `until_ms`, earliest minute first, with their deadlines,
/// and the earliest deadline the field ledger may hold after them.
pub async fn due(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    until_ms: i64,
    limit: usize,
) -> redis::RedisResult<Due> {
    let due = names(prefix, db).due(state, until_ms, 0, limit).await?;
    let next = due.next;
    Ok(Due {
        rows: due.resolve(state).await?,
        copies: Vec::new(),
        next,
    })
}

/// The earliest deadline `db`'s field ledger may hold (the poker's safety round).
pub async fn earliest(state: &mut Conn, prefix: &str, db: u32) -> redis::RedisResult<Option<i64>> {
    names(prefix, db).earliest(state).await
}

/// Converts up to a batch of an earlier keywatch's field ledger of `db`; returns how many
/// entries it still holds.
pub async fn convert(state: &mut Conn, prefix: &str, db: u32) -> redis::RedisResult<usize> {
    names(prefix, db)
        .convert(state, &old_ledger(prefix, db))
        .await
}

crate::keyspace::commands::declare! {
    /// The commands of the field ledger to its keys ([`crate::keyspace::commands`]).
    const WHY = "field ledger: deadlines of watched hash fields";
    const SCRIPTS = "field ledger: deadlines of watched hash fields (script)";
    [
        Use::new(Server::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)")
            .when(When::Fields),
        Use::new(Server::State, "evalsha", WHY)
            .on(Keys::State("fields:*"), Access::ReadWrite)
            .args("{sha} 2 {prefix}fields:0:h:k {prefix}fields:0:minutes")
            .when(When::Fields),
        Use::new(Server::State, "hset", SCRIPTS)
            .on(Keys::State("fields:*"), Access::Write)
            .args("{key} f 0")
            .when(When::Fields),
        Use::new(Server::State, "hget", SCRIPTS)
            .on(Keys::State("fields:*:h:*"), Access::Read)
            .args("{key} f")
            .when(When::Fields),
        Use::new(Server::State, "hget", SCRIPTS)
            .on(Keys::State("fields:*:hl:*"), Access::Read)
            .args("{key} f")
            .when(When::Fields),
        Use::new(Server::State, "hdel", SCRIPTS)
            .on(Keys::State("fields:*"), Access::ReadWrite)
            .args("{key} f")
            .when(When::Fields),
        Use::new(Server::State, "renamenx", WHY)
            .on(Keys::State("fields:*:name:*"), Access::ReadWrite)
            .args("{key} {key}")
            .when(When::Fields),
        Use::new(Server::State, "del", WHY)
            .on(Keys::State("fields:*:name:*"), Access::Write)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "exists", SCRIPTS)
            .on(Keys::State("fields:*:name:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "persist", SCRIPTS)
            .on(Keys::State("fields:*:name:*"), Access::Write)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "hlen", SCRIPTS)
            .on(Keys::State("fields:*:hl:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "hgetall", WHY)
            .on(Keys::State("fields:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "zadd", SCRIPTS)
            .on(Keys::State("fields:*:minutes"), Access::Write)
            .args("{key} LT 0 0")
            .when(When::Fields),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn keys(conn: &Conn, pattern: &str) -> Vec<String> {
        let mut c = conn.clone();
        let mut k: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut c)
            .await
            .unwrap();
        k.sort();
        k
    }

    /// A long hash's name is kept once, for good, while its index holds a field: written with
    /// the first field, left alone by a second, gone with the last; an upload that a crash left
    /// behind is not taken for it, and a name written again after it went comes back whole.
    #[tokio::test]
    async fn a_long_hash_s_name_is_kept_while_it_has_fields() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let key = vec![b'k'; crate::long_key::EXACT + 1];
        let hash = HashId::of(&key);
        let HashId::Long { sha256, len } = &hash else {
            panic!("{hash:?}")
        };
        let at = |s: i64| Some(4_000_000_000_000 + s * 1000);
        let mut state = conn.clone();
        write(&mut state, "kw:", 0, &key, &hash, &[(b"a".to_vec(), at(1))])
            .await
            .unwrap();
        write(&mut state, "kw:", 0, &key, &hash, &[(b"b".to_vec(), at(2))])
            .await
            .unwrap();
        let name = name_key("kw:", 0, sha256);
        assert_eq!(
            keys(&conn, "kw:fields:0:name:*").await,
            std::slice::from_ref(&name)
        );
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut state)
            .await
            .unwrap();
        assert_eq!(ttl, -1, "kept for good while it has fields");
        assert_eq!(
            super::name(&conn, "kw:", 0, *len, sha256).await.unwrap(),
            Some(key.clone())
        );
        assert_eq!(known(&mut state, "kw:", 0, &hash).await.unwrap().len(), 2);

        write(&mut state, "kw:", 0, &key, &hash, &[(b"a".to_vec(), None)])
            .await
            .unwrap();
        assert_eq!(
            keys(&conn, "kw:fields:0:name:*").await,
            std::slice::from_ref(&name)
        );
        write(&mut state, "kw:", 0, &key, &hash, &[(b"b".to_vec(), None)])
            .await
            .unwrap();
        assert!(keys(&conn, "kw:fields:0:*name*").await.is_empty());
        assert!(keys(&conn, "kw:fields:0:hl:*").await.is_empty());

        // Gone, then a field again: the name is uploaded again, whole.
        write(&mut state, "kw:", 0, &key, &hash, &[(b"c".to_vec(), at(3))])
            .await
            .unwrap();
        assert_eq!(
            super::name(&conn, "kw:", 0, *len, sha256).await.unwrap(),
            Some(key.clone())
        );
        // Not a name whose bytes are not its hash's (written by hand), nor a length no key has.
        let _: () = redis::cmd("SET")
            .arg(&name)
            .arg("forged")
            .query_async(&mut state)
            .await
            .unwrap();
        assert_eq!(super::name(&conn, "kw:", 0, 6, sha256).await.unwrap(), None);
        assert_eq!(
            super::name(&conn, "kw:", 0, crate::long_key::MOST + 1, sha256)
                .await
                .unwrap(),
            None
        );
    }
}
