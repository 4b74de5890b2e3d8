//! An alert as Prometheus Alertmanager's API v2 takes it, and the Alertmanagers of a channel
//! it is posted to: the exact JSON (docs/rules.md#alertmanager), the request per URL, and what
//! Alertmanager's answers mean. The channel's fields are read by [`super::alertmanager`].

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};

use crate::firing::rfc3339;
use crate::outcome::Outcome;
use crate::template::hidden_chars_shown;
use crate::yaml::Secret;
use crate::yaml::decode::Text;

use super::http::{self, Answer, Request};
use super::message::Message;

/// `hold` when the channel does not say: how long an alert fires unless the rule's `resolved`
/// ends it sooner.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(3600);

/// `resend` when the channel does not say: Prometheus's own `--rules.alert.resend-delay`.
pub const DEFAULT_RESEND: Duration = Duration::from_secs(60);

/// How long a resolved alert is posted again after it ended: Alertmanager's API docs ask
/// clients to keep sending resolved alerts for up to 5 minutes, since Alertmanager may restart
/// (and a resend that crossed the resolution on the way is corrected by the next one).
pub const RESOLVED_RESEND: Duration = Duration::from_secs(300);

/// The path every URL of the channel is posted to.
pub const ALERTS_PATH: &str = "/api/v2/alerts";

#[derive(Clone, Debug)]
pub struct Alertmanager {
    /// Each its own target: its own job, retries and outcome in history.
    pub urls: Vec<Secret>,
    /// `labels`: added to every alert of this channel.
    pub labels: Vec<(String, String)>,
    pub hold: Duration,
    pub resend: Duration,
    pub headers: Vec<(String, Secret)>,
}

/// Whether `name` is a label name every Alertmanager accepts: the classic Prometheus form
/// `[a-zA-Z_][a-zA-Z0-9_]*` (0.27 and later also take UTF-8 names, 0.25 does not).
pub fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Why `name` cannot be a label (or annotation) name written in the rule files, if it cannot.
pub fn bad_label_name(name: &str) -> Option<String> {
    if !is_label_name(name) {
        return Some(format!(
            "`{name}` is not a valid Prometheus label name (letters, digits and `_`, not starting with a digit), e.g. `team`"
        ));
    }
    if name.starts_with("__") {
        return Some(format!(
            "`{name}`: names starting with `__` are reserved for Prometheus's internal use"
        ));
    }
    None
}

/// The labels every alert has from its event, each with what it says: a capture of the same
/// name would make key text pass for the rule or the key.
pub const FIXED_LABELS: &[(&str, &str)] = &[
    ("alertname", "the rule's name"),
    ("key", "the key"),
    ("db", "the database"),
    ("event", "the event"),
    ("field", "the hash field"),
];

/// Why a capture named `name` cannot be a label of the alerts of alertmanager channel
/// `channel`, if it cannot: it would replace a label of [`FIXED_LABELS`], or Alertmanager
/// refuses or Prometheus reserves the name.
pub fn bad_capture_label(name: &str, channel: &str) -> Option<String> {
    if let Some((_, says)) = FIXED_LABELS.iter().find(|(l, _)| *l == name) {
        return Some(format!(
            "the capture `{name}` would replace the label `{name}` ({says}) of the alerts of alertmanager channel `{channel}`; rename it (e.g. `{name}_id`)"
        ));
    }
    let why = if name.starts_with("__") {
        "names starting with `__` are reserved for Prometheus's internal use"
    } else if !is_label_name(name) {
        "it is not a valid Prometheus label name (letters, digits and `_`, not starting with a digit)"
    } else {
        return None;
    };
    let plain = name.trim_start_matches('_');
    let instead = if is_label_name(plain) { plain } else { "id" };
    Some(format!(
        "the capture `{name}` cannot be a label of the alerts of alertmanager channel `{channel}`: {why}; rename it (e.g. `{instead}`)"
    ))
}

/// One alert as Alertmanager's API takes it, before it is put in its one-element array.
#[derive(Clone, Debug, PartialEq)]
pub struct Alert {
    /// In order: the event's, each capture, the channel's `labels`, the rule's `notify.labels`
    /// (a later one of the same name wins).
    pub labels: Vec<(String, String)>,
    pub annotations: Vec<(String, String)>,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub generator_url: Option<String>,
}

