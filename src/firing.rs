//! A matched event of one rule ([`Firing`]) and the jobs it owes ([`Job`], each one [`Action`]).
//!
//! A firing carries everything its actions need (captures, the detail read once at event time),
//! so a retry an hour later renders the same message from the same data, and a firing can be
//! stored in the queue and picked up by another instance.

use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::event::{EventKind, KeyEvent};

/// One event of one rule. Written as stored ([`Firing::apart`]): a long key's firing as its cut
/// view, wherever it is written (a job, a held message, a dead letter).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Firing {
    /// Stable across instances and retries; the `Idempotency-Key` of each request adds the action.
    pub id: String,
    pub rule: String,
    pub kind: EventKind,
    pub db: u32,
    /// The event's key, shared with it (docs/reliability.md#bounded-whatever-the-key).
    #[serde(with = "b64")]
    pub key: bytes::Bytes,
    /// The hash field of a `hexpired` event.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "b64_opt")]
    pub field: Option<Vec<u8>>,
    pub captures: Vec<Capture>,
    pub detail: Option<Detail>,
    pub deadline: Option<DateTime<Utc>>,
    pub observed_at: DateTime<Utc>,
    pub ttl_ms: Option<i64>,
    pub recovered: bool,
    pub source: String,
    /// Set on a firing as stored when its key or field is longer than
    /// [`crate::long_key::EXACT`]: the key, the field and the captures are then their cut views,
    /// and the exact values are kept once apart (`store::long_keys`), named here by
    /// their SHA-256 (docs/reliability.md#bounded-whatever-the-key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apart: Option<Apart>,
    /// Its JSON, written once ([`Firing::text`]).
    #[serde(skip)]
    written: Written,
}

impl Serialize for Firing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.stored() {
            Some(stored) => Fields::of(&stored).serialize(s),
            None => Fields::of(self).serialize(s),
        }
    }
}

/// A firing's fields as written, borrowed.
#[derive(Serialize)]
struct Fields<'a> {
    id: &'a str,
    rule: &'a str,
    kind: EventKind,
    db: u32,
    key: B64<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<B64<'a>>,
    captures: &'a [Capture],
    detail: &'a Option<Detail>,
    deadline: Option<Rfc3339>,
    observed_at: Rfc3339,
    ttl_ms: Option<i64>,
    recovered: bool,
    source: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    apart: &'a Option<Apart>,
}

impl<'a> Fields<'a> {
    fn of(f: &'a Firing) -> Fields<'a> {
        Fields {
            id: &f.id,
            rule: &f.rule,
            kind: f.kind,
            db: f.db,
            key: B64(&f.key),
            field: f.field.as_deref().map(B64),
            captures: &f.captures,
            detail: &f.detail,
            deadline: f.deadline.map(Rfc3339),
            observed_at: Rfc3339(f.observed_at),
            ttl_ms: f.ttl_ms,
            recovered: f.recovered,
            source: &f.source,
            apart: &f.apart,
        }
    }
}

/// An instant written as chrono writes a `DateTime<Utc>` (RFC 3339, `Z`, the fraction in
/// milli-, micro- or nanoseconds as needed, none when whole), without `core::fmt`: a firing
/// holds two, and chrono's formatting was 4 % of keywatch's CPU in a mass expiry's take-over
/// (docs/performance.md#mass-expiry). Years outside 0–9999 and leap seconds are left to chrono.
struct Rfc3339(DateTime<Utc>);

impl Rfc3339 {
    /// The text into `buf`, and its length; `None` where chrono writes it.
    fn write(&self, buf: &mut [u8; 30]) -> Option<usize> {
        use chrono::{Datelike, Timelike};
        let t = &self.0;
        let year = u32::try_from(t.year()).ok().filter(|y| *y <= 9999)?;
        let nanos = t.nanosecond();
        if nanos >= 1_000_000_000 {
            return None;
        }
        fn digits(out: &mut [u8], mut v: u32) {
            for b in out.iter_mut().rev() {
                *b = b'0' + (v % 10) as u8;
                v /= 10;
            }
        }
        digits(&mut buf[0..4], year);
        buf[4] = b'-';
        digits(&mut buf[5..7], t.month());
        buf[7] = b'-';
        digits(&mut buf[8..10], t.day());
        buf[10] = b'T';
        digits(&mut buf[11..13], t.hour());
        buf[13] = b':';
        digits(&mut buf[14..16], t.minute());
        buf[16] = b':';
        digits(&mut buf[17..19], t.second());
        let mut n = 19;
        let (value, width) = match nanos {
            0 => (0, 0),
            _ if nanos.is_multiple_of(1_000_000) => (nanos / 1_000_000, 3),
            _ if nanos.is_multiple_of(1_000) => (nanos / 1_000, 6),
            _ => (nanos, 9),
        };
        if width > 0 {
            buf[n] = b'.';
            digits(&mut buf[n + 1..n + 1 + width], value);
            n += 1 + width;
        }
        buf[n] = b'Z';
        Some(n + 1)
    }
}

impl Serialize for Rfc3339 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut buf = [0u8; 30];
        match self.write(&mut buf) {
            // ASCII digits and separators only.
            Some(n) => s.serialize_str(std::str::from_utf8(&buf[..n]).unwrap_or_default()),
            None => self.0.serialize(s),
        }
    }
}

/// Bytes written as base64.
struct B64<'a>(&'a [u8]);

