//! Slack incoming webhooks: `{"text": …}`, success only as HTTP 200 with body `ok`; 429 waits
//! for `Retry-After`; `no_service`, `channel_not_found`, archived channels are permanent.

use serde_json::json;

use crate::config::{Channel, Slack};

use super::{Message, fit, json_headers};
use crate::action::Outcome;
use crate::action::http::{self, Answer, Request};

/// Slack truncates `text` at 40,000 characters; stay under it in bytes.
const TEXT_LIMIT: usize = 39_000;

pub fn request(ch: &Channel, s: &Slack, msg: &Message) -> Request {
    let text = super::with_keyword(ch, &format!("*{}*\n{}", msg.title, msg.text));
    Request {
        method: reqwest::Method::POST,
        url: s.url.expose().to_string(),
        headers: json_headers(),
        body: serde_json::to_vec(&json!({"text": fit(&text, TEXT_LIMIT)})).unwrap_or_default(),
    }
}

pub fn judge(a: &Answer) -> Outcome {
    if a.status.is_success() {
        let body = a.body_text();
        return if body == "ok" {
            Outcome::Sent("ok".into())
        } else {
            Outcome::Retry {
                reason: format!("HTTP {} without `ok`: {body}", a.status.as_u16()),
                after: None,
            }
        };
    }
    http::judge_status(a)
}
