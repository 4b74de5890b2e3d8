//! Telegram bots: the Bot API's `sendMessage` at `{url}/bot{token}/sendMessage` (a local Bot API
//! server is another `url`), `parse_mode: HTML` with every value escaped, no link previews, and
//! the acknowledge and silence links as an inline keyboard of URL buttons. Success is HTTP 200
//! with `"ok": true`; a 429 waits for its `parameters.retry_after`. The token sits in the URL
//! path: it is a secret wherever it could show (`explain`, `send-test`, errors, logs, history).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::{Secret, mask_user_info};

use super::chat::{json_headers, with_keyword};
use super::fields::{Fields, check_http_url};
use super::http::{self, Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::Message;

pub const KIND: Kind = Kind {
    name: "telegram",
    fields: &["token", "token_file", "chat_id", "url"],
    // A bot may send no more than 20 messages a minute to one group, Telegram's Bot FAQ says;
    // alerts mostly go to groups (docs/rules.md#telegram).
    default_rate: Some(Rate {
        burst: 20,
        per: Duration::from_secs(60),
    }),
    example_url: "https://api.telegram.org",
    decode,
};

/// The Bot API server when the rule files name none.
pub const DEFAULT_URL: &str = "https://api.telegram.org";

/// Where messages go: a chat's numeric id (groups and channels are negative, and may need
/// more than 32 bits) or a public channel's `@username`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatId {
    Id(i64),
    Username(String),
}

impl ChatId {
    fn json(&self) -> Value {
        match self {
            ChatId::Id(n) => json!(n),
            ChatId::Username(u) => json!(u),
        }
    }
}

impl std::fmt::Display for ChatId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChatId::Id(n) => write!(f, "{n}"),
            ChatId::Username(u) => f.write_str(u),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Telegram {
    /// The Bot API server, without a trailing `/`.
    pub url: String,
    pub token: Secret,
    pub chat_id: ChatId,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let what = f.what.clone();
    let token = f.d.inline_or_file(&mut f.m, "token", &what, f.base);
    let token = match token {
        None => {
            f.d.error(
                &f.m.loc,
                format!("{what} is missing the field `token` (or `token_file`): the bot's token from @BotFather"),
            );
            None
        }
        Some(t) => {
            // Secret even when written in the file itself, not only from `${VAR}`.
            f.d.add_secret(&t.value);
            if !t.unresolved && !is_token(&t.value) {
                // The value is never quoted: it is the bot's credential.
                f.d.error(
                    &t.loc,
                    format!("{what} `token` does not look like a bot token: expected digits, `:` and letters, digits, `_` or `-` (e.g. `123456789:AAE...` from @BotFather)"),
                );
            }
            Some(Secret::new(t.value))
        }
    };
    let chat_id = match f.m.get("chat_id") {
        None => {
            f.d.error(
                &f.m.loc,
                format!("{what} is missing the field `chat_id`: a chat id (e.g. `-1001234567890`) or a channel's `@username`"),
            );
            None
        }
        Some(n) => f.d.text(n, &format!("{what} `chat_id`")).and_then(|t| {
            if t.unresolved {
                return Some(ChatId::Username(t.value));
            }
            let id = parse_chat_id(&t.value);
            if id.is_none() {
                f.d.error(
                    &t.loc,
                    format!(
                        "{what} `chat_id` must be a chat id (e.g. `-1001234567890`) or a channel's `@username`, found `{}`",
                        t.value
                    ),
                );
            }
            id
        }),
    };
    let url = match f.text("url") {
        Some(t) => {
            if !t.unresolved {
                check_http_url(
                    f.d,
                    &t.value,
                    &t.loc,
                    &format!("{what} `url`"),
                    DEFAULT_URL,
                );
            }
            t.value.trim_end_matches('/').to_string()
        }
        None => DEFAULT_URL.to_string(),
    };
    Some(Arc::new(Telegram {
        url,
        token: token?,
        chat_id: chat_id?,
    }))
}

/// `123456789:AAE…`: the bot's id, `:`, and a URL-safe secret. Anything else (a `/`, a space)
/// would send the token to another path than `sendMessage`.
fn is_token(s: &str) -> bool {
    match s.split_once(':') {
        Some((id, secret)) => {
            !id.is_empty()
                && id.bytes().all(|b| b.is_ascii_digit())
                && !secret.is_empty()
                && secret
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        }
        None => false,
    }
}