impl Serialize for B64<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        b64::serialize(self.0, s)
    }
}

/// The exact values a stored firing holds only the cut views of
/// (`store::long_keys`): the key's, the field's, or both.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Apart {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<Exact>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<Exact>,
}

/// A value kept apart: its length and SHA-256 (hex), which name it and check it when it is read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exact {
    pub len: usize,
    pub sha256: String,
}

impl Exact {
    pub fn of(bytes: &[u8]) -> Exact {
        Exact {
            len: bytes.len(),
            sha256: crate::long_key::sha256_hex(bytes),
        }
    }

    /// Whether `bytes` are the value this names.
    pub fn is(&self, bytes: &[u8]) -> bool {
        bytes.len() == self.len && crate::long_key::sha256_hex(bytes) == self.sha256
    }
}

/// A firing's JSON once written: history keeps it and the payload of each of its jobs embeds
/// it, and writing it for each of them was a tenth of the intake's CPU in a mass expiry. It is
/// derived from the firing, so it never makes two firings differ, and a clone starts without
/// it (a clone may be changed; a firing in use is shared behind an `Arc` and never is).
#[derive(Default)]
struct Written(std::sync::OnceLock<Arc<str>>);

impl Clone for Written {
    fn clone(&self) -> Written {
        Written::default()
    }
}

impl PartialEq for Written {
    fn eq(&self, _: &Written) -> bool {
        true
    }
}

impl std::fmt::Debug for Written {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Written")
    }
}

/// A firing's detail: the JSON kept beside the key (docs/rules.md), or its text when it is not JSON.
/// Read from Redis, it is kept as the JSON text it was stored as, checked but not parsed, and
/// written into history and the jobs' payloads as it is: a mass expiry stores 100,000 details
/// at once, and parsing each into a tree only to write it out again was a tenth of the intake's
/// CPU. It is parsed when something reads it (a template, the event JSON), once.
#[derive(Clone)]
pub struct Detail {
    /// The JSON as it was stored, when it is JSON.
    text: Option<Box<serde_json::value::RawValue>>,
    value: std::sync::OnceLock<serde_json::Value>,
}

impl Detail {
    /// The detail as read from Redis: its JSON when the bytes are JSON, else its text (lossy
    /// UTF-8) as a string.
    pub fn read(bytes: &[u8]) -> Detail {
        match serde_json::from_slice::<Box<serde_json::value::RawValue>>(bytes) {
            Ok(text) => Detail {
                text: Some(text),
                value: Default::default(),
            },
            Err(_) => serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned()).into(),
        }
    }

    /// The detail as templates see it.
    pub fn value(&self) -> &serde_json::Value {
        self.value.get_or_init(|| {
            self.text
                .as_ref()
                // Checked when it was read: it parses.
                .and_then(|t| serde_json::from_str(t.get()).ok())
                .unwrap_or_default()
        })
    }
}

impl From<serde_json::Value> for Detail {
    fn from(v: serde_json::Value) -> Detail {
        Detail {
            text: None,
            value: v.into(),
        }
    }
}

impl PartialEq for Detail {
    fn eq(&self, other: &Detail) -> bool {
        self.value() == other.value()
    }
}

impl std::fmt::Debug for Detail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.value().fmt(f)
    }
}

impl Serialize for Detail {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.text {
            Some(text) => text.serialize(s),
            None => self.value().serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Detail {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Detail, D::Error> {
        serde_json::Value::deserialize(d).map(Detail::from)
    }
}

/// One captured value of the rule's pattern.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capture {
    pub name: String,
    /// A slice of the event's key (or field), shared with it.
    #[serde(with = "b64")]
    pub value: bytes::Bytes,
}

/// The id of one event of one rule: a hash of what identifies the event, so every instance that
/// sees it computes the same id. `instant` is the deadline when known, else the moment the event
/// was first claimed.
pub fn event_id(
    rule: &str,
    kind: EventKind,
    db: u32,
    key: &[u8],
    instant: DateTime<Utc>,
) -> String {
    id_of(rule, kind, db, &[key], instant)
}

/// [`event_id`] of `parts` hashed one after the other as one key, so that a key of megabytes is
/// never copied to be joined.
fn id_of(rule: &str, kind: EventKind, db: u32, parts: &[&[u8]], instant: DateTime<Utc>) -> String {
    let mut h = Sha256::new();
    h.update(rule.as_bytes());
    h.update([0]);
    h.update(kind.as_str().as_bytes());
    h.update([0]);
    h.update(db.to_be_bytes());
    let len: usize = parts.iter().map(|p| p.len()).sum();
    h.update((len as u64).to_be_bytes());
    for p in parts {
        h.update(p);
    }
    h.update(instant.timestamp_millis().to_be_bytes());
    let digest = h.finalize();
    // Hex by table, not a `write!` per byte: in a mass expiry the formatting was most of the
    // id's cost (docs/performance.md#mass-expiry).
    hex::encode(&digest[..16])
}

/// [`event_id`] of a `hexpired` event: the field joins the key (length-prefixed, so no two
/// (key, field) pairs hash alike).
pub fn field_event_id(
    rule: &str,
    db: u32,
    key: &[u8],
    field: &[u8],
    instant: DateTime<Utc>,
) -> String {
    let len = (key.len() as u64).to_be_bytes();
    id_of(rule, EventKind::Hexpired, db, &[&len, key, field], instant)
}

impl Firing {
    pub fn new(
        rule: &str,
        event: &KeyEvent,
        names: &[String],
        values: Vec<bytes::Bytes>,
        detail: Option<Detail>,
    ) -> Firing {
        let instant = event.deadline.unwrap_or(event.observed_at);
        Firing {
            id: match &event.field {
                None => event_id(rule, event.kind, event.db, &event.key, instant),
                Some(f) => field_event_id(rule, event.db, &event.key, f, instant),
            },
            rule: rule.to_string(),
            kind: event.kind,
            db: event.db,
            key: event.key.clone(),
            field: event.field.clone(),
            captures: names
                .iter()
                .cloned()
                .zip(values)
                .map(|(name, value)| Capture { name, value })
                .collect(),
            detail,
            deadline: event.deadline,
            observed_at: event.observed_at,
            ttl_ms: event.ttl_ms,
            recovered: event.recovered,
            source: event.source.clone(),
            apart: None,
            written: Written::default(),
        }
    }

