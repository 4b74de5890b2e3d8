//! The intake's records and the claims: what an instance took, until its jobs are stored.
//!
//! - `{prefix}intake`, a sorted set: the intake records, scored by the end of their lease (or
//!   by when a record waiting for a retry comes due); `{prefix}intake:events`, a hash: each
//!   record's events (the codec is the engine's, [`crate::engine`]); a take's batch whose lines
//!   are longer than [`LINES_APART`] keeps them in a field of their own, `ID:b`, written before
//!   the take script in the same transaction.
//! - `{prefix}claim:ID` (`SET NX PX 5000`): the claim of an event without a known deadline
//!   that has no place in its node's stream (`crate::source::places`); `{prefix}claims:at:MARK`,
//!   hashes (`HSETNX`): the claims of those that have one, one hash per mark, dropped ten
//!   minutes after its last claim;
//!   `{prefix}claims:MINUTE:DIGIT`, hashes (`HSETNX`): the claims of events with a deadline, one
//!   per deadline minute and first hex digit of the claim, dropped ten minutes after it;
//!   `{prefix}warned:DB:RULE:DEADLINE:KEY` (`SET NX PXAT`): a scanner warning's claim
//!   (`{prefix}warned:long:DB:RULE:DEADLINE:SHA256` for a long key, [`warned`]).
//!
//! The take is one script ([`TAKE`], after the handled memory's prelude): the ledger's
//! bookkeeping, the claims and the record, atomic per event. What is taken how is the engine's
//! to say (`src/engine/intake.rs`); see `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use crate::keyspace::Conn;
use crate::store::{fields, handled, lease_ms, ledger};

/// The take of a batch (run after [`handled::RECALLED`]).
const TAKE: &str = include_str!("intake/take.lua");
/// How far back a live expiry whose deadline the instance's index does not know is looked for in
/// the ledger (see `intake/take.lua`).
pub const WINDOW_MS: i64 = 60_000;
/// How old a deadline a live expiry takes from the ledger must be for the take to ask the
/// handled memory whether an instance that did not know it claimed it already: past
/// [`WINDOW_MS`], less a margin for the instances' clock estimates.
const LATE_MS: i64 = WINDOW_MS - 5_000;

/// A batch's event lines at least this long are written beside the take script (`ID:b`, in its
/// transaction) rather than passed through it: Redis's Lua hashes every byte of every string it
/// makes, so a storm's 200 KB of lines cost it twice that in hashing (the argument, and the
/// record joined from it), a sixth of the script (docs/performance.md#mass-expiry).
pub const LINES_APART: usize = 8 * 1024;

/// Puts a record back, due later, if it is still there.
const RETRY: &str = include_str!("intake/retry.lua");
/// Takes over records whose lease ended.
const TAKE_OVER: &str = include_str!("intake/take_over.lua");

/// The claim of a scanner warning of `rule` for `key` in `db` due at `deadline_ms` (0: none):
/// named by the key, or for a key longer than [`crate::long_key::EXACT`] by its SHA-256 under
/// `warned:long:` (no database is named `long`), so that a key of megabytes makes no claim of
/// megabytes in Redis, nor a script argument and a write buffer as long in keywatch, at every
/// scan (docs/reliability.md#bounded-whatever-the-key).
pub fn warned(prefix: &str, db: u32, rule: &str, deadline_ms: i64, key: &[u8]) -> Vec<u8> {
    if crate::long_key::is_long(key) {
        let sha = crate::long_key::sha256_hex(key);
        return format!("{prefix}warned:long:{db}:{rule}:{deadline_ms}:{sha}").into_bytes();
    }
    let mut claim = format!("{prefix}warned:{db}:{rule}:{deadline_ms}:").into_bytes();
    claim.extend_from_slice(key);
    claim
}

/// The fields where the takes of records `ids` may have kept their lines (see [`LINES_APART`]).
fn lines_apart(ids: &[impl AsRef<str>]) -> Vec<String> {
    ids.iter().map(|id| format!("{}:b", id.as_ref())).collect()
}

/// The intake's keys and scripts on the state server.
#[derive(Clone)]
pub struct Records {
    conn: Conn,
    prefix: String,
    zset: String,
    records: String,
    take: redis::Script,
    take_over: redis::Script,
    retry: redis::Script,
}

