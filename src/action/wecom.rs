//! WeCom group robots (企业微信群机器人): `text` with `mentioned_list` /
//! `mentioned_mobile_list`, or `markdown` with `<@userid>`; `errcode` checked in the 200 body;
//! markdown content is limited to 4,096 bytes and text to 2,048.

use std::time::Duration;

use serde_json::json;

use crate::config::{Channel, ChatFormat, WeCom};

use super::Outcome;
use super::http::{self, Answer, Request};
use super::notify::{Message, fit, json_headers, with_keyword};

const TEXT_LIMIT: usize = 2_048;
const MARKDOWN_LIMIT: usize = 4_096;

pub fn request(ch: &Channel, w: &WeCom, msg: &Message) -> Request {
    let body = match w.msgtype {
        ChatFormat::Text => {
            let mut users = w.mention.user_ids.clone();
            if w.mention.all {
                users.push("@all".into());
            }
            let content = fit(
                &with_keyword(ch, &format!("{}\n{}", msg.title, msg.text)),
                TEXT_LIMIT,
            );
            json!({"msgtype": "text", "text": {"content": content, "mentioned_list": users, "mentioned_mobile_list": w.mention.mobiles}})
        }
        ChatFormat::Markdown => {
            let mentions: String = w
                .mention
                .user_ids
                .iter()
                .map(|u| format!(" <@{u}>"))
                .collect();
            let content = fit(
                &with_keyword(ch, &format!("**{}**\n{}", msg.title, msg.text)),
                MARKDOWN_LIMIT - mentions.len(),
            );
            json!({"msgtype": "markdown", "markdown": {"content": format!("{content}{mentions}")}})
        }
    };
    Request {
        method: reqwest::Method::POST,
        url: w.url.expose().to_string(),
        headers: json_headers(),
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

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
        45009 => Outcome::Retry {
            reason: format!("errcode 45009 (rate limited): {msg}"),
            after: Some(ch.rate.map_or(Duration::from_secs(60), |r| r.per)),
        },
        // Too long; invalid webhook key.
        40058 | 93000 => Outcome::Failed(format!("errcode {code}: {msg}")),
        _ => Outcome::Retry {
            reason: format!("errcode {code}: {msg}"),
            after: None,
        },
    }
}
