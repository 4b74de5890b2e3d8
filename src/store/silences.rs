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
    /// The SHA-256 (hex) of the exact key muted, from a signed link, which names the key by it
    /// whatever its length; when set it governs, and `key` and `pattern` only show the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_sha256: Option<String>,
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

    /// The key's hash it names, when it names one and it is a SHA-256 in hex.
    pub fn key_digest(&self) -> Option<Result<[u8; 32], String>> {
        let hex = self.key_sha256.as_deref()?;
        let mut out = [0u8; 32];
        Some(
            hex::decode_to_slice(hex, &mut out)
                .map(|()| out)
                .map_err(|_| format!("`key_sha256` `{hex:.80}` is not a SHA-256 in hex")),
        )
    }

    /// Why this silence, as stored, must not act, if it must not
    /// (docs/redis.md#keep-applications-out-of-keywatchs-state). Only a silence whose scope
    /// reads (a SHA-256 in hex, a key in base64, a pattern that parses) and whose time span
    /// starts no later than now (a minute's leeway for clocks) and ends after it starts mutes
    /// anything, and only its own rule's events. A silence written into keywatch's state by
    /// hand passes these as easily as `keywatch silence add` does: what keeps one out is the
    /// ACL of docs/redis.md; this keeps one that does not read from muting anything.
    pub fn refused(&self, now: DateTime<Utc>) -> Option<String> {
        if let Some(Err(e)) = self.key_digest() {
            return Some(e);
        }
        if let Some(Err(_)) = self.exact_key() {
            return Some("its `key` is not base64".into());
        }
        if self.key_digest().is_none()
            && self.exact_key().is_none()
            && let Some(e) = self.invalid_pattern()
        {
            return Some(format!("its pattern does not parse: {e}"));
        }
        if self.created > now + chrono::Duration::minutes(1) {
            return Some(format!(
                "it was made at {}, after now",
                crate::firing::rfc3339(self.created)
            ));
        }
        if self.until <= self.created {
            return Some("it ends before it starts".into());
        }
        None
    }

    /// The key it mutes, for people, when it names one: as it was shown (a link's key,
    /// from history), and by its hash when it names the key by one.
    pub fn key_shown(&self) -> Option<String> {
        let sha = self
            .key_sha256
            .as_deref()
            .map(|h| format!(" (sha256 {:.12})", h));
        match (self.exact_key(), &sha) {
            (Some(Ok(key)), _) => Some(format!(
                "{}{}",
                crate::event::printable(&key),
                sha.clone().unwrap_or_default()
            )),
            (_, Some(sha)) => Some(match self.pattern.as_deref() {
                Some(p) => format!("{}{sha}", crate::event::printable(p.as_bytes())),
                None => sha.trim_start().to_string(),
            }),
            _ => None,
        }
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
        Use::new(Server::State, "hdel", "silences")
            .on(Keys::State("silences"), Access::ReadWrite)
            .args("{key} id"),

    ]
}
