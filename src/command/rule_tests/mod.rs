//! `keywatch test`: rule unit tests (docs/rules.md#testing-rules). A test gives events; the
//! rules turn them into actions exactly as `run` would render them, and every action is
//! compared with what the test expects. Nothing is sent, run or read: no Redis, no network.
//!
//! - [`file`]: a test file read into typed values, every problem located.
//! - [`render`]: a test's events through the rules, to the actions they render, in order.
//! - [`compare`]: what was expected against what was rendered, problem by problem.
//!
//! Exit codes: 0 every test passed, 1 a test failed, 2 a file could not be read or is invalid
//! (its problems on stderr as `FILE:LINE:COLUMN: message`; the other files' tests still run).

mod compare;
mod file;
mod render;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use chrono::Utc;

use crate::action::ActionContext;
use crate::action::preview::Preview;
use crate::config::{self, Config, LoadError, Mode, RedisSettings};
use crate::yaml::diagnostic::{Diagnostic, Diagnostics, did_you_mean};

use compare::{Problem, ProblemKind};
use file::{Expected, TestFile};
use render::Rendered;

pub struct Options {
    pub files: Vec<PathBuf>,
    /// `-r`: the rules every file is tested against, instead of each file's `rules:`.
    pub rules: Vec<PathBuf>,
    pub json: bool,
}

/// Runs every test of every file, prints each test's verdict, and returns the exit code.
pub fn main(opts: &Options) -> ExitCode {
    let started = Utc::now();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let (mut passed, mut failed, mut invalid) = (0usize, 0usize, 0usize);
    for path in &opts.files {
        let suite = match prepare(path, opts) {
            Ok(s) => s,
            Err(problems) => {
                for p in problems {
                    let _ = writeln!(err, "{p}");
                }
                invalid += 1;
                continue;
            }
        };
        let now = suite.file.now.unwrap_or(started);
        for test in &suite.file.tests {
            let rendered = render::render(&suite.config, &suite.actions, now, test);
            let problems = compare::compare(&test.expect, &rendered, &test.expect_loc);
            match problems.is_empty() {
                true => passed += 1,
                false => failed += 1,
            }
            let shown = match opts.json {
                true => format!("{}\n", json(&suite.file.path, test, &problems, &rendered)),
                false => text(&suite.file.path, &test.name, &problems),
            };
            // `keywatch test … | head` ends quietly.
            if out.write_all(shown.as_bytes()).is_err() {
                return ExitCode::from(1);
            }
        }
    }
    if !opts.json {
        let files = match invalid {
            0 => String::new(),
            n => format!(" ({n} file(s) invalid, their problems above)"),
        };
        let _ = writeln!(out, "\n{passed} passed, {failed} failed{files}");
    }
    match (invalid, failed) {
        (0, 0) => ExitCode::SUCCESS,
        (0, _) => ExitCode::from(1),
        _ => ExitCode::from(2),
    }
}

/// A test file with the rules it tests, ready to run.
struct Suite {
    file: TestFile,
    config: Arc<Config>,
    actions: ActionContext,
}

/// Reads `path` and loads its rules; every problem found on the way, located, when it cannot run.
fn prepare(path: &Path, opts: &Options) -> Result<Suite, Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| vec![format!("{}: cannot read: {e}", path.display())])?;
    let file = file::decode(path, &text).map_err(shown)?;
    let rules = match opts.rules.is_empty() {
        true => file.rules.clone(),
        false => opts.rules.clone(),
    };
    if rules.is_empty() {
        return Err(vec![format!(
            "{}: no rules to test: name them with `rules:` (paths relative to the test file) or `-r PATH`",
            file.rules_loc
        )]);
    }
    // The file's `env` and nothing else: a test means the same on every machine.
    let env = |name: &str| {
        file.env
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let loaded = match config::load(&rules, Mode::Run, &env) {
        Ok(l) => l,
        Err(LoadError::Unreadable(msg)) => return Err(vec![format!("{}: {msg}", file.rules_loc)]),
        Err(LoadError::Invalid(diags)) => {
            let mut out = shown(diags);
            out.push(format!(
                "{}: the rules do not load with this file's `env` (as `keywatch run` would refuse them): their problems are above",
                file.rules_loc
            ));
            return Err(out);
        }
    };
    let names = unknown_names(&file, &loaded.config);
    if !names.is_empty() {
        return Err(shown(names));
    }
    let actions = actions(loaded.config).map_err(|e| vec![format!("{}: {e}", file.rules_loc)])?;
    let config = actions.config.clone();
    Ok(Suite {
        file,
        config,
        actions,
    })
}

fn shown(diags: Vec<Diagnostic>) -> Vec<String> {
    diags.iter().map(ToString::to_string).collect()
}

/// Expectations naming a rule or channel the rules do not define: such a test could never pass.
fn unknown_names(file: &TestFile, config: &Config) -> Vec<Diagnostic> {
    let mut d = Diagnostics::default();
    let rules: Vec<&str> = config.rules.iter().map(|r| r.name.as_str()).collect();
    let channels: Vec<&str> = config.channels.iter().map(|c| c.name.as_str()).collect();
    for e in file.tests.iter().flat_map(|t| &t.expect) {
        let rule = &e.rule;
        if !rules.contains(&rule.value.as_str()) {
            d.error(
                &rule.loc,
                format!(
                    "no rule `{}` in the rules tested{}",
                    rule.value,
                    did_you_mean(&rule.value, rules.iter().copied())
                ),
            );
        }
        if let Expected::Notify(m) | Expected::Escalate(m) = &e.what
            && !channels.contains(&m.channel.value.as_str())
        {
            d.error(
                &m.channel.loc,
                format!(
                    "no channel `{}` in the rules tested{}",
                    m.channel.value,
                    did_you_mean(&m.channel.value, channels.iter().copied())
                ),
            );
        }
    }
    d.into_sorted(&|_| 0)
}

