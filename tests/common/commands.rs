//! The Redis commands tests keep repeating: keys with a TTL, keys that expire right now, the
//! server's notification flags. Generic over the connection, and one command at a time (a
//! cluster connection does not pipeline), so they work on a cluster too.

use std::time::{Duration, Instant};

use redis::{ConnectionLike, ToRedisArgs};

use super::wait::PATIENCE;

/// `SET key value PX ttl`.
pub fn set_with_ttl<K: ToRedisArgs, V: ToRedisArgs>(
    conn: &mut impl ConnectionLike,
    key: K,
    value: V,
    ttl: Duration,
) {
    let () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("PX")
        .arg(ttl.as_millis().max(1) as u64)
        .query(conn)
        .expect("SET … PX");
}

/// `SET key w PX ms`: a key that expires `ms` from now.
pub fn set_px<K: ToRedisArgs>(conn: &mut impl ConnectionLike, key: K, ms: u64) {
    set_with_ttl(conn, key, "w", Duration::from_millis(ms));
}

/// How far ahead [`expire_now`] sets each key's deadline.
pub const EXPIRE_IN_MS: u64 = 50;

/// Sets each key to `v` and makes it expire now (see [`expire_now`]).
pub fn set_and_expire_now<K: ToRedisArgs>(conn: &mut impl ConnectionLike, keys: &[K]) {
    for k in keys {
        let () = redis::cmd("SET").arg(k).arg("v").query(conn).expect("SET");
    }
    expire_now(conn, keys);
}

/// Makes existing `keys` expire now, with an `expired` event: Redis publishes one only when it
/// deletes a key, so give each key a short TTL and read its TTL until Redis reports it gone,
/// which deletes it lazily. This does not wait for Redis's background expiry cycle.
///
/// The TTL is [`EXPIRE_IN_MS`], not 1 ms: Redis computes `PEXPIRE`'s deadline from the time it
/// took when the command started arriving, and if its clock has passed that deadline by the time
/// the command runs (a 1 MB key read under load takes longer than 1 ms), it deletes the key at
/// once and publishes `del`, not `expired`: the event a test waits for never comes.
pub fn expire_now<K: ToRedisArgs>(conn: &mut impl ConnectionLike, keys: &[K]) {
    for (i, k) in keys.iter().enumerate() {
        let set: i64 = redis::cmd("PEXPIRE")
            .arg(k)
            .arg(EXPIRE_IN_MS)
            .query(conn)
            .expect("PEXPIRE");
        assert_eq!(set, 1, "key #{i} does not exist, so it cannot expire");
    }
    touch_until_gone(conn, keys);
}

/// `PTTL` of every key every few milliseconds until each answers -2 (gone): touching an expired
/// key makes Redis delete it and publish `expired` right away.
pub fn touch_until_gone<K: ToRedisArgs>(conn: &mut impl ConnectionLike, keys: &[K]) {
    let mut left: Vec<&K> = keys.iter().collect();
    let deadline = Instant::now() + PATIENCE;
    while !left.is_empty() {
        std::thread::sleep(Duration::from_millis(2));
        let ttls: Vec<i64> = left
            .iter()
            .map(|k| redis::cmd("PTTL").arg(*k).query(conn).expect("PTTL"))
            .collect();
        assert!(
            !ttls.contains(&-1),
            "PTTL answered -1: a key has no TTL, it will never expire"
        );
        left = left
            .into_iter()
            .zip(ttls)
            .filter(|(_, t)| *t != -2)
            .map(|(k, _)| k)
            .collect();
        assert!(
            Instant::now() < deadline,
            "{} key(s) did not expire within {PATIENCE:?}",
            left.len()
        );
    }
}

/// `CONFIG GET notify-keyspace-events`.
pub fn notify_flags(conn: &mut impl ConnectionLike) -> String {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query(conn)
        .expect("CONFIG GET notify-keyspace-events");
    pair.get(1).cloned().unwrap_or_default()
}

/// How many jobs the members of a queue or digest-window set hold: one each, a bundle (`#N#…`,
/// jobs of one batch stored as one member) the N it names.
pub fn jobs_in(members: &[String]) -> usize {
    members
        .iter()
        .map(|m| {
            m.strip_prefix('#')
                .and_then(|r| r.split_once('#'))
                .and_then(|(n, _)| n.parse().ok())
                .unwrap_or(1)
        })
        .sum()
}

/// What a keywatch with the default state prefix (`keywatch:`) still has to do for database 0,
/// read from `conn`'s server, by sorted set: deadlines in the key and the field ledger, events
/// taken and not finished (the intake), jobs due, waiting or in flight (the queue). All zero:
/// every deadline it learnt has been decided and every job it stored has ended, so nothing more
/// can arrive from them; the signal to wait for instead of "a while".
pub fn work_left(conn: &mut impl ConnectionLike) -> Vec<(&'static str, i64)> {
    let mut left = vec![
        ("keywatch:ledger:0", super::ledger::len(conn, "keywatch:")),
        (
            "keywatch:fields:0",
            super::ledger::fields(conn, "keywatch:").len() as i64,
        ),
    ];
    left.extend(
        ["keywatch:intake", "keywatch:queue"]
            .into_iter()
            .map(|key| {
                let n: i64 = redis::cmd("ZCARD")
                    .arg(key)
                    .query(conn)
                    .unwrap_or_else(|e| panic!("ZCARD {key}: {e}"));
                (key, n)
            }),
    );
    left
}

/// Waits until [`work_left`] is all zero. Panics after [`PATIENCE`] with what is left.
pub fn wait_no_work_left(conn: &mut impl ConnectionLike) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = work_left(conn);
        if left.iter().all(|(_, n)| *n == 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "keywatch still has work after {PATIENCE:?}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
