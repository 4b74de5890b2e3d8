//! Silences: mute a rule (optionally only keys matching a pattern) for a while, kept in Redis so
//! that every instance obeys them ([`crate::store::silences`]); silenced events are counted, not
//! sent.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::keyspace::Conn;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::pattern::Pattern;

pub use crate::store::silences::{Silence, add, add_once, expire, list, new_id, remove};

/// Which keys of its rule a silence mutes, compiled once.
enum Scope {
    Every,
    Matching(Box<Pattern>),
    /// Exactly these bytes.
    Key(Vec<u8>),
    /// A pattern that does not parse: muting every key instead would silence far more than
    /// anyone asked for, so it mutes none.
    Invalid,
}

/// The active silences, compiled, as the engine reads them.
#[derive(Default)]
pub struct Active {
    list: RwLock<Vec<(Silence, Scope)>>,
}

impl Active {
    /// Whether an event of `rule` on `key` is silenced now.
    pub fn mutes(&self, rule: &str, key: &[u8]) -> bool {
        let now = Utc::now();
        let list = self.list.read().unwrap_or_else(|p| p.into_inner());
        list.iter().any(|(s, scope)| {
            s.rule == rule
                && s.active(now)
                && match scope {
                    Scope::Every => true,
                    Scope::Matching(p) => p.is_match(key),
                    Scope::Key(k) => k == key,
                    Scope::Invalid => false,
                }
        })
    }

    /// The silences in force now, soonest to end first.
    pub fn current(&self) -> Vec<Silence> {
        let now = Utc::now();
        let list = self.list.read().unwrap_or_else(|p| p.into_inner());
        list.iter()
            .filter(|(s, _)| s.active(now))
            .map(|(s, _)| s.clone())
            .collect()
    }

    fn set(&self, silences: Vec<Silence>) {
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        let compiled = silences
            .into_iter()
            .map(|s| {
                if let Some(key) = s.exact_key() {
                    let scope = match key {
                        Ok(k) => Scope::Key(k),
                        Err(_) => Scope::Invalid,
                    };
                    return (s, scope);
                }
                let scope = match s.pattern.as_deref().map(Pattern::parse) {
                    None => Scope::Every,
                    Some(Ok(p)) => Scope::Matching(Box::new(p)),
                    Some(Err(e)) => {
                        // Read every second: said once, when it first appears.
                        let known = list
                            .iter()
                            .any(|(old, scope)| old.id == s.id && matches!(scope, Scope::Invalid));
                        if !known {
                            tracing::warn!(silence = %s.id, rule = %s.rule, pattern = ?s.pattern, error = %e.message, "A stored silence has a pattern that does not parse; it is ignored (it mutes nothing). Remove it with `keywatch silence remove`.");
                        }
                        Scope::Invalid
                    }
                };
                (s, scope)
            })
            .collect();
        *list = compiled;
    }
}

/// Keeps `active` current (every second) until `stop`: a silence added anywhere applies within
/// a second, and one that ends is lifted at its `until`, checked at each event.
pub async fn follow(mut conn: Conn, prefix: String, active: Arc<Active>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => match list(&mut conn, &prefix).await {
                Ok(all) => active.set(all),
                Err(e) => tracing::warn!(error = %e, "Cannot read silences; keeping the last known ones."),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silences_mute_their_rule_and_pattern_until_they_end() {
        let now = Utc::now();
        let s = |rule: &str, pattern: Option<&str>, secs: i64| Silence {
            id: new_id(),
            rule: rule.into(),
            pattern: pattern.map(Into::into),
            key: None,
            until: now + chrono::Duration::seconds(secs),
            comment: String::new(),
            created: now,
            by: "test".into(),
        };
        let a = Active::default();
        a.set(vec![s("locks", Some("lock:42*"), 60), s("cache", None, -1)]);
        assert!(a.mutes("locks", b"lock:421"));
        assert!(!a.mutes("locks", b"lock:7"));
        assert!(!a.mutes("other", b"lock:42"));
        assert!(!a.mutes("cache", b"cache:1"), "ended silences do not mute");
    }

    #[test]
    fn a_silence_whose_pattern_does_not_parse_mutes_nothing() {
        let now = Utc::now();
        let broken = Silence {
            id: "bad".into(),
            rule: "locks".into(),
            pattern: Some("lock:{".into()),
            key: None,
            until: now + chrono::Duration::seconds(60),
            comment: String::new(),
            created: now,
            by: "test".into(),
        };
        assert!(broken.invalid_pattern().is_some());
        let a = Active::default();
        a.set(vec![broken.clone()]);
        a.set(vec![broken]);
        assert!(!a.mutes("locks", b"lock:1"));
        assert!(!a.mutes("locks", b"lock:{"));
        assert_eq!(a.current().len(), 1, "still listed, to be seen and removed");
    }
}
