//! Silences as kept in Redis: one hash, `{prefix}silences` (id → the silence's JSON), shared by
//! every instance; `keywatch silence` and the links page write it, the engine reads it every
//! second (`src/engine/silences.rs`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::keyspace::Conn;
use crate::pattern::Pattern;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Silence {
    pub id: String,
    pub rule: String,
    /// A pattern (`docs/rules.md#patterns`) the key must match too; `None`: every key of the rule.
    #[serde(rename = "match")]
    pub pattern: Option<String>,
    /// The exact key muted (base64: keys are bytes), from a signed link; when set it governs and
    /// `pattern` only spells the key for people (and older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub until: DateTime<Utc>,
    pub comment: String,
    pub created: DateTime<Utc>,
    pub by: String,
}

impl Silence {
    pub fn active(&self, now: DateTime<Utc>) -> bool {
        now < self.until
    }

    /// The exact key muted, when the silence names one (a link's); an error when the stored
    /// field is not base64 (written by hand), and then the silence mutes nothing.
    pub fn exact_key(&self) -> Option<Result<Vec<u8>, base64::DecodeError>> {
        use base64::Engine;
        let key = self.key.as_deref()?;
        Some(base64::engine::general_purpose::STANDARD.decode(key))
    }

    /// Why the stored pattern cannot be used, if it cannot: written by another version, or by
    /// hand, it no longer parses. Such a silence mutes nothing.
    pub fn invalid_pattern(&self) -> Option<String> {
        let p = self.pattern.as_deref()?;
        Pattern::parse(p).err().map(|e| e.message)
    }
}

/// The hash of silences.
pub fn hash(prefix: &str) -> String {
    format!("{prefix}silences")
}

pub async fn list(conn: &mut Conn, prefix: &str) -> redis::RedisResult<Vec<Silence>> {
    let raw: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(hash(prefix))
        .query_async(conn)
        .await?;
    let mut out: Vec<Silence> = raw
        .into_iter()
        .filter_map(|(_, v)| serde_json::from_str(&v).ok())
        .collect();
    out.sort_by_key(|s| s.until);
    Ok(out)
}

pub async fn add(conn: &mut Conn, prefix: &str, s: &Silence) -> redis::RedisResult<()> {
    let json = serde_json::to_string(s).unwrap_or_default();
    redis::cmd("HSET")
        .arg(hash(prefix))
        .arg(&s.id)
        .arg(json)
        .exec_async(conn)
        .await
}

/// Adds `s` unless a silence with its id exists; false when one did (a link replayed).
pub async fn add_once(conn: &mut Conn, prefix: &str, s: &Silence) -> redis::RedisResult<bool> {
    let json = serde_json::to_string(s).unwrap_or_default();
    redis::cmd("HSETNX")
        .arg(hash(prefix))
        .arg(&s.id)
        .arg(json)
        .query_async(conn)
        .await
}

/// Removes a silence; false when there was none with that id.
pub async fn remove(conn: &mut Conn, prefix: &str, id: &str) -> redis::RedisResult<bool> {
    let n: i64 = redis::cmd("HDEL")
        .arg(hash(prefix))
        .arg(id)
        .query_async(conn)
        .await?;
    Ok(n > 0)
}

/// Drops silences that have ended, so the hash does not grow forever.
pub async fn expire(conn: &mut Conn, prefix: &str) -> redis::RedisResult<usize> {
    let now = Utc::now();
    let ended: Vec<String> = list(conn, prefix)
        .await?
        .into_iter()
        .filter(|s| !s.active(now))
        .map(|s| s.id)
        .collect();
    if !ended.is_empty() {
        redis::cmd("HDEL")
            .arg(hash(prefix))
            .arg(&ended)
            .exec_async(conn)
            .await?;
    }
    Ok(ended.len())
}

/// A short random id people can type.
pub fn new_id() -> String {
    format!("{:08x}", fastrand::u32(..))
}

crate::keyspace::commands::declare! {
    /// The commands silences send, `keywatch silence`'s included ([`crate::keyspace::commands`]).
    [
        Use::new(Server::State, "hgetall", "silences")
            .on(Keys::State("silences"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "hset", "silences")
            .on(Keys::State("silences"), Access::Write)
            .args("{key} id silence"),
        Use::new(Server::State, "hsetnx", "silences: from a signed link")
            .on(Keys::State("silences"), Access::Write)
            .args("{key} id silence"),
        Use::new(Server::State, "hdel", "silences")
            .on(Keys::State("silences"), Access::ReadWrite)
            .args("{key} id"),

    ]
}
