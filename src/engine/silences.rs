//! Silences: mute a rule (optionally only keys matching a pattern) for a while, kept in Redis so
//! that every instance obeys them ([`crate::store::silences`]); silenced events are counted, not
//! sent.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::keyspace::Conn;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::pattern::Pattern;
use sha2::Digest;

pub use crate::store::silences::{Silence, add, expire, list, new_id, remove};

/// Which keys of its rule a silence mutes, compiled once.
enum Scope {
    Every,
    Matching(Box<Pattern>),
    /// Exactly these bytes.
    Key(Vec<u8>),
    /// Exactly the key of this SHA-256 (a signed link's, whatever the key's length).
    Digest([u8; 32]),
    /// A silence that must not act ([`Silence::refused`]: a pattern that does not parse, a
    /// span that ends before it starts…): muting every key instead would silence far more than
    /// anyone asked for, so it mutes none.
    Refused,
}

/// The active silences, compiled, as the engine reads them.
#[derive(Default)]
pub struct Active {
    list: RwLock<Vec<(Silence, Scope)>>,
    /// Told to read them again: a notice that one was added or removed, a resubscription.
    changed: tokio::sync::Notify,
}

/// How often silences are read without a notice: for one written by hand (`HSET`) or by a
/// keywatch older than notices. One added with `keywatch silence` or a link is read at once.
const SAFETY_EVERY: Duration = Duration::from_secs(30);

impl Active {
    /// Reads them again now: one was added or removed ([`crate::store::notices`]), or notices
    /// may have been missed (a resubscription).
    pub fn read_again(&self) {
        self.changed.notify_one();
    }

    /// Whether an event of `rule` on `key` is silenced now.
    pub fn mutes(&self, rule: &str, key: &[u8]) -> bool {
        let now = Utc::now();
        let list = self.list.read().unwrap_or_else(|p| p.into_inner());
        // Hashed once, and only when a silence of the rule names a key by its hash.
        let digest = std::sync::OnceLock::new();
        list.iter().any(|(s, scope)| {
            s.rule == rule
                && s.active(now)
                && match scope {
                    Scope::Every => true,
                    Scope::Matching(p) => p.is_match(key),
                    Scope::Key(k) => k == key,
                    Scope::Digest(d) => {
                        digest.get_or_init(|| <[u8; 32]>::from(sha2::Sha256::digest(key))) == d
                    }
                    Scope::Refused => false,
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
        let now = Utc::now();
        let compiled = silences
            .into_iter()
            .map(|s| {
                if let Some(why) = s.refused(now) {
                    // Read again and again: said once, when it first appears.
                    let known = list
                        .iter()
                        .any(|(old, scope)| old.id == s.id && matches!(scope, Scope::Refused));
                    if !known {
                        tracing::warn!(silence = %s.id, rule = %s.rule, reason = %why, "A stored silence is refused; it mutes nothing. Remove it with `keywatch silence remove`.");
                    }
                    return (s, Scope::Refused);
                }
                let scope = match (s.key_digest(), s.exact_key()) {
                    (Some(Ok(d)), _) => Scope::Digest(d),
                    (_, Some(Ok(k))) => Scope::Key(k),
                    _ => match s.pattern.as_deref().map(Pattern::parse) {
                        Some(Ok(p)) => Scope::Matching(Box::new(p)),
                        // Refused above when it does not parse.
                        Some(Err(_)) => Scope::Refused,
                        None => Scope::Every,
                    },
                };
                (s, scope)
            })
            .collect();
        *list = compiled;
    }
}

/// Keeps `active` current until `stop`: read when told a silence was added or removed (a
/// notice, published by whoever added it: it applies on every instance within milliseconds), after
/// every resubscription, and every [`SAFETY_EVERY`]; one that ends is lifted at its `until`,
/// checked at each event. Read every second before, whether anything changed or not
/// (docs/performance.md#an-idle-instance).
pub async fn follow(mut conn: Conn, prefix: String, active: Arc<Active>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(SAFETY_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
            _ = active.changed.notified() => {}
        }
        match list(&mut conn, &prefix).await {
            Ok(all) => active.set(all),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot read silences; keeping the last known ones, trying again in a second.");
                // Not given up until the next safety round: a notice read nothing.
                tokio::time::sleep(Duration::from_secs(1)).await;
                active.read_again();
            }
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
            key_sha256: None,
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
            key_sha256: None,
            until: now + chrono::Duration::seconds(60),
            comment: String::new(),
            created: now,
            by: "test".into(),
        };
        assert!(broken.invalid_pattern().is_some());
        assert!(broken.refused(now).is_some());
        let a = Active::default();
        a.set(vec![broken.clone()]);
        a.set(vec![broken]);
        assert!(!a.mutes("locks", b"lock:1"));
        assert!(!a.mutes("locks", b"lock:{"));
        assert_eq!(a.current().len(), 1, "still listed, to be seen and removed");
    }

    /// docs/redis.md#keep-applications-out-of-keywatchs-state: a silence written by hand that
    /// does not read, or whose span is not a span, mutes nothing; one naming a key by its
    /// hash mutes that key alone.
    #[test]
    fn a_silence_that_does_not_read_mutes_nothing_and_a_hash_names_one_key() {
        let now = Utc::now();
        let s = |f: &dyn Fn(&mut Silence)| {
            let mut s = Silence {
                id: new_id(),
                rule: "locks".into(),
                pattern: None,
                key: None,
                key_sha256: None,
                until: now + chrono::Duration::hours(1),
                comment: String::new(),
                created: now,
                by: "hand".into(),
            };
            f(&mut s);
            s
        };
        let refused = [
            s(&|s| s.key_sha256 = Some("not hex".into())),
            s(&|s| s.key = Some("not base64!".into())),
            s(&|s| s.created = now + chrono::Duration::days(1)),
            s(&|s| s.until = now - chrono::Duration::hours(2)),
        ];
        for r in &refused {
            assert!(r.refused(now).is_some(), "{r:?}");
        }
        let a = Active::default();
        a.set(refused.to_vec());
        assert!(!a.mutes("locks", b"lock:1"));
        let one = s(&|s| s.key_sha256 = Some(crate::long_key::sha256_hex(b"lock:7")));
        assert_eq!(one.refused(now), None);
        a.set(vec![one]);
        assert!(a.mutes("locks", b"lock:7"));
        assert!(!a.mutes("locks", b"lock:8"));
        assert!(!a.mutes("other", b"lock:7"));
    }
}
