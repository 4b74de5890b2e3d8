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
    pub hdel: Vec<HashField>,
}

/// An `hdel` target: the hash and the field.
type HashField = (Vec<u8>, Vec<u8>);

/// A firing's cleanup templates rendered one at a time: text and names straight from the
/// firing's bytes ([`crate::template::TemplateSet::render_plain`]), anything else from a context
/// built on first need. A context holds the key and each capture again, and a key of megabytes
/// makes each target as long (docs/reliability.md#bounded-whatever-the-key).
struct Renderer<'a> {
    a: &'a ActionContext,
    f: &'a Firing,
    names: Vec<String>,
    values: Vec<bytes::Bytes>,
    ctx: std::cell::OnceCell<crate::template::Context>,
}

impl<'a> Renderer<'a> {
    fn new(a: &'a ActionContext, f: &'a Firing) -> Renderer<'a> {
        Renderer {
            a,
            f,
            names: f.capture_names(),
            values: f.capture_values(),
            ctx: std::cell::OnceCell::new(),
        }
    }

    fn render(&self, id: crate::template::TemplateId) -> Result<Vec<u8>, String> {
        let verbatim =
            |n: &str| crate::template::verbatim(n, &self.f.key, &self.names, &self.values);
        self.a
            .config
            .templates
            .render_bytes(id, verbatim, &self.ctx, || self.a.context_of(self.f))
            .map_err(|e| e.message)
    }

    fn delete(&self, id: crate::template::TemplateId) -> Result<Vec<u8>, Outcome> {
        self.render(id)
            .map_err(|e| Outcome::Failed(format!("cleanup pattern: {e}")))
    }

    /// The hash and field of an `hdel`; `None` for a hash under `state.prefix`.
    fn hdel(&self, h: &crate::config::HdelTarget) -> Result<Option<HashField>, Outcome> {
        let own = self.a.config.state.prefix.as_bytes();
        match (self.render(h.key), self.render(h.field)) {
            (Ok(k), _) if k.starts_with(own) => Ok(None),
            (Ok(k), Ok(f)) => Ok(Some((k, f))),
            (Err(e), _) | (_, Err(e)) => Err(Outcome::Failed(format!("cleanup hdel: {e}"))),
        }
    }
}

/// The targets of one attempt, all rendered (what `keywatch test` and previews show); a
/// template that fails on this firing's data fails for good.
pub fn targets(a: &ActionContext, f: &Firing, step: &CleanupStep) -> Result<Targets, Outcome> {
    let r = Renderer::new(a, f);
    let delete = step
        .delete
        .iter()
        .map(|&id| r.delete(id))
        .collect::<Result<_, _>>()?;
    let mut hdel = Vec::with_capacity(step.hdel.len());
    for h in &step.hdel {
        hdel.extend(r.hdel(h)?);
    }
    Ok(Targets { delete, hdel })
}