/// One take's events, as the script reads them.
pub struct Batch<'a> {
    pub db: u32,
    pub now_ms: i64,
    /// The latest deadline taken as due.
    pub due_limit_ms: i64,
    /// This instance, written in its claims.
    pub instance: &'a str,
    /// The record's id.
    pub id: &'a str,
    /// Every event's record, a line each.
    pub blob: &'a str,
    /// One letter per event: how it is taken (see the script).
    pub modes: &'a str,
    /// The events' arguments, in the order of `modes`.
    pub args: &'a [bytes::Bytes],
    /// Which of `args` name where a long key is kept ([`Records::keep_long`]) rather than
    /// carry it: the script reads them there.
    pub long: &'a [usize],
}

impl Records {
    pub fn new(conn: Conn, prefix: &str) -> Records {
        Records {
            conn,
            prefix: prefix.to_string(),
            zset: format!("{prefix}intake"),
            records: format!("{prefix}intake:events"),
            take: redis::Script::new(&format!("{}{}{TAKE}", handled::RECALLED, ledger::BUCKET)),
            take_over: redis::Script::new(TAKE_OVER),
            retry: redis::Script::new(RETRY),
        }
    }

    /// Runs the take script on `batch`: returns the events won, `n:deadline` joined by commas
    /// (`n` counts from 1; the deadline empty when none is known).
    pub async fn take(&self, batch: &Batch<'_>) -> redis::RedisResult<String> {
        let (p, db) = (self.prefix.as_str(), batch.db);
        // A storm's lines go beside the script, not through it (see [`LINES_APART`]).
        let apart = batch.blob.len() >= LINES_APART;
        let keys = [
            ledger::names(p, db).minutes,
            ledger::poked(p, db),
            ledger::poked_deadlines(p, db),
            self.zset.clone(),
            self.records.clone(),
            fields::names(p, db).minutes,
        ];
        let mut args: Vec<Vec<u8>> = [
            batch.now_ms.to_string(),
            batch.due_limit_ms.to_string(),
            handled::HANDLED_MINUTES.to_string(),
            (batch.now_ms + lease_ms()).to_string(),
            batch.instance.to_string(),
            handled::memory(p, db),
            format!("{p}claim:"),
            format!("{p}claims:"),
            db.to_string(),
            batch.id.to_string(),
            if apart {
                String::new()
            } else {
                batch.blob.to_string()
            },
            batch.modes.to_string(),
            ledger::names(p, db).seconds,
            WINDOW_MS.to_string(),
            LATE_MS.to_string(),
            ledger::TAKEN_SLACK_MS.to_string(),
            fields::names(p, db).seconds,
        ]
        .into_iter()
        .map(String::into_bytes)
        .collect();
        // The events' arguments start at ARGV[19] (`intake/take.lua`).
        let long: Vec<String> = batch.long.iter().map(|i| (19 + i).to_string()).collect();
        args.push(long.join(",").into_bytes());
        if !apart {
            let mut inv = self.take.prepare_invoke();
            for k in &keys {
                inv.key(k);
            }
            for a in args
                .iter()
                .map(Vec::as_slice)
                .chain(batch.args.iter().map(|a| &a[..]))
            {
                inv.arg(a);
            }
            return inv.invoke_async(&mut self.conn.clone()).await;
        }
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(self.take.get_hash()).arg(keys.len()).arg(&keys);
        for a in args
            .iter()
            .map(Vec::as_slice)
            .chain(batch.args.iter().map(|a| &a[..]))
        {
            evalsha.arg(a);
        }
        // The lines and the take in one transaction: the script names them in its record, or
        // drops them when this instance won nothing (or the take fails).
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("HSET")
            .arg(&self.records)
            .arg(format!("{}:b", batch.id))
            .arg(batch.blob)
            .ignore()
            .add_command(evalsha);
        let mut conn = self.conn.clone();
        match pipe.query_async::<(String,)>(&mut conn).await {
            Ok((won,)) => Ok(won),
            // Redis lost the script (a restart, `SCRIPT FLUSH`): the lines were written; the
            // same record id writes them again, once the script is loaded.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.take.load_async(&mut conn).await?;
                pipe.query_async::<(String,)>(&mut conn)
                    .await
                    .map(|(won,)| won)
            }
            Err(e) => Err(e),
        }
    }

    /// Keeps a long key (whose SHA-256 is `sha256`) where the take script and a taker after a
    /// crash read it ([`crate::store::long_keys::keep`]); returns that name.
    pub async fn keep_long(
        &self,
        uploader: &str,
        exact: &[u8],
        sha256: &str,
    ) -> redis::RedisResult<String> {
        crate::store::long_keys::keep(&self.conn, &self.prefix, uploader, exact, sha256).await
    }

    /// The exact bytes of a long key kept as [`Records::keep_long`] did, `None` if gone.
    pub async fn read_long(&self, sha256: &str) -> redis::RedisResult<Option<Vec<u8>>> {
        crate::store::long_keys::read(&self.conn, &self.prefix, sha256).await
    }

    /// When the first record's lease ends (or its retry is due), `None` when there is none: one
    /// command, what an idle instance asks instead of running the take-over script.
    pub async fn earliest(&self) -> redis::RedisResult<Option<i64>> {
        let first: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&self.zset)
            .arg("-inf")
            .arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .arg("WITHSCORES")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(first.first().map(|(_, at)| at.floor() as i64))
    }

    /// Takes over up to `max` records whose lease ended, leased anew: id, record, lines triples
    /// (the lines a take kept apart for a record that names only the events won, else empty).
    pub async fn take_over(&self, now_ms: i64, max: usize) -> redis::RedisResult<Vec<String>> {
        self.take_over
            .key(&self.zset)
            .key(&self.records)
            .arg(now_ms)
            .arg(max)
            .arg(now_ms + lease_ms())
            .invoke_async(&mut self.conn.clone())
            .await
    }

    /// The command that rewrites record `id` to `stored` (whole: lines its take kept apart stay
    /// until it is cleared, unread).
    pub fn rewrite(&self, id: &str, stored: &str) -> redis::Cmd {
        let mut c = redis::cmd("HSET");
        c.arg(&self.records).arg(id).arg(stored);
        c
    }

    /// The commands that clear records `ids`, with the lines their takes kept apart.
    pub fn clearing(&self, ids: &[&str]) -> [redis::Cmd; 2] {
        let mut z = redis::cmd("ZREM");
        z.arg(&self.zset).arg(ids);
        let mut h = redis::cmd("HDEL");
        h.arg(&self.records).arg(ids).arg(lines_apart(ids));
        [z, h]
    }

    /// The commands that store record `id` as `stored`, due at `due_ms`.
    pub fn putting(&self, id: &str, stored: &str, due_ms: i64) -> [redis::Cmd; 2] {
        let mut h = redis::cmd("HSET");
        h.arg(&self.records).arg(id).arg(stored);
        let mut z = redis::cmd("ZADD");
        z.arg(&self.zset).arg(due_ms).arg(id);
        [h, z]
    }

    /// Runs commands of the above in one transaction.
    pub async fn apply(&self, cmds: Vec<redis::Cmd>) -> redis::RedisResult<()> {
        if cmds.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for c in cmds {
            pipe.add_command(c).ignore();
        }
        pipe.exec_async(&mut self.conn.clone()).await
    }

    /// Clears records `ids`, with the lines their takes kept apart.
    pub async fn clear(&self, ids: &[String]) -> redis::RedisResult<()> {
        redis::pipe()
            .cmd("ZREM")
            .arg(&self.zset)
            .arg(ids)
            .ignore()
            .cmd("HDEL")
            .arg(&self.records)
            .arg(ids)
            .arg(lines_apart(ids))
            .ignore()
            .exec_async(&mut self.conn.clone())
            .await
    }

    /// Puts record `id` back as `stored`, due at `due_ms`, if it is still there.
    pub async fn retry(&self, id: &str, due_ms: i64, stored: &str) -> redis::RedisResult<()> {
        self.retry
            .key(&self.zset)
            .key(&self.records)
            .arg(id)
            .arg(due_ms)
            .arg(stored)
            .invoke_async::<()>(&mut self.conn.clone())
            .await
    }

    /// Makes records `ids` due at `due_ms` (only those still there).
    pub async fn set_due(&self, ids: &[String], due_ms: i64) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(&self.zset).arg("XX");
        for id in ids {
            zadd.arg(due_ms).arg(id);
        }
        zadd.exec_async(&mut self.conn.clone()).await
    }

    /// Records waiting or in hand.
    pub async fn len(&self) -> redis::RedisResult<i64> {
        redis::cmd("ZCARD")
            .arg(&self.zset)
            .query_async(&mut self.conn.clone())
            .await
    }
}

