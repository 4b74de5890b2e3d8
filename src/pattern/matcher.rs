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

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::dfa::DFA;
use aho_corasick::{Anchored, MatchKind, StartKind};
use regex::bytes::RegexSet;

use crate::pattern::Pattern;

/// All rules' patterns; rule `i` is `patterns[i]` of [`Matcher::new`].
pub struct Matcher {
    rules: Vec<Pattern>,
    prefixes: Trie,
    suffixes: Trie,
    inner: Option<Inner>,
    always: Vec<u32>,
    set: Option<Set>,
}

/// `regex:` rules with no literal worth indexing, run in one pass.
struct Set {
    set: RegexSet,
    rules: Vec<u32>,
    /// A byte of each regex's required literal: a key with none of them cannot match, and
    /// finding that out is far cheaper than a pass of the set.
    gate: Needles,
}

/// Bytes to look for in a key, one `memchr` when there are few, a table when there are more.
enum Needles {
    /// Any key may match.
    Any,
    Few(Vec<u8>),
    Many(Box<[bool; 256]>),
}

impl Needles {
    /// `None` when some literal has no byte worth looking for.
    fn new(bytes: Option<Vec<u8>>) -> Needles {
        let Some(mut bytes) = bytes else {
            return Needles::Any;
        };
        bytes.sort_unstable();
        bytes.dedup();
        if bytes.len() <= 3 {
            return Needles::Few(bytes);
        }
        let mut table = Box::new([false; 256]);
        for b in bytes {
            table[usize::from(b)] = true;
        }
        Needles::Many(table)
    }

    /// Where the first needle is; `Some(0)` for [`Needles::Any`].
    #[inline]
    fn first(&self, key: &[u8]) -> Option<usize> {
        match self {
            Needles::Any => Some(0),
            Needles::Few(bytes) => match *bytes.as_slice() {
                [a] => memchr::memchr(a, key),
                [a, b] => memchr::memchr2(a, b, key),
                [a, b, c] => memchr::memchr3(a, b, c, key),
                _ => Some(0),
            },
            Needles::Many(table) => key.iter().position(|&b| table[usize::from(b)]),
        }
    }
}

