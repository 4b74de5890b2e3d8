//! Generic webhooks: the event JSON of SPEC §4 (or a digest), Alertmanager's version-4 JSON
//! so existing bridges (prometheus-webhook-dingtalk, PrometheusAlert) work unchanged, or a
//! custom `body`. Every request carries `Idempotency-Key`.

use serde_json::{Value, json};

use crate::config::{Channel, Webhook, WebhookFormat};

use super::Message;
use crate::action::http::Request;

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

/// SPEC §4: one event, or `{"version", "rule", "event", "count", "events", "omitted"}`.
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

/// Alertmanager's webhook JSON, version 4: one alert per event, labels from the rule, the key
/// and its captures.
pub fn alertmanager_body(ch: &Channel, msg: &Message) -> Value {
    let alerts: Vec<Value> = msg
        .items
        .iter()
        .map(|i| {
            let e = &i.event;
            let mut labels = serde_json::Map::new();
            labels.insert("alertname".into(), json!(msg.rule));
            labels.insert("event".into(), e["event"].clone());
            labels.insert("redis_key".into(), e["key"].clone());
            labels.insert("db".into(), json!(e["db"].to_string()));
            if let Some(c) = e["captures"].as_object() {
                for (k, v) in c {
                    labels.entry(k.clone()).or_insert(v.clone());
                }
            }
            let id = e["id"].as_str().unwrap_or("");
            json!({
                "status": "firing",
                "labels": labels,
                "annotations": {"summary": msg.title, "description": i.text},
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
        "commonAnnotations": {"summary": msg.title},
        "externalURL": "",
        "alerts": alerts,
    })
}
