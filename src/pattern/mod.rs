//! The key pattern language of docs/rules.md#patterns, on bytes: parse, match, capture, and the Redis
//! `SCAN MATCH` glob that over-approximates it.
//!
//! A pattern is defined by one regex (`{name}` is `(?P<name>.+?)`, `*` is `.*`, anchored, on
//! bytes), and that regex is what [`Pattern::captures`] runs, so captures follow its
//! leftmost-first backtracking exactly. Matching alone does not need the regex: once
//! captures are forgotten, a pattern is literals separated by gaps of at least *n* bytes, and a
//! leftmost scan for each literal decides it (see [`Shape`]). That is what the [`Matcher`] uses
//! for every key, so the regex only runs for keys that matched.
//!
//! [`Matcher`]: crate::pattern::matcher::Matcher

pub mod matcher;

use std::fmt::Write as _;

use memchr::memmem::Finder;
use regex::bytes::Regex;
use regex_syntax::ast::{self, Ast};
use regex_syntax::hir::literal::{ExtractKind, Extractor};
use regex_syntax::hir::{Hir, HirKind};

/// A compiled `match:` or `regex:` pattern of a rule.
#[derive(Clone, Debug)]
pub struct Pattern {
    source: String,
    capture_names: Vec<String>,
    /// Group index in `regex` of each entry of `capture_names`.
    capture_groups: Vec<usize>,
    /// The anchored regex that defines the pattern; for `match:` patterns it is only needed
    /// for captures.
    regex: Regex,
    glob: Vec<u8>,
    glob_exact: bool,
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Shape(Shape),
    Regex(RegexLiterals),
}

/// What a `match:` pattern accepts, captures forgotten: `head`, then for each gap at least
/// `min` bytes followed by its literal. Gaps are maximal runs of `*` and `{name}`; each
/// `{name}` adds one to `min`. The last gap's literal is the pattern's tail and may be empty;
/// the others are not, because a run stops only at a literal.
///
/// Every gap is unbounded, so taking each middle literal at its leftmost possible position
/// never loses a match: it leaves the most room for what follows.
#[derive(Clone, Debug)]
struct Shape {
    head: Vec<u8>,
    gaps: Vec<Gap>,
    min_len: usize,
    /// The pattern is `head{name}`: the capture is simply the rest of the key, so
    /// [`Pattern::captures`] can skip the regex for the most common shape of rule.
    tail_capture: bool,
}

#[derive(Clone, Debug)]
struct Gap {
    min: usize,
    lit: Vec<u8>,
    /// Prebuilt because building a searcher per key would cost more than the search.
    finder: Finder<'static>,
}

/// Literals every match of a `regex:` rule starts (ends) with: one of these, when known. Empty
/// when the regex admits no short finite set. `inner` are literals every match contains.
#[derive(Clone, Debug)]
struct RegexLiterals {
    prefixes: Vec<Vec<u8>>,
    suffixes: Vec<Vec<u8>>,
    inner: Vec<Vec<u8>>,
}

/// Literals a key must contain for a pattern to match it, for the matcher's prefilter. Each
/// field is one option: all of `prefixes` alternatives (the key starts with one of them), all of
/// `suffixes` alternatives, or any single entry of `inner` (the key contains it).
#[derive(Clone, Debug, Default)]
pub(crate) struct RequiredLiterals {
    pub(crate) prefixes: Vec<Vec<u8>>,
    pub(crate) suffixes: Vec<Vec<u8>>,
    pub(crate) inner: Vec<Vec<u8>>,
}

/// A pattern that does not compile, with the byte offset in its source where the problem is,
/// so that config diagnostics can point at the column.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PatternError {
    pub offset: usize,
    pub message: String,
}

fn error(offset: usize, message: impl Into<String>) -> PatternError {
    PatternError {
        offset,
        message: message.into(),
    }
}

#[derive(Debug)]
enum Token {
    Lit(Vec<u8>),
    Star,
    Capture,
}

/// At most this many alternative prefixes (suffixes) of a regex rule are indexed; beyond it the
/// rule is cheaper to run in the shared regex set than to look up under each one. 64 admits a
/// case-insensitive word of six letters, a common way to start a regex rule.
const MAX_REGEX_LITERALS: usize = 64;

/// Shorter literals are no use as an index: nearly every key would make the rule a candidate,
/// and verifying a regex alone costs more than its share of the regex set.
const MIN_REGEX_LITERAL: usize = 2;

impl Pattern {
    /// Compiles a `match:` pattern (docs/rules.md#patterns).
    pub fn parse(src: &str) -> Result<Pattern, PatternError> {
        let (tokens, names) = tokenize(src)?;
        let shape = Shape::new(&tokens);

        let mut re = String::from("(?s-u)^");
        let mut glob = Vec::new();
        let mut names_iter = names.iter();
        let mut prev_wildcard = false;
        for token in &tokens {
            match token {
                Token::Lit(bytes) => {
                    for &b in bytes {
                        if b.is_ascii_alphanumeric() || b == b'_' {
                            re.push(char::from(b));
                        } else {
                            // `\xNN` under `-u` is one byte, also for bytes of non-ASCII chars.
                            write!(re, r"\x{b:02X}").expect("writing to a String");
                        }
                    }
                    glob.extend_from_slice(&glob_escape(bytes));
                }
                Token::Star | Token::Capture => {
                    if let Token::Capture = token {
                        let name = names_iter.next().expect("one name per capture");
                        write!(re, "(?P<{name}>.+?)").expect("writing to a String");
                    } else {
                        re.push_str(".*");
                    }
                    // A run of wildcards is one `*`: Redis would otherwise try each split.
                    if !prev_wildcard {
                        glob.push(b'*');
                    }
                }
            }
            prev_wildcard = !matches!(token, Token::Lit(_));
        }
        re.push('$');
        let regex = Regex::new(&re).map_err(|e| error(0, format!("pattern too large: {e}")))?;
        let capture_groups = (1..=names.len()).collect();
        Ok(Pattern {
            source: src.to_owned(),
            glob_exact: names.is_empty(),
            capture_names: names,
            capture_groups,
            regex,
            glob,
            kind: Kind::Shape(shape),
        })
    }

