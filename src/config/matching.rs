//! Matching: which rules an event fires, and which keys' deadlines are worth keeping. One
//! question asked of the compiled rule set ([`crate::pattern::matcher::Matcher`] finds the
//! candidate rules by pattern); the events' kinds, databases and hash fields then narrow them.

use crate::event::{EventKind, KeyEvent};

use super::model::Config;

impl Config {
    /// Indices of the rules whose pattern matches `key`, in file order. keywatch's own keys
    /// (under `state.prefix`) never match.
    pub fn matching_rules(&self, key: &[u8], out: &mut Vec<usize>) {
        if self.state.is_own(key) {
            out.clear();
            return;
        }
        self.matcher.matching(key, out);
    }

    /// The rules that fire for `kind` in database `db` on `key`, with their captures: slices of
    /// `key`, not copies (a rule's `{id}` is nearly all of a long key,
    /// docs/reliability.md#bounded-whatever-the-key).
    pub fn rules_for(
        &self,
        kind: EventKind,
        db: u32,
        key: &bytes::Bytes,
    ) -> Vec<(usize, Vec<bytes::Bytes>)> {
        self.firing(kind, db, key)
            .filter_map(|i| {
                let ranges = self.rules[i].pattern.capture_ranges(key)?;
                Some((i, ranges.into_iter().map(|r| key.slice(r)).collect()))
            })
            .collect()
    }

    /// [`Config::rules_for`] without the captures, where only which rules fire matters.
    pub fn rules_firing(&self, kind: EventKind, db: u32, key: &[u8]) -> Vec<usize> {
        self.firing(kind, db, key)
            .filter(|&i| self.rules[i].pattern.is_match(key))
            .collect()
    }

    /// The rules that fire for `kind` in `db` among those [`Config::matching_rules`] finds for
    /// `key`, whose patterns are yet to be applied.
    fn firing(&self, kind: EventKind, db: u32, key: &[u8]) -> impl Iterator<Item = usize> + '_ {
        let mut idx = Vec::new();
        self.matching_rules(key, &mut idx);
        idx.into_iter()
            .filter(move |&i| self.rules[i].fires_on(kind, db))
    }

    /// Whether a deadline of `key` in `db` is worth keeping: some rule fires on its expiry or
    /// warns before it.
    pub fn wants_deadline(&self, db: u32, key: &[u8]) -> bool {
        let mut idx = Vec::new();
        self.matching_rules(key, &mut idx);
        idx.iter().any(|&i| {
            let r = &self.rules[i];
            r.fires_on(EventKind::Expired, db) || r.fires_on(EventKind::Expiring, db)
        })
    }

    /// The rules that fire for `e`, with their captures: [`Config::rules_for`] with the field's
    /// pattern applied to `hexpired` events.
    pub fn rules_for_event(&self, e: &KeyEvent) -> Vec<(usize, Vec<bytes::Bytes>)> {
        let mut idx = Vec::new();
        self.matching_rules(&e.key, &mut idx);
        idx.into_iter()
            .filter(|&i| self.rules[i].fires_on(e.kind, e.db))
            .filter_map(|i| {
                self.rules[i]
                    .captures_in(&e.key, e.field.as_deref())
                    .map(|c| (i, c))
            })
            .collect()
    }

    /// Whether the deadline of `field` of hash `key` in `db` is worth keeping.
    pub fn wants_field(&self, db: u32, key: &[u8], field: &[u8]) -> bool {
        let mut idx = Vec::new();
        self.matching_rules(key, &mut idx);
        // Matched, not captured: a hash's name (megabytes, maybe) is not copied per field.
        idx.iter().any(|&i| {
            let r = &self.rules[i];
            r.fires_on(EventKind::Hexpired, db)
                && r.pattern.is_match(key)
                && r.field.as_ref().is_none_or(|f| f.pattern.is_match(field))
        })
    }

    /// Whether some rule may want a field of hash `key` in `db` (its key pattern matches).
    pub fn wants_hash(&self, db: u32, key: &[u8]) -> bool {
        let mut idx = Vec::new();
        self.matching_rules(key, &mut idx);
        idx.iter()
            .any(|&i| self.rules[i].fires_on(EventKind::Hexpired, db))
    }
}
