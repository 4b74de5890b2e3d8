//! Which keys come closest to a rule's pattern that matched none: a typo in `match`
//! (`order-lock:` for `order_lock:`) passes `check`, and the keys the application really writes
//! are the best hint at what was meant.
//!
//! A key is close when its start is within a few edits of the pattern's leading literal text
//! (what precedes its first capture or wildcard, the `SCAN MATCH` glob's prefix). Keys sharing
//! that start are one suggestion ("`order_lock:1` and 41 more like it"), closest first.

use std::collections::BTreeMap;

/// Suggestions shown at most.
const SHOWN: usize = 3;

/// One kind of key close to the pattern: the least of them (SCAN's order is no order), and how
/// many others start alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suggestion {
    pub example: String,
    pub more: usize,
}

/// The literal start of a `SCAN MATCH` glob: up to its first unescaped wildcard, escapes
/// removed. Empty for a glob that starts with one (`*:lock`, most `regex:` rules).
pub fn literal_start(glob: &[u8]) -> String {
    String::from_utf8_lossy(&crate::pattern::glob_literal_start(glob).0).into_owned()
}

/// The keys among `keys` whose start is within a few edits of `start` (a third of its length,
/// at least one), grouped by that start, closest and most common first.
pub fn closest(start: &str, keys: &[Vec<u8>]) -> Vec<Suggestion> {
    let len = start.chars().count();
    // Too short to say anything: every key is "close" to `a:`.
    if len < 3 {
        return Vec::new();
    }
    let allowed = (len / 3).max(1);
    // start of the key → (distance, first key, how many)
    let mut groups: BTreeMap<String, (usize, String, usize)> = BTreeMap::new();
    for key in keys {
        let key = String::from_utf8_lossy(key);
        let head: String = key.chars().take(len).collect();
        let distance = strsim::osa_distance(start, &head);
        if distance > allowed {
            continue;
        }
        let g = groups
            .entry(head)
            .or_insert_with(|| (distance, key.to_string(), 0));
        g.2 += 1;
        if *key < *g.1 {
            g.1 = key.into_owned();
        }
    }
    let mut ranked: Vec<(usize, String, usize)> = groups.into_values().collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then(b.2.cmp(&a.2)).then(a.1.cmp(&b.1)));
    ranked
        .into_iter()
        .take(SHOWN)
        .map(|(_, example, n)| Suggestion {
            example,
            more: n - 1,
        })
        .collect()
}

/// `` `order_lock:1` and 41 more like it, `order_lock_owner:1` ``: for the doctor's line.
pub fn describe(suggestions: &[Suggestion]) -> String {
    suggestions
        .iter()
        .map(|s| match s.more {
            0 => format!("`{}`", s.example),
            n => format!("`{}` and {n} more like it", s.example),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> Vec<Vec<u8>> {
        list.iter().map(|k| k.as_bytes().to_vec()).collect()
    }

    #[test]
    fn the_literal_start_stops_at_the_first_wildcard() {
        assert_eq!(literal_start(b"order-lock:*"), "order-lock:");
        assert_eq!(literal_start(b"a\\*b:*:c"), "a*b:");
        assert_eq!(literal_start(b"*:lock"), "");
        assert_eq!(literal_start(b"job?:*"), "job");
    }

    #[test]
    fn a_typo_finds_the_keys_meant_grouped_and_closest_first() {
        let seen = keys(&[
            "session:s1",
            "order_lock:2",
            "order_lock:1",
            "order_lock:3",
            "order:9",
            "orderlock:7",
        ]);
        let found = closest("order-lock:", &seen);
        assert_eq!(
            found,
            [
                Suggestion {
                    example: "order_lock:1".into(),
                    more: 2
                },
                Suggestion {
                    example: "orderlock:7".into(),
                    more: 0
                },
            ]
        );
        assert_eq!(
            describe(&found),
            "`order_lock:1` and 2 more like it, `orderlock:7`"
        );
    }

    #[test]
    fn nothing_close_and_short_starts_suggest_nothing() {
        assert!(closest("order_lock:", &keys(&["session:1", "cart:1"])).is_empty());
        assert!(closest("a:", &keys(&["b:1"])).is_empty());
    }
}