    /// Compiles a `regex:` rule: the regex must match the whole key, as in Alertmanager, so it
    /// is anchored at both ends whether or not it says so. Its named groups are the captures;
    /// unnamed groups capture nothing. It uses the `regex` crate's syntax with its defaults
    /// (Unicode on, `.` not matching `\n`); `(?s-u)` makes it match arbitrary bytes.
    pub fn from_regex(src: &str) -> Result<Pattern, PatternError> {
        let ast = ast::parse::Parser::new().parse(src).map_err(|e| {
            error(
                e.span().start.offset,
                format!("invalid regex: {}", e.kind()),
            )
        })?;
        check_group_names(&ast)?;
        let hir = regex_syntax::hir::translate::TranslatorBuilder::new()
            .utf8(false)
            .build()
            .translate(src, &ast)
            .map_err(|e| {
                error(
                    e.span().start.offset,
                    format!("invalid regex: {}", e.kind()),
                )
            })?;

        // Anchor the printed HIR rather than the source: a `(?x)` comment in the source would
        // swallow a `)$` appended to it.
        let anchored = format!("^(?:{hir})$");
        let regex = Regex::new(&anchored).map_err(|e| error(0, format!("invalid regex: {e}")))?;

        let mut capture_names = Vec::new();
        let mut capture_groups = Vec::new();
        for (group, name) in regex.capture_names().enumerate() {
            if let Some(name) = name {
                capture_names.push(name.to_owned());
                capture_groups.push(group);
            }
        }

        let prefix_seq = Extractor::new().kind(ExtractKind::Prefix).extract(&hir);
        let mut glob = glob_escape(prefix_seq.longest_common_prefix().unwrap_or(b""));
        glob.push(b'*');
        let literals = RegexLiterals {
            prefixes: usable_literals(&hir, ExtractKind::Prefix),
            suffixes: usable_literals(&hir, ExtractKind::Suffix),
            inner: {
                let mut required = Vec::new();
                required_literals(&hir, &mut required);
                required.sort_unstable();
                required.dedup();
                required
            },
        };
        Ok(Pattern {
            source: src.to_owned(),
            capture_names,
            capture_groups,
            regex,
            glob,
            glob_exact: false,
            kind: Kind::Regex(literals),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Capture names in order of appearance; [`Pattern::captures`] returns values in this order.
    pub fn capture_names(&self) -> &[String] {
        &self.capture_names
    }

    /// The captured values of a matching key, aligned with [`Pattern::capture_names`]. A named
    /// group of a `regex:` rule that took no part in the match yields an empty value.
    pub fn captures(&self, key: &[u8]) -> Option<Vec<Vec<u8>>> {
        Some(
            self.capture_ranges(key)?
                .into_iter()
                .map(|r| key[r].to_vec())
                .collect(),
        )
    }

    /// Where in `key` each of [`Pattern::captures`] is: what shares a long key's bytes rather
    /// than copy them (docs/reliability.md#bounded-whatever-the-key).
    pub fn capture_ranges(&self, key: &[u8]) -> Option<Vec<std::ops::Range<usize>>> {
        if let Kind::Shape(shape) = &self.kind {
            if !shape.is_match(key) {
                return None;
            }
            if shape.tail_capture {
                return Some(std::iter::once(shape.head.len()..key.len()).collect());
            }
        }
        let caps = self.regex.captures(key)?;
        Some(
            self.capture_groups
                .iter()
                .map(|&g| caps.get(g).map_or(0..0, |m| m.range()))
                .collect(),
        )
    }

    #[inline]
    pub fn is_match(&self, key: &[u8]) -> bool {
        match &self.kind {
            Kind::Shape(shape) => shape.is_match(key),
            Kind::Regex(_) => self.regex.is_match(key),
        }
    }

    /// The Redis `SCAN MATCH` glob: every key the pattern accepts matches it (see
    /// [`Pattern::glob_is_exact`] for the converse).
    pub fn scan_glob(&self) -> &[u8] {
        &self.glob
    }

    /// Whether the glob accepts exactly the keys the pattern accepts, so a scanner may skip
    /// matching what SCAN returns. That holds for `match:` patterns without captures only: a
    /// capture needs at least one byte where the glob's `*` takes none, so the key made of the
    /// pattern's literals alone is always a counterexample. `regex:` rules are never exact.
    pub fn glob_is_exact(&self) -> bool {
        self.glob_exact
    }

    pub(crate) fn is_regex(&self) -> bool {
        matches!(self.kind, Kind::Regex(_))
    }

    /// The anchored regex that defines the pattern, for a shared `RegexSet`.
    pub(crate) fn regex_str(&self) -> &str {
        self.regex.as_str()
    }

    pub(crate) fn required_literals(&self) -> RequiredLiterals {
        match &self.kind {
            Kind::Regex(lits) => RequiredLiterals {
                prefixes: lits.prefixes.clone(),
                suffixes: lits.suffixes.clone(),
                inner: lits.inner.clone(),
            },
            Kind::Shape(shape) => {
                let mut req = RequiredLiterals::default();
                if !shape.head.is_empty() {
                    req.prefixes.push(shape.head.clone());
                }
                if let Some((last, middle)) = shape.gaps.split_last() {
                    if !last.lit.is_empty() {
                        req.suffixes.push(last.lit.clone());
                    }
                    req.inner = middle.iter().map(|g| g.lit.clone()).collect();
                }
                req
            }
        }
    }
}

/// Escapes the Redis glob metacharacters `* ? [ ] \`, so that the glob matches exactly `raw`.
/// `^` and `-` need nothing: they are special only inside `[...]`, which cannot open.
pub fn glob_escape(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() + raw.len() / 8);
    glob_escape_into(&mut out, raw);
    out
}

/// [`glob_escape`] appended to `out` (a value of megabytes escaped where it goes, not copied
/// twice).
pub fn glob_escape_into(out: &mut Vec<u8>, raw: &[u8]) {
    let specials = raw
        .iter()
        .filter(|&&b| matches!(b, b'*' | b'?' | b'[' | b']' | b'\\'))
        .count();
    out.reserve_exact(raw.len() + specials);
    for &b in raw {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
}

/// What a Redis glob's keys all start with, escapes resolved: up to its first unescaped `*`, `?`
/// or `[`; and whether that is the whole glob (it has no wildcard: one key, the literal).
pub fn glob_literal_start(glob: &[u8]) -> (Vec<u8>, bool) {
    let end = glob_wildcard(glob);
    let mut start = glob[..end.unwrap_or(glob.len())].to_vec();
    glob_unescape(&mut start);
    (start, end.is_none())
}

/// Where a Redis glob's first unescaped `*`, `?` or `[` is, if it has one.
pub fn glob_wildcard(glob: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < glob.len() {
        match glob[i] {
            b'\\' if i + 1 < glob.len() => i += 2,
            b'*' | b'?' | b'[' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// Resolves a glob's escapes in place (`\\x` → `x`; a last lone `\\` stays): the key a glob
/// without wildcards stands for, without a copy of a glob of megabytes.
pub fn glob_unescape(glob: &mut Vec<u8>) {
    let (mut from, mut to) = (0, 0);
    while from < glob.len() {
        if glob[from] == b'\\' && from + 1 < glob.len() {
            from += 1;
        }
        glob[to] = glob[from];
        to += 1;
        from += 1;
    }
    glob.truncate(to);
}

/// Whether `key` matches the Redis glob `glob` as `SCAN MATCH` and `KEYS` match it (Redis's
/// `stringmatchlen`, case-sensitive): `*`, `?`, `[...]` with `^` and ranges, `\` escaping the
/// next byte. For a glob too long to send with every page of a `SCAN`: the walk sends a short
/// glob that covers it and checks each key it returns here
/// (docs/reliability.md#bounded-whatever-the-key).
pub fn glob_matches(glob: &[u8], key: &[u8]) -> bool {
    // Greedy, with one backtrack point: the last `*` and where the key stood when it was met.
    // Every other token matches exactly one byte, so nothing before that `*` needs revisiting.
    let (mut g, mut k) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while k < key.len() {
        if glob.get(g) == Some(&b'*') {
            while glob.get(g) == Some(&b'*') {
                g += 1;
            }
            star = Some((g, k));
            continue;
        }
        if let Some((true, next)) = one_byte(glob, g, key[k]) {
            g = next;
            k += 1;
            continue;
        }
        match star {
            Some((sg, sk)) => {
                star = Some((sg, sk + 1));
                g = sg;
                k = sk + 1;
            }
            None => return false,
        }
    }
    glob[g.min(glob.len())..].iter().all(|&b| b == b'*')
}

/// Whether the one-byte token of `glob` at `g` (not `*`) matches `c`, and where the next token
/// starts; `None` at the end of the glob.
fn one_byte(glob: &[u8], g: usize, c: u8) -> Option<(bool, usize)> {
    match *glob.get(g)? {
        b'?' => Some((true, g + 1)),
        b'\\' if g + 1 < glob.len() => Some((glob[g + 1] == c, g + 2)),
        b'[' => {
            let mut i = g + 1;
            let not = glob.get(i) == Some(&b'^');
            if not {
                i += 1;
            }
            let mut hit = false;
            loop {
                match glob.get(i) {
                    // Unclosed: what was read is the class (as Redis reads it).
                    None => break,
                    Some(b']') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') if i + 1 < glob.len() => {
                        hit |= glob[i + 1] == c;
                        i += 2;
                    }
                    Some(&a) if glob.get(i + 1) == Some(&b'-') && i + 2 < glob.len() => {
                        let b = glob[i + 2];
                        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                        hit |= (lo..=hi).contains(&c);
                        i += 3;
                    }
                    Some(&a) => {
                        hit |= a == c;
                        i += 1;
                    }
                }
            }
            Some((hit != not, i))
        }
        b => Some((b == c, g + 1)),
    }
}

fn tokenize(src: &str) -> Result<(Vec<Token>, Vec<String>), PatternError> {
    let bytes = src.as_bytes();
    let mut tokens: Vec<Token> = Vec::new();
    let mut names: Vec<(String, usize)> = Vec::new();
    let push_lit = |tokens: &mut Vec<Token>, lit: &[u8]| match tokens.last_mut() {
        Some(Token::Lit(prev)) => prev.extend_from_slice(lit),
        _ => tokens.push(Token::Lit(lit.to_vec())),
    };
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => match bytes.get(i + 1) {
                Some(&c @ (b'{' | b'}' | b'*' | b'\\')) => {
                    push_lit(&mut tokens, &[c]);
                    i += 2;
                }
                None => {
                    return Err(error(
                        i,
                        r"lone `\` at the end of the pattern: write `\\` for a literal backslash",
                    ));
                }
                Some(_) => {
                    let c = src[i + 1..].chars().next().expect("a char follows");
                    return Err(error(
                        i,
                        format!(
                            r"`\{c}` is not an escape: only `\{{`, `\}}`, `\*` and `\\` are; write `{c}` alone for a literal `{c}`"
                        ),
                    ));
                }
            },
            b'{' => {
                let start = i + 1;
                let Some(len) = bytes[start..].iter().position(|&b| b == b'}') else {
                    return Err(error(
                        i,
                        format!(
                            r"unterminated capture `{}`: close it with `}}`, or write `\{{` for a literal brace",
                            &src[i..]
                        ),
                    ));
                };
                let name = &src[start..start + len];
                check_name(name, start)?;
                if let Some((_, first)) = names.iter().find(|(n, _)| n == name) {
                    return Err(error(
                        i,
                        format!(
                            "capture `{{{name}}}` appears twice (first at byte {first}): a name captures one value; rename one, or write `*` where the value is not needed"
                        ),
                    ));
                }
                names.push((name.to_owned(), i));
                tokens.push(Token::Capture);
                i = start + len + 1;
            }
            b'}' => {
                return Err(error(
                    i,
                    r"stray `}` with no `{` before it: write `\}` for a literal brace",
                ));
            }
            b'*' => {
                tokens.push(Token::Star);
                i += 1;
            }
            b => {
                push_lit(&mut tokens, &[b]);
                i += 1;
            }
        }
    }
    Ok((tokens, names.into_iter().map(|(n, _)| n).collect()))
}

/// Capture names become template variables, so they are restricted to what every template
/// engine and every reader takes for an identifier: `[a-z_][a-z0-9_]*`.
fn check_name(name: &str, offset: usize) -> Result<(), PatternError> {
    if name.is_empty() {
        return Err(error(
            offset - 1,
            r"empty capture `{}`: give it a name, e.g. `{id}`, or write `\{\}` for literal braces",
        ));
    }
    let bad = name
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_lowercase() || c == '_' || (i > 0 && c.is_ascii_digit())));
    if let Some((at, _)) = bad {
        return Err(error(
            offset + at,
            format!(
                "capture name `{name}` is not valid: use lowercase letters, digits and `_`, not starting with a digit, e.g. `order_id`"
            ),
        ));
    }
    Ok(())
}

fn check_group_names(ast: &Ast) -> Result<(), PatternError> {
    struct Names;
    impl ast::Visitor for Names {
        type Output = ();
        type Err = PatternError;
        fn finish(self) -> Result<(), PatternError> {
            Ok(())
        }
        fn visit_pre(&mut self, ast: &Ast) -> Result<(), PatternError> {
            if let Ast::Group(group) = ast
                && let ast::GroupKind::CaptureName { name, .. } = &group.kind
            {
                check_name(&name.name, name.span.start.offset)?;
            }
            Ok(())
        }
    }
    ast::visit(ast, Names)
}

fn usable_literals(hir: &Hir, kind: ExtractKind) -> Vec<Vec<u8>> {
    let seq = Extractor::new().kind(kind).extract(hir);
    match seq.literals() {
        Some(lits)
            if !lits.is_empty()
                && lits.len() <= MAX_REGEX_LITERALS
                && lits.iter().all(|l| l.as_bytes().len() >= MIN_REGEX_LITERAL) =>
        {
            lits.iter().map(|l| l.as_bytes().to_vec()).collect()
        }
        _ => Vec::new(),
    }
}

/// Collects literals that every match of `hir` contains. Only what is certain: a literal, and
/// what must occur inside a concatenation, a capture or a repetition of at least one.
fn required_literals(hir: &Hir, out: &mut Vec<Vec<u8>>) {
    match hir.kind() {
        HirKind::Literal(lit) => out.push(lit.0.to_vec()),
        HirKind::Capture(cap) => required_literals(&cap.sub, out),
        HirKind::Repetition(rep) if rep.min >= 1 => required_literals(&rep.sub, out),
        HirKind::Concat(subs) => subs.iter().for_each(|sub| required_literals(sub, out)),
        _ => {}
    }
}

impl Shape {
    fn new(tokens: &[Token]) -> Shape {
        let mut head = Vec::new();
        let mut gaps = Vec::new();
        let mut run: Option<(usize, usize)> = None; // (captures in run, tokens in run)
        let mut single_capture_tail = false;
        for token in tokens {
            match token {
                Token::Lit(lit) => match run.take() {
                    None => head = lit.clone(),
                    Some((min, _)) => gaps.push(Gap::new(min, lit.clone())),
                },
                Token::Star | Token::Capture => {
                    let (min, n) = run.get_or_insert((0, 0));
                    *n += 1;
                    if let Token::Capture = token {
                        *min += 1;
                    }
                }
            }
        }
        if let Some((min, n)) = run {
            single_capture_tail = gaps.is_empty() && min == 1 && n == 1;
            gaps.push(Gap::new(min, Vec::new()));
        }
        let min_len = head.len() + gaps.iter().map(|g| g.min + g.lit.len()).sum::<usize>();
        Shape {
            head,
            gaps,
            min_len,
            tail_capture: single_capture_tail,
        }
    }

