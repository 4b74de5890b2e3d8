//! Rule files → a validated [`Config`].
//!
//! Loading reads every file, parses YAML into a spanned tree ([`yaml`]), decodes each section
//! into drafts while collecting every problem ([`crate::yaml::decode`], [`sections`], [`crate::channel`],
//! [`rules`]), then checks meaning across files and compiles patterns, templates and the
//! matcher ([`build`]). Nothing stops at the first problem.

pub(crate) mod build;
pub(crate) mod fields;
pub(crate) mod followups;
pub(crate) mod live;
pub(crate) mod matching;
pub(crate) mod model;
pub(crate) mod quiet;
pub(crate) mod rules;
pub(crate) mod sections;
pub(crate) mod server;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::yaml::decode::Mode;
pub use crate::yaml::diagnostic::{Diagnostic, Loc, Severity};
pub use live::{ConfigPublisher, LiveConfig};
pub use model::*;

use crate::yaml::decode::Decoder;
use crate::yaml::diagnostic::Diagnostics;
use crate::yaml::{Kind, Node};

/// Why loading failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A path could not be read at all (exit code 2).
    #[error("{0}")]
    Unreadable(String),
    /// The files were read but are not valid (exit code 1); the diagnostics say where.
    #[error("{} error(s) in the rule files", .0.iter().filter(|d| d.severity == Severity::Error).count())]
    Invalid(Vec<Diagnostic>),
}

/// A successful load, with the warnings met on the way.
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<Diagnostic>,
}

const SECTIONS: &[&str] = &[
    "redis",
    "state",
    "channels",
    "rules",
    "scanner",
    "history",
    "links",
    "server",
    "timezone",
    "quiet_hours",
];

/// Every `*.yaml`/`*.yml` file of `paths` (files as given; folders walked, sorted by path),
/// but rule tests (`*.test.yaml`): they live beside the rules they test and are read by
/// `keywatch test` (docs/rules.md#testing-rules).
pub fn rule_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, LoadError> {
    let mut out = Vec::new();
    for p in paths {
        let meta = std::fs::metadata(p)
            .map_err(|e| LoadError::Unreadable(format!("{}: cannot read: {e}", p.display())))?;
        if !meta.is_dir() && is_rule_test(p) {
            return Err(LoadError::Unreadable(format!(
                "{}: a rule test, not a rule file: run it with `keywatch test {}`",
                p.display(),
                p.display()
            )));
        }
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(p, &mut found)
                .map_err(|e| LoadError::Unreadable(format!("{}: cannot read: {e}", p.display())))?;
            found.sort();
            if found.is_empty() {
                return Err(LoadError::Unreadable(format!(
                    "{}: no rule files (*.yaml, *.yml) in this folder",
                    p.display()
                )));
            }
            out.extend(found);
        } else {
            out.push(p.clone());
        }
    }
    out.dedup();
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if is_rule_test(&path) {
            continue;
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether `path` names a rule test file (`*.test.yaml`, `*.test.yml`), which `keywatch test`
/// reads and rule loading skips.
pub fn is_rule_test(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".test.yaml") || n.ends_with(".test.yml"))
}

/// Loads and validates the rule files under `paths`, reading the environment through `env`.
pub fn load(
    paths: &[PathBuf],
    mode: Mode,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Loaded, LoadError> {
    let (files, texts) = read_rule_files(paths)?;
    load_texts(files, &texts, mode, env)
}

/// The rule files under `paths` and their texts, in load order.
pub fn read_rule_files(paths: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<String>), LoadError> {
    let files = rule_files(paths)?;
    let mut texts = Vec::with_capacity(files.len());
    for f in &files {
        let bytes = std::fs::read(f)
            .map_err(|e| LoadError::Unreadable(format!("{}: cannot read: {e}", f.display())))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            LoadError::Unreadable(format!(
                "{}: not UTF-8 text (invalid byte at offset {})",
                f.display(),
                e.utf8_error().valid_up_to()
            ))
        })?;
        texts.push(text);
    }
    Ok((files, texts))
}

/// `check`'s verdict on one rules file's text (tests): what it loads, or every diagnostic as
/// printed.
#[cfg(test)]
pub(crate) fn checked(yaml: &str) -> Result<Loaded, Vec<String>> {
    load_texts(
        vec![std::path::PathBuf::from("rules.yaml")],
        &[yaml.to_string()],
        Mode::Check,
        &|_| None,
    )
    .map_err(|e| match e {
        LoadError::Invalid(diags) => diags.iter().map(ToString::to_string).collect(),
        LoadError::Unreadable(m) => vec![m],
    })
}