    /// The firing's JSON (as `serde_json` writes it) as stored ([`Firing::apart`]), written at
    /// the first call: what history keeps of it and what every job of it embeds
    /// ([`Job::payload`]). A firing is not changed once it is read so (it is shared behind an
    /// `Arc` by then).
    pub fn text(&self) -> Arc<str> {
        self.written
            .0
            .get_or_init(|| {
                // A long key's firing is stored as its cut view, the exact values kept once
                // apart (docs/reliability.md#bounded-whatever-the-key).
                serde_json::to_string(self).unwrap_or_default().into()
            })
            .clone()
    }

    /// The event as a source reported it, for rendering templates.
    pub fn event(&self) -> KeyEvent {
        KeyEvent {
            kind: self.kind,
            db: self.db,
            key: self.key.clone(),
            field: self.field.clone(),
            observed_at: self.observed_at,
            deadline: self.deadline,
            ttl_ms: self.ttl_ms,
            recovered: self.recovered,
            source: self.source.clone(),
            place: None,
        }
    }

    pub fn capture_names(&self) -> Vec<String> {
        self.captures.iter().map(|c| c.name.clone()).collect()
    }

    pub fn capture_values(&self) -> Vec<bytes::Bytes> {
        self.captures.iter().map(|c| c.value.clone()).collect()
    }

    /// The template context of this firing (docs/rules.md), from the stored copy of everything.
    pub fn context(&self) -> crate::template::Context {
        crate::template::Context::for_event(
            &self.rule,
            &self.event(),
            &self.capture_names(),
            &self.capture_values(),
            self.detail.as_ref().map(|d| d.value().clone()),
        )
    }

    /// This firing as people are shown it where at most `limit` bytes of a key fit: the key,
    /// the field and each capture longer than that replaced by its cut view
    /// ([`crate::long_key::view`]); `None` when every one fits. Built without copying the long
    /// values (docs/reliability.md#bounded-whatever-the-key).
    pub fn cut(&self, limit: usize) -> Option<Firing> {
        let fits = |v: &[u8]| v.len() <= limit;
        if fits(&self.key)
            && self.field.as_deref().is_none_or(fits)
            && self.captures.iter().all(|c| fits(&c.value))
        {
            return None;
        }
        let view = |v: &[u8]| crate::long_key::view(v, limit).into_owned();
        Some(
            self.with_values(
                view(&self.key).into(),
                self.field.as_deref().map(view),
                self.captures
                    .iter()
                    .map(|c| view(&c.value).into())
                    .collect(),
                self.apart.clone(),
            ),
        )
    }

    /// Whether this firing's key or field is longer than [`crate::long_key::EXACT`], as it came
    /// or as it was stored (its exact values kept apart).
    pub fn is_long(&self) -> bool {
        self.apart.is_some()
            || crate::long_key::is_long(&self.key)
            || self.field.as_deref().is_some_and(crate::long_key::is_long)
    }

    /// The exact values this firing keeps apart once stored, when it is a firing of a long key
    /// not yet stored: what the transaction that stores its jobs keeps (`store::long_keys`).
    pub fn kept_apart(&self) -> Vec<&[u8]> {
        if self.apart.is_some() {
            return Vec::new();
        }
        [Some(&self.key[..]), self.field.as_deref()]
            .into_iter()
            .flatten()
            .filter(|v| crate::long_key::is_long(v))
            .collect()
    }

    /// This firing as stored: itself, or, when its key or field is longer than
    /// [`crate::long_key::EXACT`], with the key, the field and the captures cut to
    /// [`crate::long_key::IN_TEXT`] and the exact values named in [`Firing::apart`].
    fn stored(&self) -> Option<Firing> {
        let long = |v: &[u8]| crate::long_key::is_long(v).then(|| Exact::of(v));
        let apart = Apart {
            key: long(&self.key),
            field: self.field.as_deref().and_then(long),
        };
        if self.apart.is_some() || (apart.key.is_none() && apart.field.is_none()) {
            return None;
        }
        let mut stored = self.cut(crate::long_key::IN_TEXT)?;
        stored.apart = Some(apart);
        Some(stored)
    }