    #[inline]
    fn is_match(&self, key: &[u8]) -> bool {
        let Some((last, middle)) = self.gaps.split_last() else {
            return key == self.head.as_slice();
        };
        if key.len() < self.min_len || !key.starts_with(&self.head) || !key.ends_with(&last.lit) {
            return false;
        }
        let end = key.len() - last.lit.len();
        let mut pos = self.head.len();
        for gap in middle {
            pos += gap.min;
            if pos > end {
                return false;
            }
            match gap.finder.find(&key[pos..end]) {
                Some(at) => pos += at + gap.lit.len(),
                None => return false,
            }
        }
        pos + last.min <= end
    }
}

impl Gap {
    fn new(min: usize, lit: Vec<u8>) -> Gap {
        let finder = Finder::new(&lit).into_owned();
        Gap { min, lit, finder }
    }
}

/// Generators and oracles shared by the property tests of this module and of the matcher.
#[cfg(test)]
pub(crate) mod testkit {
    use proptest::prelude::*;

    /// One token of a generated `match:` pattern; captures are named `c0`, `c1`, … in order.
    #[derive(Clone, Debug)]
    pub(crate) enum Tok {
        Lit(String),
        Cap,
        Star,
    }

    /// Characters for literals: the pattern and glob metacharacters, a multi-byte one, and
    /// a few plain ones so that literals recur in keys.
    const LIT_CHARS: &[char] = &[
        'a', 'b', ':', '*', '?', '[', ']', '\\', '{', '}', '^', '-', 'é',
    ];

