//! What a template can read (docs/rules.md), built once per event and shared by all its templates.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use minijinja::value::{Enumerator, Object, ObjectRepr, Serde, Value};

use super::bytestr;
use crate::event::{EventKind, KeyEvent};

/// Every name the context may define. Captures may not shadow them (docs/rules.md); `count` and
/// `events` exist only in digests.
pub const CONTEXT_NAMES: &[&str] = &[
    "key",
    "event",
    "db",
    "rule",
    "captures",
    "detail",
    "ttl",
    "ttl_ms",
    "deadline",
    "late_ms",
    "recovered",
    "now",
    "count",
    "events",
    "field",
    "gap",
    "gap_ms",
];

/// The bytes `name` renders to in a mode that writes values as they are, for the names known
/// without building a [`Context`]: the key, and the captures (the last of two with one name, as
/// in the context's map). `None` for every other name, including a capture named like one of
/// [`CONTEXT_NAMES`], which the context's own value shadows.
pub fn verbatim<'a>(
    name: &str,
    key: &'a [u8],
    capture_names: &[String],
    capture_values: &'a [bytes::Bytes],
) -> Option<&'a [u8]> {
    if name == "key" {
        return Some(key);
    }
    if CONTEXT_NAMES.contains(&name) {
        return None;
    }
    capture_names
        .iter()
        .zip(capture_values)
        .rev()
        .find(|(n, _)| n.as_str() == name)
        .map(|(_, v)| &v[..])
}

/// The values one event offers its templates.
///
/// Strings are held in the encoding of [`super::bytestr`], so that exact renders give back the
/// key's bytes.
#[derive(Clone, Debug)]
pub struct Context {
    /// The names and values as one map value, built once, because minijinja takes the root by
    /// value on every render and cloning a `Value` is a reference-count bump. The map itself
    /// is not kept beside it: a context is built per event and per action attempt (about 9 %
    /// of keywatch's CPU in a mass expiry), and a second copy of it is work only the rare
    /// digest and sample contexts need.
    root: Value,
}

impl Context {
    /// The context of one event of one rule.
    ///
    /// Captures are inserted first, so a capture that shadows a context name (which config
    /// rejects) loses to it. Names and values pair up by position.
    pub fn for_event(
        rule: &str,
        event: &KeyEvent,
        capture_names: &[String],
        capture_values: &[bytes::Bytes],
        detail: Option<serde_json::Value>,
    ) -> Context {
        debug_assert_eq!(capture_names.len(), capture_values.len());
        let captures = capture_names
            .iter()
            .zip(capture_values)
            .map(|(name, value)| (name.clone(), Value::from(&*bytestr::encode(value))))
            .collect();
        let detail = match detail {
            None => Value::from(()),
            Some(json) => Value::from(Serde(bytestr::encode_json(&json).as_ref())),
        };
        let ttl_ms = match event.kind {
            EventKind::Expiring => event.ttl_ms,
            _ => None,
        };
        Context::build(Parts {
            key: Value::from(&*bytestr::encode(&event.key)),
            event: event.kind,
            db: event.db,
            rule,
            captures,
            detail,
            ttl_ms,
            deadline: event.deadline,
            late_ms: event.late_ms(),
            recovered: event.recovered,
            field: event
                .field
                .as_ref()
                .map(|f| Value::from(&*bytestr::encode(f))),
        })
    }

    /// What `keywatch check` renders every template against, so that a strict render finds
    /// undefined names and filter errors without real data.
    ///
    /// Each capture's value is its own name; `key` prints as `<key>`; `detail` accepts any
    /// attribute, item or iteration and prints as `<detail>`; `ttl`/`ttl_ms` are set only for
    /// `expiring`; `deadline` and `late_ms` are plausible for the kind.
    pub fn sample(rule: &str, kind: EventKind, capture_names: &[String]) -> Context {
        let captures = capture_names
            .iter()
            .map(|name| (name.clone(), Value::from(name.as_str())))
            .collect();
        let now = Utc::now();
        let (ttl_ms, deadline, late_ms) = match kind {
            // 6d 23h 59m: what a `warn_before: 7d` rule sees.
            EventKind::Expiring => {
                let ttl = 604_740_000;
                (
                    Some(ttl),
                    Some(now + chrono::Duration::milliseconds(ttl)),
                    Some(0),
                )
            }
            _ => (
                None,
                Some(now - chrono::Duration::milliseconds(12)),
                Some(12),
            ),
        };
        Context::build(Parts {
            key: Value::from("<key>"),
            event: kind,
            db: 0,
            rule,
            captures,
            detail: Value::from_object(SampleDetail { depth: 0 }),
            ttl_ms,
            deadline,
            late_ms,
            recovered: false,
            field: (kind == EventKind::Hexpired).then(|| Value::from("<field>")),
        })
    }

