//! Feishu / Lark custom bots (飞书自定义机器人): signature in the JSON body (seconds;
//! HMAC-SHA256 keyed by "ts\nsecret" over an empty message — not DingTalk's scheme), `text` or
//! an interactive card for markdown, and `code` (or legacy `StatusCode`) checked.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;

use super::chat::{
    ChatFormat, Mention, fit, hmac_sha256_b64, json_headers, links_suffix, mention, msgtype,
    with_keyword,
};
use super::fields::Fields;
use super::http::{self, Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::{Message, TITLE_LIMIT, bounded, fit_body, too_big};

pub const KIND: Kind = Kind {
    name: "feishu",
    fields: &[
        "url",
        "url_file",
        "secret",
        "secret_file",
        "mention",
        "msgtype",
    ],
    default_rate: Some(Rate {
        burst: 5,
        per: Duration::from_secs(1),
    }),
    example_url: "https://open.feishu.cn/open-apis/bot/v2/hook/...",
    decode,
};

#[derive(Clone, Debug)]
pub struct Feishu {
    pub url: Secret,
    pub secret: Option<Secret>,
    pub mention: Mention,
    pub msgtype: ChatFormat,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let url = f.url();
    let secret = f.secret("secret");
    let mention = mention(f, false);
    let msgtype = msgtype(f, ChatFormat::Text);
    Some(Arc::new(Feishu {
        url: url?,
        secret,
        mention,
        msgtype,
    }))
}

impl Integration for Feishu {
    fn escape(&self) -> Escape {
        self.msgtype.escape()
    }

    /// Of a 20 KB body: a key's first 4 KiB, with room for the rest of the message.
    fn key_limit(&self) -> usize {
        4_096
    }

    fn target(&self) -> String {
        self.url.redacted_url()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, now: DateTime<Utc>) -> Dispatch {
        match request(ch, self, msg, now) {
            Ok(req) => Dispatch::Request(req),
            Err(outcome) => Dispatch::Done(outcome),
        }
    }

    fn judge(&self, ch: &Channel, a: &Answer) -> Outcome {
        let j = a.json();
        let code = j
            .as_ref()
            .and_then(|j| j.get("code").or_else(|| j.get("StatusCode")))
            .and_then(|c| c.as_i64());
        let msg = j
            .as_ref()
            .and_then(|j| j.get("msg").or_else(|| j.get("StatusMessage")))
            .and_then(|m| m.as_str())
            .unwrap_or("")
            .to_string();
        match (a.status.is_success(), code) {
            (true, Some(0)) => Outcome::Sent(format!("code 0 {msg}")),
            (_, Some(11232)) => Outcome::Retry {
                reason: format!("code 11232 (rate limited): {msg}"),
                after: Some(ch.rate.map_or(Duration::from_secs(1), |r| r.per)),
            },
            // Signature, IP, keyword, bad request, too large: will not get better by retrying,
            // so dead-lettered on purpose (counted, logged, `keywatch dead list`). keywatch keeps
            // every body within BODY_LIMIT; a 19036 means Feishu's limit changed.
            (_, Some(c @ (19021 | 19022 | 19024 | 9499 | 19036))) => {
                Outcome::Failed(format!("code {c}: {msg}"))
            }
            (true, Some(c)) => Outcome::Retry {
                reason: format!("code {c}: {msg}"),
                after: None,
            },
            (true, None) => Outcome::Retry {
                reason: format!("unexpected answer: {}", a.body_text()),
                after: None,
            },
            (false, _) => http::judge_status(a),
        }
    }
}

/// Feishu's limit on the request body: 20 KB in its documentation (30 KB seen in its errors),
/// signature, card and JSON escaping included.
const BODY_LIMIT: usize = 20_000;

/// The message text's first cut; [`fit_body`] cuts further when escaping makes the body longer.
const TEXT_LIMIT: usize = 18_000;

pub fn sign(secret: &str, ts_secs: i64) -> String {
    hmac_sha256_b64(format!("{ts_secs}\n{secret}").as_bytes(), b"")
}

/// The request of `msg`, every part bounded so that the body stays within [`BODY_LIMIT`]; a
/// failure when it cannot.
pub fn request(
    ch: &Channel,
    f: &Feishu,
    msg: &Message,
    now: DateTime<Utc>,
) -> Result<Request, Outcome> {
    // The links after the text, a part of their own: what is too long is cut from the text,
    // never the links.
    let links = links_suffix(msg, f.msgtype.escape());
    let parts = vec![
        bounded(&msg.title, TITLE_LIMIT).into_owned(),
        fit(&msg.text, TEXT_LIMIT.saturating_sub(links.len())),
        links,
    ];
    let body = fit_body(BODY_LIMIT, parts, |parts| {
        let text = format!("{}{}", parts[1], parts[2]);
        let body = body(ch, f, msg, (&parts[0], &text), now);
        serde_json::to_vec(&body).unwrap_or_default()
    })
    .map_err(|size| too_big("Feishu", size, BODY_LIMIT))?;
    Ok(Request {
        method: reqwest::Method::POST,
        url: f.url.expose().to_string(),
        headers: json_headers(),
        body,
    })
}

/// The JSON body of `msg` with its `title` and `text` (both already bounded).
fn body(
    ch: &Channel,
    f: &Feishu,
    msg: &Message,
    (title, text): (&str, &str),
    now: DateTime<Utc>,
) -> serde_json::Value {
    let mention = f.mention.merged(&msg.mention);
    let mut body = match f.msgtype {
        ChatFormat::Text => {
            let mut mentions: Vec<String> = mention
                .user_ids
                .iter()
                .map(|u| format!("<at user_id=\"{u}\"></at>"))
                .collect();
            if mention.all {
                mentions.push("<at user_id=\"all\">所有人</at>".into());
            }
            let text = with_keyword(ch, &format!("{title}\n{text}"));
            let text = if mentions.is_empty() {
                text
            } else {
                format!("{text}\n{}", mentions.join(" "))
            };
            json!({"msg_type": "text", "content": {"text": text}})
        }
        ChatFormat::Markdown => {
            let mut mentions: Vec<String> = mention
                .user_ids
                .iter()
                .map(|u| format!("<at id={u}></at>"))
                .collect();
            if mention.all {
                mentions.push("<at id=all></at>".into());
            }
            let text = with_keyword(ch, text);
            let text = if mentions.is_empty() {
                text
            } else {
                format!("{text}\n{}", mentions.join(" "))
            };
            json!({
                "msg_type": "interactive",
                "card": {
                    "header": {"title": {"tag": "plain_text", "content": with_keyword(ch, title)}},
                    "elements": [{"tag": "markdown", "content": text}],
                },
            })
        }
    };
    if let Some(secret) = &f.secret {
        let ts = now.timestamp();
        body["timestamp"] = json!(ts.to_string());
        body["sign"] = json!(sign(secret.expose(), ts));
    }
    body
}
