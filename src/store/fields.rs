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

/// The per-hash index of `key` in `db`: `{prefix}fields:DB:h:KEY`, field → deadline.
pub fn index(prefix: &str, db: u32, key: &[u8]) -> Vec<u8> {
    let mut k = format!("{prefix}fields:{db}:h:").into_bytes();
    k.extend_from_slice(key);
    k
}

/// The ledger member of `field` of hash `key`.
pub fn member(key: &[u8], field: &[u8]) -> Vec<u8> {
    let mut m = format!("{}:", key.len()).into_bytes();
    m.extend_from_slice(key);
    m.extend_from_slice(field);
    m
}

/// A member back into key and field; `None` for bytes no [`member`] wrote.
pub fn split(m: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let colon = m.iter().position(|b| *b == b':')?;
    let len: usize = std::str::from_utf8(&m[..colon]).ok()?.parse().ok()?;
    let rest = &m[colon + 1..];
    (rest.len() >= len).then(|| (rest[..len].to_vec(), rest[len..].to_vec()))
}

/// The known deadlines of the fields of hash `key`.
pub async fn known(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    key: &[u8],
) -> redis::RedisResult<HashMap<Vec<u8>, i64>> {
    let all: Vec<(Vec<u8>, i64)> = redis::cmd("HGETALL")
        .arg(index(prefix, db, key))
        .query_async(state)
        .await?;
    Ok(all.into_iter().collect())
}

/// Writes deadlines (`Some`) and forgets fields (`None`) of hash `key`, in one round trip.
pub async fn write(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    key: &[u8],
    changes: &[(Vec<u8>, Option<i64>)],
) -> redis::RedisResult<()> {
    let mut inv = WRITE.prepare_invoke();
    inv.key(index(prefix, db, key))
        .key(names(prefix, db).minutes)
        .arg(names(prefix, db).seconds);
    for (f, d) in changes {
        inv.arg(f).arg(member(key, f)).arg(d.unwrap_or(-1));
    }
    inv.invoke_async(state).await
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
        Use::new(Server::State, "hdel", SCRIPTS)
            .on(Keys::State("fields:*"), Access::ReadWrite)
            .args("{key} f")
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