/// What the actions render with: the rules, and a watched Redis that is named (events carry
/// its address as `source`) but never connected to.
fn actions(config: Config) -> Result<ActionContext, String> {
    let url = crate::keyspace::connect::pick_url(None, None, &config.redis);
    // Only the address matters: no TLS files, sentinels or cluster to set up for a test.
    let settings = RedisSettings {
        cluster: false,
        tls: None,
        sentinel: None,
        ..config.redis.clone()
    };
    let keyspace = crate::keyspace::Keyspace::new(url, settings).map_err(|e| e.to_string())?;
    Ok(ActionContext::new(
        config::LiveConfig::fixed(config),
        crate::channel::http::client(),
        keyspace,
    ))
}

/// One test's verdict line, and each problem under it with its location and what differs.
fn text(path: &Path, name: &str, problems: &[Problem]) -> String {
    let mut out = String::new();
    let verdict = if problems.is_empty() { "ok" } else { "FAILED" };
    let _ = writeln!(out, "{verdict:<6}  {}: {name}", path.display());
    for p in problems {
        let _ = writeln!(out, "  {}: {}", p.loc, p.summary());
        match &p.kind {
            ProblemKind::Differs {
                expected,
                rendered,
                contains: false,
                ..
            } => out.push_str(&diff(expected, rendered)),
            ProblemKind::Differs {
                expected,
                rendered,
                contains: true,
                ..
            } => {
                let _ = writeln!(
                    out,
                    "      expected to contain: {}",
                    compare::quoted(expected)
                );
                let _ = writeln!(
                    out,
                    "      rendered:            {}",
                    compare::quoted(rendered)
                );
            }
            ProblemKind::Unexpected { expectation } => {
                let _ = writeln!(out, "      to expect it: - {expectation}");
            }
            _ => {}
        }
    }
    out
}

/// A line diff, `-` what was expected, `+` what was rendered.
fn diff(expected: &str, rendered: &str) -> String {
    let mut out = String::from("      --- expected\n      +++ rendered\n");
    let d = similar::TextDiff::from_lines(expected, rendered);
    for change in d.iter_all_changes() {
        let sign = match change.tag() {
            similar::ChangeTag::Delete => '-',
            similar::ChangeTag::Insert => '+',
            similar::ChangeTag::Equal => ' ',
        };
        let line = change.value().trim_end_matches('\n');
        let _ = writeln!(out, "      {sign}{}", compare::visible(line));
    }
    out
}

/// `{"file", "test", "line", "ok", "problems": [...], "rendered": [...]}`: one object per test.
fn json(
    path: &Path,
    test: &file::Test,
    problems: &[Problem],
    rendered: &[Rendered],
) -> serde_json::Value {
    use serde_json::json;
    let problems: Vec<serde_json::Value> = problems
        .iter()
        .map(|p| {
            let mut o = json!({
                "at": p.loc.to_string(),
                "rule": p.rule,
                "action": p.action,
                "channel": p.channel,
                "message": p.summary(),
            });
            let (kind, extra) = match &p.kind {
                ProblemKind::Missing { .. } => ("missing", json!({})),
                ProblemKind::Elsewhere => ("elsewhere", json!({})),
                ProblemKind::Unexpected { expectation } => {
                    ("unexpected", json!({ "expectation": expectation }))
                }
                ProblemKind::Differs {
                    part,
                    expected,
                    rendered,
                    contains,
                } => (
                    "differs",
                    json!({ "part": part, "expected": expected, "rendered": rendered, "contains": contains }),
                ),
                ProblemKind::Fails { why } => ("fails", json!({ "why": why })),
            };
            o["problem"] = kind.into();
            if let (Some(o), Some(extra)) = (o.as_object_mut(), extra.as_object()) {
                o.extend(extra.clone());
            }
            o
        })
        .collect();
    json!({
        "file": path.display().to_string(),
        "test": test.name,
        "line": test.loc.line,
        "ok": problems.is_empty(),
        "problems": problems,
        "rendered": rendered.iter().map(rendered_json).collect::<Vec<_>>(),
    })
}

fn rendered_json(r: &Rendered) -> serde_json::Value {
    use serde_json::json;
    let at = crate::firing::rfc3339(r.at);
    let mut o = json!({ "rule": r.rule, "action": r.action, "channel": r.channel, "at": at });
    let what = match &r.preview {
        Err(why) => json!({ "fails": why }),
        Ok(Preview::Notify { title, text, .. } | Preview::Escalate { title, text, .. }) => {
            json!({ "title": title, "text": text })
        }
        Ok(Preview::Reload {
            method, url, body, ..
        }) => json!({ "reload": format!("{method} {url}"), "body": body }),
        Ok(Preview::Exec { argv }) => json!({ "exec": argv }),
        Ok(Preview::Cleanup { delete, hdel }) => {
            json!({ "cleanup": { "delete": delete, "hdel": hdel } })
        }
    };
    if let (Some(o), Some(what)) = (o.as_object_mut(), what.as_object()) {
        o.extend(what.clone());
    }
    o
}

#[cfg(test)]
mod tests;
