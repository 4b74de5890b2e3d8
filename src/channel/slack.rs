//! Slack incoming webhooks: `{"text": …}`, success only as HTTP 200 with body `ok`; 429 waits
//! for `Retry-After`; `no_service`, `channel_not_found`, archived channels are permanent.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;

use super::chat::{fit, fit_before, json_headers, links_suffix, with_keyword};
use super::fields::Fields;
use super::http::{self, Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::{Message, TITLE_LIMIT, bounded};

pub const KIND: Kind = Kind {
    name: "slack",
    fields: &["url", "url_file"],
    default_rate: Some(Rate {
        burst: 1,
        per: Duration::from_secs(1),
    }),
    example_url: "https://hooks.slack.com/services/T000/B000/XXXX",
    decode,
};

#[derive(Clone, Debug)]
pub struct Slack {
    pub url: Secret,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    Some(Arc::new(Slack { url: f.url()? }))
}

impl Integration for Slack {
    fn escape(&self) -> Escape {
        Escape::Slack
    }

    /// Of 40,000 characters: a key's first 4 KiB, with room for the rest of the message.
    fn key_limit(&self) -> usize {
        4_096
    }

    fn target(&self) -> String {
        self.url.redacted_url()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        Dispatch::Request(request(ch, self, msg))
    }

    fn judge(&self, _ch: &Channel, a: &Answer) -> Outcome {
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
}

/// Slack truncates `text` at 40,000 characters; stay under it in bytes.
const TEXT_LIMIT: usize = 39_000;

pub fn request(ch: &Channel, s: &Slack, msg: &Message) -> Request {
    // A rule's mentions (Slack channels have none of their own): `<@U…>` and `<!channel>`,
    // written after the text, whose own `<` were escaped.
    let mut mentions: Vec<String> = msg
        .mention
        .user_ids
        .iter()
        .map(|u| format!("<@{u}>"))
        .collect();
    if msg.mention.all {
        mentions.push("<!channel>".into());
    }
    let text = with_keyword(
        ch,
        &format!("*{}*\n{}", bounded(&msg.title, TITLE_LIMIT), msg.text),
    );
    // The links, then the mentions, after the text: what is too long is cut from the text.
    let mut tail = links_suffix(msg, Escape::Slack);
    if !mentions.is_empty() {
        tail.push('\n');
        tail.push_str(&fit(&mentions.join(" "), 2_000));
    }
    let text = fit_before(&text, &tail, TEXT_LIMIT);
    Request {
        method: reqwest::Method::POST,
        url: s.url.expose().to_string(),
        headers: json_headers(),
        body: serde_json::to_vec(&json!({ "text": text })).unwrap_or_default(),
    }
}
