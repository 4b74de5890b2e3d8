//! The deadline ledger as the tests read it: per database, a hash per second of deadlines
//! (`{prefix}ledger:DB:at:SECOND[:long]`, key → ms within the second) and the minutes that hold
//! some (`{prefix}ledger:DB:minutes`), and the far buckets of the hours not refined yet
//! (`{prefix}ledger:DB:far`, the hours; `…:far:shards`, their shard counts;
//! `…:far:HOUR:SHARD`, key → ms within the hour), as
//! docs/how-it-works.md#what-keywatch-keeps-in-redis describes them.

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
    fields_in(conn, prefix, 0)
}

/// The field ledger's deadlines of database `db`, member → deadline.
pub fn fields_in(conn: &mut impl ConnectionLike, prefix: &str, db: u32) -> BTreeMap<String, i64> {
    entries_under(conn, &format!("{prefix}fields:{db}"))
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
    let hours: Vec<(i64, i64)> = redis::cmd("HGETALL")
        .arg(format!("{base}:far:shards"))
        .query(conn)
        .unwrap_or_else(|e| panic!("the ledger's far buckets: {e}"));
    // A dense hour's count is negative: its shards may still hold that many.
    for (hour, shards) in hours {
        for shard in 0..shards.abs() {
            let hash = format!("{base}:far:{hour}:{shard}");
            let fields: Vec<(String, i64)> = redis::cmd("HGETALL")
                .arg(&hash)
                .query(conn)
                .unwrap_or_else(|e| panic!("HGETALL {hash}: {e}"));
            for (k, ms) in fields {
                out.insert(k, hour * 3_600_000 + ms);
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

/// Writes `key`'s deadline into database 0 of the ledger under `prefix` as a far deadline, in
/// the only shard of its hour (for tests that set up an hour the poker has not refined: its
/// instances were down). The hour must hold no far deadline yet.
pub fn put_far(conn: &mut impl ConnectionLike, prefix: &str, key: &str, deadline_ms: i64) {
    let hour = deadline_ms.div_euclid(3_600_000);
    let base = format!("{prefix}ledger:0:far");
    let () = redis::pipe()
        .cmd("HSET")
        .arg(format!("{base}:{hour}:0"))
        .arg(key)
        .arg(deadline_ms - hour * 3_600_000)
        .ignore()
        .cmd("HSET")
        .arg(format!("{base}:shards"))
        .arg(hour)
        .arg(1)
        .ignore()
        .cmd("ZADD")
        .arg(&base)
        .arg(hour * 3_600_000)
        .arg(hour)
        .ignore()
        .query(conn)
        .unwrap_or_else(|e| panic!("writing {key}'s far deadline: {e}"));
}

/// How many deadlines database 0 of the ledger under `prefix` holds in all, every place
/// counted (a deadline in two places counts twice): its seconds' hashes and its far shards.
pub fn places(conn: &mut impl ConnectionLike, prefix: &str) -> usize {
    let base = format!("{prefix}ledger:0");
    let mut n = 0;
    for pattern in [format!("{base}:at:*"), format!("{base}:far:*:*")] {
        let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(conn).unwrap();
        for k in keys {
            let len: usize = redis::cmd("HLEN").arg(&k).query(conn).unwrap();
            n += len;
        }
    }
    n
}