/// Deletes what `step` names for `f`, each target rendered as it comes (one long target held
/// at a time, not all of them): a template that fails on this firing's data fails for good,
/// after the targets before it were deleted (deleting again is harmless).
pub async fn run(a: &ActionContext, f: &Firing, _rule: &Rule, step: &CleanupStep) -> Outcome {
    let r = Renderer::new(a, f);
    let mut conn = match a.keyspace.conn(f.db).await {
        Ok(c) => c,
        Err(e) => {
            return Outcome::Retry {
                reason: format!("cleanup: Redis: {e}"),
                after: None,
            };
        }
    };
    let redis_error = |e: redis::RedisError| Outcome::Retry {
        reason: format!("cleanup: Redis: {e}"),
        after: None,
    };
    let own = a.config.state.prefix.as_bytes();
    let mut deleted = 0usize;
    for &id in &step.delete {
        let glob = match r.delete(id) {
            Ok(g) => g,
            Err(o) => return o,
        };
        let result = match literal(glob) {
            Ok(key) if key.starts_with(own) => Ok(0),
            Ok(key) if crate::long_key::is_long(&key) => conn
                .direct(&[b"UNLINK", &key])
                .await
                .and_then(|n| Ok(redis::from_redis_value(n)?)),
            Ok(key) => {
                redis::cmd("UNLINK")
                    .arg(&key)
                    .query_async::<usize>(&mut conn)
                    .await
            }
            Err(glob) => scan_unlink(a, &mut conn, f.db, &glob, own).await,
        };
        match result {
            Ok(n) => deleted += n,
            Err(e) => return redis_error(e),
        }
    }
    let mut fields = 0usize;
    for h in &step.hdel {
        let (key, field) = match r.hdel(h) {
            Ok(Some(t)) => t,
            Ok(None) => continue,
            Err(o) => return o,
        };
        // Each hash may be on another node of a cluster: one command per hash. A long name
        // goes on a connection of its own (docs/reliability.md#bounded-whatever-the-key).
        let removed = match crate::long_key::is_long(&key) || crate::long_key::is_long(&field) {
            true => conn
                .direct(&[b"HDEL", &key, &field])
                .await
                .and_then(|n| Ok(redis::from_redis_value::<usize>(n)?)),
            false => {
                redis::cmd("HDEL")
                    .arg(&key)
                    .arg(&field)
                    .query_async::<usize>(&mut conn)
                    .await
            }
        };
        match removed {
            Ok(n) => fields += n,
            Err(e) => return redis_error(e),
        }
    }
    Outcome::Sent(format!(
        "deleted {deleted} key(s) and {fields} hash field(s)"
    ))
}

/// The key a glob stands for when it has no unescaped wildcard (saves a SCAN of the keyspace),
/// its escapes resolved in place; else the glob, as it came.
pub fn literal(mut glob: Vec<u8>) -> Result<Vec<u8>, Vec<u8>> {
    if crate::pattern::glob_wildcard(&glob).is_some() {
        return Err(glob);
    }
    crate::pattern::glob_unescape(&mut glob);
    Ok(glob)
}

/// SCAN + UNLINK of `glob`'s keys, on the one node or on every master of a cluster; UNLINK
/// goes through `conn`, which routes each key to its node. The `SCAN`s go on connections of
/// their own when the glob is long (each page's command carries it; a page may carry a long
/// key too), so that their buffers go with the walk
/// (docs/reliability.md#bounded-whatever-the-key).
async fn scan_unlink(
    a: &ActionContext,
    conn: &mut Conn,
    db: u32,
    glob: &[u8],
    own: &[u8],
) -> redis::RedisResult<usize> {
    let mut deleted = 0;
    let long = crate::long_key::is_long(glob);
    let nodes = match long {
        true => a.keyspace.walk_conns(db, None).await?,
        false => a.keyspace.scan_conns(db).await?,
    };
    let sent = match long {
        true => covering_glob(glob),
        false => glob.to_vec(),
    };
    for mut node in nodes {
        deleted += scan_unlink_on(&mut node, conn, (&sent, glob), own).await?;
    }
    Ok(deleted)
}

/// Bytes of a long glob's literal start that the `SCAN`s send instead of the glob
/// ([`covering_glob`]).
const COVERING: usize = 1024;

/// A short glob that every key of `glob` matches: its literal start, cut at [`COVERING`]
/// bytes, then `*`. Sent with each page of a `SCAN` instead of a glob of megabytes (a key of
/// megabytes captured into it), the keys it returns checked against the whole glob here.
fn covering_glob(glob: &[u8]) -> Vec<u8> {
    // Enough of the glob for COVERING unescaped bytes, and one more: a head cut through an
    // escape (`\` as its last byte) reads that byte as a backslash, which the cut then drops.
    let head = &glob[..glob.len().min(2 * COVERING + 2)];
    let (start, _) = crate::pattern::glob_literal_start(head);
    let mut out = crate::pattern::glob_escape(&start[..start.len().min(COVERING)]);
    out.push(b'*');
    out
}