impl Alert {
    /// The alert of one event (its JSON of docs/rules.md#event-json) under `title` and
    /// `message`, firing from `starts_at` until `ends_at`: labels `alertname`, `key`, `db`,
    /// `event`, `field` and the captures; annotations `summary`, `description`, `keywatch_id`.
    /// The channel's and the rule's own labels and annotations are added by the caller.
    pub fn of_event(
        rule: &str,
        event: &Value,
        title: &str,
        message: &str,
        starts_at: DateTime<Utc>,
        ends_at: DateTime<Utc>,
    ) -> Alert {
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        let mut labels = vec![
            ("alertname".to_string(), rule.to_string()),
            ("key".to_string(), text(&event["key"])),
            ("db".to_string(), text(&event["db"])),
            ("event".to_string(), text(&event["event"])),
        ];
        if let Some(field) = event.get("field").filter(|f| !f.is_null()) {
            labels.push(("field".into(), text(field)));
        }
        if let Some(c) = event["captures"].as_object() {
            // `check` refuses these on alertmanager channels; left out here all the same, so
            // key text can never stand in for the rule or the key (docs/rules.md#alertmanager).
            let usable = |k: &str| bad_capture_label(k, "").is_none();
            for (k, v) in c.iter().filter(|(k, _)| usable(k)) {
                labels.push((k.clone(), text(v)));
            }
        }
        Alert {
            labels,
            annotations: vec![
                ("summary".into(), title.to_string()),
                ("description".into(), message.to_string()),
                ("keywatch_id".into(), text(&event["id"])),
            ],
            starts_at,
            ends_at,
            generator_url: None,
        }
    }

    /// `labels` added after the alert's own, replacing one of the same name.
    pub fn with_labels(mut self, labels: impl IntoIterator<Item = (String, String)>) -> Alert {
        put_all(&mut self.labels, labels);
        self
    }

    pub fn with_annotations(
        mut self,
        annotations: impl IntoIterator<Item = (String, String)>,
    ) -> Alert {
        put_all(&mut self.annotations, annotations);
        self
    }

    /// The body Alertmanager takes: a JSON array of this one alert. `generatorURL` is left out
    /// when there is none (Alertmanager takes it as optional; an empty one is not a URI).
    pub fn body(&self) -> Value {
        let map = |pairs: &[(String, String)]| {
            let mut m = Map::new();
            for (k, v) in pairs {
                m.insert(k.clone(), Value::String(v.clone()));
            }
            Value::Object(m)
        };
        let annotations: Vec<(String, String)> = self
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), hidden_chars_shown(v)))
            .collect();
        let mut alert = json!({
            "labels": map(&self.labels),
            "annotations": map(&annotations),
            "startsAt": rfc3339(self.starts_at),
            "endsAt": rfc3339(self.ends_at),
        });
        if let Some(u) = &self.generator_url {
            alert["generatorURL"] = Value::String(u.clone());
        }
        Value::Array(vec![alert])
    }
}

fn put_all(into: &mut Vec<(String, String)>, pairs: impl IntoIterator<Item = (String, String)>) {
    for (k, v) in pairs {
        match into.iter_mut().find(|(name, _)| *name == k) {
            Some(slot) => slot.1 = v,
            None => into.push((k, v)),
        }
    }
}

impl Alertmanager {
    /// `urls[target]` without user info, query or fragment: what history, `explain` and
    /// `send-test` show of it.
    pub fn shown_url(&self, target: usize) -> String {
        match self.urls.get(target) {
            Some(u) => shown(u),
            None => "<no such URL>".into(),
        }
    }

    /// What [`Alertmanager::request`] posts to for `urls[target]`, shown as
    /// [`Alertmanager::shown_url`] is: `explain`'s line.
    pub fn shown_alerts_url(&self, target: usize) -> String {
        match self.urls.get(target) {
            Some(u) => shown(&Secret::new(alerts_url(u.expose()))),
            None => "<no such URL>".into(),
        }
    }

