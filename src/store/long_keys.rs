//! The exact bytes of keys (and hash fields) longer than [`crate::long_key::EXACT`], kept once
//! per value, `{prefix}long:SHA256` (a string), so that the firing each job, held message and
//! dead letter embeds carries only the value's cut view and its SHA-256
//! (docs/reliability.md#bounded-whatever-the-key). Written in the transaction that stores the
//! firing's jobs, read again by each attempt that needs the exact bytes (to take the captures
//! again, for `cleanup`, `detail`, follow-ups' `EXISTS`), which renews its time.
//!
//! It expires [`KEEP`] after it was last written or read: longer than a job can wait between
//! two attempts (the 24 h retry window), so only a dead letter retried later, or a follow-up due
//! later, finds it gone, and is then refused saying so.

use std::time::Duration;

use crate::keyspace::Conn;

/// How long the exact bytes are kept after they were last written or read.
pub const KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// Where the exact bytes whose SHA-256 is `sha256` (hex) are kept.
pub fn key(prefix: &str, sha256: &str) -> String {
    format!("{prefix}long:{sha256}")
}

/// How much of a long value one command carries, to Redis or back: a 16 MB key written or read
/// whole went through four buffers of redis-rs at once (the command, its packed form, the
/// connection's buffer, which keeps its size), and each was as long as the key.
pub const CHUNK: usize = 1 << 20;

/// Upload names are unique per process (the instance's name and start make them unique across).
static UPLOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Keeps `exact` (for [`KEEP`] from now) and returns where: its name, by SHA-256. Written a
/// [`CHUNK`] at a time under a name of this upload's own, renamed once whole, so that a crash
/// midway leaves no partial value under the SHA-256's name (the partial one expires). Already kept
/// (another instance heard the same event), it is only renewed.
pub async fn keep(
    state: &Conn,
    prefix: &str,
    uploader: &str,
    exact: &[u8],
    sha256: &str,
) -> redis::RedisResult<String> {
    let name = key(prefix, sha256);
    let mut conn = state.clone();
    let renewed: bool = redis::cmd("PEXPIRE")
        .arg(&name)
        .arg(KEEP.as_millis() as u64)
        .query_async(&mut conn)
        .await?;
    if renewed {
        return Ok(name);
    }
    let n = UPLOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let upload = format!("{name}:up:{uploader}:{n}");
    upload_to(&mut conn, &upload, exact, KEEP.as_millis() as u64).await?;
    redis::cmd("RENAME")
        .arg(&upload)
        .arg(&name)
        .exec_async(&mut conn)
        .await?;
    Ok(name)
}

/// Writes `exact` to the string `upload` a [`CHUNK`] at a time (`SET … PX keep_ms`, then
/// `APPEND`): the caller renames it into place once whole, so that a crash midway leaves only an
/// upload that expires.
pub async fn upload_to(
    conn: &mut Conn,
    upload: &str,
    exact: &[u8],
    keep_ms: u64,
) -> redis::RedisResult<()> {
    for (i, chunk) in exact.chunks(CHUNK).enumerate() {
        let mut c = redis::cmd(if i == 0 { "SET" } else { "APPEND" });
        c.arg(upload).arg(chunk);
        if i == 0 {
            c.arg("PX").arg(keep_ms);
        }
        c.exec_async(conn).await?;
    }
    Ok(())
}

/// The exact bytes whose SHA-256 is `sha256`, if they are still kept (their time renewed), read
/// a [`CHUNK`] at a time. A value is never changed under its name (it is its hash), so the
/// chunks of one read are of one value; [`crate::firing`] checks the hash of what it gets.
pub async fn read(state: &Conn, prefix: &str, sha256: &str) -> redis::RedisResult<Option<Vec<u8>>> {
    let name = key(prefix, sha256);
    let mut conn = state.clone();
    let (renewed, len): (bool, usize) = redis::pipe()
        .cmd("PEXPIRE")
        .arg(&name)
        .arg(KEEP.as_millis() as u64)
        .cmd("STRLEN")
        .arg(&name)
        .query_async(&mut conn)
        .await?;
    if !renewed {
        return Ok(None);
    }
    read_at(&mut conn, &name, len).await
}

