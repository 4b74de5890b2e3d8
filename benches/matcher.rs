//! Keys per second through the [`Matcher`] for 1,000 mixed rules, beside the loop it replaces:
//! every rule's own anchored regex tried in turn.
//!
//! `cargo bench --bench matcher`. The matcher runs over 1 M keys per iteration; the loops, a
//! thousand times slower per key, over the first 10,000 of the same shuffled keys, so that a run
//! takes minutes and not hours. Throughput is per key in both, so the figures compare directly.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fastrand::Rng;
use keywatch::pattern::Pattern;
use keywatch::pattern::matcher::Matcher;
use regex::bytes::Regex;

const RULES: usize = 1_000;
const KEYS: usize = 1_000_000;
const LOOP_KEYS: usize = 10_000;

/// A rule as a user would write it, and the regex docs/rules.md#patterns says it means.
struct Rule {
    pattern: Pattern,
    regex: Regex,
}

fn match_rule(src: &str) -> Rule {
    let mut re = String::from("(?s-u)^");
    let mut rest = src;
    while let Some(c) = rest.chars().next() {
        if c == '{' {
            let end = rest.find('}').unwrap();
            re.push_str(&format!("(?P<{}>.+?)", &rest[1..end]));
            rest = &rest[end + 1..];
        } else {
            if c == '*' {
                re.push_str(".*");
            } else {
                re.push_str(&regex::escape(&c.to_string()));
            }
            rest = &rest[c.len_utf8()..];
        }
    }
    re.push('$');
    Rule {
        pattern: Pattern::parse(src).unwrap(),
        regex: Regex::new(&re).unwrap(),
    }
}

fn regex_rule(src: &str) -> Rule {
    Rule {
        pattern: Pattern::from_regex(src).unwrap(),
        regex: Regex::new(&format!("^(?:{src})$")).unwrap(),
    }
}

/// Ten families of rules, a hundred of each, told apart by a service number `n`: prefixes,
/// a prefix shared by all (`cache:`) with distinct suffixes, suffixes, inner literals, globs,
/// regexes with a literal prefix, two case-insensitive regexes, and one regex with no literal
/// to index, which every key runs.
fn rules() -> Vec<Rule> {
    (0..RULES)
        .map(|i| {
            let n = i / 10;
            match i % 10 {
                0 => match_rule(&format!("svc{n}:order_lock:{{order_id}}")),
                1 => match_rule(&format!("cache:{{user}}:kind{n}")),
                2 => match_rule(&format!("session{n}:{{sid}}")),
                3 => match_rule(&format!("app{n}:cache:{{user}}:{{kind}}")),
                4 => match_rule(&format!("*:tmp{n}")),
                5 => match_rule(&format!("{{tenant}}:quota{n}:{{id}}")),
                6 => match_rule(&format!("job{n}:*:done")),
                7 => match_rule(&format!("lock{n}:*")),
                8 => regex_rule(&format!(r"^metrics{n}:(?P<host>[a-z0-9-]+)$")),
                _ if n < 2 => regex_rule(&format!(r"(?i)audit{n}:(?P<id>.+)")),
                _ if n == 2 => regex_rule(r"(?P<kind>[a-z]+)_(?P<id>\d+)"),
                _ => match_rule(&format!("feed{n}:{{a}}:{{b}}:{{c}}")),
            }
        })
        .collect()
}

fn id(rng: &mut Rng) -> String {
    rng.u64(1..10_000_000_000).to_string()
}

fn word(rng: &mut Rng) -> &'static str {
    const WORDS: &[&str] = &[
        "user", "profile", "avatar", "feed", "cart", "token", "rate", "queue", "celery", "bull",
        "lock", "cache", "session", "job", "tmp", "order", "metrics", "audit",
    ];
    WORDS[rng.usize(..WORDS.len())]
}

