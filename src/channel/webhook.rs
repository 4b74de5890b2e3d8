//! Generic webhooks: the event JSON of docs/rules.md#event-json (or a digest), Alertmanager's version-4 JSON
//! so existing bridges (prometheus-webhook-dingtalk, PrometheusAlert) work unchanged, or a
//! custom `body`. Every request carries `Idempotency-Key`.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::template::Escape;
use crate::yaml::Secret;

use super::fields::Fields;
use super::http::Request;
use super::integration::{Channel, Dispatch, Integration, Kind};
use super::message::{Message, TITLE_LIMIT, bounded};

pub const KIND: Kind = Kind {
    name: "webhook",
    fields: &["url", "url_file", "headers", "format", "body"],
    default_rate: None,
    example_url: "https://example.com/hooks/keywatch",
    decode,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WebhookFormat {
    /// The event JSON of docs/rules.md#event-json.
    Keywatch,
    /// Alertmanager's version-4 webhook JSON, so existing bridges work unchanged.
    Alertmanager,
}

#[derive(Clone, Debug)]
pub struct Webhook {
    pub url: Secret,
    pub headers: Vec<(String, Secret)>,
    pub format: WebhookFormat,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let url = f.url();
    let what = f.what.clone();
    let headers: Vec<(String, Secret)> =
        f.m.get("headers")
            .map(|n| f.d.string_map(n, &format!("{what} `headers`")))
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k.value, Secret::new(v.value)))
            .collect();
    // A header of a webhook is a credential more often than not (`X-Token`); masked wherever
    // it shows.
    for (_, v) in &headers {
        f.d.note_secret(v.expose());
    }
    let format = match f.text("format") {
        None if f.m.key_loc("format").is_some() => None,
        None => Some(WebhookFormat::Keywatch),
        Some(t) => match t.value.as_str() {
            "keywatch" => Some(WebhookFormat::Keywatch),
            "alertmanager" => Some(WebhookFormat::Alertmanager),
            other => {
                f.d.error(
                    &t.loc,
                    format!(
                        "{what} `format` must be `keywatch` or `alertmanager`, found `{other}`"
                    ),
                );
                None
            }
        },
    };
    f.body = f.text("body");
    Some(Arc::new(Webhook {
        url: url?,
        headers,
        format: format?,
    }))
}

impl Integration for Webhook {
    fn escape(&self) -> Escape {
        Escape::Raw
    }

    /// Its event JSON is data for programs: a key is whole up to [`crate::long_key::EXACT`];
    /// the Alertmanager format's labels take [`LABEL_LIMIT`].
    fn key_limit(&self) -> usize {
        match self.format {
            WebhookFormat::Keywatch => crate::long_key::EXACT,
            WebhookFormat::Alertmanager => LABEL_LIMIT,
        }
    }

    fn target(&self) -> String {
        self.url.redacted_url()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        Dispatch::Request(request(ch, self, msg))
    }
}

pub fn request(ch: &Channel, w: &Webhook, msg: &Message) -> Request {
    let (body, content_type) = match (&msg.custom_body, w.format) {
        (Some(b), _) => {
            let ct = if serde_json::from_slice::<Value>(b).is_ok() {
                "application/json"
            } else {
                "text/plain; charset=utf-8"
            };
            (b.clone(), ct)
        }
        (None, WebhookFormat::Keywatch) => (
            serde_json::to_vec(&keywatch_body(msg)).unwrap_or_default(),
            "application/json",
        ),
        (None, WebhookFormat::Alertmanager) => (
            serde_json::to_vec(&alertmanager_body(ch, msg)).unwrap_or_default(),
            "application/json",
        ),
    };
    let mut headers = vec![
        ("Content-Type".to_string(), content_type.to_string()),
        ("Idempotency-Key".to_string(), msg.idempotency_key.clone()),
    ];
    for (k, v) in &w.headers {
        headers.retain(|(h, _)| !h.eq_ignore_ascii_case(k));
        headers.push((k.clone(), v.expose().to_string()));
    }
    Request {
        method: reqwest::Method::POST,
        url: w.url.expose().to_string(),
        headers,
        body,
    }
}

/// docs/rules.md#event-json: one event, or `{"version", "rule", "event", "count", "events", "omitted"}`.
pub fn keywatch_body(msg: &Message) -> Value {
    if !msg.digest && msg.items.len() == 1 {
        return msg.items[0].event.clone();
    }
    json!({
        "version": 1,
        "rule": msg.rule,
        "event": msg.event,
        "count": msg.count,
        "events": msg.items.iter().map(|i| i.event.clone()).collect::<Vec<_>>(),
        "omitted": msg.omitted(),
    })
}

/// The most a label or an annotation of the Alertmanager format takes: bridges forward them
/// to chat services with limits of their own (DingTalk's 20,000 bytes).
const LABEL_LIMIT: usize = TITLE_LIMIT;

/// A string `v` within [`LABEL_LIMIT`]; other JSON values as they are.
fn label(v: &Value) -> Value {
    match v.as_str() {
        Some(s) => Value::from(bounded(s, LABEL_LIMIT).into_owned()),
        None => v.clone(),
    }
}

/// Alertmanager's webhook JSON, version 4: one alert per event, labels from the rule, the key
/// and its captures. Labels and annotations are bounded ([`LABEL_LIMIT`], the cut marked),
/// unlike the `keywatch` format, whose event JSON is exact: a 1 MB key made a 14.7 MB body.
pub fn alertmanager_body(ch: &Channel, msg: &Message) -> Value {
    let alerts: Vec<Value> = msg
        .items
        .iter()
        .map(|i| {
            let e = &i.event;
            let mut labels = serde_json::Map::new();
            labels.insert("alertname".into(), json!(msg.rule));
            labels.insert("event".into(), e["event"].clone());
            labels.insert("redis_key".into(), label(&e["key"]));
            labels.insert("db".into(), json!(e["db"].to_string()));
            if let Some(c) = e["captures"].as_object() {
                for (k, v) in c {
                    labels.entry(k.clone()).or_insert_with(|| label(v));
                }
            }
            let id = e["id"].as_str().unwrap_or("");
            json!({
                "status": "firing",
                "labels": labels,
                "annotations": {
                    "summary": bounded(&msg.title, LABEL_LIMIT),
                    "description": bounded(&i.text, LABEL_LIMIT),
                },
                "startsAt": e["observed_at"],
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": &id[..id.len().min(16)],
            })
        })
        .collect();
    json!({
        "version": "4",
        "groupKey": format!("{{}}:{{alertname=\"{}\"}}", msg.rule),
        "truncatedAlerts": msg.omitted(),
        "status": "firing",
        "receiver": ch.name,
        "groupLabels": {"alertname": msg.rule},
        "commonLabels": {"alertname": msg.rule, "event": msg.event},
        "commonAnnotations": {"summary": bounded(&msg.title, LABEL_LIMIT)},
        "externalURL": "",
        "alerts": alerts,
    })
}
