//! What the chat robots (DingTalk, Feishu, WeCom, Slack) have in common: text or Markdown,
//! mentions, a size limit, keyword security, signatures, and errors inside an HTTP 200.

use crate::outcome::Outcome;

use super::http::{self, Answer};
use crate::yaml::decode::{Decoder, MapReader};

use super::fields::Fields;
use super::integration::Channel;
use crate::template::Escape;

/// Text or Markdown messages for the chat robots that offer both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatFormat {
    Text,
    Markdown,
}

impl ChatFormat {
    pub fn escape(self) -> Escape {
        match self {
            ChatFormat::Text => Escape::Text,
            ChatFormat::Markdown => Escape::Markdown,
        }
    }
}

pub use super::message::Mention;

/// `mention: {mobiles, user_ids, all}`; services that cannot mention by mobile number
/// reject `mobiles` with the reason.
pub fn mention(f: &mut Fields<'_, '_>, mobiles_allowed: bool) -> Mention {
    let mut out = Mention::default();
    let what = f.what.clone();
    let d = &mut *f.d;
    let Some(node) = f.m.get("mention") else {
        return out;
    };
    let Some(mut mm) = d.map(node, &format!("{what} `mention`")) else {
        return out;
    };
    let read = |d: &mut Decoder<'_>, mm: &mut MapReader<'_>, field: &str| -> Vec<String> {
        let Some(n) = mm.get(field) else {
            return Vec::new();
        };
        d.one_or_many(n, &format!("{what} `mention.{field}`"))
            .into_iter()
            .filter_map(|item| {
                d.text(item, &format!("{what} `mention.{field}`"))
                    .map(|t| t.value)
            })
            .collect()
    };
    if mobiles_allowed {
        out.mobiles = read(d, &mut mm, "mobiles");
    }
    out.user_ids = read(d, &mut mm, "user_ids");
    if let Some(n) = mm.get("all") {
        out.all = d.bool(n, &format!("{what} `mention.all`")).unwrap_or(false);
    }
    let known: &[&str] = if mobiles_allowed {
        &["mobiles", "user_ids", "all"]
    } else {
        &["user_ids", "all"]
    };
    mm.finish(d, known, &|f| {
        (f == "mobiles").then(|| {
            "Feishu robots cannot mention by mobile number; use `user_ids` (open_id)".to_string()
        })
    });
    out
}

/// `msgtype: text | markdown`.
pub fn msgtype(f: &mut Fields<'_, '_>, default: ChatFormat) -> ChatFormat {
    let Some(n) = f.m.get("msgtype") else {
        return default;
    };
    match f.d.text(n, &format!("{} `msgtype`", f.what)) {
        Some(t) if t.value == "text" => ChatFormat::Text,
        Some(t) if t.value == "markdown" => ChatFormat::Markdown,
        Some(t) => {
            f.d.error(
                &t.loc,
                format!(
                    "{} `msgtype` must be `text` or `markdown`, found `{}`",
                    f.what, t.value
                ),
            );
            default
        }
        None => default,
    }
}

/// The JSON content type every chat API expects.
pub fn json_headers() -> Vec<(String, String)> {
    vec![(
        "Content-Type".into(),
        "application/json; charset=utf-8".into(),
    )]
}

/// `keyword` first, for robots whose keyword security rejects messages without it.
pub fn with_keyword(ch: &Channel, text: &str) -> String {
    match &ch.keyword {
        Some(k) if !text.contains(k.as_str()) => format!("{k} {text}"),
        _ => text.to_string(),
    }
}

/// What the text of `msg` ends with to show its acknowledge and silence links in the link syntax
/// of a chat format (empty for other formats, and without links): the channel puts it after the
/// text, which it cuts first when the whole is too long, so the links are never what is cut.
pub fn links_suffix(msg: &super::message::Message, escape: Escape) -> String {
    if msg.links.is_empty() || !escape.is_chat() {
        return String::new();
    }
    let shown: Vec<String> = msg
        .links
        .iter()
        .map(|(label, url)| match escape {
            Escape::Markdown => format!("[{label}]({url})"),
            Escape::Slack => format!("<{url}|{label}>"),
            _ => format!("{label}: {url}"),
        })
        .collect();
    let sep = if escape == Escape::Text { "\n" } else { " · " };
    format!("\n\n{}", shown.join(sep))
}

/// `text` cut to leave room for `suffix` (the links) within `limit` bytes, then the suffix: a
/// message too long loses the end of its text, saying how much, never its links.
pub fn fit_before(text: &str, suffix: &str, limit: usize) -> String {
    let mut out = fit(text, limit.saturating_sub(suffix.len()));
    out.push_str(suffix);
    out
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
    fn links_take_each_chat_format_s_syntax_after_a_text_cut_first() {
        let msg = crate::channel::Message {
            links: vec![("Acknowledge".to_string(), "https://k/l/t".to_string())],
            ..crate::channel::Message::uncomposed_digest("r", "id", "c", 1)
        };
        assert_eq!(
            links_suffix(&msg, Escape::Markdown),
            "\n\n[Acknowledge](https://k/l/t)"
        );
        assert_eq!(
            links_suffix(&msg, Escape::Slack),
            "\n\n<https://k/l/t|Acknowledge>"
        );
        assert_eq!(
            links_suffix(&msg, Escape::Text),
            "\n\nAcknowledge: https://k/l/t"
        );
        assert_eq!(links_suffix(&msg, Escape::Raw), "");
        let suffix = links_suffix(&msg, Escape::Text);
        let cut = fit_before(&"x".repeat(500), &suffix, 200);
        assert!(cut.len() <= 200 && cut.ends_with(&suffix), "{cut}");
        assert!(cut.contains("more bytes"), "{cut}");
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