/// The config of one rules file's text, which must load (tests). `mode` as the command that
/// would load it: `Check` reports what `Run` would also refuse, without needing the environment.
#[cfg(test)]
pub(crate) fn of_yaml(yaml: &str, mode: Mode) -> Config {
    load_texts(
        vec!["rules.yaml".into()],
        &[yaml.to_string()],
        mode,
        &|_| None,
    )
    .unwrap_or_else(|e| panic!("the test's rules do not load: {e:?}"))
    .config
}

/// The same as [`load`] for texts already read (tests, reload).
pub fn load_texts(
    files: Vec<PathBuf>,
    texts: &[String],
    mode: Mode,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Loaded, LoadError> {
    let mut diags = Diagnostics::default();
    let mut drafts = build::Drafts::default();
    let mut channel_names: Vec<crate::yaml::decode::Spanned<String>> = Vec::new();
    let (config, secrets) = {
        let mut d = Decoder::new(&mut diags, mode, env);
        for (path, text) in files.iter().zip(texts) {
            let file: Arc<Path> = Arc::from(path.as_path());
            let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
            for doc in crate::yaml::parse(&file, text, d.diags) {
                decode_document(&mut d, &doc, &base, &mut drafts, &mut channel_names);
            }
        }
        drafts.channel_names = channel_names.iter().map(|n| n.value.clone()).collect();
        let config = build::build(&mut d, drafts, files.clone());
        (config, d.secrets())
    };
    let order = |p: &Path| files.iter().position(|f| f == p).unwrap_or(usize::MAX);
    let has_errors = diags.has_errors();
    let mut all = diags.into_sorted(&order);
    // A message may quote a value (`… is not a duration`) that came from the environment.
    for diag in &mut all {
        diag.message = secrets.mask(&diag.message);
    }
    match config {
        Some(config) if !has_errors => Ok(Loaded {
            config,
            warnings: all,
        }),
        _ => Err(LoadError::Invalid(all)),
    }
}

fn decode_document(
    d: &mut Decoder<'_>,
    doc: &Node,
    base: &Path,
    drafts: &mut build::Drafts,
    channel_names: &mut Vec<crate::yaml::decode::Spanned<String>>,
) {
    if matches!(doc.kind, Kind::Null) {
        return;
    }
    let Some(mut m) = d.map(doc, "a rule file") else {
        return;
    };
    if let Some(n) = m.get("redis") {
        sections::decode_redis(d, n, base, &mut drafts.redis);
    }
    if let Some(n) = m.get("state") {
        sections::decode_state(d, n, &mut drafts.state);
    }
    if let Some(n) = m.get("channels") {
        crate::channel::decode_channels(d, n, base, &mut drafts.channels, channel_names);
    }
    if let Some(n) = m.get("rules") {
        rules::decode_rules(d, n, &mut drafts.rules);
    }
    if let Some(n) = m.get("scanner") {
        sections::decode_scanner(d, n, &mut drafts.scanner);
    }
    if let Some(n) = m.get("history") {
        followups::decode_history(d, n, &mut drafts.history);
    }
    if let Some(n) = m.get("links") {
        followups::decode_links(d, n, &mut drafts.links);
    }
    if let Some(n) = m.get("server") {
        server::decode_server(d, n, base, &mut drafts.server);
    }
    if let Some(n) = m.get("timezone") {
        quiet::decode_timezone(d, n, &mut drafts.quiet);
    }
    if let Some(n) = m.get("quiet_hours") {
        quiet::decode_quiet_hours(d, n, &mut drafts.quiet);
    }
    m.finish(d, SECTIONS, &|f| match f {
        "rule" => Some("rules are listed under `rules:`".into()),
        "channel" => Some("channels are defined under `channels:`".into()),
        _ => None,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rule test beside the rules it tests is not a rule file: `run -r rules/` and `check`
    /// skip it in a folder, and refuse it named on its own (it would only fail as rules).
    #[test]
    fn rule_tests_are_not_rule_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("locks.yaml"), "rules: []\n").unwrap();
        std::fs::write(dir.path().join("locks.test.yaml"), "tests: []\n").unwrap();
        std::fs::write(dir.path().join("other.test.yml"), "tests: []\n").unwrap();
        let files = rule_files(&[dir.path().to_path_buf()]).unwrap();
        assert_eq!(files, [dir.path().join("locks.yaml")]);
        let named = dir.path().join("locks.test.yaml");
        match rule_files(std::slice::from_ref(&named)) {
            Err(LoadError::Unreadable(msg)) => {
                assert!(msg.contains("keywatch test"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
    }
}