fn parse_chat_id(s: &str) -> Option<ChatId> {
    if let Ok(n) = s.parse::<i64>() {
        return Some(ChatId::Id(n));
    }
    let name = s.strip_prefix('@')?;
    let ok = (4..=32).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphabetic())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    ok.then(|| ChatId::Username(s.to_string()))
}

impl Integration for Telegram {
    fn escape(&self) -> Escape {
        Escape::Html
    }

    fn target(&self) -> String {
        format!(
            "{}/bot<secret>/sendMessage, chat {}",
            mask_user_info(&self.url),
            self.chat_id
        )
    }

    fn links_as_buttons(&self) -> bool {
        true
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        Dispatch::Request(request(ch, self, msg))
    }

    /// Success is HTTP 200 with `"ok": true`; flood control is a 429 whose
    /// `parameters.retry_after` says how many seconds to wait.
    fn judge(&self, ch: &Channel, a: &Answer) -> Outcome {
        let j = a.json();
        let field = |name: &str| j.as_ref().and_then(|j| j.get(name));
        let description = field("description")
            .and_then(Value::as_str)
            .map_or_else(|| a.body_text(), str::to_string);
        let parameter =
            |name: &str| field("parameters").and_then(|p| p.get(name)).and_then(Value::as_i64);
        let s = a.status.as_u16();
        match s {
            200 if field("ok").and_then(Value::as_bool) == Some(true) => {
                let id = field("result")
                    .and_then(|r| r.get("message_id"))
                    .and_then(Value::as_i64);
                Outcome::Sent(match id {
                    Some(id) => format!("ok, message_id {id}"),
                    None => "ok".into(),
                })
            }
            200..=299 => Outcome::Retry {
                reason: format!("HTTP {s} without \"ok\": true: {}", a.body_text()),
                after: None,
            },
            429 => Outcome::Retry {
                reason: format!("HTTP 429: {description}"),
                after: parameter("retry_after")
                    .map(|secs| Duration::from_secs(secs.max(0) as u64))
                    .or_else(|| http::retry_after(&a.headers))
                    .or(ch.rate.map(|r| r.per / r.burst.max(1))),
            },
            400 if parameter("migrate_to_chat_id").is_some() => Outcome::Failed(format!(
                "HTTP 400: the group became a supergroup: set `chat_id` to {}: {description}",
                parameter("migrate_to_chat_id").unwrap_or_default()
            )),
            408 | 500..=599 => Outcome::Retry {
                reason: format!("HTTP {s}: {description}"),
                after: http::retry_after(&a.headers),
            },
            // 400 (chat not found, text the HTML parser refuses), 401 (a revoked token),
            // 403 (the bot was removed from the chat): the same request will not get better.
            _ => Outcome::Failed(format!("HTTP {s}: {description}")),
        }
    }
}

/// `text` of `sendMessage` is 1 to 4,096 characters after entity parsing (tags do not count).
pub const TEXT_LIMIT: usize = 4_096;

