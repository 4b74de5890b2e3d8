//! `notify`: a message composed from a rule's templates, escaped for its channel, sent through
//! the channel's integration, and judged by that integration's idea of success.

use std::sync::Arc;

use chrono::Utc;

use crate::config::{Channel, ChannelKind, Rule};
use crate::firing::{Action, Firing};

use crate::action::http::{self, Answer, Request};
use crate::action::{Actions, Outcome};

pub mod dingtalk;
pub mod feishu;
pub mod log;
pub mod slack;
pub mod webhook;
pub mod wecom;

/// One event of a message (a digest has several).
#[derive(Clone, Debug)]
pub struct Item {
    /// The event JSON of SPEC §4.
    pub event: serde_json::Value,
    /// Its rendered `notify.message`, escaped for the channel.
    pub text: String,
}

/// What a channel sends: already rendered and escaped for that channel.
#[derive(Clone, Debug)]
pub struct Message {
    pub rule: String,
    pub event: String,
    pub title: String,
    /// The body: one event's message, or a digest's lines.
    pub text: String,
    pub items: Vec<Item>,
    /// Events the message stands for (more than `items` when a digest was cut).
    pub count: usize,
    pub digest: bool,
    pub idempotency_key: String,
    /// A webhook's custom `body`, rendered.
    pub custom_body: Option<Vec<u8>>,
}

impl Message {
    /// Stands in for a digest that could not be composed (its rule or channel is gone), so its
    /// dead letter still says how many events it held, under the key it would have had.
    pub fn uncomposed_digest(rule: &str, first_id: &str, channel: &str, count: usize) -> Message {
        Message {
            rule: rule.to_string(),
            event: String::new(),
            title: String::new(),
            text: String::new(),
            items: Vec::new(),
            count,
            digest: true,
            idempotency_key: digest_key(first_id, channel, count),
            custom_body: None,
        }
    }

    pub fn omitted(&self) -> usize {
        self.count.saturating_sub(self.items.len())
    }
}

/// The `Idempotency-Key` of a digest: the same firings for the same channel give the same key,
/// so a retried digest is recognisably the same message.
fn digest_key(first_id: &str, channel: &str, count: usize) -> String {
    format!("{first_id}:digest:{channel}:{count}")
}

/// The message of one firing for one channel.
pub fn compose(a: &Actions, f: &Firing, rule: &Rule, ch: &Channel) -> Result<Message, String> {
    let n = rule.notify.as_ref().ok_or("the rule has no `notify`")?;
    let escape = ch.escape();
    let t = &a.config.templates;
    let ctx = f.context();
    let title = match n.title.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.title: {}", e.message))?,
        None => rule.name.clone(),
    };
    let text = match n.message.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.message: {}", e.message))?,
        None => String::new(),
    };
    let custom_body = match &ch.kind {
        ChannelKind::Webhook(w) => match w.body {
            Some(id) => Some(
                t.render_text(id, &ctx)
                    .map_err(|e| format!("channel body: {}", e.message))?
                    .into_bytes(),
            ),
            None => None,
        },
        _ => None,
    };
    Ok(Message {
        rule: rule.name.clone(),
        event: f.kind.as_str().to_string(),
        items: vec![Item {
            event: f.to_json(),
            text: text.clone(),
        }],
        title,
        text,
        count: 1,
        digest: false,
        idempotency_key: Action::Notify {
            channel: ch.name.clone(),
        }
        .idempotency_key(&f.id),
        custom_body,
    })
}

/// One digest message for `firings` (all of one rule, for one channel): the title rendered with
/// `count` and `events`, then one line per event up to `max_items`, then "… and N more".
pub fn compose_digest(
    a: &Actions,
    firings: &[Arc<Firing>],
    rule: &Rule,
    ch: &Channel,
    max_items: usize,
) -> Result<Message, String> {
    let n = rule.notify.as_ref().ok_or("the rule has no `notify`")?;
    let first = firings.first().ok_or("an empty digest")?;
    let escape = ch.escape();
    let t = &a.config.templates;
    let mut items = Vec::new();
    for f in firings.iter().take(max_items) {
        let text = match n.message.get(escape) {
            Some(id) => t
                .render_text(id, &f.context())
                .map_err(|e| format!("notify.message: {}", e.message))?,
            None => String::new(),
        };
        items.push(Item {
            event: f.to_json(),
            text,
        });
    }
    let events: Vec<serde_json::Value> = items.iter().map(|i| i.event.clone()).collect();
    let ctx = first.context().with_digest(firings.len(), events);
    let title = match n.title.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.title: {}", e.message))?,
        None => rule.name.clone(),
    };
    let mut text = String::new();
    if firings.len() > 1 {
        text.push_str(&format!(
            "{} {} events:\n",
            firings.len(),
            first.kind.as_str()
        ));
    }
    for i in &items {
        text.push_str(&format!("- {}\n", i.text));
    }
    let omitted = firings.len().saturating_sub(items.len());
    if omitted > 0 {
        text.push_str(&format!("… and {omitted} more\n"));
    }
    Ok(Message {
        rule: rule.name.clone(),
        event: first.kind.as_str().to_string(),
        title,
        text: text.trim_end().to_string(),
        items,
        count: firings.len(),
        digest: true,
        idempotency_key: digest_key(&first.id, &ch.name, firings.len()),
        custom_body: None,
    })
}