    /// Pieces of keys: the literal characters' bytes, plus bytes no pattern literal has.
    const KEY_PIECES: &[&[u8]] = &[
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
        "é".as_bytes(),
        b"\xC3",
        b"\xff",
        b"\n",
        b"\0",
        b"ab",
        b"a:b",
        b"x",
    ];

    pub(crate) fn literal(min: usize, max: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(LIT_CHARS), min..=max)
            .prop_map(|cs| cs.into_iter().collect())
    }

    pub(crate) fn tokens() -> impl Strategy<Value = Vec<Tok>> {
        let tok = prop_oneof![
            3 => literal(1, 3).prop_map(Tok::Lit),
            2 => Just(Tok::Cap),
            1 => Just(Tok::Star),
        ];
        prop::collection::vec(tok, 0..7)
    }

    pub(crate) fn bytes_from_pieces(max_pieces: usize) -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(prop::sample::select(KEY_PIECES), 0..=max_pieces)
            .prop_map(|ps| ps.concat())
    }

    /// The pattern source of `toks`, escaping literal `{ } * \`.
    pub(crate) fn source(toks: &[Tok]) -> String {
        let mut src = String::new();
        let mut caps = 0;
        for tok in toks {
            match tok {
                Tok::Lit(lit) => {
                    for c in lit.chars() {
                        if matches!(c, '{' | '}' | '*' | '\\') {
                            src.push('\\');
                        }
                        src.push(c);
                    }
                }
                Tok::Cap => {
                    src.push_str(&format!("{{c{caps}}}"));
                    caps += 1;
                }
                Tok::Star => src.push('*'),
            }
        }
        src
    }

    /// docs/rules.md#patterns word for word, written apart from the implementation: `{name}` is
    /// `(?P<name>.+?)`, `*` is `.*`, anchored, on bytes.
    pub(crate) fn reference_regex(toks: &[Tok]) -> regex::bytes::Regex {
        let mut re = String::from("(?s-u)^");
        let mut caps = 0;
        for tok in toks {
            match tok {
                Tok::Lit(lit) => {
                    for c in lit.chars() {
                        if c.is_ascii() {
                            re.push_str(&regex::escape(c.encode_utf8(&mut [0; 4])));
                        } else {
                            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                                re.push_str(&format!(r"\x{b:02x}"));
                            }
                        }
                    }
                }
                Tok::Cap => {
                    re.push_str(&format!("(?P<c{caps}>.+?)"));
                    caps += 1;
                }
                Tok::Star => re.push_str(".*"),
            }
        }
        re.push('$');
        regex::bytes::Regex::new(&re).unwrap()
    }

    /// Whether Redis's `SCAN … MATCH glob` returns `key`: SCAN does not match at all when the
    /// glob is exactly `*` (so the empty key is returned), otherwise it is `stringmatchlen`.
    pub(crate) fn scan_accepts(glob: &[u8], key: &[u8]) -> bool {
        glob == b"*" || stringmatchlen(glob, key)
    }

    /// A port of Redis's `stringmatchlen` (src/util.c, case-sensitive), as of the fix for
    /// CVE-2022-36021 (`skipLongerMatches`) and the later nesting limit. Reads past the end of
    /// the pattern see the C string's terminating NUL, as in Redis.
    pub(crate) fn stringmatchlen(pattern: &[u8], string: &[u8]) -> bool {
        let mut skip_longer_matches = false;
        matchlen(pattern, 0, string, 0, &mut skip_longer_matches, 0)
    }

    fn matchlen(
        pat: &[u8],
        mut pi: usize,
        s: &[u8],
        mut si: usize,
        skip_longer_matches: &mut bool,
        nesting: u32,
    ) -> bool {
        if nesting > 1000 {
            return false;
        }
        let p = |i: usize| pat.get(i).copied().unwrap_or(0);
        let mut plen = pat.len() - pi;
        let mut slen = s.len() - si;
        while plen > 0 && slen > 0 {
            match p(pi) {
                b'*' => {
                    while plen > 0 && p(pi + 1) == b'*' {
                        pi += 1;
                        plen -= 1;
                    }
                    if plen == 1 {
                        return true;
                    }
                    while slen > 0 {
                        if matchlen(pat, pi + 1, s, si, skip_longer_matches, nesting + 1) {
                            return true;
                        }
                        if *skip_longer_matches {
                            return false;
                        }
                        si += 1;
                        slen -= 1;
                    }
                    *skip_longer_matches = true;
                    return false;
                }
                b'?' => {
                    si += 1;
                    slen -= 1;
                }
                b'[' => {
                    pi += 1;
                    plen -= 1;
                    let not = p(pi) == b'^';
                    if not {
                        pi += 1;
                        plen -= 1;
                    }
                    let mut matched = false;
                    loop {
                        if p(pi) == b'\\' && plen >= 2 {
                            pi += 1;
                            plen -= 1;
                            if p(pi) == s[si] {
                                matched = true;
                            }
                        } else if p(pi) == b']' {
                            break;
                        } else if plen == 0 {
                            pi -= 1;
                            plen += 1;
                            break;
                        } else if plen >= 3 && p(pi + 1) == b'-' {
                            let (mut start, mut end) = (p(pi), p(pi + 2));
                            if start > end {
                                std::mem::swap(&mut start, &mut end);
                            }
                            pi += 2;
                            plen -= 2;
                            if (start..=end).contains(&s[si]) {
                                matched = true;
                            }
                        } else if p(pi) == s[si] {
                            matched = true;
                        }
                        pi += 1;
                        plen -= 1;
                    }
                    if not {
                        matched = !matched;
                    }
                    if !matched {
                        return false;
                    }
                    si += 1;
                    slen -= 1;
                }
                c => {
                    if c == b'\\' && plen >= 2 {
                        pi += 1;
                        plen -= 1;
                    }
                    if p(pi) != s[si] {
                        return false;
                    }
                    si += 1;
                    slen -= 1;
                }
            }
            pi += 1;
            plen -= 1;
            if slen == 0 {
                while p(pi) == b'*' {
                    pi += 1;
                    plen -= 1;
                }
                break;
            }
        }
        plen == 0 && slen == 0
    }

    #[test]
    fn oracle_agrees_with_known_redis_answers() {
        let cases: &[(&[u8], &[u8], bool)] = &[
            (b"h?llo", b"hello", true),
            (b"h*llo", b"heeeello", true),
            (b"h[ae]llo", b"hallo", true),
            (b"h[^e]llo", b"hello", false),
            (b"h[a-b]llo", b"hbllo", true),
            (b"h[b-a]llo", b"hbllo", true),
            (b"h\\*llo", b"h*llo", true),
            (b"h\\*llo", b"hxllo", false),
            (b"a*", b"a", true),
            (b"*a", b"", false),
            (b"*", b"", false),
            (b"", b"", true),
            (b"a*a*a*a*a*a*a*a*a*b", &[b'a'; 40], false),
            (b"[", b"[", false),
            (b"[a", b"a", true),
            (b"\\", b"\\", true),
        ];
        for &(glob, key, want) in cases {
            assert_eq!(stringmatchlen(glob, key), want, "{glob:?} {key:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;
    use proptest::prelude::*;

    fn err(src: &str) -> PatternError {
        Pattern::parse(src).expect_err(src)
    }

    fn caps(p: &str, key: &[u8]) -> Option<Vec<Vec<u8>>> {
        Pattern::parse(p).unwrap().captures(key)
    }

    fn v(s: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
        Some(s.iter().map(|s| s.to_vec()).collect())
    }

    #[test]
    fn parse_errors_point_at_the_problem() {
        let e = err(r"a:\");
        assert_eq!(e.offset, 2);
        assert_eq!(
            e.message,
            r"lone `\` at the end of the pattern: write `\\` for a literal backslash"
        );
        let e = err(r"a\?b");
        assert_eq!(e.offset, 1);
        assert_eq!(
            e.message,
            r"`\?` is not an escape: only `\{`, `\}`, `\*` and `\\` are; write `?` alone for a literal `?`"
        );
        assert!(err(r"\é").message.starts_with(r"`\é` is not an escape"));
        let e = err("lock:{id");
        assert_eq!(e.offset, 5);
        assert_eq!(
            e.message,
            r"unterminated capture `{id`: close it with `}`, or write `\{` for a literal brace"
        );
        let e = err("lock:{}");
        assert_eq!(e.offset, 5);
        assert!(e.message.starts_with("empty capture `{}`"), "{}", e.message);
        let e = err("lock:{Id}");
        assert_eq!(e.offset, 6);
        assert!(e.message.starts_with("capture name `Id` is not valid"));
        assert_eq!(err("lock:{1d}").offset, 6);
        assert_eq!(err("lock:{i-d}").offset, 7);
        assert_eq!(err("é:{a b}").offset, 5, "offsets are in bytes");
        let e = err("{x}:{y}:{x}");
        assert_eq!(e.offset, 8);
        assert_eq!(
            e.message,
            "capture `{x}` appears twice (first at byte 0): a name captures one value; \
             rename one, or write `*` where the value is not needed"
        );
        let e = err("a}b");
        assert_eq!(e.offset, 1);
        assert_eq!(
            e.message,
            r"stray `}` with no `{` before it: write `\}` for a literal brace"
        );
        assert_eq!(
            err("{a{b}").offset,
            2,
            "a `{{` inside a name is an invalid character"
        );
        assert_eq!(err("{a}}").offset, 3);
    }

    #[test]
    fn valid_names_and_literals() {
        for src in ["", "*", "{_}", "{a0_z}", r"\{\}\*\\", "a?[b]^-", "é{x}"] {
            Pattern::parse(src).unwrap_or_else(|e| panic!("{src}: {e}"));
        }
    }

    #[test]
    fn captures_follow_lazy_backtracking() {
        assert_eq!(caps("order_lock:{order_id}", b"order_lock:42"), v(&[b"42"]));
        assert_eq!(caps("order_lock:{order_id}", b"order_lock:"), None);
        assert_eq!(caps("order_lock:{order_id}", b"order_lock"), None);
        assert_eq!(caps("a:{x}:b", b"a:1:2:b"), v(&[b"1:2"]));
        assert_eq!(caps("a:{x}:b", b"a::b"), None);
        assert_eq!(caps("a:{x}:b", b"a:::b"), v(&[b":"]));
        assert_eq!(caps("{a}:{b}", b"x:y:z"), v(&[b"x", b"y:z"]));
        assert_eq!(caps("{a}{b}", b"xyz"), v(&[b"x", b"yz"]));
        assert_eq!(caps("{a}{b}", b"x"), None);
        assert_eq!(caps("*:{x}", b"a:b:c"), v(&[b"c"]));
        assert_eq!(caps("{x}*", b"abc"), v(&[b"a"]));
        assert_eq!(caps("*{x}", b"abc"), v(&[b"c"]));
        assert_eq!(
            caps("cache:{user}:{kind}", b"cache:u1:profile:v2"),
            v(&[b"u1", b"profile:v2"])
        );
        assert_eq!(caps(r"\{x\}:{v}", b"{x}:1"), v(&[b"1"]));
        assert_eq!(caps("x{a}x{b}x", b"xxxxx"), v(&[b"x", b"x"]));
        assert_eq!(caps("x{a}x{b}x", b"xxxx"), None);
    }

    #[test]
    fn metacharacters_are_literal() {
        let p = Pattern::parse(r"a?[b]\*\\").unwrap();
        assert!(p.is_match(br"a?[b]*\"));
        assert!(!p.is_match(b"ab*\\"));
        assert!(!p.is_match(br"a?[b]x\"));
        assert!(Pattern::parse("*").unwrap().is_match(b""));
        assert!(Pattern::parse("").unwrap().is_match(b""));
        assert!(!Pattern::parse("").unwrap().is_match(b"a"));
    }

    #[test]
    fn keys_are_bytes() {
        let key = b"k:\xff\xfe\n\0:end";
        assert_eq!(caps("k:{x}", key), v(&[b"\xff\xfe\n\0:end"]));
        assert_eq!(caps("k:{x}:end", key), v(&[b"\xff\xfe\n\0"]));
        assert!(Pattern::parse("k:*").unwrap().is_match(key));
        assert_eq!(caps("é:{x}", "é:ü".as_bytes()), v(&["ü".as_bytes()]));
        assert_eq!(
            caps("é:{x}", b"\xc3:x"),
            None,
            "a literal's bytes match as a whole"
        );
    }

    #[test]
    fn hostile_keys_are_captured_verbatim() {
        for value in [
            &b"*"[..],
            b"@all",
            b"<!channel>",
            b"\\",
            b"{x}",
            b"a:b",
            b"%00",
        ] {
            let key = [b"session:", value].concat();
            assert_eq!(caps("session:{sid}", &key), v(&[value]));
            let key = [b"s:", value, b":end"].concat();
            assert_eq!(caps("s:{sid}:end", &key), v(&[value]));
        }
    }

    #[test]
    fn megabyte_keys() {
        let body = vec![b'a'; 1 << 20];
        let key = [&b"big:"[..], &body, b":end"].concat();
        assert_eq!(caps("big:{x}:end", &key), Some(vec![body.clone()]));
        assert_eq!(caps("big:{x}", &key).unwrap()[0].len(), body.len() + 4);
        assert!(Pattern::parse("*a:e*").unwrap().is_match(&key));
        assert!(!Pattern::parse("*a:x*").unwrap().is_match(&key));

        let colons = vec![b':'; 1 << 20];
        let got = caps("{a}:{b}:{c}", &colons).unwrap();
        assert_eq!(got[0], b":");
        assert_eq!(got[1], b":");
        assert_eq!(got[2].len(), colons.len() - 4);
        assert_eq!(caps("{a}:{b}:{c}", &colons[..4]), None);
    }

    #[test]
    fn globs() {
        let cases: &[(&str, &[u8], bool)] = &[
            ("order_lock:{order_id}", b"order_lock:*", false),
            ("cache:{user}:{kind}", b"cache:*:*", false),
            ("a*{x}*b", b"a*b", false),
            ("{x}", b"*", false),
            ("*", b"*", true),
            ("**", b"*", true),
            ("", b"", true),
            ("cache:*", b"cache:*", true),
            ("*:lock:*", b"*:lock:*", true),
            (r"l\*\{\}\\?[]^-:{x}", br"l\*{}\\\?\[\]^-:*", false),
            (r"x\**", br"x\**", true),
        ];
        for &(src, glob, exact) in cases {
            let p = Pattern::parse(src).unwrap();
            assert_eq!(p.scan_glob(), glob, "{src}");
            assert_eq!(p.glob_is_exact(), exact, "{src}");
            assert_eq!(p.source(), src);
        }
    }

    #[test]
    fn glob_escape_escapes_exactly_the_metacharacters() {
        assert_eq!(glob_escape(br"a*b?c[d]e\f{g}^-"), br"a\*b\?c\[d\]e\\f{g}^-");
        assert_eq!(glob_escape(b""), b"");
        assert_eq!(glob_escape(b"\xff\0"), b"\xff\0");
    }

    #[test]
    fn regex_rules() {
        let p = Pattern::from_regex(r"^order_lock:(?P<order_id>\d+)$").unwrap();
        assert_eq!(p.capture_names(), ["order_id"]);
        assert_eq!(p.captures(b"order_lock:42"), v(&[b"42"]));
        assert!(!p.is_match(b"order_lock:42x"));
        assert_eq!(p.scan_glob(), b"order_lock:*");
        assert!(!p.glob_is_exact());

        let p = Pattern::from_regex(r"lock:(?P<id>\d+)").unwrap();
        assert!(!p.is_match(b"xlock:1"), "anchored at the start");
        assert!(!p.is_match(b"lock:1x"), "anchored at the end");
        assert!(
            Pattern::from_regex("a|b").unwrap().is_match(b"b"),
            "anchors bind the whole"
        );

        let p = Pattern::from_regex(r"(?P<a>x)?(y)(?P<b>z)").unwrap();
        assert_eq!(p.capture_names(), ["a", "b"]);
        assert_eq!(p.captures(b"yz"), v(&[b"", b"z"]));

        assert_eq!(
            Pattern::from_regex(r"foo[*]bar.*").unwrap().scan_glob(),
            br"foo\*bar*"
        );
        assert_eq!(Pattern::from_regex(r"(a|ab)c").unwrap().scan_glob(), b"a*");
        assert_eq!(Pattern::from_regex(r"(?i)abc").unwrap().scan_glob(), b"*");
        assert_eq!(Pattern::from_regex(r".*x").unwrap().scan_glob(), b"*");

        let p = Pattern::from_regex("(?x) k : (?P<id> .+ ) # the id\n").unwrap();
        assert_eq!(
            p.captures(b"k:1"),
            v(&[b"1"]),
            "a comment cannot eat the anchor"
        );
        let p = Pattern::from_regex(r"(?s-u)k:(?P<v>.+)").unwrap();
        assert_eq!(p.captures(b"k:\xff\n"), v(&[b"\xff\n"]));
    }

    #[test]
    fn regex_errors() {
        let e = Pattern::from_regex(r"a(b").unwrap_err();
        assert_eq!(e.offset, 1);
        assert_eq!(e.message, "invalid regex: unclosed group");
        let e = Pattern::from_regex(r"ab\pQ").unwrap_err();
        assert_eq!(e.offset, 2);
        assert!(e.message.starts_with("invalid regex: "), "{}", e.message);
        let e = Pattern::from_regex(r"x(?P<Bad>y)").unwrap_err();
        assert_eq!(e.offset, 5);
        assert!(e.message.starts_with("capture name `Bad` is not valid"));
        let e = Pattern::from_regex(r"(?P<a>x)(?P<a>y)").unwrap_err();
        assert_eq!(e.offset, 12);
    }

    /// A key built from `toks`, with the capture values it must yield, when the values are such
    /// that lazy matching cannot stop earlier: a value followed by a literal must not let that
    /// literal start inside it, and a value followed by another wildcard is one byte. Stars come
    /// after every capture, as greedy stars before a capture would shift it.
    fn build_key(toks: &[Tok], values: &[Vec<u8>], fillers: &[Vec<u8>]) -> Option<Vec<u8>> {
        let mut key = Vec::new();
        let (mut vi, mut fi) = (0, 0);
        for (i, tok) in toks.iter().enumerate() {
            match tok {
                Tok::Lit(l) => key.extend_from_slice(l.as_bytes()),
                Tok::Star => {
                    key.extend_from_slice(&fillers[fi]);
                    fi += 1;
                }
                Tok::Cap => {
                    let value = &values[vi];
                    vi += 1;
                    match toks.get(i + 1) {
                        None => {}
                        Some(Tok::Lit(l)) => {
                            let next = [value.as_slice(), l.as_bytes()].concat();
                            let first = memchr::memmem::find(&next[1..], l.as_bytes());
                            if first != Some(value.len() - 1) {
                                return None;
                            }
                        }
                        Some(_) if value.len() != 1 => return None,
                        Some(_) => {}
                    }
                    key.extend_from_slice(value);
                }
            }
        }
        Some(key)
    }

    fn captures_first(toks: Vec<Tok>) -> Vec<Tok> {
        let mut front = Vec::new();
        let mut stars = Vec::new();
        let caps = toks.iter().filter(|t| matches!(t, Tok::Cap)).count();
        let mut seen = 0;
        for t in toks {
            match t {
                Tok::Star if seen < caps => stars.push(Tok::Lit(":".into())),
                Tok::Cap => {
                    seen += 1;
                    front.push(t);
                }
                t => front.push(t),
            }
        }
        front.extend(stars);
        front
    }

    proptest! {
        #[test]
        fn built_keys_yield_their_values(
            toks in tokens().prop_map(captures_first),
            values in prop::collection::vec(
                prop_oneof![
                    prop::collection::vec(any::<u8>(), 1..6),
                    bytes_from_pieces(4).prop_filter("non-empty", |v| !v.is_empty()),
                ], 8),
            fillers in prop::collection::vec(bytes_from_pieces(3), 8),
        ) {
            let ncaps = toks.iter().filter(|t| matches!(t, Tok::Cap)).count();
            let key = build_key(&toks, &values, &fillers);
            prop_assume!(key.is_some());
            let key = key.unwrap();
            let p = Pattern::parse(&source(&toks)).unwrap();
            prop_assert!(p.is_match(&key));
            prop_assert_eq!(p.captures(&key), Some(values[..ncaps].to_vec()));
        }

        #[test]
        fn pattern_is_the_reference_regex(toks in tokens(), key in bytes_from_pieces(10)) {
            let p = Pattern::parse(&source(&toks)).unwrap();
            let re = reference_regex(&toks);
            prop_assert_eq!(p.is_match(&key), re.is_match(&key));
            let want = re.captures(&key).map(|c| {
                c.iter().skip(1).map(|m| m.unwrap().as_bytes().to_vec()).collect::<Vec<_>>()
            });
            prop_assert_eq!(p.captures(&key), want);
            let names: Vec<String> = re.capture_names().flatten().map(String::from).collect();
            prop_assert_eq!(p.capture_names(), names.as_slice());
        }

        #[test]
        fn escaped_bytes_glob_match_exactly_themselves(
            raw in prop::collection::vec(any::<u8>(), 0..12),
            other in prop::collection::vec(any::<u8>(), 0..12),
            pieces in bytes_from_pieces(6),
        ) {
            for raw in [&raw, &pieces] {
                let glob = glob_escape(raw);
                prop_assert!(stringmatchlen(&glob, raw));
                for key in [&other, &pieces, &raw[..raw.len().saturating_sub(1)].to_vec()] {
                    prop_assert_eq!(stringmatchlen(&glob, key), key == raw);
                }
            }
        }

        #[test]
        fn scan_glob_covers_the_pattern(
            toks in tokens(),
            values in prop::collection::vec(bytes_from_pieces(3), 8),
            noise in bytes_from_pieces(10),
        ) {
            let p = Pattern::parse(&source(&toks)).unwrap();
            // Keys near the pattern: its own shape with arbitrary fillers (some empty, so some
            // do not match), and one made of its literals alone.
            let mut built = Vec::new();
            let mut literals_only = Vec::new();
            let mut vi = 0;
            for tok in &toks {
                if let Tok::Lit(l) = tok {
                    built.extend_from_slice(l.as_bytes());
                    literals_only.extend_from_slice(l.as_bytes());
                } else {
                    built.extend_from_slice(&values[vi]);
                    vi += 1;
                }
            }
            for key in [&built, &literals_only, &noise] {
                let accepted = scan_accepts(p.scan_glob(), key);
                if p.is_match(key) {
                    prop_assert!(accepted, "glob {:?} misses {:?}", p.scan_glob(), key);
                }
                if p.glob_is_exact() {
                    prop_assert_eq!(accepted, p.is_match(key));
                }
            }
            if !p.glob_is_exact() {
                prop_assert!(scan_accepts(p.scan_glob(), &literals_only));
                prop_assert!(!p.is_match(&literals_only));
            }
        }
    }
}
