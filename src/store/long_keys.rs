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

/// Keeps the exact values `firings` will be stored without ([`crate::firing::Firing::apart`]),
/// each once however many firings (one per rule that matched the key) name it, for the
/// transaction that stores their jobs.
pub fn keep_cmds<'a>(
    prefix: &str,
    firings: impl IntoIterator<Item = &'a crate::firing::Firing>,
) -> Vec<redis::Cmd> {
    let mut kept: Vec<&[u8]> = Vec::new();
    for exact in firings.into_iter().flat_map(|f| f.kept_apart()) {
        if !kept.contains(&exact) {
            kept.push(exact);
        }
    }
    kept.into_iter()
        .map(|exact| keep_cmd(prefix, exact))
        .collect()
}

/// Keeps `exact`, named by its SHA-256.
fn keep_cmd(prefix: &str, exact: &[u8]) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(key(prefix, &crate::long_key::sha256_hex(exact)))
        .arg(exact)
        .arg("PX")
        .arg(KEEP.as_millis() as u64);
    set
}

/// The exact bytes whose SHA-256 is `sha256`, if they are still kept (their time renewed).
pub async fn read(state: &Conn, prefix: &str, sha256: &str) -> redis::RedisResult<Option<Vec<u8>>> {
    redis::cmd("GETEX")
        .arg(key(prefix, sha256))
        .arg("PX")
        .arg(KEEP.as_millis() as u64)
        .query_async(&mut state.clone())
        .await
}

crate::keyspace::commands::declare! {
    /// The commands that keep and read the exact bytes of long keys
    /// ([`crate::keyspace::commands`]).
    const WHY = "long keys: their exact bytes kept once";
    [
        Use::new(Server::State, "set", WHY)
            .on(Keys::State("long:*"), Access::Write)
            .args("{key} bytes PX 1000"),
        Use::new(Server::State, "getex", WHY)
            .on(Keys::State("long:*"), Access::ReadWrite)
            .args("{key} PX 1000"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firing::expiry;

    #[test]
    fn a_long_key_is_kept_once_however_many_rules_fire_and_a_short_one_not_at_all() {
        let long = format!("big:{}", "k".repeat(crate::long_key::EXACT + 1));
        let at = "2026-12-06T10:00:00Z";
        let (a, b, short) = (
            expiry("a", &long, at),
            expiry("b", &long, at),
            expiry("c", "k:1", at),
        );
        let cmds = keep_cmds("kw:", [&a, &b, &short]);
        assert_eq!(cmds.len(), 1);
        let packed = String::from_utf8_lossy(&cmds[0].get_packed_command()).into_owned();
        let sha = crate::long_key::sha256_hex(long.as_bytes());
        assert!(
            packed.contains(&format!("kw:long:{sha}")),
            "named by its hash"
        );
        assert!(packed.contains(&long), "the exact bytes");
        // Stored, a firing names the key apart and keeps nothing more.
        let stored: crate::firing::Firing = serde_json::from_str(&a.text()).unwrap();
        assert!(keep_cmds("kw:", [&stored]).is_empty());
    }
}
