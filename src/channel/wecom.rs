//! WeCom group robots (企业微信群机器人): `text` with `mentioned_list` /
//! `mentioned_mobile_list`, or `markdown` with `<@userid>`; `errcode` checked in the 200 body;
//! markdown content is limited to 4,096 bytes and text to 2,048.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;

use super::chat::{
    ChatFormat, Mention, fit_before, json_headers, judge_errcode, links_suffix, mention, msgtype,
    with_keyword,
};
use super::fields::Fields;
use super::http::{Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::{Message, TITLE_LIMIT, bounded};

pub const KIND: Kind = Kind {
    name: "wecom",
    fields: &["url", "url_file", "mention", "msgtype"],
    default_rate: Some(Rate {
        burst: 20,
        per: Duration::from_secs(60),
    }),
    example_url: "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=...",
    decode,
};

#[derive(Clone, Debug)]
pub struct WeCom {
    pub url: Secret,
    pub mention: Mention,
    pub msgtype: ChatFormat,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let url = f.url();
    let mention = mention(f, true);
    let msgtype = msgtype(f, ChatFormat::Text);
    if msgtype == ChatFormat::Markdown && !mention.mobiles.is_empty() {
        let warning = format!(
            "{}: WeCom markdown messages cannot mention by mobile number; use `msgtype: text` or `mention.user_ids`",
            f.what
        );
        f.d.warning(&f.loc, warning);
    }
    Some(Arc::new(WeCom {
        url: url?,
        mention,
        msgtype,
    }))
}

impl Integration for WeCom {
    fn escape(&self) -> Escape {
        self.msgtype.escape()
    }

    /// Of 2,048 bytes of text: a key's first 512, with room for the title, the message and
    /// the links.
    fn key_limit(&self) -> usize {
        512
    }

    fn mentions_mobiles(&self) -> bool {
        self.msgtype == ChatFormat::Text
    }

    fn target(&self) -> String {
        self.url.redacted_url()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        Dispatch::Request(request(ch, self, msg))
    }

    fn judge(&self, ch: &Channel, a: &Answer) -> Outcome {
        // 40058: too long; keywatch keeps content within the limits, so one means WeCom's
        // limit changed: dead-lettered on purpose (counted, logged, `keywatch dead list`).
        judge_errcode(ch, a, 45009, &|code| matches!(code, 40058 | 93000))
    }
}

const TEXT_LIMIT: usize = 2_048;
const MARKDOWN_LIMIT: usize = 4_096;

pub fn request(ch: &Channel, w: &WeCom, msg: &Message) -> Request {
    let mention = w.mention.merged(&msg.mention);
    let body = match w.msgtype {
        ChatFormat::Text => {
            let mut users = mention.user_ids.clone();
            if mention.all {
                users.push("@all".into());
            }
            let content = fit_before(
                &with_keyword(
                    ch,
                    &format!("{}\n{}", bounded(&msg.title, TITLE_LIMIT), msg.text),
                ),
                &links_suffix(msg, w.msgtype.escape()),
                TEXT_LIMIT,
            );
            json!({"msgtype": "text", "text": {"content": content, "mentioned_list": users, "mentioned_mobile_list": mention.mobiles}})
        }
        ChatFormat::Markdown => {
            let mentions: String = mention
                .user_ids
                .iter()
                .map(|u| format!(" <@{u}>"))
                .collect();
            // A rule's mentions are rendered per event: never let them take the room the
            // limit leaves (a subtraction that underflowed would have panicked).
            let content = fit_before(
                &with_keyword(
                    ch,
                    &format!("**{}**\n{}", bounded(&msg.title, TITLE_LIMIT), msg.text),
                ),
                &links_suffix(msg, w.msgtype.escape()),
                MARKDOWN_LIMIT.saturating_sub(mentions.len()).max(MARKDOWN_LIMIT / 2),
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
