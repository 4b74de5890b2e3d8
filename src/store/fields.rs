//! The field ledger's keys: per watched database, a sorted set of the deadlines of the hash
//! fields the rules watch (member: [`member`] of key and field, score: the deadline in ms), and
//! per hash an index of its fields' deadlines (field → deadline). What the field ledger does
//! with them is [`crate::source`]'s; see `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use std::collections::HashMap;

use crate::keyspace::Conn;

/// The sorted set of field deadlines of `db`: `{prefix}fields:DB`.
pub fn deadlines(prefix: &str, db: u32) -> String {
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
    let zset = deadlines(prefix, db);
    let index = index(prefix, db, key);
    let mut pipe = redis::pipe();
    for (f, d) in changes {
        match d {
            Some(d) => {
                pipe.cmd("ZADD")
                    .arg(&zset)
                    .arg(d)
                    .arg(member(key, f))
                    .ignore();
                pipe.cmd("HSET").arg(&index).arg(f).arg(d).ignore();
            }
            None => {
                pipe.cmd("ZREM").arg(&zset).arg(member(key, f)).ignore();
                pipe.cmd("HDEL").arg(&index).arg(f).ignore();
            }
        }
    }
    pipe.exec_async(state).await
}

/// Up to `limit` members of `db` due by `until_ms`, soonest first, with their deadlines.
pub async fn due(
    state: &mut Conn,
    prefix: &str,
    db: u32,
    until_ms: i64,
    limit: usize,
) -> redis::RedisResult<Vec<(Vec<u8>, f64)>> {
    redis::cmd("ZRANGE")
        .arg(deadlines(prefix, db))
        .arg("-inf")
        .arg(until_ms)
        .arg("BYSCORE")
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .arg("WITHSCORES")
        .query_async(state)
        .await
}

crate::keyspace::commands::declare! {
    /// The commands of the field ledger to its keys ([`crate::keyspace::commands`]).
    const WHY = "field ledger: deadlines of watched hash fields";
    [
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("fields:*"), Access::Write)
            .args("{key} 0 k")
            .when(When::Fields),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("fields:*"), Access::Write)
            .args("{key} k")
            .when(When::Fields),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("fields:*"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1 WITHSCORES")
            .when(When::Fields),
        Use::new(Server::State, "hset", WHY)
            .on(Keys::State("fields:*:h:*"), Access::Write)
            .args("{key} f 0")
            .when(When::Fields),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("fields:*:h:*"), Access::ReadWrite)
            .args("{key} f")
            .when(When::Fields),
        Use::new(Server::State, "hgetall", WHY)
            .on(Keys::State("fields:*:h:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
    ]
}
