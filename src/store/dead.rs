//! Dead letters: actions that failed for good (a permanent error, or 24 h of retries), kept in
//! Redis so nothing is dropped silently: `{prefix}dead` (id → the dead letter's JSON),
//! `{prefix}dead:index` (ids by when they died, the oldest dropped beyond [`KEEP`]) and
//! `{prefix}dead:redrive` (a list of ids to run again). `keywatch dead list|retry|drop` inspects, re-drives and
//! discards them; a running instance picks re-driven ones up within a second.

use crate::keyspace::Conn;

pub use crate::firing::DeadLetter;

/// How many dead letters are kept; beyond that the oldest go (and the log still has them).
pub const KEEP: usize = 10_000;

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

    fn redrive_list(&self) -> String {
        format!("{}dead:redrive", self.prefix)
    }

    pub async fn store(&self, d: &DeadLetter) -> redis::RedisResult<()> {
        let mut c = self.conn.clone();
        let json = serde_json::to_string(d).unwrap_or_default();
        redis::pipe()
            .cmd("HSET")
            .arg(self.hash())
            .arg(&d.id)
            .arg(json)
            .ignore()
            .cmd("ZADD")
            .arg(self.index())
            .arg(d.at.timestamp_millis())
            .arg(&d.id)
            .ignore()
            .exec_async(&mut c)
            .await?;
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

    /// Hands the letters to the running instances to try again; returns how many.
    pub async fn retry(&self, ids: &[String]) -> redis::RedisResult<usize> {
        let letters = self.take(ids).await?;
        if letters.is_empty() {
            return Ok(0);
        }
        let jsons: Vec<String> = letters
            .iter()
            .map(|d| serde_json::to_string(d).unwrap_or_default())
            .collect();
        redis::cmd("LPUSH")
            .arg(self.redrive_list())
            .arg(&jsons)
            .exec_async(&mut self.conn.clone())
            .await?;
        Ok(letters.len())
    }

    /// Discards the letters; returns how many.
    pub async fn drop_letters(&self, ids: &[String]) -> redis::RedisResult<usize> {
        Ok(self.take(ids).await?.len())
    }

    /// Letters waiting to be re-driven, up to `max`.
    pub async fn take_redriven(&self, max: usize) -> redis::RedisResult<Vec<DeadLetter>> {
        let raw: Option<Vec<String>> = redis::cmd("RPOP")
            .arg(self.redrive_list())
            .arg(max)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(raw
            .unwrap_or_default()
            .into_iter()
            .filter_map(|j| serde_json::from_str(&j).ok())
            .collect())
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
        Use::new(Server::State, "lpush", RETRY)
            .on(Keys::State("dead:redrive"), Access::Write)
            .args("{key} letter"),
        Use::new(Server::State, "rpop", RETRY)
            .on(Keys::State("dead:redrive"), Access::ReadWrite)
            .args("{key} 1"),

    ]
}
