//! A rule test file (docs/rules.md#testing-rules) read into typed values, every problem
//! reported at its `FILE:LINE:COLUMN` with the others, as rule files are ([`crate::yaml`]).
//!
//! Values are taken as written: a test's expected text is compared with what keywatch renders,
//! so `${VAR}` in it is not interpolated (the file's `env` is for the rules).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::event::EventKind;
use crate::yaml::decode::{Decoder, MapReader, Spanned, parse_duration};
use crate::yaml::diagnostic::{Diagnostic, Diagnostics, Loc};
use crate::yaml::{Kind, Node};

/// One test file.
#[derive(Debug)]
pub struct TestFile {
    pub path: PathBuf,
    /// Rule files or folders, relative to the test file already; empty when it names none.
    pub rules: Vec<PathBuf>,
    /// Where `rules:` is (or the file's start), for problems of the rules as a whole.
    pub rules_loc: Loc,
    /// The clock of every test; `None`: the real one.
    pub now: Option<DateTime<Utc>>,
    /// `${VAR}` values for the rules; nothing else of the environment is read.
    pub env: Vec<(String, String)>,
    pub tests: Vec<Test>,
}

#[derive(Debug)]
pub struct Test {
    pub name: String,
    pub loc: Loc,
    pub events: Vec<Event>,
    pub expect: Vec<Expect>,
    /// Where `expect:` is: where an action rendered and not expected is reported.
    pub expect_loc: Loc,
}

/// One event a test feeds the rules.
#[derive(Debug)]
pub struct Event {
    pub key: Vec<u8>,
    pub kind: EventKind,
    pub db: u32,
    pub field: Option<Vec<u8>>,
    /// What a `detail` step would read; `None`: nothing is there.
    pub detail: Option<DetailGiven>,
    /// When it happened (an expiry: the deadline); `None`: the test's `now`.
    pub at: Option<DateTime<Utc>>,
    /// Found after keywatch was down: observed at the test's `now`, after `at`.
    pub recovered: bool,
    /// A silence of every rule it matches is in force.
    pub silenced: bool,
    /// An `expiring` event's TTL; `None`: the rule's `warn_before`.
    pub ttl: Option<Duration>,
}

/// A detail as a test gives it.
#[derive(Debug)]
pub enum DetailGiven {
    /// Text, as Redis would hold it (read as JSON when it is JSON, as keywatch reads it).
    Text(String),
    /// YAML standing for JSON.
    Json(serde_json::Value),
}

/// One action a test expects.
#[derive(Debug)]
pub struct Expect {
    pub loc: Loc,
    pub rule: Spanned<String>,
    pub what: Expected,
}

#[derive(Debug)]
pub enum Expected {
    Notify(Message),
    Escalate(Message),
    Reload {
        method: String,
        url: String,
        body: Option<Spanned<String>>,
    },
    Exec {
        argv: Vec<String>,
    },
    Cleanup {
        delete: Vec<String>,
        hdel: Vec<(String, String)>,
    },
}

/// An expected message to a channel: its title and text, each checked only when given.
#[derive(Debug)]
pub struct Message {
    pub channel: Spanned<String>,
    pub title: Option<Spanned<String>>,
    pub text: Option<TextCheck>,
    /// Held by the channel's quiet hours until then (docs/rules.md#quiet-hours); `None`: sent
    /// when it happens.
    pub held_until: Option<Spanned<DateTime<Utc>>>,
}

#[derive(Debug)]
pub enum TextCheck {
    Exact(Spanned<String>),
    Contains(Spanned<String>),
}

impl Expected {
    /// The action's name, as in docs/rules.md (`notify`, `escalate`, `reload`, `exec`, `cleanup`).
    pub fn action(&self) -> &'static str {
        match self {
            Expected::Notify(_) => "notify",
            Expected::Escalate(_) => "escalate",
            Expected::Reload { .. } => "reload",
            Expected::Exec { .. } => "exec",
            Expected::Cleanup { .. } => "cleanup",
        }
    }

    pub fn channel(&self) -> Option<&str> {
        match self {
            Expected::Notify(m) | Expected::Escalate(m) => Some(&m.channel.value),
            _ => None,
        }
    }
}