struct Inner {
    /// Stepped by hand, byte by byte: the iterator's per-call setup costs more than the scan
    /// of a short key, and its prefilter helps little when some literal is one common byte.
    dfa: DFA,
    start: StateID,
    /// A byte of each literal, the rarest: a key without any of them (most keys, when the
    /// literals are words) skips the scan.
    needles: Needles,
    /// The scan can start this many bytes before the first needle, not earlier.
    max_len: usize,
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
            // A single byte only when nothing longer is known, and a common one last. Then the
            // fewest rules behind one literal: they are what a key carrying it verifies. Then
            // the cheaper lookup, then the longer literal, which fewer keys carry.
            let best = opts.iter().min_by_key(|(place, lits)| {
                let shared = lits
                    .iter()
                    .map(|l| sharing[&(*place, l.as_slice())])
                    .max()
                    .unwrap_or(0);
                let shortest = lits.iter().map(Vec::len).min().unwrap_or(0);
                let weak = lits.iter().map(|l| weakness(l)).max().unwrap_or(0);
                (weak, shared, *place, std::cmp::Reverse(shortest))
            });
            match best {
                // A byte most keys contain (`:`) filters nothing, and would make every key
                // scan for inner literals: such rules are cheaper verified for every key
                // (a pattern: a `memchr`) or in the regex set.
                Some((_, lits)) if lits.iter().any(|l| weakness(l) == 2) => {
                    if pattern.is_regex() {
                        set_rules.push(rule);
                    } else {
                        always.push(rule);
                    }
                }
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

        let inner = (!inner.is_empty()).then(|| {
            // Standard semantics: every state knows all literals that end at it, overlaps too.
            let dfa = DFA::builder()
                .match_kind(MatchKind::Standard)
                .start_kind(StartKind::Unanchored)
                .prefilter(false)
                .build(inner.keys())
                .expect("a few thousand literals fit an Aho-Corasick DFA");
            let start = dfa
                .start_state(Anchored::No)
                .expect("built with an unanchored start");
            let needles = Needles::new(Some(inner.keys().map(|lit| rarest_byte(lit)).collect()));
            Inner {
                dfa,
                start,
                needles,
                max_len: inner.keys().map(|lit| lit.len()).max().unwrap_or(0),
                rules: inner.into_values().collect(),
            }
        });
        let set = if set_rules.is_empty() {
            None
        } else {
            let regexes = set_rules.iter().map(|&r| patterns[r as usize].regex_str());
            let gate = set_rules
                .iter()
                .map(|&r| {
                    let required = patterns[r as usize].required_literals().inner;
                    required
                        .iter()
                        .map(|lit| rarest_byte(lit))
                        .min_by_key(|&b| rank(b))
                })
                .collect();
            match RegexSet::new(regexes) {
                Ok(set) => Some(Set {
                    set,
                    rules: set_rules,
                    gate: Needles::new(gate),
                }),
                // Each regex compiled alone when its rule was loaded, but together they can pass
                // the regex crate's size limit (three `\w{100}` do): those rules are then
                // verified one by one, slower per key, but the rules load.
                Err(_) => {
                    always.extend(set_rules);
                    None
                }
            }
        };
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
        if let Some(inner) = &self.inner
            && let Some(from) = inner.scan_from(key)
        {
            let dfa = &inner.dfa;
            let mut state = inner.start;
            for &b in &key[from..] {
                state = dfa.next_state(Anchored::No, state, b);
                if dfa.is_special(state) && dfa.is_match(state) {
                    for i in 0..dfa.match_len(state) {
                        for &r in &inner.rules[dfa.match_pattern(state, i).as_usize()] {
                            self.verify(r, key, out);
                        }
                    }
                }
            }
        }
        for &r in &self.always {
            self.verify(r, key, out);
        }
        // `is_match` first: `matches` allocates, and most keys match no regex.
        if let Some(set) = &self.set
            && set.gate.first(key).is_some()
            && set.set.is_match(key)
        {
            out.extend(set.set.matches(key).iter().map(|i| set.rules[i] as usize));
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

impl Inner {
    /// Where an inner literal can first start in `key`, or `None` when none can occur.
    #[inline]
    fn scan_from(&self, key: &[u8]) -> Option<usize> {
        let first = self.needles.first(key)?;
        Some((first + 1).saturating_sub(self.max_len))
    }
}

/// The byte of `lit` least likely to be in a key.
fn rarest_byte(lit: &[u8]) -> u8 {
    lit.iter()
        .copied()
        .min_by_key(|&b| rank(b))
        .expect("literals are not empty")
}

/// 0 for a literal of two bytes or more, 1 for one rare byte, 2 for one common byte.
fn weakness(lit: &[u8]) -> u8 {
    match lit {
        [b] if rank(*b) <= 3 => 1,
        [_] => 2,
        _ => 0,
    }
}

/// A rough rank of bytes by how often they are in Redis keys: digits and separators are
/// everywhere, common letters often, anything else seldom.
fn rank(b: u8) -> u8 {
    match b {
        b':' => 7,
        b'0'..=b'9' => 6,
        b'_' | b'-' | b'.' | b'/' => 5,
        b'a' | b'c' | b'd' | b'e' | b'h' | b'i' | b'l' | b'm' | b'n' | b'o' | b'r' | b's'
        | b't' | b'u' => 4,
        b'a'..=b'z' => 3,
        b'A'..=b'Z' => 2,
        _ => 1,
    }
}

/// A path-compressed byte trie of literals, walked from the start of a key (prefixes) or from
/// its end (suffixes, stored reversed). Path compression matters because rule prefixes are long
/// and mostly unshared past a few bytes: a walk is a few label comparisons, not one step per
/// byte. Nodes live in flat arrays, not behind boxes, so a step touches few cache lines.
struct Trie {
    reversed: bool,
    nodes: Vec<Node>,
    labels: Vec<u8>,
    rules: Vec<u32>,
    edge_bytes: Vec<u8>,
    edge_nodes: Vec<u32>,
    /// 256 child indices (or `NONE`) for each node with many children, such as the digit after
    /// `svc`: a lookup where a search would take several compares.
    tables: Vec<u32>,
}

const NONE: u32 = u32::MAX;

/// A node with more children than this gets a 256-entry table.
const DENSE: usize = 4;

/// Ranges into the [`Trie`]'s arrays.
#[derive(Clone, Copy)]
struct Node {
    /// Bytes after the edge byte that leads here, in key order (also in a reversed trie, so the
    /// comparison is one slice equality).
    label: (u32, u32),
    rules: (u32, u32),
    edges: (u32, u32),
    table: u32,
}

#[derive(Default)]
struct RawNode {
    children: BTreeMap<u8, usize>,
    rules: Vec<u32>,
}

fn span(range: (u32, u32)) -> std::ops::Range<usize> {
    range.0 as usize..(range.0 + range.1) as usize
}

fn range_of<T>(all: &mut Vec<T>, items: impl IntoIterator<Item = T>) -> (u32, u32) {
    let start = all.len();
    all.extend(items);
    let len = all.len() - start;
    (
        u32::try_from(start).expect("trie under 4 GiB"),
        u32::try_from(len).expect("trie under 4 GiB"),
    )
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
            reversed,
            nodes: Vec::new(),
            labels: Vec::new(),
            rules: Vec::new(),
            edge_bytes: Vec::new(),
            edge_nodes: Vec::new(),
            tables: Vec::new(),
        };
        trie.compress(&raw, 0, Vec::new());
        trie
    }

    fn compress(&mut self, raw: &[RawNode], mut at: usize, mut label: Vec<u8>) -> u32 {
        while at != 0 && raw[at].rules.is_empty() && raw[at].children.len() == 1 {
            let (&b, &child) = raw[at].children.iter().next().expect("one child");
            label.push(b);
            at = child;
        }
        if self.reversed {
            label.reverse();
        }
        let index = self.nodes.len();
        let node = Node {
            label: range_of(&mut self.labels, label),
            rules: range_of(&mut self.rules, raw[at].rules.iter().copied()),
            edges: (0, 0),
            table: NONE,
        };
        self.nodes.push(node);
        let children: Vec<(u8, u32)> = raw[at]
            .children
            .iter()
            .map(|(&b, &child)| (b, self.compress(raw, child, Vec::new())))
            .collect();
        let edges = range_of(&mut self.edge_bytes, children.iter().map(|&(b, _)| b));
        range_of(&mut self.edge_nodes, children.iter().map(|&(_, c)| c));
        self.nodes[index].edges = edges;
        if children.len() > DENSE {
            let table = self.tables.len();
            self.tables.resize(table + 256, NONE);
            for &(b, child) in &children {
                self.tables[table + usize::from(b)] = child;
            }
            self.nodes[index].table = u32::try_from(table).expect("trie under 4 GiB");
        }
        u32::try_from(index).expect("fewer than 4 billion trie nodes")
    }

    #[inline(always)]
    fn walk(&self, key: &[u8], mut found: impl FnMut(u32)) {
        let mut node = self.nodes[0];
        let mut depth = 0;
        loop {
            for &rule in &self.rules[span(node.rules)] {
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
            let child = if node.table != NONE {
                self.tables[node.table as usize + usize::from(b)]
            } else {
                let edges = span(node.edges);
                match self.edge_bytes[edges.clone()].iter().position(|&e| e == b) {
                    Some(slot) => self.edge_nodes[edges.start + slot],
                    None => NONE,
                }
            };
            if child == NONE {
                return;
            }
            node = self.nodes[child as usize];
            let label = &self.labels[span(node.label)];
            let len = label.len();
            if key.len() < depth + 1 + len {
                return;
            }
            let span = if self.reversed {
                let end = key.len() - 1 - depth;
                &key[end - len..end]
            } else {
                &key[depth + 1..depth + 1 + len]
            };
            if !same(span, label) {
                return;
            }
            depth += 1 + len;
        }
    }
}

/// Labels are a few bytes: a loop the compiler unrolls beats a call to `memcmp`.
#[inline(always)]
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
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
    fn regexes_too_big_together_are_verified_one_by_one() {
        // Each compiles alone; as one set they pass the regex crate's size limit.
        let patterns: Vec<Pattern> = ["1", "2", "3"]
            .iter()
            .map(|end| Pattern::from_regex(&format!(r"^(?P<x>\w{{100}}){end}$")).unwrap())
            .collect();
        let m = Matcher::new(&patterns);
        assert!(m.set.is_none());
        let key = format!("{}2", "a".repeat(100));
        assert_eq!(matching(&m, key.as_bytes()), vec![1]);
        assert!(matching(&m, b"a2").is_empty());
    }

    #[test]
    fn regex_rules_by_required_byte_or_in_the_set() {
        // A regex needing a rare `@` is looked up by it; one needing a common `_` is not.
        for sep in ['@', '_'] {
            let patterns: Vec<Pattern> = (0..3)
                .map(|i| {
                    Pattern::from_regex(&format!("(?P<u>[a-z]+){sep}(?P<d>[0-{i}]+)")).unwrap()
                })
                .collect();
            let m = Matcher::new(&patterns);
            assert_eq!(m.set.is_some(), sep == '_');
            assert_eq!(m.inner.is_some(), sep == '@');
            for key in [
                "ab@0", "ab@5", "ab@", "ab0", "@0", "x@0@1", "ab_0", "ab_2", "_0",
            ] {
                let key = key.as_bytes();
                assert_eq!(
                    matching(&m, key),
                    naive(&patterns, key),
                    "{}",
                    key.escape_ascii()
                );
            }
            let key = format!("ab{sep}0");
            assert_eq!(matching(&m, key.as_bytes()), [0, 1, 2]);
            assert_eq!(matching(&m, format!("ab{sep}2").as_bytes()), [2]);
        }
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