crate::keyspace::commands::declare! {
    /// The commands the intake sends, its scripts' included ([`crate::keyspace::commands`]).
    const WHY = "intake: claims and taken events";
    const SCRIPT = "intake: claims and taken events (script)";
    [
        Use::new(Server::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Server::State, "evalsha", WHY)
            .on(Keys::State("intake"), Access::ReadWrite)
            .args("{sha} 2 {prefix}intake {prefix}intake:events"),
        // A detail read's retry moved into its own record when no job is stored with it.
        Use::new(Server::State, "multi", WHY),
        Use::new(Server::State, "exec", WHY),
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("intake"), Access::Write)
            .args("{key} XX 0 id"),
        Use::new(Server::State, "zscore", WHY)
            .on(Keys::State("intake"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("intake"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "zcard", WHY)
            .on(Keys::State("intake"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zrange", SCRIPT)
            .on(Keys::State("intake"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1"),
        Use::new(Server::State, "zrange", "intake: when the first lease ends (an idle instance)")
            .on(Keys::State("intake"), Access::Read)
            .args("{key} -inf +inf BYSCORE LIMIT 0 1 WITHSCORES"),
        Use::new(Server::State, "hset", WHY)
            .on(Keys::State("intake:events"), Access::Write)
            .args("{key} id r"),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("intake:events"), Access::ReadWrite)
            .args("{key} id"),
        Use::new(Server::State, "hmget", SCRIPT)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key} k"),
        // A long key, read where it is kept rather than carried in the arguments.
        Use::new(Server::State, "get", SCRIPT)
            .on(Keys::State("long:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "hget", SCRIPT)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key} k"),
        Use::new(Server::State, "exists", SCRIPT)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "hdel", SCRIPT)
            .on(Keys::State("ledger:*:at:*"), Access::ReadWrite)
            .args("{key} k"),
        Use::new(Server::State, "zrem", SCRIPT)
            .on(Keys::State("ledger:*:poked"), Access::Write)
            .args("{key} k"),
        Use::new(Server::State, "hget", SCRIPT)
            .on(Keys::State("ledger:*:poked-deadline"), Access::Read)
            .args("{key} k"),
        Use::new(Server::State, "hmget", SCRIPT)
            .on(Keys::State("ledger:*:poked-deadline"), Access::Read)
            .args("{key} k"),
        Use::new(Server::State, "hdel", SCRIPT)
            .on(Keys::State("ledger:*:poked-deadline"), Access::ReadWrite)
            .args("{key} k"),
        Use::new(Server::State, "hset", SCRIPT)
            .on(Keys::State("ledger:*:handled:*"), Access::Write)
            .args("{key} k 0"),
        Use::new(Server::State, "pexpireat", SCRIPT)
            .on(Keys::State("ledger:*:handled:*"), Access::Write)
            .args("{key} 1000"),
        Use::new(Server::State, "hget", SCRIPT)
            .on(Keys::State("ledger:*:handled:*"), Access::Read)
            .args("{key} k"),
        Use::new(Server::State, "hsetnx", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Write)
            .args("{key} id 1"),
        Use::new(Server::State, "pexpiretime", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "pexpireat", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Write)
            .args("{key} 1000"),
        // A placed claim's hash lasts ten minutes after its last claim.
        Use::new(Server::State, "pexpire", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Write)
            .args("{key} 1000"),
        Use::new(Server::State, "set", SCRIPT)
            .on(Keys::State("claim:*"), Access::Write)
            .args("{key} 1 NX PX 1000"),
        // A placed claim yields to a claim by name of an instance before places (an upgrade).
        Use::new(Server::State, "get", SCRIPT)
            .on(Keys::State("claim:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "set", SCRIPT)
            .on(Keys::State("warned:*"), Access::Write)
            .args("{key} 1 NX PXAT 1"),
        Use::new(Server::State, "hget", SCRIPT)
            .on(Keys::State("fields:*:h:*"), Access::Read)
            .args("{key} f"),
        Use::new(Server::State, "hget", SCRIPT)
            .on(Keys::State("fields:*:hl:*"), Access::Read)
            .args("{key} f"),
        Use::new(Server::State, "hdel", SCRIPT)
            .on(Keys::State("fields:*"), Access::ReadWrite)
            .args("{key} f"),
        // A long hash's name leaves with the last field of its index.
        Use::new(Server::State, "hlen", SCRIPT)
            .on(Keys::State("fields:*:hl:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "del", SCRIPT)
            .on(Keys::State("fields:*:name:*"), Access::Write)
            .args("{key}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long key's warning claim is short and its own; a short key's names the key.
    #[test]
    fn a_long_key_s_warning_claim_is_named_by_its_hash() {
        let long = |c: u8| vec![c; crate::long_key::EXACT + 1];
        let a = warned("kw:", 0, "soon", 5, &long(b'a'));
        let b = warned("kw:", 0, "soon", 5, &long(b'b'));
        assert!(a.len() < 128, "{}", a.len());
        assert!(a.starts_with(b"kw:warned:long:0:soon:5:"));
        assert_ne!(a, b);
        assert_eq!(
            warned("kw:", 1, "soon", 5, b"lock:1"),
            b"kw:warned:1:soon:5:lock:1"
        );
    }
}
