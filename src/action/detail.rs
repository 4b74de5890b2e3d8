//! `detail`: what the key's value can no longer tell, read from beside it when the event is taken.
//!
//! Read once per event, for a whole batch of events in one pipeline per database (a mass expiry
//! of 100,000 delayed tasks must not cost 100,000 round trips), stored with the firing so
//! retries use the same copy, and removed only after the firings are handed on.

use std::collections::BTreeMap;

use crate::config::{DetailSource, Rule};
use crate::template::Context;
use crate::template::TemplateSet;

/// Where one event's detail lives, rendered to exact key bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Hash { key: Vec<u8>, field: Vec<u8> },
    Key { key: Vec<u8> },
}

impl Location {
    /// `hash_cmd key field` or `key_cmd key`: reading (HGET/GET) or removing (HDEL/UNLINK).
    fn command(&self, hash_cmd: &str, key_cmd: &str) -> redis::Cmd {
        match self {
            Location::Hash { key, field } => {
                let mut c = redis::cmd(hash_cmd);
                c.arg(key).arg(field);
                c
            }
            Location::Key { key } => {
                let mut c = redis::cmd(key_cmd);
                c.arg(key);
                c
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    pub db: u32,
    pub at: Location,
    pub remove: bool,
}

/// Renders the rule's `detail` location for one event.
pub fn request(
    templates: &TemplateSet,
    rule: &Rule,
    db: u32,
    ctx: &Context,
) -> Option<Result<Request, String>> {
    let d = rule.detail.as_ref()?;
    let render = |id| {
        templates
            .render(id, ctx)
            .map_err(|e| format!("detail: {}", e.message))
    };
    let at = match &d.source {
        DetailSource::Hash { key, field } => match (render(*key), render(*field)) {
            (Ok(key), Ok(field)) => Location::Hash { key, field },
            (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
        },
        DetailSource::Key { key } => match render(*key) {
            Ok(key) => Location::Key { key },
            Err(e) => return Some(Err(e)),
        },
    };
    Some(Ok(Request {
        db,
        at,
        remove: d.remove,
    }))
}

/// The detail as templates see it: parsed JSON when it is JSON, else its text.
pub fn parse(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned()))
}

/// Reads every request, one pipeline per database (one command per key on a cluster); the answers are in request order
/// (`Ok(None)`: nothing there).
pub async fn fetch(
    keyspace: &crate::keyspace::Keyspace,
    reqs: &[Request],
) -> Vec<Result<Option<Vec<u8>>, String>> {
    let mut out: Vec<Result<Option<Vec<u8>>, String>> = vec![Ok(None); reqs.len()];
    let mut by_db: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, r) in reqs.iter().enumerate() {
        by_db.entry(r.db).or_default().push(i);
    }
    for (db, idx) in by_db {
        let cmds = idx
            .iter()
            .map(|&i| reqs[i].at.command("HGET", "GET"))
            .collect();
        let answer: Result<Vec<Option<Vec<u8>>>, String> = match keyspace.conn(db).await {
            Ok(c) => c
                .each(cmds)
                .await
                .map_err(|e| format!("detail: Redis: {e}")),
            Err(e) => Err(format!("detail: Redis: {e}")),
        };
        match answer {
            Ok(values) => {
                for (&i, v) in idx.iter().zip(values) {
                    out[i] = Ok(v);
                }
            }
            Err(e) => {
                for &i in &idx {
                    out[i] = Err(e.clone());
                }
            }
        }
    }
    out
}

/// Deletes the details marked `remove`, one pipeline per database.
pub async fn remove(keyspace: &crate::keyspace::Keyspace, reqs: &[&Request]) -> Result<(), String> {
    let mut by_db: BTreeMap<u32, Vec<redis::Cmd>> = BTreeMap::new();
    for r in reqs.iter().filter(|r| r.remove) {
        by_db
            .entry(r.db)
            .or_default()
            .push(r.at.command("HDEL", "UNLINK"));
    }
    for (db, cmds) in by_db {
        let c = keyspace
            .conn(db)
            .await
            .map_err(|e| format!("detail removal: Redis: {e}"))?;
        c.each::<redis::Value>(cmds)
            .await
            .map_err(|e| format!("detail removal: Redis: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_details_are_parsed_and_text_is_kept() {
        assert_eq!(
            parse(br#"{"order_id": 1}"#),
            serde_json::json!({"order_id": 1})
        );
        assert_eq!(parse(b"plain text"), serde_json::json!("plain text"));
        assert_eq!(parse(b"\xff"), serde_json::json!("\u{fffd}"));
    }
}
