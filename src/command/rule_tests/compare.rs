//! What a test expected against what its events rendered: the two lists lined up by action
//! (rule, action, channel) as a longest common subsequence, so an action missing or extra
//! is named as such rather than shifting every later one, then each pair compared.

use similar::{Algorithm, DiffOp, capture_diff_slices};

use crate::action::preview::Preview;
use crate::yaml::diagnostic::Loc;

use super::file::{Expect, Expected, TextCheck};
use super::render::Rendered;

/// One way a test failed, pinned to the expectation it is about (or, for an action nobody
/// expected, to the test's `expect:`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub loc: Loc,
    pub rule: String,
    pub action: &'static str,
    pub channel: Option<String>,
    pub kind: ProblemKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// Expected, and not rendered; `fired` says whether the rule rendered anything at all.
    Missing { fired: bool },
    /// Expected and rendered, but in another place of the list (it is in the order they happen).
    Elsewhere,
    /// Rendered, and not expected: what to add to `expect` for it.
    Unexpected { expectation: String },
    /// Expected and rendered, one part different.
    Differs {
        /// `text`, `title`, `reload`, `body`, `exec`, `cleanup`.
        part: &'static str,
        expected: String,
        rendered: String,
        /// `contains` was given: the rendered text lacks `expected`.
        contains: bool,
    },
    /// Expected, and keywatch would fail for good rendering it (a template that fails on this
    /// data, a URL or argv it refuses).
    Fails { why: String },
}

impl Problem {
    /// What went wrong, in a few words, for the line that leads it.
    pub fn summary(&self) -> String {
        let what = match &self.channel {
            Some(c) => format!("{} {} {c}", self.rule, self.action),
            None => format!("{} {}", self.rule, self.action),
        };
        let why = match &self.kind {
            ProblemKind::Missing { fired: true } => "expected, not rendered".to_string(),
            ProblemKind::Missing { fired: false } => "expected, not rendered: the rule renders nothing for these events (`keywatch explain KEY` shows why)".to_string(),
            ProblemKind::Elsewhere => {
                "rendered in another place: list the actions in the order they happen".into()
            }
            ProblemKind::Unexpected { .. } => "rendered, not expected".into(),
            ProblemKind::Differs {
                part,
                contains: true,
                ..
            } => format!("the {part} does not contain what is expected"),
            ProblemKind::Differs { part, .. } => format!("the {part} differs"),
            ProblemKind::Fails { why } => format!("would fail for good, never sent: {why}"),
        };
        format!("{what}: {why}")
    }
}

/// Identity of an action in a list: what lines expected and rendered up.
type Slot<'a> = (&'a str, &'static str, Option<&'a str>);