const FILE_FIELDS: &[&str] = &["rules", "now", "env", "tests"];
const TEST_FIELDS: &[&str] = &["name", "events", "expect"];
const EVENT_FIELDS: &[&str] = &[
    "key",
    "event",
    "db",
    "field",
    "detail",
    "at",
    "recovered",
    "silenced",
    "ttl",
];
/// What each kind of expectation may say besides `rule`.
const ACTIONS: &[(&str, &[&str])] = &[
    ("notify", &["title", "text", "contains", "held_until"]),
    ("escalate", &["title", "text", "contains", "held_until"]),
    ("reload", &["body"]),
    ("exec", &[]),
    ("cleanup", &[]),
];

/// Reads the test file at `path` from `text`; every problem, in file order, when it has any.
pub fn decode(path: &Path, text: &str) -> Result<TestFile, Vec<Diagnostic>> {
    let file: Arc<Path> = Arc::from(path);
    let mut diags = Diagnostics::default();
    let docs = crate::yaml::parse(&file, text, &mut diags);
    let start = Loc::new(&file, 1, 1);
    let none = |_: &str| None;
    let mut d = Decoder::new(&mut diags, crate::config::Mode::Check, &none);
    let mut out = TestFile {
        path: path.to_path_buf(),
        rules: Vec::new(),
        rules_loc: start.clone(),
        now: None,
        env: Vec::new(),
        tests: Vec::new(),
    };
    match docs.as_slice() {
        [doc] => decode_file(&mut d, doc, &mut out),
        [] => d.error(&start, "an empty test file: expected `tests:`"),
        [_, second, ..] => d.error(
            &second.loc,
            "a test file is one YAML document; this is a second one",
        ),
    }
    match diags.has_errors() {
        false => Ok(out),
        true => Err(diags.into_sorted(&|_| 0)),
    }
}

fn decode_file(d: &mut Decoder<'_>, doc: &Node, out: &mut TestFile) {
    let Some(mut m) = d.map(doc, "a test file") else {
        return;
    };
    let base = out.path.parent().map(Path::to_path_buf).unwrap_or_default();
    if let Some(n) = m.get("rules") {
        out.rules_loc = n.loc.clone();
        for item in d.one_or_many(n, "`rules`") {
            if let Some(p) = literal(d, item, "`rules`") {
                out.rules.push(base.join(p.value));
            }
        }
    }
    if let Some(n) = m.get("now") {
        out.now = instant(d, n, "`now`");
    }
    if let Some(n) = m.get("env")
        && let Some(mut env) = d.map(n, "`env`")
    {
        for e in env.drain() {
            if let Some(v) = literal(d, e.value, &format!("`env` `{}`", e.name)) {
                out.env.push((e.name.clone(), v.value));
            }
        }
    }
    if let Some(n) = m.require(d, "tests") {
        for item in d.list(n, "`tests`") {
            let Some(t) = decode_test(d, item) else {
                continue;
            };
            if let Some(first) = out.tests.iter().find(|f| f.name == t.name) {
                let msg = format!(
                    "the test `{}` is named twice: first at {}",
                    t.name, first.loc
                );
                d.error(&t.loc, msg);
                continue;
            }
            out.tests.push(t);
        }
    }
    m.finish(d, FILE_FIELDS, &|f| match f {
        "test" => Some("tests are listed under `tests:`".into()),
        _ => None,
    });
}

fn decode_test(d: &mut Decoder<'_>, node: &Node) -> Option<Test> {
    let mut m = d.map(node, "a test")?;
    let name = m
        .require(d, "name")
        .and_then(|n| literal(d, n, "a test's `name`"));
    let mut events = Vec::new();
    if let Some(n) = m.require(d, "events") {
        for item in d.list(n, "`events`") {
            if let Some(e) = decode_event(d, item) {
                events.push(e);
            }
        }
    }
    let mut expect = Vec::new();
    let expect_loc = m.key_loc("expect").unwrap_or_else(|| node.loc.clone());
    match m.get("expect") {
        Some(n) => {
            for item in d.list(n, "`expect`") {
                if let Some(e) = decode_expect(d, item) {
                    expect.push(e);
                }
            }
        }
        // Nothing firing is said as `expect: []`: a forgotten `expect` must not pass.
        None => d.error(
            &expect_loc,
            "a test says what it expects: `expect:` is missing or empty (write `expect: []` when nothing should fire)",
        ),
    }
    m.finish(d, TEST_FIELDS, &|_| None);
    Some(Test {
        name: name?.value,
        loc: node.loc.clone(),
        events,
        expect,
        expect_loc,
    })
}

