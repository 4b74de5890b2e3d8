//! Every rule's pattern compiled into one matcher, so that a key costs about the same with a
//! thousand rules as with ten.
//!
//! Each rule is filed under one literal that any key it accepts must have: a prefix (a trie
//! walked from the key's start), a suffix (a trie walked from its end) or an inner literal (one
//! Aho-Corasick pass over the key). Only the rules found that way are verified, with the
//! pattern's regex-free [`Pattern::is_match`]. The literal is chosen per rule to be the one
//! fewest other rules share, so a prefix like `session:` common to a hundred rules does not make
//! every session key verify a hundred patterns when their suffixes tell them apart. `regex:`
//! rules with no usable literal share one `RegexSet`; `match:` patterns with no literal at all
//! (`*`, `{x}`) are verified for every key, which is a length check.

use std::collections::{BTreeMap, HashMap};

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};
use regex::bytes::RegexSet;

use crate::pattern::Pattern;

/// All rules' patterns; rule `i` is `patterns[i]` of [`Matcher::new`].
pub struct Matcher {
    rules: Vec<Pattern>,
    prefixes: Trie,
    suffixes: Trie,
    inner: Option<Inner>,
    always: Vec<u32>,
    set: Option<(RegexSet, Vec<u32>)>,
}

struct Inner {
    searcher: AhoCorasick,
    /// Rules filed under each literal of `searcher`, by its pattern id.
    rules: Vec<Vec<u32>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum Place {
    Prefix,
    Suffix,
    Inner,
}

impl Matcher {
    pub fn new(patterns: &[Pattern]) -> Matcher {
        let options: Vec<Vec<(Place, Vec<Vec<u8>>)>> = patterns
            .iter()
            .map(|p| {
                let req = p.required_literals();
                let mut opts = Vec::new();
                if !req.prefixes.is_empty() {
                    opts.push((Place::Prefix, req.prefixes));
                }
                if !req.suffixes.is_empty() {
                    opts.push((Place::Suffix, req.suffixes));
                }
                opts.extend(req.inner.into_iter().map(|lit| (Place::Inner, vec![lit])));
                opts
            })
            .collect();

        let mut sharing: HashMap<(Place, &[u8]), usize> = HashMap::new();
        for opts in &options {
            let mut seen: Vec<(Place, &[u8])> = Vec::new();
            for (place, lits) in opts {
                for lit in lits {
                    if !seen.contains(&(*place, lit.as_slice())) {
                        seen.push((*place, lit));
                        *sharing.entry((*place, lit)).or_default() += 1;
                    }
                }
            }
        }

        let mut prefixes = Vec::new();
        let mut suffixes = Vec::new();
        let mut inner: BTreeMap<&[u8], Vec<u32>> = BTreeMap::new();
        let mut always = Vec::new();
        let mut set_rules = Vec::new();
        for (rule, (pattern, opts)) in patterns.iter().zip(&options).enumerate() {
            let rule = u32::try_from(rule).expect("fewer than 4 billion rules");
            // Fewest rules sharing the literal first: they are what a matching key verifies.
            // Then the cheaper lookup, then the longer literal, which fewer keys carry.
            let best = opts.iter().min_by_key(|(place, lits)| {
                let shared: usize = lits.iter().map(|l| sharing[&(*place, l.as_slice())]).sum();
                let shortest = lits.iter().map(Vec::len).min().unwrap_or(0);
                (shared, *place, std::cmp::Reverse(shortest))
            });
            match best {
                Some((Place::Prefix, lits)) => {
                    prefixes.extend(lits.iter().map(|l| (l.clone(), rule)));
                }
                Some((Place::Suffix, lits)) => {
                    suffixes.extend(
                        lits.iter()
                            .map(|l| (l.iter().rev().copied().collect(), rule)),
                    );
                }
                Some((Place::Inner, lits)) => inner.entry(&lits[0]).or_default().push(rule),
                None if pattern.is_regex() => set_rules.push(rule),
                None => always.push(rule),
            }
        }

        let inner = (!inner.is_empty()).then(|| Inner {
            searcher: AhoCorasick::builder()
                .kind(Some(AhoCorasickKind::DFA))
                .match_kind(MatchKind::Standard)
                .build(inner.keys())
                .expect("a few thousand literals fit an Aho-Corasick DFA"),
            rules: inner.into_values().collect(),
        });
        let set = (!set_rules.is_empty()).then(|| {
            let regexes = set_rules.iter().map(|&r| patterns[r as usize].regex_str());
            let set = RegexSet::new(regexes).expect("each regex compiled alone");
            (set, set_rules)
        });
        Matcher {
            rules: patterns.to_vec(),
            prefixes: Trie::new(prefixes, false),
            suffixes: Trie::new(suffixes, true),
            inner,
            always,
            set,
        }
    }