pub async fn send_one(a: &Actions, f: &Firing, rule: &Rule, ch: &Channel) -> Outcome {
    match compose(a, f, rule, ch) {
        Ok(msg) => send(&a.http, ch, &msg).await,
        Err(e) => Outcome::Failed(e),
    }
}

/// Sends a composed message through its channel (also what `send-test` uses).
pub async fn send(client: &reqwest::Client, ch: &Channel, msg: &Message) -> Outcome {
    if let ChannelKind::Log = ch.kind {
        return log::send(ch, msg);
    }
    let Some(req) = request(ch, msg, Utc::now()) else {
        return Outcome::Failed("this channel sends no request".into());
    };
    match http::send(client, &req, ch.timeout).await {
        Ok(answer) => judge(ch, &answer),
        Err(o) => o,
    }
}

/// The request for `msg` on `ch` at `now` (signatures depend on the time).
pub fn request(ch: &Channel, msg: &Message, now: chrono::DateTime<Utc>) -> Option<Request> {
    Some(match &ch.kind {
        ChannelKind::DingTalk(d) => dingtalk::request(ch, d, msg, now),
        ChannelKind::Slack(s) => slack::request(ch, s, msg),
        ChannelKind::Feishu(f) => feishu::request(ch, f, msg, now),
        ChannelKind::WeCom(w) => wecom::request(ch, w, msg),
        ChannelKind::Webhook(w) => webhook::request(ch, w, msg),
        ChannelKind::Log => return None,
    })
}

pub fn judge(ch: &Channel, answer: &Answer) -> Outcome {
    match &ch.kind {
        ChannelKind::DingTalk(_) => dingtalk::judge(ch, answer),
        ChannelKind::Slack(_) => slack::judge(answer),
        ChannelKind::Feishu(_) => feishu::judge(ch, answer),
        ChannelKind::WeCom(_) => wecom::judge(ch, answer),
        ChannelKind::Webhook(_) | ChannelKind::Log => http::judge_status(answer),
    }
}

/// `keyword` first, for robots whose keyword security rejects messages without it.
pub fn with_keyword(ch: &Channel, text: &str) -> String {
    match &ch.keyword {
        Some(k) if !text.contains(k.as_str()) => format!("{k} {text}"),
        _ => text.to_string(),
    }
}

/// Cuts `text` to at most `limit` bytes on a character boundary, saying how much was left out,
/// so an over-long message still arrives instead of being rejected by the target.
pub fn fit(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let suffix_room = 40;
    let mut end = limit.saturating_sub(suffix_room);
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n… and {} more bytes", &text[..end], text.len() - end)
}

/// The `errcode`/`errmsg` convention of DingTalk and WeCom robots: errors come inside an HTTP
/// 200, so success is 2xx *and* `errcode` 0. `rate_limited` is retried after one rate period
/// of the channel; codes `permanent` accepts are given up; anything else is retried.
pub fn judge_errcode(
    ch: &Channel,
    a: &Answer,
    rate_limited: i64,
    permanent: &dyn Fn(i64) -> bool,
) -> Outcome {
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
        c if c == rate_limited => Outcome::Retry {
            reason: format!("errcode {c} (rate limited): {msg}"),
            after: Some(
                ch.rate
                    .map_or(std::time::Duration::from_secs(60), |r| r.per),
            ),
        },
        c if permanent(c) => Outcome::Failed(format!("errcode {c}: {msg}")),
        c => Outcome::Retry {
            reason: format!("errcode {c}: {msg}"),
            after: None,
        },
    }
}

/// HMAC-SHA256 of `message` with `key`, base64: DingTalk and Feishu signatures.
pub fn hmac_sha256_b64(key: &[u8], message: &[u8]) -> String {
    use base64::Engine;
    use hmac::{Hmac, KeyInit, Mac};
    let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key)
        .expect("HMAC accepts keys of any length");
    mac.update(message);
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

/// The JSON content type every chat API expects.
pub fn json_headers() -> Vec<(String, String)> {
    vec![(
        "Content-Type".into(),
        "application/json; charset=utf-8".into(),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_keeps_short_text_and_cuts_long_text_on_char_boundaries() {
        assert_eq!(fit("short", 100), "short");
        let long = "é".repeat(1000);
        let cut = fit(&long, 200);
        assert!(cut.len() <= 200, "{}", cut.len());
        assert!(cut.ends_with("more bytes"));
    }

    #[test]
    fn hmac_matches_a_known_answer() {
        // Python: base64.b64encode(hmac.new(b"SEC123", b"1700000000000\nSEC123", hashlib.sha256).digest())
        assert_eq!(
            hmac_sha256_b64(b"SEC123", b"1700000000000\nSEC123"),
            "lkcPI1uoxBY1gUnCnnPH1Kkru0Hqjo7rFpA3haIVhEQ="
        );
    }
}