fn decode_event(d: &mut Decoder<'_>, node: &Node) -> Option<Event> {
    let mut m = d.map(node, "an event")?;
    // Each field is read whatever the others hold, so one run reports all their problems.
    let mut bad = false;
    let key = m
        .require(d, "key")
        .and_then(|n| literal(d, n, "an event's `key`"));
    bad |= key.is_none();
    let field = m
        .get("field")
        .and_then(|n| literal(d, n, "an event's `field`"))
        .map(|f| f.value.into_bytes());
    let kind = match m.get("event") {
        Some(n) => {
            let kind = literal(d, n, "an event's `event`").and_then(|t| event_kind(d, &t));
            bad |= kind.is_none();
            kind.unwrap_or(EventKind::Expired)
        }
        // A field's event, as `explain --field` takes it.
        None if field.is_some() => EventKind::Hexpired,
        None => EventKind::Expired,
    };
    let db = match m.get("db") {
        Some(n) => {
            let db = d.uint(n, "an event's `db`", 0, u64::from(u32::MAX));
            bad |= db.is_none();
            db.unwrap_or(0) as u32
        }
        None => 0,
    };
    let detail = m.get("detail").map(|n| match &n.kind {
        Kind::Scalar { text, .. } => DetailGiven::Text(text.clone()),
        _ => DetailGiven::Json(json_of(n)),
    });
    let at = match m.get("at") {
        Some(n) => {
            let at = instant(d, n, "an event's `at`");
            bad |= at.is_none();
            at
        }
        None => None,
    };
    let mut flags = [false; 2];
    for (flag, name) in flags.iter_mut().zip(["recovered", "silenced"]) {
        if let Some(n) = m.get(name) {
            let v = d.bool(n, &format!("an event's `{name}`"));
            bad |= v.is_none();
            *flag = v.unwrap_or(false);
        }
    }
    let [recovered, silenced] = flags;
    let ttl = match m.get("ttl") {
        Some(n) => {
            let ttl = literal(d, n, "an event's `ttl`").and_then(|t| ttl(d, &t, kind));
            bad |= ttl.is_none();
            ttl
        }
        None => None,
    };
    m.finish(d, EVENT_FIELDS, &|_| None);
    if bad {
        return None;
    }
    Some(Event {
        key: key?.value.into_bytes(),
        kind,
        db,
        field,
        detail,
        at,
        recovered,
        silenced,
        ttl,
    })
}

/// An `expiring` event's `ttl`.
fn ttl(d: &mut Decoder<'_>, t: &Spanned<String>, kind: EventKind) -> Option<Duration> {
    if kind != EventKind::Expiring {
        d.error(&t.loc, "`ttl` is for `expiring` events only");
    }
    let ttl = parse_duration(&t.value);
    if ttl.is_none() {
        d.error(
            &t.loc,
            format!(
                "an event's `ttl`: `{}` is not a duration; write e.g. `6d 23h`",
                t.value
            ),
        );
    }
    ttl
}

/// An event's kind by its name, or the error that names the kinds.
fn event_kind(d: &mut Decoder<'_>, t: &Spanned<String>) -> Option<EventKind> {
    let kind = EventKind::parse(&t.value);
    if kind.is_none() {
        let names = EventKind::ALL.map(|k| k.as_str());
        d.error(
            &t.loc,
            format!(
                "`{}` is not an event; expected one of {}{}",
                t.value,
                names.join(", "),
                crate::yaml::diagnostic::did_you_mean(&t.value, names)
            ),
        );
    }
    kind
}