/// About a third of the keys belong to a rule; the rest are near misses (a rule's prefix with
/// the wrong shape, an unknown service number) and keys of other applications.
fn key(rng: &mut Rng) -> Vec<u8> {
    let n = rng.usize(..RULES / 10);
    let unknown = n + RULES / 10 + rng.usize(..1000);
    let key = match rng.u32(..20) {
        0 => format!("svc{n}:order_lock:{}", id(rng)),
        1 => format!("cache:u{}:kind{n}", id(rng)),
        2 => format!("session{n}:{:032x}", rng.u128(..)),
        3 => format!("app{n}:cache:u{}:{}", id(rng), word(rng)),
        4 => format!("{}:{}:tmp{n}", word(rng), id(rng)),
        5 => format!("t{}:quota{n}:{}", rng.u32(..100), id(rng)),
        6 => format!("job{n}:{}:done", id(rng)),
        7 => format!("metrics{n}:host-{}", rng.u32(..500)),
        8 => format!("svc{n}:order_lock:"),
        9 => format!("svc{unknown}:order_lock:{}", id(rng)),
        10 => format!("cache:u{}:kind{unknown}", id(rng)),
        11 => format!("session{n}"),
        12 => format!("job{n}:{}:doing", id(rng)),
        13 => format!("metrics{n}:HOST_{}", rng.u32(..500)),
        14 => format!("{}:{}:{}", word(rng), word(rng), id(rng)),
        15 if rng.bool() => format!("celery-task-meta-{:032x}", rng.u128(..)),
        15 => format!("{}_{}", word(rng), id(rng)),
        16 => format!("bull:{}:{}", word(rng), id(rng)),
        17 => format!("{}:{}", word(rng), id(rng)),
        18 => format!("app{unknown}:cache:u{}:{}", id(rng), word(rng)),
        19 if rng.u32(..10) == 0 => format!("AUDIT{}:{}", rng.usize(..4), id(rng)),
        _ => format!(
            "rate:{}.{}.{}.{}",
            rng.u8(..),
            rng.u8(..),
            rng.u8(..),
            rng.u8(..)
        ),
    };
    key.into_bytes()
}

fn bench(c: &mut Criterion) {
    let rules = rules();
    let patterns: Vec<Pattern> = rules.iter().map(|r| r.pattern.clone()).collect();
    let matcher = Matcher::new(&patterns);
    let mut rng = Rng::with_seed(7);
    let keys: Vec<Vec<u8>> = (0..KEYS).map(|_| key(&mut rng)).collect();

    // The mix, and a check that the matcher and the naive loop agree on it.
    let mut out = Vec::new();
    let mut matched = 0;
    for (i, key) in keys.iter().enumerate() {
        matcher.matching(key, &mut out);
        matched += usize::from(!out.is_empty());
        if i < LOOP_KEYS {
            let naive: Vec<usize> = (0..rules.len())
                .filter(|&r| rules[r].regex.is_match(key))
                .collect();
            assert_eq!(out, naive, "{}", key.escape_ascii());
        }
    }
    eprintln!(
        "{RULES} rules, {KEYS} keys, {:.1}% of keys match a rule",
        100.0 * matched as f64 / KEYS as f64
    );

    let mut group = c.benchmark_group("matcher");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(15));
    group.throughput(Throughput::Elements(KEYS as u64));
    group.bench_function("matcher_1000_rules", |b| {
        let mut out = Vec::new();
        b.iter(|| {
            let mut hits = 0;
            for key in &keys {
                matcher.matching(black_box(key), &mut out);
                hits += out.len();
            }
            hits
        })
    });

    group.throughput(Throughput::Elements(LOOP_KEYS as u64));
    group.bench_function("naive_regex_loop_1000_rules", |b| {
        b.iter(|| {
            let mut hits = 0;
            for key in &keys[..LOOP_KEYS] {
                for rule in &rules {
                    hits += usize::from(rule.regex.is_match(black_box(key)));
                }
            }
            hits
        })
    });
    // Not the goal's baseline, but it shows how much comes from indexing and how much from
    // matching without a regex.
    group.bench_function("pattern_is_match_loop_1000_rules", |b| {
        b.iter(|| {
            let mut hits = 0;
            for key in &keys[..LOOP_KEYS] {
                for pattern in &patterns {
                    hits += usize::from(pattern.is_match(black_box(key)));
                }
            }
            hits
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
