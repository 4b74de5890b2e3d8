//! `cleanup`: delete the keys an expired key leaves behind (`delete` glob patterns, with
//! SCAN + UNLINK, never KEYS) and fields in hashes (`hdel`). Captures are glob-escaped in the
//! patterns, so a session id `*` deletes `session:*:…` literally, not every session; keywatch's
//! own keys are never deleted.

use crate::config::{CleanupStep, Rule};
use crate::firing::Firing;

use super::context::ActionContext;
use crate::keyspace::Conn;
use crate::outcome::Outcome;

/// Keys asked per SCAN call: large enough to walk a big keyspace in few round trips, small
/// enough to keep each call short for other clients.
const SCAN_COUNT: usize = 1000;

/// What one cleanup of a firing deletes, rendered: `delete`'s glob patterns (captures
/// glob-escaped) and `hdel`'s (hash, field) pairs, those under `state.prefix` left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Targets {
    pub delete: Vec<Vec<u8>>,
    pub hdel: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The targets of one attempt; a template that fails on this firing's data fails for good.
pub fn targets(a: &ActionContext, f: &Firing, step: &CleanupStep) -> Result<Targets, Outcome> {
    let t = &a.config.templates;
    let ctx = a.context_of(f);
    let own = a.config.state.prefix.as_bytes();
    let mut delete = Vec::with_capacity(step.delete.len());
    for &id in &step.delete {
        match t.render(id, &ctx) {
            Ok(g) => delete.push(g),
            Err(e) => return Err(Outcome::Failed(format!("cleanup pattern: {}", e.message))),
        }
    }
    let mut hdel = Vec::with_capacity(step.hdel.len());
    for h in &step.hdel {
        match (t.render(h.key, &ctx), t.render(h.field, &ctx)) {
            (Ok(k), _) if k.starts_with(own) => {}
            (Ok(k), Ok(f)) => hdel.push((k, f)),
            (Err(e), _) | (_, Err(e)) => {
                return Err(Outcome::Failed(format!("cleanup hdel: {}", e.message)));
            }
        }
    }
    Ok(Targets { delete, hdel })
}

pub async fn run(a: &ActionContext, f: &Firing, _rule: &Rule, step: &CleanupStep) -> Outcome {
    let targets = match targets(a, f, step) {
        Ok(t) => t,
        Err(o) => return o,
    };
    let mut conn = match a.keyspace.conn(f.db).await {
        Ok(c) => c,
        Err(e) => {
            return Outcome::Retry {
                reason: format!("cleanup: Redis: {e}"),
                after: None,
            };
        }
    };
    let own = a.config.state.prefix.as_bytes();
    let mut deleted = 0usize;
    for glob in &targets.delete {
        let result = match literal(glob) {
            Some(key) if key.starts_with(own) => Ok(0),
            Some(key) => {
                redis::cmd("UNLINK")
                    .arg(&key)
                    .query_async::<usize>(&mut conn)
                    .await
            }
            None => scan_unlink(a, &mut conn, f.db, glob, own).await,
        };
        match result {
            Ok(n) => deleted += n,
            Err(e) => {
                return Outcome::Retry {
                    reason: format!("cleanup: Redis: {e}"),
                    after: None,
                };
            }
        }
    }
    let mut fields = 0usize;
    if !targets.hdel.is_empty() {
        let mut cmds = Vec::new();
        for (key, field) in &targets.hdel {
            let mut cmd = redis::cmd("HDEL");
            cmd.arg(key).arg(field);
            cmds.push(cmd);
        }
        // Each hash may be on another node of a cluster: one command per hash.
        match conn.each::<usize>(cmds).await {
            Ok(v) => fields = v.iter().sum(),
            Err(e) => {
                return Outcome::Retry {
                    reason: format!("cleanup: Redis: {e}"),
                    after: None,
                };
            }
        }
    }
    Outcome::Sent(format!(
        "deleted {deleted} key(s) and {fields} hash field(s)"
    ))
}

/// The key a glob stands for when it has no unescaped wildcard (saves a SCAN of the keyspace).
pub fn literal(glob: &[u8]) -> Option<Vec<u8>> {
    let (start, whole) = crate::pattern::glob_literal_start(glob);
    whole.then_some(start)
}

/// SCAN + UNLINK of `glob`'s keys, on the one node or on every master of a cluster; UNLINK
/// goes through `conn`, which routes each key to its node.
async fn scan_unlink(
    a: &ActionContext,
    conn: &mut Conn,
    db: u32,
    glob: &[u8],
    own: &[u8],
) -> redis::RedisResult<usize> {
    let mut deleted = 0;
    for mut node in a.keyspace.scan_conns(db).await? {
        deleted += scan_unlink_on(&mut node, conn, glob, own).await?;
    }
    Ok(deleted)
}

async fn scan_unlink_on(
    scan: &mut impl redis::aio::ConnectionLike,
    unlink: &mut Conn,
    glob: &[u8],
    own: &[u8],
) -> redis::RedisResult<usize> {
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    loop {
        let (next, keys) = crate::keyspace::scan_page(scan, cursor, glob, SCAN_COUNT).await?;
        let keys: Vec<Vec<u8>> = keys.into_iter().filter(|k| !k.starts_with(own)).collect();
        if !keys.is_empty() {
            deleted += redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<usize>(unlink)
                .await?;
        }
        if next == 0 {
            return Ok(deleted);
        }
        cursor = next;
    }
}

crate::keyspace::commands::declare! {
    /// The commands cleanups send ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "scan", "cleanup")
            .on(Keys::CleanupDelete, Access::Read)
            .args("0 MATCH {glob} COUNT 10")
            .when(When::Cleanup),
        Use::new(Server::Watched, "unlink", "cleanup")
            .on(Keys::CleanupDelete, Access::Write)
            .args("{key}")
            .when(When::Cleanup),
        Use::new(Server::Watched, "hdel", "cleanup")
            .on(Keys::CleanupHash, Access::ReadWrite)
            .args("{key} {field}")
            .when(When::Cleanup),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_globs_need_no_scan() {
        assert_eq!(literal(b"cart:42"), Some(b"cart:42".to_vec()));
        assert_eq!(literal(b"cart:\\*"), Some(b"cart:*".to_vec()));
        assert_eq!(literal(b"session:42:*"), None);
        assert_eq!(literal(b"a?b"), None);
        assert_eq!(literal(b"a[b]"), None);
    }
}