fn decode_expect(d: &mut Decoder<'_>, node: &Node) -> Option<Expect> {
    let mut m = d.map(node, "an expected action")?;
    let rule = m
        .require(d, "rule")
        .and_then(|n| literal(d, n, "an expected action's `rule`"));
    let present: Vec<&str> = ACTIONS
        .iter()
        .map(|(a, _)| *a)
        .filter(|a| m.key_loc(a).is_some())
        .collect();
    let action = match present.as_slice() {
        [one] => *one,
        [] => {
            let names: Vec<&str> = ACTIONS.iter().map(|(a, _)| *a).collect();
            d.error(
                &node.loc,
                format!(
                    "an expected action says which: one of {}",
                    names
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            finish_expect(d, m, &[]);
            return None;
        }
        [first, second, ..] => {
            let loc = m.key_loc(second).unwrap_or_else(|| node.loc.clone());
            d.error(
                &loc,
                format!("an expected action is one action: `{first}` or `{second}`, not both (list each on its own)"),
            );
            finish_expect(d, m, &[]);
            return None;
        }
    };
    let value = m.get(action);
    let what = match (action, value) {
        (_, None) => {
            let loc = m.key_loc(action).unwrap_or_else(|| node.loc.clone());
            d.error(&loc, format!("`{action}` needs a value"));
            None
        }
        ("notify", Some(v)) => message(d, &mut m, v, "notify").map(Expected::Notify),
        ("escalate", Some(v)) => message(d, &mut m, v, "escalate").map(Expected::Escalate),
        ("reload", Some(v)) => reload(d, &mut m, v),
        ("exec", Some(v)) => {
            let argv: Option<Vec<String>> = d
                .list(v, "`exec`")
                .iter()
                .map(|a| literal(d, a, "an `exec` argument").map(|a| a.value))
                .collect();
            argv.map(|argv| Expected::Exec { argv })
        }
        (_, Some(v)) => cleanup(d, v),
    };
    let allowed = ACTIONS
        .iter()
        .find(|(a, _)| *a == action)
        .map_or(&[][..], |(_, f)| *f);
    finish_expect(d, m, allowed);
    Some(Expect {
        loc: node.loc.clone(),
        rule: rule?,
        what: what?,
    })
}

/// Reports the fields of an expectation nobody read, saying which action a misplaced one
/// belongs to.
fn finish_expect(d: &mut Decoder<'_>, m: MapReader<'_>, allowed: &[&str]) {
    let mut known = vec!["rule"];
    known.extend(ACTIONS.iter().map(|(a, _)| *a));
    known.extend_from_slice(allowed);
    m.finish(d, &known, &|f| {
        let owners: Vec<String> = ACTIONS
            .iter()
            .filter(|(_, fields)| fields.contains(&f))
            .map(|(a, _)| format!("`{a}`"))
            .collect();
        (!owners.is_empty()).then(|| format!("it goes with {}", owners.join(" or ")))
    });
}

fn message(d: &mut Decoder<'_>, m: &mut MapReader<'_>, v: &Node, action: &str) -> Option<Message> {
    let channel = literal(d, v, &format!("`{action}` (a channel)"));
    let held_until = m.get("held_until").and_then(|n| {
        let loc = n.loc.clone();
        instant(d, n, "`held_until`").map(|value| Spanned { value, loc })
    });
    let title = m.get("title").and_then(|n| literal(d, n, "`title`"));
    let text = match (m.get("text"), m.get("contains")) {
        (Some(t), Some(_)) => {
            d.error(
                &t.loc,
                "give `text` (the exact text) or `contains` (a part of it), not both",
            );
            None
        }
        (Some(t), None) => literal(d, t, "`text`").map(TextCheck::Exact),
        (None, Some(c)) => literal(d, c, "`contains`").map(TextCheck::Contains),
        (None, None) => None,
    };
    Some(Message {
        channel: channel?,
        title,
        text,
        held_until,
    })
}

fn reload(d: &mut Decoder<'_>, m: &mut MapReader<'_>, v: &Node) -> Option<Expected> {
    let request = literal(d, v, "`reload`")?;
    let body = m.get("body").and_then(|n| literal(d, n, "`body`"));
    match request.value.split_once(char::is_whitespace) {
        Some((method, url)) if !url.trim().is_empty() => Some(Expected::Reload {
            method: method.to_string(),
            url: url.trim().to_string(),
            body,
        }),
        _ => {
            d.error(
                &request.loc,
                format!(
                    "`reload` is the method and the URL, e.g. \"POST http://127.0.0.1:8080/reload/42\"; found \"{}\"",
                    request.value
                ),
            );
            None
        }
    }
}

fn cleanup(d: &mut Decoder<'_>, v: &Node) -> Option<Expected> {
    let mut m = d.map(v, "`cleanup`")?;
    let mut delete = Vec::new();
    if let Some(n) = m.get("delete") {
        for item in d.list(n, "`cleanup.delete`") {
            delete.push(literal(d, item, "a `cleanup.delete` pattern")?.value);
        }
    }
    let mut hdel = Vec::new();
    if let Some(n) = m.get("hdel") {
        for item in d.list(n, "`cleanup.hdel`") {
            match &item.kind {
                Kind::Seq(pair) if pair.len() == 2 => {
                    let key = literal(d, &pair[0], "a `cleanup.hdel` key")?;
                    let field = literal(d, &pair[1], "a `cleanup.hdel` field")?;
                    hdel.push((key.value, field.value));
                }
                _ => {
                    d.error(
                        &item.loc,
                        "a `cleanup.hdel` entry is a pair [hash, field], e.g. [online_users, s1]",
                    );
                    return None;
                }
            }
        }
    }
    m.finish(d, &["delete", "hdel"], &|_| None);
    Some(Expected::Cleanup { delete, hdel })
}

/// A scalar exactly as written (no `${VAR}` interpolation).
fn literal(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<Spanned<String>> {
    match &node.kind {
        Kind::Scalar { text, .. } => Some(Spanned {
            value: text.clone(),
            loc: node.loc.clone(),
        }),
        _ => {
            d.error(
                &node.loc,
                format!("{what} must be a string, found {}", node.kind_name()),
            );
            None
        }
    }
}

/// An RFC 3339 time with its offset (`2026-12-06T10:00:00+08:00`).
fn instant(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<DateTime<Utc>> {
    let t = literal(d, node, what)?;
    match DateTime::parse_from_rfc3339(t.value.trim()) {
        Ok(at) => Some(at.with_timezone(&Utc)),
        Err(e) => {
            d.error(
                &t.loc,
                format!(
                    "{what}: `{}` is not a time ({e}); write e.g. \"2026-12-06T10:00:00+08:00\"",
                    t.value
                ),
            );
            None
        }
    }
}

/// YAML standing for JSON: plain scalars typed by YAML 1.2's core schema (`true`, `42`, `1.5`,
/// `null`), quoted ones text.
fn json_of(node: &Node) -> serde_json::Value {
    use serde_json::Value;
    match &node.kind {
        Kind::Null => Value::Null,
        Kind::Scalar { text, plain: false } => Value::String(text.clone()),
        Kind::Scalar { text, plain: true } => match text.as_str() {
            "true" | "True" | "TRUE" => Value::Bool(true),
            "false" | "False" | "FALSE" => Value::Bool(false),
            "null" | "Null" | "NULL" | "~" => Value::Null,
            t => t
                .parse::<i64>()
                .map(Value::from)
                .ok()
                .or_else(|| {
                    t.parse::<f64>()
                        .ok()
                        .filter(|f| f.is_finite())
                        .and_then(serde_json::Number::from_f64)
                        .map(Value::Number)
                })
                .unwrap_or_else(|| Value::String(t.to_string())),
        },
        Kind::Seq(items) => Value::Array(items.iter().map(json_of).collect()),
        Kind::Map(entries) => Value::Object(
            entries
                .iter()
                .map(|(k, v)| {
                    let key = match &k.kind {
                        Kind::Scalar { text, .. } => text.clone(),
                        _ => String::new(),
                    };
                    (key, json_of(v))
                })
                .collect(),
        ),
    }
}
