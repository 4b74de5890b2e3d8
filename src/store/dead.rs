//! Dead letters: actions that failed for good (a permanent error, or 24 h of retries), kept in
//! Redis so nothing is dropped silently: `{prefix}dead` (id → the dead letter's JSON) and
//! `{prefix}dead:index` (ids by when they died, the oldest dropped beyond [`KEEP`]).
//! `keywatch dead list|retry|drop` inspects, re-drives and discards them.
//!
//! A re-driven letter goes back into the durable queue (`store::queue`) in the same script
//! that takes it out of the store: its job due at once, or a digest's notifications in their
//! window, so it is retried, rate-limited and taken over after a crash like any other job, and
//! waits there when no instance runs (docs/operations.md#silences-and-dead-letters).

use std::collections::HashMap;
use std::sync::Arc;

use crate::firing::{Action, Job};
use crate::keyspace::Conn;
use crate::store::queue::{Entry, Window, keys as queue_keys};

pub use crate::firing::DeadLetter;

/// How many dead letters are kept; beyond that the oldest go (and the log still has them).
pub const KEEP: usize = 10_000;

/// Moves letters into the queue, each by whoever removes it (see the script).
const REDRIVE: &str = include_str!("dead/redrive.lua");

/// Letters moved per script call: a digest's letter can hold thousands of events.
const REDRIVE_BATCH: usize = 50;

/// What `dead retry` did.
#[derive(Debug, Default, PartialEq)]
pub struct Retried {
    /// Letters put back in the queue.
    pub moved: usize,
    /// Letters kept because they hold nothing to send again (a stored job this version could
    /// not read), by id.
    pub kept: Vec<String>,
}

#[derive(Clone)]
pub struct DeadStore {
    conn: Conn,
    prefix: String,
}

impl DeadStore {
    pub fn new(conn: Conn, prefix: &str) -> DeadStore {
        DeadStore {
            conn,
            prefix: prefix.to_string(),
        }
    }

    fn hash(&self) -> String {
        format!("{}dead", self.prefix)
    }

    fn index(&self) -> String {
        format!("{}dead:index", self.prefix)
    }

    /// The commands that keep `d`, for the transaction that also takes its job out of the
    /// queue: the letter is kept exactly when its job is gone. [`DeadStore::trim`] after it.
    pub fn store_cmds(&self, d: &DeadLetter) -> Vec<redis::Cmd> {
        let json = serde_json::to_string(d).unwrap_or_default();
        let mut hset = redis::cmd("HSET");
        hset.arg(self.hash()).arg(&d.id).arg(json);
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(self.index())
            .arg(d.at.timestamp_millis())
            .arg(&d.id);
        vec![hset, zadd]
    }

    /// Keeps `d` on its own (a firing whose actions never became jobs).
    pub async fn store(&self, d: &DeadLetter) -> redis::RedisResult<()> {
        let mut pipe = redis::pipe();
        for cmd in self.store_cmds(d) {
            pipe.add_command(cmd).ignore();
        }
        pipe.exec_async(&mut self.conn.clone()).await?;
        self.trim().await
    }

    /// Drops the oldest letters beyond [`KEEP`].
    pub async fn trim(&self) -> redis::RedisResult<()> {
        let mut c = self.conn.clone();
        let n: usize = redis::cmd("ZCARD")
            .arg(self.index())
            .query_async(&mut c)
            .await?;
        if n > KEEP {
            let oldest: Vec<(String, f64)> = redis::cmd("ZPOPMIN")
                .arg(self.index())
                .arg(n - KEEP)
                .query_async(&mut c)
                .await?;
            let ids: Vec<String> = oldest.into_iter().map(|(id, _)| id).collect();
            redis::cmd("HDEL")
                .arg(self.hash())
                .arg(&ids)
                .exec_async(&mut c)
                .await?;
        }
        Ok(())
    }

