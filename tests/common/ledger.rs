//! The deadline ledger as the tests read it: per database, a hash per second of deadlines
//! (`{prefix}ledger:DB:at:SECOND[:long]`, key → ms within the second) and the minutes that hold
//! some (`{prefix}ledger:DB:minutes`), as docs/how-it-works.md#what-keywatch-keeps-in-redis
//! describes them.

use std::collections::BTreeMap;

use redis::ConnectionLike;

/// Every deadline in database 0 of the ledger under `prefix`, by key: the hashes of every
/// second of every minute the ledger lists (one hash tag, so a cluster connection finds them).
pub fn entries(conn: &mut impl ConnectionLike, prefix: &str) -> BTreeMap<String, i64> {
    entries_under(conn, &format!("{prefix}ledger:0"))
}

/// Every field deadline in database 0 of the field ledger under `prefix`, by member (the key's
/// length, a colon, the key, the field).
pub fn fields(conn: &mut impl ConnectionLike, prefix: &str) -> BTreeMap<String, i64> {
    entries_under(conn, &format!("{prefix}fields:0"))
}

/// The deadlines kept under `base` (`{prefix}ledger:0`, `{prefix}fields:0`).
fn entries_under(conn: &mut impl ConnectionLike, base: &str) -> BTreeMap<String, i64> {
    let minutes: Vec<i64> = redis::cmd("ZRANGE")
        .arg(format!("{base}:minutes"))
        .arg(0)
        .arg(-1)
        .query(conn)
        .unwrap_or_else(|e| panic!("the ledger's minutes: {e}"));
    let mut out = BTreeMap::new();
    for minute in minutes {
        for second in minute * 60..minute * 60 + 60 {
            for hash in [
                format!("{base}:at:{second}"),
                format!("{base}:at:{second}:long"),
            ] {
                let fields: Vec<(String, i64)> = redis::cmd("HGETALL")
                    .arg(&hash)
                    .query(conn)
                    .unwrap_or_else(|e| panic!("HGETALL {hash}: {e}"));
                for (k, ms) in fields {
                    out.insert(k, second * 1000 + ms);
                }
            }
        }
    }
    out
}

/// Every deadline in database `db` of the ledger under `prefix`, by key.
pub fn entries_in(conn: &mut impl ConnectionLike, prefix: &str, db: u32) -> BTreeMap<String, i64> {
    entries_under(conn, &format!("{prefix}ledger:{db}"))
}

/// How many deadlines database 0 of the ledger under `prefix` holds.
pub fn len(conn: &mut impl ConnectionLike, prefix: &str) -> i64 {
    entries(conn, prefix).len() as i64
}

/// `key`'s deadline in database 0 of the ledger under `prefix`.
pub fn deadline(conn: &mut impl ConnectionLike, prefix: &str, key: &str) -> Option<i64> {
    entries(conn, prefix).get(key).copied()
}

/// Writes `key`'s deadline into database 0 of the ledger under `prefix`, as keywatch records
/// one (for tests that set the ledger up by hand).
pub fn put(conn: &mut impl ConnectionLike, prefix: &str, key: &str, deadline_ms: i64) {
    let second = deadline_ms.div_euclid(1000);
    let hash = if key.len() > 64 {
        format!("{prefix}ledger:0:at:{second}:long")
    } else {
        format!("{prefix}ledger:0:at:{second}")
    };
    let () = redis::pipe()
        .cmd("HSET")
        .arg(&hash)
        .arg(key)
        .arg(deadline_ms - second * 1000)
        .ignore()
        .cmd("ZADD")
        .arg(format!("{prefix}ledger:0:minutes"))
        .arg("LT")
        .arg(deadline_ms)
        .arg(second.div_euclid(60))
        .ignore()
        .query(conn)
        .unwrap_or_else(|e| panic!("writing {key}'s deadline: {e}"));
}