    /// This stored firing made whole with the exact values it keeps apart (`key`, `field`: as
    /// read from `store::long_keys`), its captures taken again from them by `captures`
    /// (the rule's pattern): an error says why it cannot be, and the job is refused
    /// (docs/reliability.md#keywatchs-state-is-not-a-way-in).
    pub fn whole(
        &self,
        key: Option<Vec<u8>>,
        field: Option<Vec<u8>>,
        captures: impl Fn(&bytes::Bytes, Option<&[u8]>) -> Option<Vec<bytes::Bytes>>,
    ) -> Result<Firing, String> {
        let Some(apart) = &self.apart else {
            return Ok(self.clone());
        };
        let exact = |what: &str, named: &Option<Exact>, read: Option<Vec<u8>>, cut: &[u8]| match (
            named, read,
        ) {
            (None, _) => Ok(cut.to_vec()),
            (Some(e), Some(bytes)) if e.is(&bytes) => Ok(bytes),
            (Some(e), Some(_)) => Err(format!(
                "the {what} kept apart is not the one its firing names (sha256 {})",
                e.sha256
            )),
            (Some(e), None) => Err(format!(
                "the exact {what} ({} bytes, sha256 {}) is no longer kept: it is kept for 7 days after it was last used (docs/reliability.md#bounded-whatever-the-key)",
                e.len, e.sha256,
            )),
        };
        // Shared from here on: the captures are slices of it, not copies
        // (docs/reliability.md#bounded-whatever-the-key).
        let key = bytes::Bytes::from(exact("key", &apart.key, key, &self.key)?);
        let field = match &self.field {
            None => None,
            Some(cut) => Some(exact("field", &apart.field, field, cut)?),
        };
        let Some(values) = captures(&key, field.as_deref()) else {
            return Err(format!(
                "the key {} does not match the pattern of rule `{}`",
                crate::event::printable(&crate::long_key::view(&key, crate::long_key::IN_TEXT)),
                self.rule
            ));
        };
        let same = values.len() == self.captures.len()
            && values
                .iter()
                .zip(&self.captures)
                .all(|(v, c)| crate::long_key::view(v, crate::long_key::IN_TEXT) == &c.value[..]);
        if !same {
            return Err(format!(
                "its captures are not the ones the pattern of rule `{}` takes from its key",
                self.rule
            ));
        }
        Ok(self.with_values(key, field, values, None))
    }

    /// This firing with other values of its key, field, captures (in order) and `apart`.
    fn with_values(
        &self,
        key: bytes::Bytes,
        field: Option<Vec<u8>>,
        values: Vec<bytes::Bytes>,
        apart: Option<Apart>,
    ) -> Firing {
        Firing {
            id: self.id.clone(),
            rule: self.rule.clone(),
            kind: self.kind,
            db: self.db,
            key,
            field,
            captures: self
                .captures
                .iter()
                .zip(values)
                .map(|(c, value)| Capture {
                    name: c.name.clone(),
                    value,
                })
                .collect(),
            detail: self.detail.clone(),
            deadline: self.deadline,
            observed_at: self.observed_at,
            ttl_ms: self.ttl_ms,
            recovered: self.recovered,
            source: self.source.clone(),
            apart,
            written: Written::default(),
        }
    }

    pub fn late_ms(&self) -> Option<i64> {
        self.deadline
            .map(|d| (self.observed_at - d).num_milliseconds().max(0))
    }

    /// The event JSON of docs/rules.md#event-json (with `"field"` for `hexpired` events).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.event_json()).unwrap_or_default()
    }

    fn event_json(&self) -> EventJson<'_> {
        EventJson {
            captures: self
                .captures
                .iter()
                .map(|c| (c.name.as_str(), String::from_utf8_lossy(&c.value)))
                .collect(),
            db: self.db,
            deadline: self.deadline.map(rfc3339),
            detail: self.detail.as_ref().map(Detail::value),
            event: self.kind.as_str(),
            field: self.field.as_deref().map(String::from_utf8_lossy),
            id: &self.id,
            key: String::from_utf8_lossy(&self.key),
            late_ms: self.late_ms(),
            observed_at: rfc3339(self.observed_at),
            recovered: self.recovered,
            rule: &self.rule,
            source: &self.source,
            ttl_ms: self.ttl_ms,
            version: 1,
        }
    }
}

/// The event JSON of docs/rules.md#event-json, borrowed from a firing. The fields are in the order a
/// `serde_json::Value` object keeps them (sorted by name), so the text is the same whichever
/// way it is written; `captures` is a sorted map for the same reason (and, like an object, keeps
/// the last of two captures with one name).
#[derive(Serialize)]
struct EventJson<'a> {
    captures: std::collections::BTreeMap<&'a str, std::borrow::Cow<'a, str>>,
    db: u32,
    deadline: Option<String>,
    detail: Option<&'a serde_json::Value>,
    event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<std::borrow::Cow<'a, str>>,
    id: &'a str,
    key: std::borrow::Cow<'a, str>,
    late_ms: Option<i64>,
    observed_at: String,
    recovered: bool,
    rule: &'a str,
    source: &'a str,
    ttl_ms: Option<i64>,
    version: u32,
}