pub fn request(ch: &Channel, t: &Telegram, msg: &Message) -> Request {
    let title = with_keyword(ch, &msg.title);
    let text = if msg.text.is_empty() {
        format!("<b>{title}</b>")
    } else {
        format!("<b>{title}</b>\n{}", msg.text)
    };
    let mut body = json!({
        "chat_id": t.chat_id.json(),
        "text": fit_html(&text, TEXT_LIMIT),
        "parse_mode": "HTML",
        // Key text, or a link in the message, must not unfold a preview of some page.
        "link_preview_options": {"is_disabled": true},
    });
    if !msg.links.is_empty() {
        let row: Vec<Value> = msg
            .links
            .iter()
            .map(|(label, url)| json!({"text": label, "url": url}))
            .collect();
        body["reply_markup"] = json!({"inline_keyboard": [row]});
    }
    Request {
        method: reqwest::Method::POST,
        url: format!("{}/bot{}/sendMessage", t.url, t.token.expose()),
        headers: json_headers(),
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// One piece of Telegram HTML: a tag (shows nothing), an entity (one character) or a
/// character.
enum Piece<'a> {
    Tag(&'a str),
    Shown(&'a str, usize),
}

/// The pieces of `html`. A `<` or `&` that opens no tag or entity counts as the character it
/// is (Telegram would refuse it, but the count stays honest).
fn pieces(html: &str) -> impl Iterator<Item = Piece<'_>> {
    let mut rest = html;
    std::iter::from_fn(move || {
        let c = rest.chars().next()?;
        let len = match c {
            '<' => rest.find('>').map(|e| e + 1),
            '&' => rest
                .char_indices()
                .take(12)
                .find(|(_, c)| *c == ';')
                .map(|(e, _)| e + 1),
            _ => None,
        };
        let (piece, n) = match (c, len) {
            ('<', Some(n)) => (Piece::Tag(&rest[..n]), n),
            ('&', Some(n)) => (Piece::Shown(&rest[..n], 1), n),
            _ => (Piece::Shown(&rest[..c.len_utf8()], c.len_utf16()), c.len_utf8()),
        };
        rest = &rest[n..];
        Some(piece)
    })
}

/// Characters as Telegram counts them against [`TEXT_LIMIT`]; UTF-16 units, which are never
/// fewer than code points, so a text that fits here fits whichever Telegram counts.
pub fn visible_len(html: &str) -> usize {
    pieces(html)
        .map(|p| match p {
            Piece::Tag(_) => 0,
            Piece::Shown(_, n) => n,
        })
        .sum()
}

/// `html` cut to at most `limit` visible characters, never inside a tag or an entity, with the
/// tags open at the cut closed and the cut said in words, so Telegram neither refuses the text
/// as too long nor as broken HTML.
pub fn fit_html(html: &str, limit: usize) -> String {
    let total = visible_len(html);
    if total <= limit {
        return html.to_string();
    }
    // Room for "\n… and 1234567 more characters".
    let budget = limit.saturating_sub(40);
    let mut out = String::new();
    let mut open: Vec<&str> = Vec::new();
    let mut shown = 0;
    for p in pieces(html) {
        match p {
            Piece::Tag(tag) => {
                let name = tag
                    .trim_start_matches('<')
                    .trim_end_matches('>')
                    .split_whitespace()
                    .next()
                    .unwrap_or("");
                if let Some(closing) = name.strip_prefix('/') {
                    if let Some(i) = open.iter().rposition(|o| *o == closing) {
                        open.truncate(i);
                    }
                } else if !name.is_empty() {
                    open.push(name);
                }
                out.push_str(tag);
            }
            Piece::Shown(s, n) => {
                if shown + n > budget {
                    break;
                }
                shown += n;
                out.push_str(s);
            }
        }
    }
    for name in open.iter().rev() {
        out.push_str(&format!("</{name}>"));
    }
    out.push_str(&format!("\n… and {} more characters", total - shown));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Item;
    use reqwest::StatusCode;
    use reqwest::header::HeaderMap;

    fn telegram() -> Telegram {
        Telegram {
            url: "http://127.0.0.1:8081".into(),
            token: Secret::new("123456:AAE-secret_token"),
            chat_id: ChatId::Id(-1001234567890),
        }
    }

    fn channel() -> Channel {
        Channel::for_test("tg", &KIND, Arc::new(telegram()))
    }

    fn message(title: &str, text: &str) -> Message {
        Message {
            rule: "r".into(),
            event: "expired".into(),
            title: title.into(),
            text: text.into(),
            items: vec![Item {
                event: json!({"id": "e1"}),
                text: text.into(),
            }],
            count: 1,
            digest: false,
            idempotency_key: "e1:notify:tg".into(),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: HeaderMap::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn the_request_is_exactly_send_message_with_buttons() {
        let mut msg = message("Lock expired", "Lock of <code>42</code> &amp; more.");
        msg.links = vec![
            ("Acknowledge".into(), "https://kw/l/a".into()),
            ("Silence 1h".into(), "https://kw/l/s".into()),
        ];
        let req = request(&channel(), &telegram(), &msg);
        assert_eq!(req.method, reqwest::Method::POST);
        assert_eq!(
            req.url,
            "http://127.0.0.1:8081/bot123456:AAE-secret_token/sendMessage"
        );
        assert_eq!(
            String::from_utf8(req.body).unwrap(),
            concat!(
                r#"{"chat_id":-1001234567890,"link_preview_options":{"is_disabled":true},"parse_mode":"HTML","#,
                r#""reply_markup":{"inline_keyboard":[[{"text":"Acknowledge","url":"https://kw/l/a"},"#,
                r#"{"text":"Silence 1h","url":"https://kw/l/s"}]]},"#,
                r#""text":"<b>Lock expired</b>\nLock of <code>42</code> &amp; more."}"#
            )
        );
        let no_links = request(&channel(), &telegram(), &message("T", ""));
        assert_eq!(
            String::from_utf8(no_links.body).unwrap(),
            r#"{"chat_id":-1001234567890,"link_preview_options":{"is_disabled":true},"parse_mode":"HTML","text":"<b>T</b>"}"#
        );
    }

    #[test]
    fn the_target_never_shows_the_token() {
        let t = telegram();
        assert_eq!(
            t.target(),
            "http://127.0.0.1:8081/bot<secret>/sendMessage, chat -1001234567890"
        );
        assert!(!format!("{t:?}").contains("secret_token"));
    }

    #[test]
    fn tokens_and_chat_ids_are_recognised() {
        assert!(is_token("123456789:AAE-x_Y9"));
        for bad in ["", "123456789", ":abc", "12a:abc", "1:a/b", "1:a b", "1:"] {
            assert!(!is_token(bad), "{bad}");
        }
        assert_eq!(parse_chat_id("-1001234567890"), Some(ChatId::Id(-1001234567890)));
        assert_eq!(
            parse_chat_id("@my_channel"),
            Some(ChatId::Username("@my_channel".into()))
        );
        for bad in ["", "@", "@ab", "@1abc", "abc", "@a-b-c", "1.5"] {
            assert_eq!(parse_chat_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn answers_mean_what_the_bot_api_says() {
        let ch = channel();
        let t = telegram();
        assert!(matches!(
            t.judge(&ch, &answer(200, r#"{"ok":true,"result":{"message_id":7}}"#)),
            Outcome::Sent(m) if m == "ok, message_id 7"
        ));
        assert!(matches!(
            t.judge(&ch, &answer(200, r#"{"ok":false}"#)),
            Outcome::Retry { .. }
        ));
        match t.judge(
            &ch,
            &answer(
                429,
                r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 35","parameters":{"retry_after":35}}"#,
            ),
        ) {
            Outcome::Retry { reason, after } => {
                assert_eq!(after, Some(Duration::from_secs(35)));
                assert_eq!(reason, "HTTP 429: Too Many Requests: retry after 35");
            }
            o => panic!("{o:?}"),
        }
        assert!(matches!(
            t.judge(&ch, &answer(400, r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#)),
            Outcome::Failed(m) if m == "HTTP 400: Bad Request: chat not found"
        ));
        assert!(matches!(
            t.judge(&ch, &answer(400, r#"{"ok":false,"error_code":400,"description":"Bad Request: group chat was upgraded to a supergroup chat","parameters":{"migrate_to_chat_id":-1009}}"#)),
            Outcome::Failed(m) if m.contains("set `chat_id` to -1009")
        ));
        assert!(matches!(
            t.judge(&ch, &answer(403, r#"{"ok":false,"error_code":403,"description":"Forbidden: bot was kicked from the group chat"}"#)),
            Outcome::Failed(_)
        ));
        assert!(matches!(
            t.judge(&ch, &answer(502, "Bad Gateway")),
            Outcome::Retry { reason, .. } if reason == "HTTP 502: Bad Gateway"
        ));
    }

    #[test]
    fn long_text_is_cut_between_tags_and_entities_and_says_so() {
        let html = format!("<b>{}</b>\n<i>{}</i>", "t".repeat(10), "&amp;".repeat(5_000));
        let cut = fit_html(&html, TEXT_LIMIT);
        assert!(visible_len(&cut) <= TEXT_LIMIT, "{}", visible_len(&cut));
        assert!(
            cut.ends_with("&amp;</i>\n… and 955 more characters"),
            "{}",
            &cut[cut.len() - 60..]
        );
        assert!(cut.starts_with("<b>tttttttttt</b>\n<i>&amp;"));
        // Characters outside the BMP count twice, as UTF-16 does.
        let emoji = "😀".repeat(3_000);
        let cut = fit_html(&emoji, TEXT_LIMIT);
        assert!(visible_len(&cut) <= TEXT_LIMIT);
        assert_eq!(visible_len("😀"), 2);
        assert_eq!(fit_html("<b>short</b>", TEXT_LIMIT), "<b>short</b>");
    }
}