/// SCAN with `sent` of the keys of `glob` (the same glob, or one that covers it), checked
/// against `glob` when they differ, and UNLINK of them; a long key's UNLINK on a connection of
/// its own.
async fn scan_unlink_on(
    scan: &mut impl redis::aio::ConnectionLike,
    unlink: &mut Conn,
    (sent, glob): (&[u8], &[u8]),
    own: &[u8],
) -> redis::RedisResult<usize> {
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    loop {
        let (next, keys) = crate::keyspace::scan_page(scan, cursor, sent, SCAN_COUNT).await?;
        let (long, keys): (Vec<Vec<u8>>, Vec<Vec<u8>>) = keys
            .into_iter()
            .filter(|k| !k.starts_with(own))
            .filter(|k| sent == glob || crate::pattern::glob_matches(glob, k))
            .partition(|k| crate::long_key::is_long(k));
        if !keys.is_empty() {
            deleted += redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<usize>(unlink)
                .await?;
        }
        for k in long {
            let n = unlink.direct(&[b"UNLINK", &k]).await?;
            deleted += redis::from_redis_value::<usize>(n)?;
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

    /// What a long glob's walk keeps ([`covering_glob`] sent, each key checked with
    /// [`crate::pattern::glob_matches`]) is what Redis's own `SCAN MATCH` of the glob returns,
    /// for globs with every kind of token, escapes and unclosed classes.
    #[tokio::test]
    async fn a_covering_walk_keeps_what_redis_matches() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let keys: Vec<&[u8]> = vec![
            b"s:1", b"s:12", b"s:a", b"s:b:c", b"s:*", b"s:?", b"s:[", b"s:]", b"s:\\", b"s:",
            b"s:1:x", b"s:ab", b"s:^", b"s:-", b"t:1", b"s:z", b"s:\xff", b"s:aXb", b"s:abb",
        ];
        let mut set = redis::pipe();
        for k in &keys {
            set.cmd("SET").arg(*k).arg("v").ignore();
        }
        let () = set.query_async(&mut conn.clone()).await.unwrap();
        let globs: Vec<&[u8]> = vec![
            b"s:*",
            b"s:?",
            b"s:??",
            b"s:\\*",
            b"s:\\?",
            b"s:[ab]",
            b"s:[^ab]",
            b"s:[a-c]*",
            b"s:[c-a]",
            b"s:[\\]]",
            b"s:[\\\\]",
            b"s:*:*",
            b"s:a*b",
            b"s:*b",
            b"*",
            b"s:[]",
            b"s:[^]",
            b"s:[a",
            b"s:\\",
            b"s:[-]",
            b"s:**1",
            b"s:a?b",
            b"s:[!a]",
            b"s:\\[",
            b"s:*\\",
            b"s:[\\x]",
        ];
        for glob in globs {
            let mut redis_says = Vec::new();
            let mut cursor = 0;
            loop {
                let (next, page) =
                    crate::keyspace::scan_page(&mut conn.clone(), cursor, glob, 1000)
                        .await
                        .unwrap();
                redis_says.extend(page);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
            redis_says.sort();
            let cover = covering_glob(glob);
            let mut kept: Vec<Vec<u8>> = keys
                .iter()
                .filter(|k| crate::pattern::glob_matches(&cover, k))
                .filter(|k| crate::pattern::glob_matches(glob, k))
                .map(|k| k.to_vec())
                .collect();
            kept.sort();
            assert_eq!(kept, redis_says, "glob {:?}", String::from_utf8_lossy(glob));
        }
    }

    #[test]
    fn literal_globs_need_no_scan() {
        let literal = |g: &[u8]| literal(g.to_vec());
        assert_eq!(literal(b"cart:42"), Ok(b"cart:42".to_vec()));
        assert_eq!(literal(b"cart:\\*"), Ok(b"cart:*".to_vec()));
        assert_eq!(literal(b"session:42:*"), Err(b"session:42:*".to_vec()));
        assert_eq!(literal(b"a\\[b\\]?"), Err(b"a\\[b\\]?".to_vec()));
        assert_eq!(literal(b"a?b"), Err(b"a?b".to_vec()));
        assert_eq!(literal(b"a[b]"), Err(b"a[b]".to_vec()));
    }
}