/// RFC 3339 in UTC with milliseconds, as in docs/rules.md#event-json: `2026-11-29T10:15:00.000Z`.
pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// What a job does; the order of the variants is the order of docs/rules.md.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Action {
    Reload,
    Exec,
    Cleanup,
    Notify {
        channel: String,
    },
    /// `notify` through an Alertmanager channel, to one of its `urls` (`target`, from 0): the
    /// alert is posted, posted again every `resend` while it fires, and ended by the rule's
    /// `resolved` (`action::alert`). Each URL is a job of its own, with its own retries and
    /// outcome, as Prometheus sends to each Alertmanager.
    Alert {
        channel: String,
        target: u32,
    },
    /// `escalate`: due `after` the alert; sends to `channel` unless the alert was handled.
    Escalate {
        channel: String,
    },
    /// `resolved`: sends to `channel` once the key exists again, within `within`.
    Resolved {
        channel: String,
    },
}

impl Action {
    /// The `action` label of metrics and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Reload => "reload",
            Action::Exec => "exec",
            Action::Cleanup => "cleanup",
            Action::Notify { .. } | Action::Alert { .. } => "notify",
            Action::Escalate { .. } => "escalate",
            Action::Resolved { .. } => "resolved",
        }
    }

    /// The channel of a notification or follow-up.
    pub fn channel(&self) -> Option<&str> {
        match self {
            Action::Notify { channel }
            | Action::Alert { channel, .. }
            | Action::Escalate { channel }
            | Action::Resolved { channel } => Some(channel),
            _ => None,
        }
    }

    /// The URL of an Alertmanager channel an alert job posts to (its place in `urls`).
    pub fn target(&self) -> Option<u32> {
        match self {
            Action::Alert { target, .. } => Some(*target),
            _ => None,
        }
    }

    /// A notification of the rule's `notify` (to a chat channel or an Alertmanager): each is
    /// independent of the others, and none waits for another.
    pub fn is_notification(&self) -> bool {
        matches!(self, Action::Notify { .. } | Action::Alert { .. })
    }

    /// Where the action comes among a firing's first attempts (docs/rules.md: reload → exec →
    /// cleanup → notify).
    pub fn order(&self) -> u8 {
        match self {
            Action::Reload => 0,
            Action::Exec => 1,
            Action::Cleanup => 2,
            Action::Notify { .. } | Action::Alert { .. } => 3,
            Action::Escalate { .. } | Action::Resolved { .. } => 4,
        }
    }

    /// The `Idempotency-Key` of a request: the event id plus the action (and channel).
    pub fn idempotency_key(&self, firing_id: &str) -> String {
        match self {
            Action::Notify { channel }
            | Action::Escalate { channel }
            | Action::Resolved { channel } => format!("{firing_id}:{}:{channel}", self.name()),
            Action::Alert { channel, target } => format!("{firing_id}:notify:{channel}:{target}"),
            other => format!("{firing_id}:{}", other.name()),
        }
    }
}

/// One action a firing owes: the unit the delivery stage stores, takes, attempts, retries and
/// dead-letters. Stored in the queue as JSON, so another instance can take it over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Shared by the jobs of one firing in memory; stored whole with each job.
    pub firing: Arc<Firing>,
    pub action: Action,
    /// Attempts made so far.
    pub attempt: u32,
    /// When the first attempt failed (unix ms), for the 24 h retry window.
    pub failing_since: Option<i64>,
    /// Set on a message quiet hours held and released as itself: it says so, and is not held
    /// again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<Released>,
}

/// How a message held by quiet hours was released as itself (docs/rules.md#quiet-hours).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// The channel's window, while the rules still name it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    /// When the quiet period ended (unix ms).
    pub until: i64,
    /// Its key (or hash field) existed again at the release.
    #[serde(default)]
    pub resolved: bool,
}

impl Job {
    /// A job not yet attempted.
    pub fn first(firing: Arc<Firing>, action: Action) -> Job {
        Job {
            firing,
            action,
            attempt: 0,
            failing_since: None,
            released: None,
        }
    }

    /// Its id in the queue: the `Idempotency-Key` of its requests.
    pub fn id(&self) -> String {
        self.action.idempotency_key(&self.firing.id)
    }

    /// Its JSON as the queue stores it: the text `serde_json` writes for it, with the firing's
    /// own JSON written once for history and all its jobs ([`Firing::text`]) put in whole.
    pub fn payload(&self) -> String {
        /// The job after its firing, as the job writes it.
        #[derive(Serialize)]
        struct Rest<'a> {
            action: &'a Action,
            attempt: u32,
            failing_since: Option<i64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            released: &'a Option<Released>,
        }
        let firing = self.firing.text();
        let rest = serde_json::to_string(&Rest {
            action: &self.action,
            attempt: self.attempt,
            failing_since: self.failing_since,
            released: &self.released,
        })
        .unwrap_or_default();
        let mut out = String::with_capacity(firing.len() + rest.len() + 12);
        out.push_str("{\"firing\":");
        out.push_str(&firing);
        out.push(',');
        // `rest` is an object: its fields follow the firing's, in the job's own order.
        out.push_str(rest.strip_prefix('{').unwrap_or("}"));
        out
    }
}

/// A job given up: a permanent error, or 24 h of retries. Kept in Redis so that nothing is
/// dropped silently (`keywatch dead list|retry|drop`), and shown on the status page.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// What `keywatch dead retry|drop` names it by.
    pub id: String,
    pub at: DateTime<Utc>,
    pub rule: String,
    /// The key as text (for a digest: how many keys).
    pub key: String,
    pub action: Action,
    pub reason: String,
    /// The firings the action was for (several for a digest).
    pub firings: Vec<Firing>,
    pub digest: bool,
}