    /// Clears `out`, then pushes the index of every rule whose pattern matches `key`, ascending.
    pub fn matching(&self, key: &[u8], out: &mut Vec<usize>) {
        out.clear();
        self.prefixes.walk(key, |r| self.verify(r, key, out));
        self.suffixes.walk(key, |r| self.verify(r, key, out));
        if let Some(inner) = &self.inner {
            for found in inner.searcher.find_overlapping_iter(key) {
                for &r in &inner.rules[found.pattern().as_usize()] {
                    self.verify(r, key, out);
                }
            }
        }
        for &r in &self.always {
            self.verify(r, key, out);
        }
        // `is_match` first: `matches` allocates, and most keys match no regex.
        if let Some((set, rules)) = &self.set
            && set.is_match(key)
        {
            out.extend(set.matches(key).iter().map(|i| rules[i] as usize));
        }
        if out.len() > 1 {
            // Buckets interleave, and a rule filed under several literals (a regex's
            // alternatives) or an inner literal that occurs twice can be found twice.
            out.sort_unstable();
            out.dedup();
        }
    }

    #[inline]
    fn verify(&self, rule: u32, key: &[u8], out: &mut Vec<usize>) {
        if self.rules[rule as usize].is_match(key) {
            out.push(rule as usize);
        }
    }
}

/// A path-compressed byte trie of literals, walked from the start of a key (prefixes) or from
/// its end (suffixes, stored reversed). Path compression matters because rule prefixes are long
/// and mostly unshared past a few bytes: a walk is a few label comparisons, not one step per byte.
struct Trie {
    nodes: Vec<Node>,
    reversed: bool,
}

struct Node {
    /// Bytes after the edge byte that leads here, in key order (also in a reversed trie, so the
    /// comparison is one slice equality).
    label: Box<[u8]>,
    rules: Box<[u32]>,
    /// First byte of each child's edge, sorted, beside the child's node index.
    edges: Box<[u8]>,
    children: Box<[u32]>,
}

#[derive(Default)]
struct RawNode {
    children: BTreeMap<u8, usize>,
    rules: Vec<u32>,
}

impl Trie {
    /// `entries` are (literal in walk order, rule).
    fn new(entries: Vec<(Vec<u8>, u32)>, reversed: bool) -> Trie {
        let mut raw = vec![RawNode::default()];
        for (lit, rule) in entries {
            let mut at = 0;
            for b in lit {
                at = match raw[at].children.get(&b) {
                    Some(&child) => child,
                    None => {
                        raw.push(RawNode::default());
                        let child = raw.len() - 1;
                        raw[at].children.insert(b, child);
                        child
                    }
                };
            }
            raw[at].rules.push(rule);
        }
        let mut trie = Trie {
            nodes: Vec::new(),
            reversed,
        };
        trie.compress(&raw, 0, Vec::new());
        trie
    }

    fn compress(&mut self, raw: &[RawNode], mut at: usize, mut label: Vec<u8>) -> u32 {
        while raw[at].rules.is_empty() && raw[at].children.len() == 1 && at != 0 {
            let (&b, &child) = raw[at].children.iter().next().expect("one child");
            label.push(b);
            at = child;
        }
        if self.reversed {
            label.reverse();
        }
        let index = self.nodes.len();
        self.nodes.push(Node {
            label: label.into(),
            rules: raw[at].rules.clone().into(),
            edges: raw[at].children.keys().copied().collect(),
            children: Box::new([]),
        });
        let children: Box<[u32]> = raw[at]
            .children
            .values()
            .map(|&child| self.compress(raw, child, Vec::new()))
            .collect();
        self.nodes[index].children = children;
        u32::try_from(index).expect("fewer than 4 billion trie nodes")
    }