/// Every problem of one test, in the order of its expectations (unexpected actions where they
/// would go).
pub fn compare(expect: &[Expect], rendered: &[Rendered], expect_loc: &Loc) -> Vec<Problem> {
    let wanted: Vec<Slot<'_>> = expect
        .iter()
        .map(|e| (e.rule.value.as_str(), e.what.action(), e.what.channel()))
        .collect();
    let got: Vec<Slot<'_>> = rendered
        .iter()
        .map(|r| (r.rule.as_str(), r.action, r.channel.as_deref()))
        .collect();
    let mut missing: Vec<usize> = Vec::new();
    // (rendered action, how many expectations come before where it would be listed)
    let mut extra: Vec<(usize, usize)> = Vec::new();
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for op in capture_diff_slices(Algorithm::Myers, &wanted, &got) {
        match op {
            DiffOp::Equal {
                old_index,
                new_index,
                len,
            } => pairs.extend((0..len).map(|i| (old_index + i, new_index + i))),
            DiffOp::Delete {
                old_index, old_len, ..
            } => missing.extend(old_index..old_index + old_len),
            DiffOp::Insert {
                old_index,
                new_index,
                new_len,
            } => extra.extend((new_index..new_index + new_len).map(|r| (r, old_index))),
            DiffOp::Replace {
                old_index,
                old_len,
                new_index,
                new_len,
            } => {
                missing.extend(old_index..old_index + old_len);
                extra.extend((new_index..new_index + new_len).map(|r| (r, old_index + old_len)));
            }
        }
    }
    // (position among the expectations, problem): unexpected ones where they would have gone.
    let mut out: Vec<((usize, u8), Problem)> = Vec::new();
    for (e, r) in pairs {
        if let Some(kind) = differs(&expect[e].what, &rendered[r].preview)
            .or_else(|| held_differs(&expect[e].what, rendered[r].held_until))
        {
            out.push(((e, 1), problem(&expect[e], kind)));
        }
    }
    for &e in &missing {
        let slot = wanted[e];
        let kind = if extra.iter().any(|&(r, _)| got[r] == slot) {
            ProblemKind::Elsewhere
        } else {
            ProblemKind::Missing {
                fired: rendered.iter().any(|r| r.rule == slot.0),
            }
        };
        out.push(((e, 1), problem(&expect[e], kind)));
    }
    for &(r, before) in &extra {
        let moved = missing.iter().any(|&e| wanted[e] == got[r]);
        if moved {
            continue;
        }
        out.push((
            (before, 0),
            Problem {
                loc: expect_loc.clone(),
                rule: rendered[r].rule.clone(),
                action: rendered[r].action,
                channel: rendered[r].channel.clone(),
                kind: ProblemKind::Unexpected {
                    expectation: expectation(&rendered[r]),
                },
            },
        ));
    }
    out.sort_by_key(|(at, _)| *at);
    out.into_iter().map(|(_, p)| p).collect()
}

fn problem(e: &Expect, kind: ProblemKind) -> Problem {
    Problem {
        loc: e.loc.clone(),
        rule: e.rule.value.clone(),
        action: e.what.action(),
        channel: e.what.channel().map(str::to_string),
        kind,
    }
}

/// The first part of a rendered action that is not what was expected, if any.
fn differs(expected: &Expected, rendered: &Result<Preview, String>) -> Option<ProblemKind> {
    let preview = match rendered {
        Ok(p) => p,
        Err(why) => return Some(ProblemKind::Fails { why: why.clone() }),
    };
    let exact = |part: &'static str, expected: &str, rendered: &str| {
        (expected != rendered).then(|| ProblemKind::Differs {
            part,
            expected: expected.to_string(),
            rendered: rendered.to_string(),
            contains: false,
        })
    };
    match (expected, preview) {
        (Expected::Notify(m), Preview::Notify { title, text, .. })
        | (Expected::Escalate(m), Preview::Escalate { title, text, .. }) => {
            if let Some(t) = &m.title
                && let Some(d) = exact("title", &t.value, title)
            {
                return Some(d);
            }
            match &m.text {
                Some(TextCheck::Exact(t)) => exact("text", &t.value, text),
                Some(TextCheck::Contains(part)) => {
                    (!text.contains(&part.value)).then(|| ProblemKind::Differs {
                        part: "text",
                        expected: part.value.clone(),
                        rendered: text.clone(),
                        contains: true,
                    })
                }
                None => None,
            }
        }
        (
            Expected::Reload { method, url, body },
            Preview::Reload {
                method: m,
                url: u,
                body: b,
                ..
            },
        ) => exact("reload", &format!("{method} {url}"), &format!("{m} {u}"))
            .or_else(|| body.as_ref().and_then(|body| exact("body", &body.value, b))),
        (Expected::Exec { argv }, Preview::Exec { argv: got }) => {
            exact("exec", &lines(argv.iter()), &lines(got.iter()))
        }
        (Expected::Cleanup { delete, hdel }, Preview::Cleanup { delete: d, hdel: h }) => exact(
            "cleanup",
            &cleanup_lines(delete, hdel),
            &cleanup_lines(d, h),
        ),
        // Lined up by action, so the kinds agree.
        _ => None,
    }
}