/// The `len` bytes of the string `name`, read a [`CHUNK`] at a time, or `None` if it is gone
/// before they are all read: a reply of a whole long value would double the connection's read
/// buffer, which then keeps its size.
pub async fn read_at(
    conn: &mut Conn,
    name: &str,
    len: usize,
) -> redis::RedisResult<Option<Vec<u8>>> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let end = (out.len() + CHUNK).min(len) - 1;
        let part: Vec<u8> = redis::cmd("GETRANGE")
            .arg(name)
            .arg(out.len())
            .arg(end)
            .query_async(conn)
            .await?;
        if part.is_empty() {
            // Gone meanwhile: its time ended during the read.
            return Ok(None);
        }
        out.extend_from_slice(&part);
    }
    Ok(Some(out))
}

crate::keyspace::commands::declare! {
    /// The commands that keep and read the exact bytes of long keys
    /// ([`crate::keyspace::commands`]).
    const WHY = "long keys: their exact bytes kept once";
    [
        Use::new(Server::State, "pexpire", WHY)
            .on(Keys::State("long:*"), Access::Write)
            .args("{key} 1000"),
        Use::new(Server::State, "set", WHY)
            .on(Keys::State("long:*"), Access::Write)
            .args("{key} bytes PX 1000"),
        Use::new(Server::State, "append", WHY)
            .on(Keys::State("long:*"), Access::Write)
            .args("{key} bytes"),
        Use::new(Server::State, "rename", WHY)
            .on(Keys::State("long:*"), Access::ReadWrite)
            .args("{key} {key}"),
        Use::new(Server::State, "strlen", WHY)
            .on(Keys::State("long:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "getrange", WHY)
            .on(Keys::State("long:*"), Access::Read)
            .args("{key} 0 1"),
        // The poker's copies of due long keys (and members), `store::ledger`'s `due.lua`.
        Use::new(Server::State, "getrange", "ledger: a due long key's copy, a MiB at a time")
            .on(Keys::State("ledger:*:copy:*"), Access::Read)
            .args("{key} 0 1")
            .when(When::Ledger),
        Use::new(Server::State, "getrange", "field ledger: a due long member's copy, a MiB at a time")
            .on(Keys::State("fields:*:copy:*"), Access::Read)
            .args("{key} 0 1")
            .when(When::Fields),
        // A long hash's name, uploaded (`store::fields::write`) and read (`store::fields::name`).
        Use::new(Server::State, "set", "field ledger: a long hash's name, a MiB at a time")
            .on(Keys::State("fields:*:name:*"), Access::Write)
            .args("{key} bytes PX 1000")
            .when(When::Fields),
        Use::new(Server::State, "append", "field ledger: a long hash's name, a MiB at a time")
            .on(Keys::State("fields:*:name:*"), Access::Write)
            .args("{key} bytes")
            .when(When::Fields),
        Use::new(Server::State, "getrange", "field ledger: a long hash's name, a MiB at a time")
            .on(Keys::State("fields:*:name:*"), Access::Read)
            .args("{key} 0 1")
            .when(When::Fields),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of several chunks crosses whole; a crash midway (an upload never renamed) leaves
    /// nothing under the hash's name; kept again, it is only renewed; gone, it reads as `None`.
    #[tokio::test]
    async fn a_long_value_is_kept_in_chunks_under_its_hash_and_read_back_whole() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let exact: Vec<u8> = (0..CHUNK * 2 + 123).map(|i| (i % 251) as u8).collect();
        let sha = crate::long_key::sha256_hex(&exact);
        assert_eq!(read(&conn, "kw:", &sha).await.unwrap(), None);
        let name = keep(&conn, "kw:", "me", &exact, &sha).await.unwrap();
        assert_eq!(name, format!("kw:long:{sha}"));
        assert_eq!(
            read(&conn, "kw:", &sha).await.unwrap().as_deref(),
            Some(&exact[..])
        );
        let mut c = conn.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("kw:*")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(keys, vec![name.clone()], "no upload left behind");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(
            ttl > (KEEP.as_millis() as i64) - 60_000,
            "kept for {ttl} ms"
        );
        // Kept again (another instance, the stage after the take): renewed, not written.
        let _: () = redis::cmd("PEXPIRE")
            .arg(&name)
            .arg(1000)
            .query_async(&mut c)
            .await
            .unwrap();
        keep(&conn, "kw:", "other", b"not these bytes", &sha)
            .await
            .unwrap();
        assert_eq!(
            read(&conn, "kw:", &sha).await.unwrap().as_deref(),
            Some(&exact[..])
        );
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(ttl > 1000, "renewed: {ttl} ms");
    }
}