    #[inline]
    fn walk(&self, key: &[u8], mut found: impl FnMut(u32)) {
        let mut node = &self.nodes[0];
        let mut depth = 0;
        loop {
            for &rule in &node.rules {
                found(rule);
            }
            if depth >= key.len() {
                return;
            }
            let b = if self.reversed {
                key[key.len() - 1 - depth]
            } else {
                key[depth]
            };
            let slot = if node.edges.len() <= 8 {
                node.edges.iter().position(|&e| e == b)
            } else {
                node.edges.binary_search(&b).ok()
            };
            let Some(slot) = slot else { return };
            let child = &self.nodes[node.children[slot] as usize];
            let len = child.label.len();
            if key.len() < depth + 1 + len {
                return;
            }
            let span = if self.reversed {
                let end = key.len() - 1 - depth;
                &key[end - len..end]
            } else {
                &key[depth + 1..depth + 1 + len]
            };
            if span != &*child.label {
                return;
            }
            depth += 1 + len;
            node = child;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::testkit::{bytes_from_pieces, literal, source, tokens};
    use proptest::prelude::*;

    fn naive(patterns: &[Pattern], key: &[u8]) -> Vec<usize> {
        (0..patterns.len())
            .filter(|&i| patterns[i].is_match(key))
            .collect()
    }

    fn matching(m: &Matcher, key: &[u8]) -> Vec<usize> {
        let mut out = vec![usize::MAX];
        m.matching(key, &mut out);
        out
    }

    #[test]
    fn every_kind_of_rule_is_found() {
        let patterns = vec![
            Pattern::parse("order_lock:{id}").unwrap(),    // 0 prefix
            Pattern::parse("session:{sid}:web").unwrap(),  // 1 shared prefix…
            Pattern::parse("session:{sid}:app").unwrap(),  // 2 …told apart by suffix
            Pattern::parse("*:tmp").unwrap(),              // 3 suffix
            Pattern::parse("{tenant}:lock:{id}").unwrap(), // 4 inner
            Pattern::parse("*").unwrap(),                  // 5 no literal
            Pattern::parse("{a}{b}").unwrap(),             // 6 no literal, min 2
            Pattern::from_regex(r"order_lock:(?P<id>\d+)").unwrap(), // 7 regex prefix
            Pattern::from_regex(r"(?P<x>[a-z]+)\d").unwrap(), // 8 regex, no literal
            Pattern::from_regex(r"(foo|bar):(?P<x>.+)").unwrap(), // 9 regex, two prefixes
            Pattern::parse("exact").unwrap(),              // 10 literal only
        ];
        let m = Matcher::new(&patterns);
        let cases: &[(&[u8], &[usize])] = &[
            (b"order_lock:42", &[0, 5, 6, 7]),
            (b"order_lock:x", &[0, 5, 6]),
            (b"session:1:web", &[1, 5, 6]),
            (b"session:1:app", &[2, 5, 6]),
            (b"a:tmp", &[3, 5, 6]),
            (b"t1:lock:9", &[4, 5, 6]),
            (b"x", &[5]),
            (b"", &[5]),
            (b"abc1", &[5, 6, 8]),
            (b"bar:lock:1", &[4, 5, 6, 9]),
            (b"foo:x", &[5, 6, 9]),
            (b"exact", &[5, 6, 10]),
            (b"exactly", &[5, 6]),
        ];
        for &(key, want) in cases {
            assert_eq!(matching(&m, key), want, "{}", key.escape_ascii());
            assert_eq!(naive(&patterns, key), want);
        }
        assert!(matching(&Matcher::new(&[]), b"k").is_empty());
    }

    #[test]
    fn a_literal_found_twice_reports_the_rule_once() {
        let patterns = vec![
            Pattern::parse("*ab*").unwrap(),
            Pattern::parse("{x}ab").unwrap(),
        ];
        let m = Matcher::new(&patterns);
        assert_eq!(matching(&m, b"abxabab"), [0, 1]);
    }

    fn rule() -> impl Strategy<Value = Pattern> {
        prop_oneof![
            4 => tokens().prop_map(|t| Pattern::parse(&source(&t)).unwrap()),
            1 => (literal(1, 3), literal(1, 3), 0..5usize).prop_map(|(a, b, shape)| {
                let (a, b) = (regex::escape(&a), regex::escape(&b));
                let re = match shape {
                    0 => format!("{a}(?P<v>.+)"),
                    1 => format!("(?s-u).*{a}"),
                    2 => format!("(?:{a}|{b}).*"),
                    3 => format!("(?-u)(?P<v>[^:]+){a}"),
                    _ => format!("(?s-u).*{a}.*{b}.*"),
                };
                Pattern::from_regex(&re).unwrap()
            }),
        ]
    }

    proptest! {
        #[test]
        fn matcher_equals_trying_each_rule(
            patterns in prop::collection::vec(rule(), 0..24),
            keys in prop::collection::vec(bytes_from_pieces(10), 1..16),
        ) {
            let m = Matcher::new(&patterns);
            for key in &keys {
                prop_assert_eq!(matching(&m, key), naive(&patterns, key), "key {:?}", key);
            }
        }
    }
}