    /// The request that posts `alert` to `urls[target]`.
    pub fn request(&self, target: usize, alert: &Alert) -> Option<Request> {
        let url = self.urls.get(target)?;
        let mut headers = vec![("Content-Type".to_string(), "application/json".to_string())];
        for (k, v) in &self.headers {
            headers.retain(|(h, _)| !h.eq_ignore_ascii_case(k));
            headers.push((k.clone(), v.expose().to_string()));
        }
        Some(Request {
            method: reqwest::Method::POST,
            url: alerts_url(url.expose()),
            headers,
            body: serde_json::to_vec(&alert.body()).unwrap_or_default(),
        })
    }
}

/// `url` with [`ALERTS_PATH`] joined to its path: its query kept after it (a proxy's
/// `?tenant=…`), its fragment, which is never sent, left out.
pub fn alerts_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let path = format!("{}{ALERTS_PATH}", u.path().trim_end_matches('/'));
            u.set_path(&path);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => format!("{}{ALERTS_PATH}", url.trim_end_matches('/')),
    }
}

/// A URL as people may see it: scheme, host, port and path; user info, query and fragment
/// (where credentials go) replaced by `<secret>`.
fn shown(u: &Secret) -> String {
    match url::Url::parse(u.expose()) {
        Ok(mut parsed) => {
            let hidden = !parsed.username().is_empty()
                || parsed.password().is_some()
                || parsed.query().is_some()
                || parsed.fragment().is_some();
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            let s = parsed.to_string();
            let s = s.trim_end_matches('/').to_string();
            if hidden { format!("{s} (<secret>)") } else { s }
        }
        Err(_) => "<secret>".into(),
    }
}

/// How the Alertmanager at one URL answered: 2xx taken; 5xx, 408 and 429 retried; any other
/// answer (a 400 naming a label it refuses, a 422 of a malformed body, a 415) means the
/// request itself is wrong and is given up with Alertmanager's own words.
pub fn judge(answer: &Answer) -> Outcome {
    let s = answer.status.as_u16();
    if (200..300).contains(&s) {
        return Outcome::Sent(format!("HTTP {s}"));
    }
    let said = match answer.json() {
        Some(Value::String(m)) => m,
        Some(Value::Object(o)) => o
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| answer.body_text(), str::to_string),
        _ => answer.body_text(),
    };
    match http::judge_status(answer) {
        Outcome::Failed(_) => Outcome::Failed(format!("HTTP {s}: {said}")),
        Outcome::Retry { after, .. } => Outcome::Retry {
            reason: format!("HTTP {s}: {said}"),
            after,
        },
        sent => sent,
    }
}

/// A test alert of `send-test` for `urls[target]`: `alertname="keywatch-send-test"`, the
/// channel's labels, firing for 5 minutes.
pub fn test_alert(am: &Alertmanager, msg: &Message, now: DateTime<Utc>) -> Alert {
    let item = msg.items.first();
    let event = item.map(|i| i.event.clone()).unwrap_or_default();
    Alert::of_event(
        "keywatch-send-test",
        &event,
        &msg.title,
        &msg.text,
        now,
        now + chrono::Duration::minutes(5),
    )
    .with_labels(am.labels.iter().cloned())
}

