//! Each pattern's `SCAN MATCH` glob against a real redis-server: SCAN must return every key the
//! pattern accepts, and exactly those when the pattern says its glob is exact. The unit tests
//! check the same against a port of Redis's matcher; this checks the port's premise.

use crate::common;

use std::collections::BTreeSet;

use common::RedisServer;
use fastrand::Rng;
use keywatch::pattern::Pattern;

/// Characters of literals: every Redis glob metacharacter, the pattern's own, and plain ones.
const LIT_CHARS: &[char] = &[
    'a', 'b', ':', '*', '?', '[', ']', '\\', '{', '}', '^', '-', 'é',
];

/// Pieces of capture values and of noise keys, with bytes no literal has.
const PIECES: &[&[u8]] = &[
    b"a",
    b"b",
    b":",
    b"*",
    b"?",
    b"[",
    b"]",
    b"\\",
    b"{",
    b"}",
    b"^",
    b"-",
    b"\xc3\xa9",
    b"\xc3",
    b"\xff",
    b"\n",
    b"\0",
    b" ",
    b"ab",
    b"x",
];

enum Tok {
    Lit(String),
    Cap,
    Star,
}

fn tokens(rng: &mut Rng) -> Vec<Tok> {
    (0..rng.usize(0..7))
        .map(|_| match rng.u8(0..6) {
            0..3 => Tok::Lit(
                (0..rng.usize(1..4))
                    .map(|_| LIT_CHARS[rng.usize(..LIT_CHARS.len())])
                    .collect(),
            ),
            3 | 4 => Tok::Cap,
            _ => Tok::Star,
        })
        .collect()
}

fn source(toks: &[Tok]) -> String {
    let mut src = String::new();
    for (i, tok) in toks.iter().enumerate() {
        match tok {
            Tok::Lit(lit) => {
                for c in lit.chars() {
                    if matches!(c, '{' | '}' | '*' | '\\') {
                        src.push('\\');
                    }
                    src.push(c);
                }
            }
            Tok::Cap => src.push_str(&format!("{{c{i}}}")),
            Tok::Star => src.push('*'),
        }
    }
    src
}

fn filler(rng: &mut Rng, max_pieces: usize) -> Vec<u8> {
    (0..rng.usize(0..=max_pieces))
        .flat_map(|_| PIECES[rng.usize(..PIECES.len())].iter().copied())
        .collect()
}

/// Keys shaped like the pattern: its literals with random fillers, some of them empty, so some
/// keys match and some miss by a little.
fn keys_near(rng: &mut Rng, toks: &[Tok], n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            let mut key = Vec::new();
            for tok in toks {
                match tok {
                    Tok::Lit(lit) => key.extend_from_slice(lit.as_bytes()),
                    _ => key.extend(filler(rng, 3)),
                }
            }
            key
        })
        .collect()
}

fn scan(conn: &mut redis::Connection, glob: &[u8]) -> BTreeSet<Vec<u8>> {
    let mut found = BTreeSet::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(glob)
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .unwrap();
        found.extend(keys);
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

#[test]
fn scan_globs_cover_their_patterns_on_a_real_server() {
    let mut rng = Rng::with_seed(20_260_829);
    let mut generated: Vec<Vec<Tok>> = (0..300).map(|_| tokens(&mut rng)).collect();
    // Hand-picked shapes: every metacharacter as a literal, wildcard runs, the empty pattern.
    for src in [
        vec![Tok::Lit(r"*?[]\{}".into()), Tok::Cap],
        vec![Tok::Lit("[a-b]".into()), Tok::Star],
        vec![Tok::Lit("[^a]".into())],
        vec![Tok::Cap, Tok::Lit(r"\".into()), Tok::Cap],
        vec![Tok::Star, Tok::Cap, Tok::Star, Tok::Lit("?".into())],
        vec![Tok::Star],
        vec![],
    ] {
        generated.push(src);
    }

    let mut patterns: Vec<Pattern> = generated
        .iter()
        .map(|toks| Pattern::parse(&source(toks)).unwrap())
        .collect();
    for re in [
        r"a\*(?P<x>.+)",
        r"(?s-u)\[a\](?P<x>.*)",
        r"(?i)ab:(?P<x>.+)",
        r"(?s-u).*\\",
        r"(?s-u)[?*](?P<x>.)",
    ] {
        patterns.push(Pattern::from_regex(re).unwrap());
    }

    let mut keys: BTreeSet<Vec<u8>> = BTreeSet::new();
    for toks in &generated {
        keys.extend(keys_near(&mut rng, toks, 12));
    }
    for _ in 0..500 {
        keys.insert(filler(&mut rng, 8));
    }
    keys.insert(Vec::new());
    keys.insert(b"a*xyz".to_vec());
    keys.insert(b"[a]\xff".to_vec());
    keys.insert(b"AB:1".to_vec());

    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("SET").arg(key).arg(1).ignore();
    }
    let () = pipe.query(&mut conn).unwrap();
    let dbsize: usize = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    assert_eq!(
        dbsize,
        keys.len(),
        "every generated key is stored, the empty key too"
    );

    let mut exact_checked = 0;
    let mut accepted_total = 0;
    for pattern in &patterns {
        let want: BTreeSet<Vec<u8>> = keys
            .iter()
            .filter(|k| pattern.is_match(k))
            .cloned()
            .collect();
        let got = scan(&mut conn, pattern.scan_glob());
        let missing: Vec<_> = want
            .difference(&got)
            .map(|k| k.escape_ascii().to_string())
            .collect();
        assert!(
            missing.is_empty(),
            "pattern {:?}, glob {:?}: SCAN misses {missing:?}",
            pattern.source(),
            pattern.scan_glob().escape_ascii().to_string()
        );
        if pattern.glob_is_exact() {
            let extra: Vec<_> = got
                .difference(&want)
                .map(|k| k.escape_ascii().to_string())
                .collect();
            assert!(
                extra.is_empty(),
                "pattern {:?}, exact glob {:?}: SCAN also returns {extra:?}",
                pattern.source(),
                pattern.scan_glob().escape_ascii().to_string()
            );
            exact_checked += 1;
        }
        accepted_total += want.len();
    }
    // The corpus must exercise both claims, or the loop above proves little.
    assert!(exact_checked >= 30, "only {exact_checked} exact globs");
    assert!(
        accepted_total >= 1000,
        "only {accepted_total} accepted keys in all"
    );
}
