//! WeCom group robots (企业微信群机器人): `text` with `mentioned_list` /
//! `mentioned_mobile_list`, or `markdown` with `<@userid>`; `errcode` checked in the 200 body;
//! markdown content is limited to 4,096 bytes and text to 2,048.

use serde_json::json;

use crate::config::{Channel, ChatFormat, WeCom};

use super::{Message, fit, json_headers, judge_errcode, with_keyword};
use crate::action::Outcome;
use crate::action::http::{Answer, Request};

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
    // 45009: rate limited; 40058: too long and 93000: invalid webhook key will not get better.
    judge_errcode(ch, a, 45009, &|code| matches!(code, 40058 | 93000))
}