/// Whether an expected message's quiet hours are not what was rendered: held until another
/// time, held though expected at once, or sent at once though expected held.
fn held_differs(
    expected: &Expected,
    rendered: Option<chrono::DateTime<chrono::Utc>>,
) -> Option<ProblemKind> {
    let (Expected::Notify(m) | Expected::Escalate(m)) = expected else {
        return None;
    };
    let expected = m.held_until.as_ref().map(|h| h.value);
    let shown = |at: Option<chrono::DateTime<chrono::Utc>>| match at {
        Some(t) => format!("held until {}", crate::firing::rfc3339(t)),
        None => "sent at once (not held)".to_string(),
    };
    (expected != rendered).then(|| ProblemKind::Differs {
        part: "held_until",
        expected: shown(expected),
        rendered: shown(rendered),
        contains: false,
    })
}

/// One value per line, quoted as JSON: a diff then points at the argument that differs.
fn lines<'a>(values: impl Iterator<Item = &'a String>) -> String {
    values.map(|v| format!("{}\n", quoted(v))).collect()
}

fn cleanup_lines(delete: &[String], hdel: &[(String, String)]) -> String {
    let mut out = String::new();
    for d in delete {
        out.push_str(&format!("delete {}\n", quoted(d)));
    }
    for (k, f) in hdel {
        out.push_str(&format!("hdel [{}, {}]\n", quoted(k), quoted(f)));
    }
    out
}

/// `s` as a double-quoted scalar that YAML and JSON read alike, with the characters one cannot
/// see written as escapes ([`visible`]).
pub fn quoted(s: &str) -> String {
    visible(&serde_json::to_string(s).unwrap_or_default())
}

/// `text` with every character that shows as nothing written as `\uXXXX`, as YAML's and JSON's
/// double-quoted scalars write it: controls, direction marks, and the zero-width characters
/// keywatch itself puts into key text (a zero-width space keeps `example.com` from becoming a
/// link, docs/rules.md#templates). Two texts that look alike then read differently.
pub fn visible(text: &str) -> String {
    let unseen = |c: char| {
        (crate::event::hidden(c) && c != '\n' && c != '\t')
            || matches!(c, '\u{00AD}' | '\u{200B}'..='\u{200D}' | '\u{2060}'..='\u{2064}' | '\u{FEFF}')
    };
    if !text.chars().any(unseen) {
        return text.to_string();
    }
    text.chars()
        .map(|c| match unseen(c) {
            true => format!("\\u{:04X}", u32::from(c)),
            false => c.to_string(),
        })
        .collect()
}

/// The expectation that would list `r`, in the flow style of the examples: what to paste into
/// `expect` when the action is wanted.
pub fn expectation(r: &Rendered) -> String {
    let rule = &r.rule;
    match &r.preview {
        Err(why) => format!(
            "{{ rule: {rule}, {}: … }}   # would fail for good: {why}",
            r.action
        ),
        Ok(Preview::Notify { channel, text, .. }) => {
            let held = r.held_until.map_or(String::new(), |t| {
                format!(", held_until: {}", quoted(&crate::firing::rfc3339(t)))
            });
            format!(
                "{{ rule: {rule}, notify: {channel}, text: {}{held} }}",
                quoted(text)
            )
        }
        Ok(Preview::Escalate { channel, text, .. }) => {
            format!(
                "{{ rule: {rule}, escalate: {channel}, text: {} }}",
                quoted(text)
            )
        }
        Ok(Preview::Reload {
            method, url, body, ..
        }) => {
            let body = match body.is_empty() {
                true => String::new(),
                false => format!(", body: {}", quoted(body)),
            };
            format!(
                "{{ rule: {rule}, reload: {}{body} }}",
                quoted(&format!("{method} {url}"))
            )
        }
        Ok(Preview::Exec { argv }) => {
            let argv: Vec<String> = argv.iter().map(|a| quoted(a)).collect();
            format!("{{ rule: {rule}, exec: [{}] }}", argv.join(", "))
        }
        Ok(Preview::Cleanup { delete, hdel }) => {
            let delete: Vec<String> = delete.iter().map(|d| quoted(d)).collect();
            let hdel: Vec<String> = hdel
                .iter()
                .map(|(k, f)| format!("[{}, {}]", quoted(k), quoted(f)))
                .collect();
            format!(
                "{{ rule: {rule}, cleanup: {{ delete: [{}], hdel: [{}] }} }}",
                delete.join(", "),
                hdel.join(", ")
            )
        }
    }
}
