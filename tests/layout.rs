//! The layout of `src/` shows the pipeline (sources → engine → delivery → actions), and stays
//! that way: no import circle between the crate's top-level modules, nor between its files, and
//! what keywatch keeps in Redis (`store`) imports none of the stages that use it.
//!
//! Reads the source text rather than compiler output, so it runs in every `cargo test`: every
//! `crate::…`, `super::…` and child-module path outside comments, string literals and unit-test
//! modules is resolved to the file that defines it, and the graph of those references must be
//! acyclic. A parent module declaring its children (`mod x;`) is not a reference; a parent that
//! *uses* a child while the child uses the parent is a circle like any other, so shared types
//! live in a file of their own that both import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module of the crate, as the path of segments from the crate root (`["channel", "http"]`).
type Module = Vec<String>;

struct Crate {
    /// Every module that is a file, with its code (comments, strings and tests removed).
    files: BTreeMap<Module, String>,
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut files = BTreeMap::new();
        walk(src, src, &mut files);
        Crate { files }
    }

    /// The longest prefix of `path` that is a module file.
    fn resolve(&self, path: &[String]) -> Option<Module> {
        (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|m| self.files.contains_key(m))
    }

    /// Which files each file refers to.
    fn references(&self) -> BTreeMap<Module, BTreeSet<Module>> {
        let mut out = BTreeMap::new();
        for (module, code) in &self.files {
            let children = children(code);
            let mut to = BTreeSet::new();
            for path in paths(code) {
                let absolute: Vec<String> = match path.first().map(String::as_str) {
                    Some("crate") => path[1..].to_vec(),
                    Some("super") => {
                        let mut base = module.clone();
                        let mut rest = &path[..];
                        while rest.first().map(String::as_str) == Some("super") {
                            base.pop();
                            rest = &rest[1..];
                        }
                        base.extend(rest.iter().cloned());
                        base
                    }
                    Some("self") => module.iter().chain(&path[1..]).cloned().collect(),
                    Some(first) if children.contains(first) => {
                        module.iter().chain(&path).cloned().collect()
                    }
                    _ => continue,
                };
                if let Some(target) = self.resolve(&absolute)
                    && &target != module
                {
                    to.insert(target);
                }
            }
            out.insert(module.clone(), to);
        }
        out
    }
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<Module, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(root, &path, out);
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let rel: PathBuf = path.strip_prefix(root).unwrap().with_extension("");
        let mut module: Module = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(
            module.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            module.pop();
        }
        if path.ends_with("main.rs") {
            continue; // the binary is a client of the library, not one of its modules
        }
        let text = std::fs::read_to_string(&path).unwrap();
        out.insert(module, code_of(&text));
    }
}

/// The code of a file without comments, string and char literals, and `#[cfg(test)]` modules.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'r' if matches!(b.get(i + 1), Some(b'"' | b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                while j < b.len() && !b[j..].starts_with(&close) {
                    j += 1;
                }
                i = j + close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal ('x', '\n', '\''), not a lifetime ('a).
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// The child modules a file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn children(code: &str) -> BTreeSet<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("pub(crate) mod "))
                .or_else(|| l.strip_prefix("mod "))?;
            rest.strip_suffix(';').map(str::to_string)
        })
        .collect()
}