/// A rule's `notify.labels` or `notify.annotations` as written: names checked here, values
/// compiled as templates by the caller.
pub fn check_names(
    d: &mut crate::yaml::decode::Decoder<'_>,
    pairs: &[(crate::yaml::decode::Spanned<String>, Text)],
    what: &str,
    labels: bool,
) -> bool {
    let mut ok = true;
    for (k, _) in pairs {
        if let Some(why) = bad_label_name(&k.value) {
            d.error(&k.loc, format!("{what}: {why}"));
            ok = false;
        } else if labels && k.value == "alertname" {
            d.error(
                &k.loc,
                format!("{what}: `alertname` is the rule's name and cannot be set"),
            );
            ok = false;
        }
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Integration;

    fn event() -> Value {
        json!({"version": 1, "id": "0123abcd", "rule": "order-lock-timeout", "event": "expired",
            "key": "order_lock:\u{fffd}42", "db": 0, "captures": {"order_id": "\u{fffd}42"},
            "detail": null, "deadline": "2026-11-29T10:15:00.000Z",
            "observed_at": "2026-11-29T10:15:00.012Z", "late_ms": 12, "recovered": false,
            "ttl_ms": null, "source": "127.0.0.1:6379"})
    }

    fn am() -> Alertmanager {
        Alertmanager {
            urls: vec![
                Secret::new("http://user:pw@am-0:9093"),
                Secret::new("http://am-1:9093/prefix"),
            ],
            labels: vec![("team".into(), "payments".into())],
            hold: DEFAULT_HOLD,
            resend: DEFAULT_RESEND,
            headers: vec![("Authorization".into(), Secret::new("Bearer t0ken"))],
        }
    }

    /// The exact bytes Alertmanager is sent: a one-element array, labels and annotations in
    /// the order keywatch adds them (serde_json keeps objects sorted), times in RFC 3339 with
    /// milliseconds.
    #[test]
    fn the_alert_json_is_exact() {
        let starts: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let alert = Alert::of_event(
            "order-lock-timeout",
            &event(),
            "Order lock expired",
            "Lock of order 42 expired.",
            starts,
            starts + chrono::Duration::hours(1),
        )
        .with_labels([
            ("team".to_string(), "payments".to_string()),
            ("severity".to_string(), "page".to_string()),
        ])
        .with_annotations([("runbook_url".to_string(), "https://wiki/x".to_string())]);
        let alert = Alert {
            generator_url: Some("https://kw.example/api/history?id=0123abcd".into()),
            ..alert
        };
        let body = serde_json::to_string(&alert.body()).unwrap();
        assert_eq!(
            body,
            concat!(
                r#"[{"annotations":{"description":"Lock of order 42 expired.","keywatch_id":"0123abcd","#,
                r#""runbook_url":"https://wiki/x","summary":"Order lock expired"},"#,
                r#""endsAt":"2026-11-29T11:15:00.000Z","#,
                r#""generatorURL":"https://kw.example/api/history?id=0123abcd","#,
                r#""labels":{"alertname":"order-lock-timeout","db":"0","event":"expired","#,
                r#""key":"order_lock:�42","order_id":"�42","severity":"page","team":"payments"},"#,
                r#""startsAt":"2026-11-29T10:15:00.000Z"}]"#
            )
        );
    }

    #[test]
    fn a_field_is_a_label_and_later_labels_replace_earlier_ones() {
        let mut e = event();
        e["field"] = json!("sku-1");
        let t: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let a = Alert::of_event("r", &e, "t", "m", t, t)
            .with_labels([("event".to_string(), "custom".to_string())]);
        assert!(a.labels.contains(&("field".into(), "sku-1".into())));
        assert_eq!(
            a.labels
                .iter()
                .filter(|(k, _)| k == "event")
                .collect::<Vec<_>>(),
            [&("event".to_string(), "custom".to_string())]
        );
        let body = a.body();
        assert!(body[0].get("generatorURL").is_none(), "{body}");
    }

    /// `check` refuses such captures on alertmanager channels; an alert built anyway (rules
    /// that predate the check, `send-test`) still names the rule and the real key.
    #[test]
    fn a_capture_never_replaces_a_fixed_label_nor_brings_an_invalid_one() {
        let mut e = event();
        e["field"] = json!("sku-1");
        e["captures"] = json!({"alertname": "key text", "key": "k", "db": "9", "event": "x",
            "field": "f", "__meta": "m", "order_id": "42"});
        let t: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let a = Alert::of_event("order-lock-timeout", &e, "t", "m", t, t);
        assert_eq!(
            a.body()[0]["labels"],
            json!({"alertname": "order-lock-timeout", "key": "order_lock:\u{fffd}42", "db": "0",
                "event": "expired", "field": "sku-1", "order_id": "42"})
        );
    }

    #[test]
    fn annotations_show_invisible_characters_and_labels_keep_them() {
        let mut e = event();
        e["key"] = json!("k\u{202E}exe.txt\u{1b}[2J");
        let t: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let body = Alert::of_event("r", &e, "t\u{202E}", "line one\nline two\tend", t, t).body();
        assert_eq!(body[0]["labels"]["key"], "k\u{202E}exe.txt\u{1b}[2J");
        assert_eq!(body[0]["annotations"]["summary"], "t\\u202E");
        assert_eq!(
            body[0]["annotations"]["description"],
            "line one\nline two\tend"
        );
    }

    #[test]
    fn each_url_gets_the_alerts_path_and_the_headers() {
        let a = am();
        let t: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let alert = Alert::of_event("r", &event(), "t", "m", t, t);
        let r0 = a.request(0, &alert).unwrap();
        let r1 = a.request(1, &alert).unwrap();
        assert_eq!(r0.url, "http://user:pw@am-0:9093/api/v2/alerts");
        assert_eq!(r1.url, "http://am-1:9093/prefix/api/v2/alerts");
        assert_eq!(
            r0.headers,
            [
                ("Content-Type".to_string(), "application/json".to_string()),
                ("Authorization".to_string(), "Bearer t0ken".to_string())
            ]
        );
        assert!(a.request(2, &alert).is_none());
    }

    /// An Alertmanager behind a proxy that wants a query (`?tenant=…`): the path is joined
    /// before it, not appended to the query.
    #[test]
    fn a_url_with_a_query_keeps_it_after_the_alerts_path() {
        let a = Alertmanager {
            urls: vec![
                Secret::new("http://am-2:9093/prefix/?tenant=a&x=1#frag"),
                Secret::new("https://am-3?tenant=b"),
            ],
            ..am()
        };
        let t: DateTime<Utc> = "2026-11-29T10:15:00.000Z".parse().unwrap();
        let alert = Alert::of_event("r", &event(), "t", "m", t, t);
        assert_eq!(
            a.request(0, &alert).unwrap().url,
            "http://am-2:9093/prefix/api/v2/alerts?tenant=a&x=1"
        );
        assert_eq!(
            a.request(1, &alert).unwrap().url,
            "https://am-3/api/v2/alerts?tenant=b"
        );
        assert_eq!(a.shown_url(0), "http://am-2:9093/prefix (<secret>)");
        assert_eq!(
            a.shown_alerts_url(0),
            "http://am-2:9093/prefix/api/v2/alerts (<secret>)"
        );
    }

    #[test]
    fn urls_are_shown_without_credentials() {
        let a = am();
        assert_eq!(a.shown_url(0), "http://am-0:9093 (<secret>)");
        assert_eq!(a.shown_url(1), "http://am-1:9093/prefix");
        assert!(!a.target().contains("pw"), "{}", a.target());
    }

    #[test]
    fn label_names_are_prometheus_names() {
        for ok in ["team", "_x", "a1", "order_id"] {
            assert!(bad_label_name(ok).is_none(), "{ok}");
        }
        for bad in ["1bad", "a-b", "", "__meta", "é"] {
            assert!(bad_label_name(bad).is_some(), "{bad}");
        }
    }

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status: reqwest::StatusCode::from_u16(status).unwrap(),
            headers: Default::default(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// Alertmanager's two error shapes (a bare JSON string, or `{code, message}`) are quoted
    /// in its own words; 4xx is given up, 5xx retried.
    #[test]
    fn alertmanager_answers_are_judged_in_its_own_words() {
        assert_eq!(judge(&answer(200, "")), Outcome::Sent("HTTP 200".into()));
        assert_eq!(
            judge(&answer(
                400,
                r#""invalid label set: invalid name \"1bad\"""#
            )),
            Outcome::Failed(r#"HTTP 400: invalid label set: invalid name "1bad""#.into())
        );
        assert_eq!(
            judge(&answer(
                422,
                r#"{"code":602,"message":"0.labels in body is required"}"#
            )),
            Outcome::Failed("HTTP 422: 0.labels in body is required".into())
        );
        assert!(matches!(
            judge(&answer(503, "down")),
            Outcome::Retry { reason, .. } if reason == "HTTP 503: down"
        ));
    }
}
