//! Arbitrary `match:`/`regex:` patterns and keys through the pattern compiler and the matcher.
//!
//! Oracles, each cheap:
//! - the matcher finds exactly the rules a naive loop over `Pattern::is_match` finds;
//! - `is_match` (the regex-free shape walk) agrees with `captures` (the regex of docs/rules.md#patterns), and
//!   captures come one per name;
//! - every key a pattern accepts matches its `SCAN MATCH` glob under Redis's glob rules, and when
//!   the glob is exact, every key the glob accepts is accepted by the pattern.
#![no_main]

use keywatch::pattern::matcher::Matcher;
use keywatch::pattern::Pattern;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<(bool, String)>, Vec<Vec<u8>>)| {
    let (sources, keys) = input;
    let patterns: Vec<Pattern> = sources
        .iter()
        .take(16)
        .filter_map(|(is_regex, src)| {
            if *is_regex {
                Pattern::from_regex(src).ok()
            } else {
                Pattern::parse(src).ok()
            }
        })
        .collect();
    let matcher = Matcher::new(&patterns);
    let mut found = Vec::new();
    for key in keys.iter().take(16) {
        matcher.matching(key, &mut found);
        let naive: Vec<usize> = (0..patterns.len())
            .filter(|&i| patterns[i].is_match(key))
            .collect();
        assert_eq!(found, naive, "matcher and naive loop disagree on {key:?}");
        for p in &patterns {
            let caps = p.captures(key);
            assert_eq!(
                caps.is_some(),
                p.is_match(key),
                "is_match and captures disagree: pattern {:?}, key {key:?}",
                p.source()
            );
            if let Some(caps) = caps {
                assert_eq!(caps.len(), p.capture_names().len());
                assert!(
                    glob_match(p.scan_glob(), key),
                    "glob {:?} of {:?} misses {key:?}",
                    String::from_utf8_lossy(p.scan_glob()),
                    p.source()
                );
            } else if p.glob_is_exact() {
                assert!(
                    !glob_match(p.scan_glob(), key),
                    "exact glob {:?} of {:?} accepts {key:?}, the pattern does not",
                    String::from_utf8_lossy(p.scan_glob()),
                    p.source()
                );
            }
        }
    }
});

/// Redis's `stringmatchlen` (util.c), case-sensitive, on bytes: `*`, `?`, `[...]` with `^`
/// and ranges, `\` escaping the next byte.
fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    if pat.is_empty() {
        return s.is_empty();
    }
    match pat[0] {
        b'*' => {
            let mut rest = pat;
            while rest.first() == Some(&b'*') {
                rest = &rest[1..];
            }
            if rest.is_empty() {
                return true;
            }
            (0..=s.len()).any(|i| glob_match(rest, &s[i..]))
        }
        b'?' => !s.is_empty() && glob_match(&pat[1..], &s[1..]),
        b'[' => {
            let Some((&c, rest_s)) = s.split_first() else {
                return false;
            };
            let mut p = &pat[1..];
            let not = p.first() == Some(&b'^');
            if not {
                p = &p[1..];
            }
            let mut hit = false;
            loop {
                match p {
                    [] => break,
                    [b'\\', x, tail @ ..] => {
                        hit |= *x == c;
                        p = tail;
                    }
                    [b']', tail @ ..] => {
                        p = tail;
                        break;
                    }
                    [a, b'-', z, tail @ ..] if *z != b']' => {
                        let (lo, hi) = if a <= z { (*a, *z) } else { (*z, *a) };
                        hit |= (lo..=hi).contains(&c);
                        p = tail;
                    }
                    [x, tail @ ..] => {
                        hit |= *x == c;
                        p = tail;
                    }
                }
            }
            hit != not && glob_match(p, rest_s)
        }
        b'\\' if pat.len() >= 2 => s.first() == Some(&pat[1]) && glob_match(&pat[2..], &s[1..]),
        b => s.first() == Some(&b) && glob_match(&pat[1..], &s[1..]),
    }
}