    /// Newest first.
    pub async fn list(&self, limit: usize) -> redis::RedisResult<Vec<DeadLetter>> {
        let mut c = self.conn.clone();
        let ids: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.index())
            .arg(0)
            .arg(limit.saturating_sub(1))
            .arg("REV")
            .query_async(&mut c)
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let letters = self.read(&ids).await?;
        Ok(letters)
    }

    /// The letters stored under `ids` (gone ones skipped).
    async fn read(&self, ids: &[String]) -> redis::RedisResult<Vec<DeadLetter>> {
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.hash())
            .arg(ids)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(raw
            .into_iter()
            .flatten()
            .filter_map(|j| serde_json::from_str(&j).ok())
            .collect())
    }

    /// Every id, or those given.
    async fn select(&self, ids: &[String]) -> redis::RedisResult<Vec<String>> {
        if !ids.is_empty() {
            return Ok(ids.to_vec());
        }
        redis::cmd("ZRANGE")
            .arg(self.index())
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Takes the letters out (all when `ids` is empty); returns what was there.
    async fn take(&self, ids: &[String]) -> redis::RedisResult<Vec<DeadLetter>> {
        let ids = self.select(ids).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.conn.clone();
        let letters = self.read(&ids).await?;
        redis::pipe()
            .cmd("HDEL")
            .arg(self.hash())
            .arg(&ids)
            .ignore()
            .cmd("ZREM")
            .arg(self.index())
            .arg(&ids)
            .ignore()
            .exec_async(&mut c)
            .await?;
        Ok(letters)
    }

    /// Puts the letters back in the queue (all when `ids` is empty), each in the script that
    /// takes it out of the store, so two `dead retry` at once send it once.
    pub async fn retry(&self, ids: &[String]) -> redis::RedisResult<Retried> {
        let ids = self.select(ids).await?;
        let mut out = Retried::default();
        for chunk in ids.chunks(REDRIVE_BATCH) {
            let letters = self.read(chunk).await?;
            let mut batch = Vec::new();
            for d in letters {
                let entries = entries(&self.prefix, &d);
                if entries.is_empty() {
                    out.kept.push(d.id);
                } else {
                    batch.push((d.id, entries));
                }
            }
            out.moved += self.move_to_queue(batch).await?;
        }
        Ok(out)
    }

    /// Runs the script for `letters` (each its id, with its entries).
    async fn move_to_queue(&self, letters: Vec<(String, Vec<Entry>)>) -> redis::RedisResult<usize> {
        if letters.is_empty() {
            return Ok(0);
        }
        let script = redis::Script::new(REDRIVE);
        let mut inv = script.prepare_invoke();
        inv.key(self.hash())
            .key(self.index())
            .key(queue_keys::jobs(&self.prefix))
            .key(queue_keys::windows(&self.prefix));
        // Each sorted set once among the keys, after the four above.
        let mut zsets: HashMap<String, usize> = HashMap::new();
        for (letter, entries) in &letters {
            inv.arg(letter).arg(entries.len());
            for e in entries {
                let next = 5 + zsets.len();
                let index = *zsets.entry(e.zset.clone()).or_insert_with(|| {
                    inv.key(&e.zset);
                    next
                });
                inv.arg(index)
                    .arg(&e.id)
                    .arg(&e.payload)
                    .arg(e.window.as_deref().unwrap_or(""));
            }
        }
        inv.invoke_async(&mut self.conn.clone()).await
    }

    /// Discards the letters; returns how many.
    pub async fn drop_letters(&self, ids: &[String]) -> redis::RedisResult<usize> {
        Ok(self.take(ids).await?.len())
    }
}

/// What puts `d`'s work back: its job in the queue; for a digest, its notifications in their
/// window, sent as one digest again. Nothing for a letter that kept no event.
fn entries(prefix: &str, d: &DeadLetter) -> Vec<Entry> {
    let jobs: Vec<Job> = d
        .firings
        .iter()
        .map(|f| Job::first(Arc::new(f.clone()), d.action.clone()))
        .collect();
    match (&d.action, d.digest) {
        (Action::Notify { channel }, true) => {
            let w = Window {
                rule: d.rule.clone(),
                channel: channel.clone(),
            };
            Entry::window(prefix, &w, &jobs)
        }
        // One job's letter keeps its one firing.
        _ => jobs.iter().take(1).map(|j| Entry::job(prefix, j)).collect(),
    }
}