/// Every path in `code` (`a::b::C`, with `use` groups `a::{b, c::D}` expanded), as segments.
fn paths(code: &str) -> Vec<Vec<String>> {
    let tokens = tokenize(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let starts = is_ident(&tokens[i])
            && tokens.get(i + 1).map(String::as_str) == Some("::")
            && (i == 0 || tokens[i - 1] != "::");
        if starts {
            let (found, next) = path_tree(&tokens, i);
            out.extend(found);
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The paths of the tree that starts at `tokens[i]`, and the index after it.
fn path_tree(tokens: &[String], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    while i < tokens.len() && is_ident(&tokens[i]) {
        prefix.push(tokens[i].clone());
        i += 1;
        if tokens.get(i).map(String::as_str) != Some("::") {
            return (vec![prefix], i);
        }
        i += 1;
        if tokens.get(i).map(String::as_str) == Some("{") {
            i += 1;
            let mut out = Vec::new();
            while i < tokens.len() && tokens[i] != "}" {
                if is_ident(&tokens[i]) {
                    let (found, next) = path_tree(tokens, i);
                    for f in found {
                        out.push(prefix.iter().cloned().chain(f).collect());
                    }
                    i = next;
                } else {
                    i += 1;
                }
            }
            if out.is_empty() {
                out.push(prefix);
            }
            return (out, i + 1);
        }
    }
    (vec![prefix], i)
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

fn tokenize(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += 1;
        }
    }
    out
}

/// Every circle of `graph`, each as the modules along it (found once, from its least member).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found = BTreeSet::new();
    for start in graph.keys() {
        // Depth-first from `start`, only through modules greater than it, so each circle is
        // reported once.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, path)) = stack.pop() {
            for next in graph.get(&at).into_iter().flatten() {
                if next == start {
                    found.insert(path.clone());
                } else if next > start && seen.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    found.into_iter().collect()
}

fn shown(circles: &[Vec<String>]) -> String {
    circles
        .iter()
        .map(|c| format!("  {} → {}", c.join(" → "), c[0]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn crate_src() -> Crate {
    Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_circle_between_top_level_modules() {
    let refs = crate_src().references();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in &refs {
        let Some(a) = from.first() else { continue };
        let entry = graph.entry(a.clone()).or_default();
        for t in to {
            if let Some(b) = t.first()
                && b != a
            {
                entry.insert(b.clone());
            }
        }
    }
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between top-level modules of src/:\n{}",
        shown(&found)
    );
}

/// What keywatch keeps in Redis (`src/store/`) sits below the stages: each stage calls it, and it
/// imports none of them (nor the commands above them), so data still flows one way.
#[test]
fn the_store_imports_no_stage() {
    const ABOVE: &[&str] = &[
        "source", "engine", "delivery", "action", "channel", "command",
    ];
    let refs = crate_src().references();
    let mut found = Vec::new();
    for (from, to) in &refs {
        if from.first().map(String::as_str) != Some("store") {
            continue;
        }
        for t in to {
            if t.first().is_some_and(|m| ABOVE.contains(&m.as_str())) {
                found.push(format!("{} imports {}", from.join("::"), t.join("::")));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the store imports a stage:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_circle_between_files() {
    let refs = crate_src().references();
    let graph: BTreeMap<String, BTreeSet<String>> = refs
        .iter()
        .map(|(from, to)| {
            (
                from.join("::"),
                to.iter().map(|t| t.join("::")).collect::<BTreeSet<_>>(),
            )
        })
        .collect();
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between files of src/:\n{}",
        shown(&found)
    );
}

/// The check itself finds what it is for: a made-up crate with a circle through a `use`
/// group, `super` and a child module, and none once the circle is cut.
#[test]
fn the_check_sees_circles_through_groups_super_and_children() {
    let with = |files: &[(&str, &str)]| -> Vec<Vec<String>> {
        let c = Crate {
            files: files
                .iter()
                .map(|(m, code)| {
                    let module: Module = m
                        .split("::")
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect();
                    (module, code_of(code))
                })
                .collect(),
        };
        let graph = c
            .references()
            .iter()
            .map(|(f, t)| (f.join("::"), t.iter().map(|t| t.join("::")).collect()))
            .collect();
        circles(&graph)
    };
    let circle = with(&[
        ("", "pub mod a;\npub mod b;"),
        (
            "a",
            "pub mod x;\nuse crate::{b::{B, C}};\n// crate::z::Z in a comment",
        ),
        ("a::x", "use super::super::b;"),
        (
            "b",
            "fn f() { let s = \"crate::a::x\"; crate::a::x::X::new(); crate::a::helper(); }",
        ),
    ]);
    assert_eq!(
        circle,
        vec![
            vec!["a".to_string(), "b".into()],
            vec!["a::x".into(), "b".into()]
        ]
    );
    let cut = with(&[
        ("", "pub mod a;\npub mod b;"),
        ("a", "pub mod x;\nuse crate::b::B;"),
        ("a::x", "pub struct X;"),
        ("b", "pub struct B;"),
    ]);
    assert!(cut.is_empty(), "{cut:?}");
}
