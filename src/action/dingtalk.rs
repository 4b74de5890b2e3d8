//! DingTalk custom robots (钉钉自定义机器人): HMAC-SHA256 signature per request in the URL,
//! `text` or `markdown`, `at` mentions backed by `@mobile` tokens in the text (DingTalk only
//! mentions people whose token is in the content), and `errcode` checked in the HTTP 200 body.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::config::{Channel, ChatFormat, DingTalk};

use super::Outcome;
use super::http::{self, Answer, Request};
use super::notify::{Message, fit, hmac_sha256_b64, json_headers, with_keyword};

/// DingTalk rejects bodies over 20,000 bytes (errcode 460101); leave room for the JSON around.
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

pub fn request(ch: &Channel, d: &DingTalk, msg: &Message, now: DateTime<Utc>) -> Request {
    let url = match &d.secret {
        Some(s) => signed_url(d.url.expose(), s.expose(), now),
        None => d.url.expose().to_string(),
    };
    let tokens: Vec<String> = d
        .mention
        .mobiles
        .iter()
        .chain(&d.mention.user_ids)
        .map(|m| format!("@{m}"))
        .collect();
    let mentions = if tokens.is_empty() {
        String::new()
    } else {
        format!("\n{}", tokens.join(" "))
    };
    let at = json!({
        "atMobiles": d.mention.mobiles,
        "atUserIds": d.mention.user_ids,
        "isAtAll": d.mention.all,
    });
    let body = match d.msgtype {
        ChatFormat::Text => {
            let content = with_keyword(ch, &format!("{}\n{}", msg.title, msg.text));
            json!({"msgtype": "text", "text": {"content": format!("{}{mentions}", fit(&content, TEXT_LIMIT))}, "at": at})
        }
        ChatFormat::Markdown => {
            // The keyword goes into the heading: put before `####` it would stop the heading
            // from being one.
            let title = with_keyword(ch, &msg.title);
            let text = format!("#### {title}\n\n{}", msg.text);
            json!({
                "msgtype": "markdown",
                "markdown": {"title": title, "text": format!("{}{mentions}", fit(&text, TEXT_LIMIT))},
                "at": at,
            })
        }
    };
    Request {
        method: reqwest::Method::POST,
        url,
        headers: json_headers(),
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// Success is HTTP 2xx *and* `errcode` 0: DingTalk reports its errors inside HTTP 200.
pub fn judge(ch: &Channel, a: &Answer) -> Outcome {
    if !a.status.is_success() {
        return http::judge_status(a);
    }
    let Some(j) = a.json() else {
        return Outcome::Retry {
            reason: format!("unexpected answer: {}", a.body_text()),
            after: None,
        };
    };
    let code = j.get("errcode").and_then(|c| c.as_i64()).unwrap_or(-1);
    let msg = j.get("errmsg").and_then(|m| m.as_str()).unwrap_or("");
    match code {
        0 => Outcome::Sent(format!("errcode 0 {msg}")),
        // Rate limited: the robot is throttled for a while; come back after a rate period.
        130101 => Outcome::Retry {
            reason: format!("errcode 130101 (rate limited): {msg}"),
            after: Some(ch.rate.map_or(Duration::from_secs(60), |r| r.per)),
        },
        // Keyword, signature or timestamp check failed; message too long: will not get better.
        310000 | 101002 | 460000..=460199 => Outcome::Failed(format!("errcode {code}: {msg}")),
        _ => Outcome::Retry {
            reason: format!("errcode {code}: {msg}"),
            after: None,
        },
    }
}
