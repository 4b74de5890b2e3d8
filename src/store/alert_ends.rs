//! When an Alertmanager alert ended: set by the rule's `resolved` for the alert of one firing sent
//! through one channel (`{prefix}alert-end:FIRING:CHANNEL`, a string: the moment it ended, unix
//! ms by Redis's clock), read by each of the alert's jobs before it posts. Making those jobs due
//! at once goes with it, in one round trip. See
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use std::time::Duration;

use crate::keyspace::Conn;

use super::queue::keys;

/// The end of the alert of `firing_id` sent through `channel`.
pub fn key(prefix: &str, firing_id: &str, channel: &str) -> String {
    format!("{prefix}alert-end:{firing_id}:{channel}")
}

/// When the alert ended (unix ms), if it did.
pub async fn ended_at(
    conn: &Conn,
    prefix: &str,
    firing_id: &str,
    channel: &str,
) -> redis::RedisResult<Option<i64>> {
    redis::cmd("GET")
        .arg(key(prefix, firing_id, channel))
        .query_async(&mut conn.clone())
        .await
}

/// Records that the alert ends at `now_ms`, kept for `keep` (the first moment stays: a resolved
/// notice retried later does not move it), and makes the queued `jobs` (by id) due at once; a
/// job already finished stays gone (`ZADD XX`).
pub async fn end(
    conn: &Conn,
    prefix: &str,
    firing_id: &str,
    channel: &str,
    now_ms: i64,
    keep: Duration,
    jobs: &[String],
) -> redis::RedisResult<()> {
    let mut p = redis::pipe();
    p.cmd("SET")
        .arg(key(prefix, firing_id, channel))
        .arg(now_ms)
        .arg("NX")
        .arg("PX")
        .arg(u64::try_from(keep.as_millis()).unwrap_or(u64::MAX))
        .ignore();
    let due = p.cmd("ZADD").arg(keys::queue(prefix)).arg("XX");
    for id in jobs {
        due.arg(now_ms).arg(id);
    }
    due.ignore();
    p.query_async::<()>(&mut conn.clone()).await
}

crate::keyspace::commands::declare! {
    /// The commands alertmanager alerts send ([`crate::keyspace::commands`]).
    const WHY = "alertmanager alerts";
    [
        Use::new(Server::State, "get", WHY)
            .on(Keys::State("alert-end:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "set", WHY)
            .on(Keys::State("alert-end:*"), Access::Write)
            .args("{key} 1 NX PX 1000"),
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} XX 0 id"),
    ]
}
