//! DingTalk custom robots (钉钉自定义机器人): HMAC-SHA256 signature per request in the URL,
//! `text` or `markdown`, `at` mentions backed by `@mobile` tokens in the text (DingTalk only
//! mentions people whose token is in the content), and `errcode` checked in the HTTP 200 body.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;

use super::chat::{
    ChatFormat, Mention, fit, hmac_sha256_b64, json_headers, judge_errcode, links_suffix, mention,
    msgtype, with_keyword,
};
use super::fields::Fields;
use super::http::{Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::{Message, TITLE_LIMIT, bounded, fit_body, too_big};

pub const KIND: Kind = Kind {
    name: "dingtalk",
    fields: &[
        "url",
        "url_file",
        "secret",
        "secret_file",
        "mention",
        "msgtype",
    ],
    default_rate: Some(Rate {
        burst: 20,
        per: Duration::from_secs(60),
    }),
    example_url: "https://oapi.dingtalk.com/robot/send?access_token=...",
    decode,
};

#[derive(Clone, Debug)]
pub struct DingTalk {
    pub url: Secret,
    pub secret: Option<Secret>,
    pub mention: Mention,
    pub msgtype: ChatFormat,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let url = f.url();
    let secret = f.secret("secret");
    let mention = mention(f, true);
    let msgtype = msgtype(f, ChatFormat::Markdown);
    Some(Arc::new(DingTalk {
        url: url?,
        secret,
        mention,
        msgtype,
    }))
}

impl Integration for DingTalk {
    fn escape(&self) -> Escape {
        self.msgtype.escape()
    }

    /// Of a 20,000-byte body: a key's first 4 KiB, with room for the rest of the message.
    fn key_limit(&self) -> usize {
        4_096
    }

    fn mentions_mobiles(&self) -> bool {
        true
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

    /// Success is HTTP 2xx *and* `errcode` 0: DingTalk reports its errors inside HTTP 200.
    fn judge(&self, ch: &Channel, a: &Answer) -> Outcome {
        // 130101: rate limited (the robot is throttled for a while); 310000: keyword, signature
        // or timestamp check failed; 101002/4601xx: message too long. The last two will not get
        // better: dead-lettered on purpose (counted, logged, `keywatch dead list`), never lost.
        // keywatch keeps every body within BODY_LIMIT, so a size refusal means DingTalk's
        // limit changed.
        judge_errcode(ch, a, 130101, &|code| {
            matches!(code, 310000 | 101002 | 460000..=460199)
        })
    }
}

/// DingTalk rejects bodies over 20,000 bytes (errcode 460101): the whole request body, title,
/// mentions and JSON escaping included.
const BODY_LIMIT: usize = 20_000;

/// The message text's first cut; [`fit_body`] cuts further when escaping makes the body longer.
const TEXT_LIMIT: usize = 18_000;

/// The signed URL: `timestamp` (ms) and `sign` = base64(HMAC-SHA256(secret, "ts\nsecret")),
/// percent-encoded exactly once by the URL library.
pub fn signed_url(url: &str, secret: &str, now: DateTime<Utc>) -> String {
    let ts = now.timestamp_millis().to_string();
    let sign = hmac_sha256_b64(secret.as_bytes(), format!("{ts}\n{secret}").as_bytes());
    match url::Url::parse(url) {
        Ok(mut u) => {
            u.query_pairs_mut()
                .append_pair("timestamp", &ts)
                .append_pair("sign", &sign);
            u.to_string()
        }
        Err(_) => url.to_string(),
    }
}

/// The request of `msg`, every part bounded so that the body stays within [`BODY_LIMIT`]; a
/// failure when it cannot.
pub fn request(
    ch: &Channel,
    d: &DingTalk,
    msg: &Message,
    now: DateTime<Utc>,
) -> Result<Request, Outcome> {
    let url = match &d.secret {
        Some(s) => signed_url(d.url.expose(), s.expose(), now),
        None => d.url.expose().to_string(),
    };
    let mention = d.mention.merged(&msg.mention);
    let tokens: Vec<String> = mention
        .mobiles
        .iter()
        .chain(&mention.user_ids)
        .map(|m| format!("@{m}"))
        .collect();
    let mentions = if tokens.is_empty() {
        String::new()
    } else {
        format!("\n{}", tokens.join(" "))
    };
    let at = json!({
        "atMobiles": mention.mobiles,
        "atUserIds": mention.user_ids,
        "isAtAll": mention.all,
    });
    // The links after the text, a part of their own: what is too long is cut from the text,
    // never the links.
    let links = links_suffix(msg, d.msgtype.escape());
    let build = |parts: &[String]| {
        let (title, text) = (&parts[0], format!("{}{}", parts[1], parts[2]));
        let body = match d.msgtype {
            ChatFormat::Text => {
                let content = with_keyword(ch, &format!("{title}\n{text}"));
                json!({"msgtype": "text", "text": {"content": format!("{content}{mentions}")}, "at": at})
            }
            ChatFormat::Markdown => {
                // The keyword goes into the heading: put before `####` it would stop the
                // heading from being one.
                let title = with_keyword(ch, title);
                json!({
                    "msgtype": "markdown",
                    "markdown": {"title": title, "text": format!("#### {title}\n\n{text}{mentions}")},
                    "at": at,
                })
            }
        };
        serde_json::to_vec(&body).unwrap_or_default()
    };
    let parts = vec![
        bounded(&msg.title, TITLE_LIMIT).into_owned(),
        fit(&msg.text, TEXT_LIMIT.saturating_sub(links.len())),
        links,
    ];
    let body = fit_body(BODY_LIMIT, parts, build)
        .map_err(|size| too_big("DingTalk", size, BODY_LIMIT))?;
    Ok(Request {
        method: reqwest::Method::POST,
        url,
        headers: json_headers(),
        body,
    })
}