impl DeadLetter {
    /// A new dead letter, now, with an id of its own.
    pub fn new(
        rule: &str,
        key: String,
        action: Action,
        reason: &str,
        firings: Vec<Firing>,
        digest: bool,
    ) -> DeadLetter {
        DeadLetter {
            id: format!("{:012x}", fastrand::u64(..) >> 16),
            at: Utc::now(),
            rule: rule.to_string(),
            key,
            action,
            reason: reason.to_string(),
            firings,
            digest,
        }
    }

    /// This letter without its firings: what the status page keeps of its last dead letters, so
    /// that fifty digests of thousands of firings each are not held in memory for it.
    pub fn summary(&self) -> DeadLetter {
        DeadLetter {
            id: self.id.clone(),
            at: self.at,
            rule: self.rule.clone(),
            key: self.key.clone(),
            action: self.action.clone(),
            reason: self.reason.clone(),
            firings: Vec::new(),
            digest: self.digest,
        }
    }

    /// The action as the status page names it: `notify:CHANNEL` for notifications.
    pub fn label(&self) -> String {
        match self.action.channel() {
            Some(channel) => format!("{}:{channel}", self.action.name()),
            None => self.action.name().to_string(),
        }
    }
}

/// Bytes as base64 text in stored JSON: keys need not be UTF-8.
pub(crate) mod b64 {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: From<Vec<u8>>>(d: D) -> Result<T, D::Error> {
        let s = String::deserialize(d)?;
        STANDARD
            .decode(s)
            .map(T::from)
            .map_err(serde::de::Error::custom)
    }
}