    /// Makes `count` and `events` (the event JSON objects of the first `max_items`) defined, for
    /// digest messages.
    pub fn with_digest(self, count: usize, events: Vec<serde_json::Value>) -> Context {
        let events: Vec<Value> = events
            .iter()
            .map(|e| Value::from(Serde(bytestr::encode_json(e).as_ref())))
            .collect();
        self.with([
            ("count", Value::from(count)),
            ("events", Value::from(events)),
        ])
    }

    /// Makes `gap` (human) and `gap_ms` defined: the time from the alert to a follow-up
    /// (`escalate`, `resolved`).
    pub fn with_gap(self, gap_ms: i64) -> Context {
        self.with([
            ("gap", Value::from(human_duration(gap_ms))),
            ("gap_ms", Value::from(gap_ms)),
        ])
    }

    /// The context as rendered at `now` rather than the real clock (`keywatch test`).
    pub fn at(self, now: DateTime<Utc>) -> Context {
        self.with([("now", Value::from(rfc3339(now)))])
    }

    /// Replaces `detail` with the stand-in `sample()` uses, for `keywatch explain`: the real
    /// detail exists only in Redis at event time.
    pub fn with_sample_detail(self) -> Context {
        self.with([("detail", Value::from_object(SampleDetail { depth: 0 }))])
    }

    /// The context with `extra` names set (replacing any of the same name): for the rare
    /// contexts that add to an event's (digests, samples), so the map is rebuilt only there.
    fn with<const N: usize>(self, extra: [(&str, Value); N]) -> Context {
        let mut vars = BTreeMap::new();
        if let Ok(names) = self.root.try_iter() {
            for name in names {
                if let (Some(k), Ok(v)) = (name.as_str(), self.root.get_item(&name)) {
                    vars.insert(k.to_owned(), v);
                }
            }
        }
        for (k, v) in extra {
            vars.insert(k.to_owned(), v);
        }
        Context {
            root: Value::from(vars),
        }
    }

    pub(crate) fn root(&self) -> &Value {
        &self.root
    }

    fn build(p: Parts<'_>) -> Context {
        let mut vars: BTreeMap<String, Value> = p.captures.clone();
        let mut set = |name: &str, value: Value| {
            vars.insert(name.to_owned(), value);
        };
        set("key", p.key);
        set("event", Value::from(p.event.as_str()));
        set("db", Value::from(p.db));
        set(
            "rule",
            Value::from(bytestr::encode_str(p.rule).into_owned()),
        );
        set("captures", Value::from(p.captures));
        set("detail", p.detail);
        set("ttl", Value::from(p.ttl_ms.map(human_duration)));
        set("ttl_ms", Value::from(p.ttl_ms));
        set("deadline", Value::from(p.deadline.map(rfc3339)));
        set("late_ms", Value::from(p.late_ms));
        set("recovered", Value::from(p.recovered));
        set("now", Value::from(rfc3339(Utc::now())));
        // Only `hexpired` events have one; `none` elsewhere, like `ttl_ms` outside `expiring`.
        set("field", p.field.unwrap_or_else(|| Value::from(())));
        Context {
            root: Value::from(vars),
        }
    }
}

struct Parts<'a> {
    key: Value,
    event: EventKind,
    db: u32,
    rule: &'a str,
    captures: BTreeMap<String, Value>,
    detail: Value,
    ttl_ms: Option<i64>,
    deadline: Option<DateTime<Utc>>,
    late_ms: Option<i64>,
    recovered: bool,
    field: Option<Value>,
}

