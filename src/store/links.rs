//! Signed links' use: `{prefix}link:HASH` (HASH: the first 16 bytes of the token's SHA-256, hex;
//! value: when it was used), set when a link's button acts and kept until a day after the link
//! expires. A link acts once: replayed (a chat app's retries, a script), or after `keywatch
//! silence remove` took away the silence it made, it does nothing again
//! (docs/operations.md#exposing-the-endpoint). See
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use sha2::{Digest, Sha256};

use crate::keyspace::Conn;

/// How long after its link's expiry a marker is kept: past it the link is refused as expired.
const KEPT_AFTER_EXPIRY_MS: i64 = 86_400_000;

/// The marker of the link whose token is `token`.
pub fn used_key(prefix: &str, token: &str) -> String {
    format!(
        "{prefix}link:{}",
        hex::encode(&Sha256::digest(token.as_bytes())[..16])
    )
}

/// Marks the link `token` (expiring at `exp_ms`) used, now (`now_ms`); false when it already
/// was, and then it must not act again.
pub async fn take(
    conn: &mut Conn,
    prefix: &str,
    token: &str,
    exp_ms: i64,
    now_ms: i64,
) -> redis::RedisResult<bool> {
    let set: Option<String> = redis::cmd("SET")
        .arg(used_key(prefix, token))
        .arg(now_ms)
        .arg("NX")
        .arg("PX")
        .arg((exp_ms - now_ms).max(0) + KEPT_AFTER_EXPIRY_MS)
        .query_async(conn)
        .await?;
    Ok(set.is_some())
}

/// Undoes [`take`] when the link's action could not be done, so that it can be pressed again.
pub async fn give_back(conn: &mut Conn, prefix: &str, token: &str) -> redis::RedisResult<()> {
    redis::cmd("DEL")
        .arg(used_key(prefix, token))
        .query_async(conn)
        .await
}

crate::keyspace::commands::declare! {
    /// The commands signed links send to mark themselves used ([`crate::keyspace::commands`]).
    const WHY = "signed links: used once";
    [
        Use::new(Server::State, "set", WHY)
            .on(Keys::State("link:*"), Access::Write)
            .args("{key} 1 NX PX 1000"),
        Use::new(Server::State, "del", WHY)
            .on(Keys::State("link:*"), Access::Write)
            .args("{key}"),
    ]
}