crate::keyspace::commands::declare! {
    /// The commands dead letters send, `keywatch dead`'s included ([`crate::keyspace::commands`]).
    const WHY = "dead letters";
    const RETRY = "dead letters: retry";
    [
        Use::new(Server::State, "hset", WHY)
            .on(Keys::State("dead"), Access::Write)
            .args("{key} id letter"),
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("dead:index"), Access::Write)
            .args("{key} 0 id"),
        Use::new(Server::State, "zcard", WHY)
            .on(Keys::State("dead:index"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zpopmin", WHY)
            .on(Keys::State("dead:index"), Access::ReadWrite)
            .args("{key} 1"),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("dead"), Access::ReadWrite)
            .args("{key} id"),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("dead:index"), Access::Read)
            .args("{key} 0 0 REV"),
        Use::new(Server::State, "hmget", WHY)
            .on(Keys::State("dead"), Access::Read)
            .args("{key} id"),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("dead:index"), Access::Write)
            .args("{key} id"),
        // `dead retry` moves letters into the queue in one script per batch.
        Use::new(Server::State, "script|load", RETRY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Server::State, "evalsha", RETRY)
            .on(Keys::State("dead"), Access::ReadWrite)
            .args("{sha} 5 {key} {prefix}dead:index {prefix}queue:jobs {prefix}groups {prefix}queue"),
        Use::new(Server::State, "hsetnx", RETRY)
            .on(Keys::State("queue:jobs"), Access::Write)
            .args("{key} id job"),
        Use::new(Server::State, "zadd", RETRY)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} NX 0 id"),
        Use::new(Server::State, "zadd", RETRY)
            .on(Keys::State("group:*:*"), Access::Write)
            .args("{key} NX 0 id"),
        Use::new(Server::State, "sadd", RETRY)
            .on(Keys::State("groups"), Access::Write)
            .args("{key} w"),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::queue::keys;

    fn letter(key: &str, digest: bool, n: usize) -> DeadLetter {
        let firings = (0..n)
            .map(|i| crate::firing::expiry("r", &format!("{key}{i}"), "2026-01-01T00:00:00Z"))
            .collect();
        let action = Action::Notify {
            channel: "hook".into(),
        };
        DeadLetter::new("r", key.into(), action, "HTTP 404", firings, digest)
    }

    async fn zcard(conn: &Conn, key: &str) -> i64 {
        redis::cmd("ZCARD")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    /// Two `dead retry` at once: each letter is moved by one of them, and queued once.
    #[tokio::test]
    async fn a_letter_retried_twice_at_once_is_queued_once() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let store = DeadStore::new(conn.clone(), "kw:");
        for i in 0..20 {
            store
                .store(&letter(&format!("k{i}:"), false, 1))
                .await
                .unwrap();
        }
        let (a, b) = tokio::join!(store.retry(&[]), store.retry(&[]));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.moved + b.moved, 20, "{a:?} {b:?}");
        assert_eq!(zcard(&conn, &keys::queue("kw:")).await, 20);
        assert!(store.list(100).await.unwrap().is_empty());
        // Due at once, whatever the clock of whoever retried says.
        let due: i64 = redis::cmd("ZCOUNT")
            .arg(keys::queue("kw:"))
            .arg("-inf")
            .arg(0)
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(due, 20);
    }

    /// A digest's letter goes into its window, one member per bundle, and the window is listed;
    /// a letter that kept no event stays a dead letter.
    #[tokio::test]
    async fn a_digest_goes_into_its_window_and_an_empty_letter_is_kept() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let store = DeadStore::new(conn.clone(), "kw:");
        store.store(&letter("burst:", true, 1500)).await.unwrap();
        let empty = letter("job 1", false, 0);
        store.store(&empty).await.unwrap();
        let r = store.retry(&[]).await.unwrap();
        assert_eq!(r.moved, 1);
        assert_eq!(r.kept, std::slice::from_ref(&empty.id));
        assert_eq!(zcard(&conn, &keys::window("kw:", "r", "hook")).await, 2);
        let windows: Vec<String> = redis::cmd("SMEMBERS")
            .arg(keys::windows("kw:"))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(windows, [r#"["r","hook"]"#]);
        let left = store.list(10).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].id, empty.id);
    }
}