/// The timestamp format of docs/rules.md#event-json (`2026-11-29T10:15:00.000Z`), also used in templates so that
/// messages and event JSON agree.
fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A duration for people, as in docs/rules.md's `6d 23h`: the two largest non-zero units of d/h/m/s,
/// truncated (a TTL of 6d 23h 59m is not yet 7d). Below one second it shows milliseconds.
pub fn human_duration(ms: i64) -> String {
    if ms <= 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms / 1000;
    let units = [
        (secs / 86_400, 'd'),
        (secs / 3600 % 24, 'h'),
        (secs / 60 % 60, 'm'),
        (secs % 60, 's'),
    ];
    let mut out = String::new();
    for (n, unit) in units.into_iter().filter(|(n, _)| *n > 0).take(2) {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&n.to_string());
        out.push(unit);
    }
    out
}

/// `detail` in a sample context: stands for any JSON shape, so `detail.a.b`, `detail["x"]`,
/// `detail[0]` and loops over it all work during `check`.
///
/// It iterates as one element like itself, so loop bodies are checked too; the depth bound keeps
/// `| tojson` (which walks the elements) finite.
#[derive(Debug)]
struct SampleDetail {
    depth: u8,
}

impl Object for SampleDetail {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn get_value(self: &Arc<Self>, _key: &Value) -> Option<Value> {
        Some(self.child())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        if self.depth < 3 {
            Enumerator::Values(vec![self.child()])
        } else {
            Enumerator::Empty
        }
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<detail>")
    }
}

/// Registers `int`, `float`, `round` and `abs` so that they give `0` for a sample `detail`
/// instead of failing: `{{ detail.amount | round(2) }}` is fine with real JSON, and `check` must
/// not reject it. Every other value goes to minijinja's own filter.
pub(crate) fn add_sample_aware_filters(env: &mut minijinja::Environment<'static>) {
    use minijinja::filters;
    use minijinja::value::Kwargs;
    use minijinja::{Error, State};

    fn is_sample(value: &Value) -> bool {
        value.downcast_object_ref::<SampleDetail>().is_some()
    }
    env.add_filter(
        "int",
        |state: &State,
         value: &Value,
         default: Option<Value>,
         base: Option<u32>,
         kwargs: Kwargs| {
            if is_sample(value) {
                return Ok(Value::from(0));
            }
            filters::int(state, value, default, base, kwargs)
        },
    );
    env.add_filter(
        "float",
        |state: &State, value: &Value, default: Option<Value>, kwargs: Kwargs| {
            if is_sample(value) {
                return Ok(Value::from(0.0));
            }
            filters::float(state, value, default, kwargs)
        },
    );
    env.add_filter(
        "round",
        |value: Value, precision: Option<i32>, method: Option<&str>, kwargs: Kwargs| {
            if is_sample(&value) {
                return Ok(Value::from(0.0));
            }
            filters::round(value, precision, method, kwargs)
        },
    );
    env.add_filter("abs", |value: Value| -> Result<Value, Error> {
        if is_sample(&value) {
            return Ok(Value::from(0));
        }
        filters::abs(value)
    });
}

/// Whether `value` is `check`'s stand-in for a `detail` (or a part of one).
pub(super) fn is_sample(value: &Value) -> bool {
    value.downcast_object_ref::<SampleDetail>().is_some()
}

impl SampleDetail {
    fn child(&self) -> Value {
        Value::from_object(SampleDetail {
            depth: self.depth.saturating_add(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_duration_two_largest_units() {
        assert_eq!(human_duration(604_740_000), "6d 23h");
        assert_eq!(human_duration(604_800_000), "7d");
        assert_eq!(human_duration(90_000), "1m 30s");
        assert_eq!(human_duration(3_600_000), "1h");
        assert_eq!(human_duration(86_405_000), "1d 5s");
        assert_eq!(human_duration(3_723_000), "1h 2m");
        assert_eq!(human_duration(1_999), "1s");
        assert_eq!(human_duration(850), "850ms");
        assert_eq!(human_duration(1), "1ms");
        assert_eq!(human_duration(0), "0s");
        assert_eq!(human_duration(-5), "0s");
    }

    #[test]
    fn deadline_format_has_millis_and_z() {
        let t = DateTime::parse_from_rfc3339("2026-11-29T10:15:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(rfc3339(t), "2026-11-29T10:15:00.000Z");
        let t = t + chrono::Duration::milliseconds(12);
        assert_eq!(rfc3339(t), "2026-11-29T10:15:00.012Z");
    }
}