/// [`b64`] of a value's cut view ([`crate::long_key::view`] to [`crate::long_key::IN_TEXT`])
/// when it is longer than [`crate::long_key::EXACT`], for what keeps such a value apart.
pub(crate) mod b64_view {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        if crate::long_key::is_long(v) {
            super::b64::serialize(&crate::long_key::view(v, crate::long_key::IN_TEXT), s)
        } else {
            super::b64::serialize(v, s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: From<Vec<u8>>>(d: D) -> Result<T, D::Error> {
        super::b64::deserialize(d)
    }
}

/// [`b64`] for an optional value (a `hexpired` event's field).
pub(crate) mod b64_opt {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => super::b64::serialize(v, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        #[derive(Deserialize)]
        struct Wrap(#[serde(with = "super::b64")] Vec<u8>);
        Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
    }
}

/// An expiry of `key` matched by `rule`, observed at `observed_at` (no captures, no detail):
/// what the unit tests of the parts after matching start from.
#[cfg(test)]
pub(crate) fn expiry(rule: &str, key: &str, observed_at: &str) -> Firing {
    let event = KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: bytes::Bytes::from(key.as_bytes().to_vec()),
        field: None,
        observed_at: observed_at.parse().unwrap(),
        deadline: None,
        ttl_ms: None,
        recovered: false,
        source: "127.0.0.1:1".into(),
        place: None,
    };
    Firing::new(rule, &event, &[], vec![], None)
}

#[cfg(test)]
mod tests {

    /// Every instant is written as chrono writes it: whole seconds, milli-, micro- and
    /// nanoseconds, the ends of the years keywatch writes itself, and those it leaves to chrono.
    #[test]
    fn instants_are_written_as_chrono_writes_them() {
        use chrono::TimeZone;
        let mut instants = vec![
            Utc.timestamp_opt(0, 0).unwrap(),
            Utc.timestamp_opt(1_796_605_856, 444_000_000).unwrap(),
            Utc.timestamp_opt(1_796_605_856, 444_500_000).unwrap(),
            Utc.timestamp_opt(1_796_605_856, 444_500_001).unwrap(),
            Utc.timestamp_opt(1_796_605_856, 1).unwrap(),
            Utc.timestamp_opt(1_796_605_856, 1_000).unwrap(),
            Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap(),
            Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap(),
            Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap(),
            Utc.with_ymd_and_hms(-1, 1, 1, 0, 0, 0).unwrap(),
            chrono::NaiveDate::from_ymd_opt(2016, 12, 31)
                .unwrap()
                .and_hms_nano_opt(23, 59, 59, 1_500_000_000)
                .unwrap()
                .and_utc(),
        ];
        for _ in 0..2000 {
            let secs = fastrand::i64(-62_000_000_000..300_000_000_000);
            let nanos = match fastrand::u8(0..4) {
                0 => 0,
                1 => fastrand::u32(0..1000) * 1_000_000,
                2 => fastrand::u32(0..1_000_000) * 1_000,
                _ => fastrand::u32(0..1_000_000_000),
            };
            instants.push(Utc.timestamp_opt(secs, nanos).unwrap());
        }
        for t in instants {
            assert_eq!(
                serde_json::to_string(&Rfc3339(t)).unwrap(),
                serde_json::to_string(&t).unwrap()
            );
        }
    }
    use super::*;

    fn event() -> KeyEvent {
        KeyEvent {
            kind: EventKind::Expired,
            db: 0,
            key: bytes::Bytes::from(b"order_lock:\xff42".to_vec()),
            field: None,
            observed_at: "2026-11-29T10:15:00.012Z".parse().unwrap(),
            deadline: Some("2026-11-29T10:15:00.000Z".parse().unwrap()),
            ttl_ms: None,
            recovered: false,
            source: "127.0.0.1:6379".into(),
            place: None,
        }
    }

    #[test]
    fn ids_are_stable_and_distinct() {
        let e = event();
        let a = Firing::new("r", &e, &["id".into()], vec![b"42".to_vec().into()], None);
        let b = Firing::new("r", &e, &["id".into()], vec![b"42".to_vec().into()], None);
        assert_eq!(a.id, b.id);
        assert_eq!(a.id.len(), 32);
        assert_ne!(a.id, Firing::new("other", &e, &[], vec![], None).id);
        assert_eq!(
            Action::Notify {
                channel: "oncall".into()
            }
            .idempotency_key(&a.id),
            format!("{}:notify:oncall", a.id)
        );
    }

    #[test]
    fn event_json_has_the_fields_of_the_spec() {
        let f = Firing::new(
            "order-lock-timeout",
            &event(),
            &["order_id".into()],
            vec![b"\xff42".to_vec().into()],
            None,
        );
        let j = f.to_json();
        assert_eq!(j["version"], 1);
        assert_eq!(j["event"], "expired");
        assert_eq!(j["key"], "order_lock:\u{fffd}42");
        assert_eq!(j["deadline"], "2026-11-29T10:15:00.000Z");
        assert_eq!(j["observed_at"], "2026-11-29T10:15:00.012Z");
        assert_eq!(j["late_ms"], 12);
        assert_eq!(j["detail"], serde_json::Value::Null);
        assert_eq!(j["ttl_ms"], serde_json::Value::Null);
        let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
        for k in ["id", "rule", "captures", "recovered", "source", "db"] {
            assert!(keys.contains(&k), "{k}");
        }
    }

    /// The event JSON as it was built before it was written straight from the firing: a
    /// `Value` tree, whose objects sort their keys. Kept here as the reference the bytes of
    /// [`Firing::to_json`] must not drift from (webhook payloads and history carry them).
    fn event_value(f: &Firing) -> serde_json::Value {
        let captures: serde_json::Map<String, serde_json::Value> = f
            .captures
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    String::from_utf8_lossy(&c.value).into_owned().into(),
                )
            })
            .collect();
        let mut json = serde_json::json!({
            "version": 1,
            "id": f.id,
            "rule": f.rule,
            "event": f.kind.as_str(),
            "key": String::from_utf8_lossy(&f.key),
            "db": f.db,
            "captures": captures,
            "detail": f.detail,
            "deadline": f.deadline.map(rfc3339),
            "observed_at": rfc3339(f.observed_at),
            "late_ms": f.late_ms(),
            "recovered": f.recovered,
            "ttl_ms": f.ttl_ms,
            "source": f.source,
        });
        if let (Some(field), Some(o)) = (&f.field, json.as_object_mut()) {
            o.insert(
                "field".into(),
                String::from_utf8_lossy(field).into_owned().into(),
            );
        }
        json
    }

    #[test]
    fn event_json_is_the_value_form_it_was_built_as() {
        let plain = Firing::new("r", &event(), &[], vec![], None);
        let mut field = event();
        field.kind = EventKind::Hexpired;
        field.field = Some(b"f\xfe\"<!channel>".to_vec());
        field.deadline = None;
        field.ttl_ms = Some(1500);
        field.recovered = true;
        let rich = Firing::new(
            "sessions \u{1f512}",
            &field,
            // Two captures of one name: the last wins, as in an object.
            &["z".into(), "a".into(), "z".into()],
            vec![
                b"1".to_vec().into(),
                b"\xff@all".to_vec().into(),
                b"3".to_vec().into(),
            ],
            Some(serde_json::json!({"user": "u\n1", "n": [1, 2.5, null], "b": {"x": true}}).into()),
        );
        for f in [plain, rich] {
            assert_eq!(f.to_json(), event_value(&f));
        }
    }

    #[test]
    fn a_payload_is_the_jobs_json() {
        let f = Firing::new(
            "r",
            &event(),
            &["id".into()],
            vec![vec![b'x'; 4000].into()],
            Some(serde_json::json!({"order": 42}).into()),
        );
        let f = Arc::new(f);
        let channel = || "on\"call\t<!channel>".to_string();
        let actions = [
            Action::Reload,
            Action::Exec,
            Action::Cleanup,
            Action::Notify { channel: channel() },
            Action::Escalate { channel: channel() },
            Action::Resolved { channel: channel() },
        ];
        for action in actions {
            let released = Released {
                window: Some("night".into()),
                until: 1_796_227_237_527,
                resolved: true,
            };
            for (attempt, failing_since, released) in [
                (0, None, None),
                (7, Some(1_796_227_237_527), None),
                (0, None, Some(released)),
            ] {
                let job = Job {
                    firing: f.clone(),
                    action: action.clone(),
                    attempt,
                    failing_since,
                    released,
                };
                assert_eq!(job.payload(), serde_json::to_string(&job).unwrap());
                let back: Job = serde_json::from_str(&job.payload()).unwrap();
                assert_eq!(back, job);
            }
        }
        // Written once for all of them, and a clone (which may be changed) writes its own.
        assert!(Arc::ptr_eq(&f.text(), &f.text()));
        let mut changed = (*f).clone();
        changed.recovered = !changed.recovered;
        assert_eq!(&*changed.text(), serde_json::to_string(&changed).unwrap());
        assert_ne!(changed.text(), f.text());
    }

    /// How a detail was read before it was kept as its text: parsed at once.
    fn parsed(bytes: &[u8]) -> serde_json::Value {
        serde_json::from_slice(bytes).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned())
        })
    }

    #[test]
    fn json_details_are_kept_as_stored_and_read_as_parsed_and_text_is_kept() {
        let stored = br#" {"order_id": 1, "user": "u\n1", "n": [1e3, 2.50, null]} "#;
        let d = Detail::read(stored);
        assert_eq!(d.value(), &parsed(stored));
        // Written as it was stored (without the spaces around it), not as a tree writes it.
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"order_id": 1, "user": "u\n1", "n": [1e3, 2.50, null]}"#
        );
        for text in [&b"plain text"[..], b"\xff", b"\"\xff\"", b"{\"a\": 1", b""] {
            let d = Detail::read(text);
            assert_eq!(d.value(), &parsed(text), "{text:?}");
            assert_eq!(serde_json::to_string(&d).unwrap(), parsed(text).to_string());
        }
    }

    mod detail_bytes {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever the bytes beside a key, a detail reads as it did when it was parsed at
            /// once, and its JSON in a job's payload reads back as that.
            #[test]
            fn a_detail_reads_as_parsed_and_its_json_reads_back_the_same(
                bytes in prop_oneof![
                    proptest::collection::vec(any::<u8>(), 0..40),
                    "[ \\[\\]{}\":,0-9a-z.eE+\\-\\\\\n]{0,40}".prop_map(String::into_bytes),
                    any::<i64>().prop_map(|n| format!(" {{\"n\": {n}, \"s\": [\"x\\u00e9\", true]}}").into_bytes()),
                ]
            ) {
                let d = Detail::read(&bytes);
                prop_assert_eq!(d.value(), &parsed(&bytes));
                let text = serde_json::to_string(&d).unwrap();
                let back: Detail = serde_json::from_str(&text).unwrap();
                prop_assert_eq!(back.value(), &parsed(&bytes));
            }
        }
    }

    #[test]
    fn a_cut_firing_shows_long_values_cut_and_keeps_the_rest() {
        let mut e = event();
        e.key = bytes::Bytes::from([b"big:".as_slice(), &[b'k'; 3000]].concat());
        let f = Firing::new(
            "r",
            &e,
            &["rest".into()],
            vec![vec![b'k'; 3000].into()],
            None,
        );
        assert!(f.cut(4000).is_none(), "everything fits");
        let cut = f.cut(1024).unwrap();
        assert_eq!(cut.id, f.id);
        assert!(cut.key.len() <= 1024 && cut.captures[0].value.len() <= 1024);
        let json = cut.to_json();
        let key = json["key"].as_str().unwrap();
        assert!(key.starts_with("big:kkk") && key.ends_with(']'), "{key}");
        assert!(key.contains("3004 bytes, sha256 "), "{key}");
    }

    /// The captures `big:{rest}` takes from a key.
    fn big_captures(key: &bytes::Bytes, _: Option<&[u8]>) -> Option<Vec<bytes::Bytes>> {
        key.starts_with(b"big:").then(|| vec![key.slice(4..)])
    }

    #[test]
    fn a_long_keys_firing_is_stored_cut_and_made_whole_only_by_its_exact_key() {
        let mut e = event();
        let long = [b"big:".as_slice(), &[b'k'; 100_000]].concat();
        e.key = bytes::Bytes::from(long.clone());
        let f = Firing::new(
            "r",
            &e,
            &["rest".into()],
            vec![vec![b'k'; 100_000].into()],
            None,
        );
        let text = f.text();
        assert!(
            text.len() < 4096,
            "stored as its cut view: {} bytes",
            text.len()
        );
        let stored: Firing = serde_json::from_str(&text).unwrap();
        assert!(stored.is_long() && stored.key.len() <= crate::long_key::IN_TEXT);
        assert_eq!(stored.apart.as_ref().unwrap().key, Some(Exact::of(&long)));
        assert_eq!(
            serde_json::to_string(&stored).unwrap(),
            *text,
            "written again the same"
        );
        assert!(f.kept_apart() == [long.as_slice()] && stored.kept_apart().is_empty());

        let whole = stored
            .whole(Some(long.clone()), None, big_captures)
            .unwrap();
        assert_eq!(whole, f, "made whole, it is the firing that was stored");

        let mut other = long.clone();
        *other.last_mut().unwrap() = b'x';
        let wrong = stored.whole(Some(other), None, big_captures).unwrap_err();
        assert!(wrong.contains("not the one its firing names"), "{wrong}");
        let gone = stored.whole(None, None, big_captures).unwrap_err();
        assert!(gone.contains("no longer kept"), "{gone}");

        // Captures written by hand into the stored firing are not the key's: refused.
        let mut forged = stored.clone();
        forged.captures[0].value = bytes::Bytes::from_static(b"FORGED");
        let why = forged.whole(Some(long), None, big_captures).unwrap_err();
        assert!(why.contains("captures are not the ones"), "{why}");
    }

    #[test]
    fn firings_survive_storage_byte_exact() {
        let f = Firing::new(
            "r",
            &event(),
            &["id".into()],
            vec![b"\xff42".to_vec().into()],
            Some(serde_json::json!({"a": 1}).into()),
        );
        let stored = serde_json::to_string(&f).unwrap();
        let back: Firing = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, f);
    }
}
