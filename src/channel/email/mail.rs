//! The mail a notification becomes: its subject, and its plain and HTML bodies, every piece of
//! the event escaped for where it goes (docs/rules.md#email).

use crate::channel::chat::{fit, fit_before, links_suffix};
use crate::channel::integration::Channel;
use crate::channel::message::Message;

/// The longest subject, in characters: mail clients show about 80, and a key a megabyte long
/// must not make a header of that size.
pub(super) const SUBJECT_CHARS: usize = 200;

/// The most each body part carries, in bytes, before it is cut saying how much was left out.
const BODY_LIMIT: usize = 64 * 1024;

/// The subject: the title on one line (line breaks and other controls as spaces, bidi
/// controls dropped so a key cannot reorder what is shown), the channel's `keyword` first, at
/// most [`SUBJECT_CHARS`] characters; lettre encodes it (RFC 2047).
pub(super) fn subject(ch: &Channel, title: &str) -> String {
    let title = match &ch.keyword {
        Some(k) if !title.contains(k.as_str()) => format!("{k} {title}"),
        _ => title.to_string(),
    };
    let mut out = String::with_capacity(title.len().min(SUBJECT_CHARS * 4));
    let mut chars = 0;
    for c in title.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if is_bidi_control(c) || (c == ' ' && (out.is_empty() || out.ends_with(' '))) {
            continue;
        }
        if chars == SUBJECT_CHARS {
            while out.ends_with(' ') {
                out.pop();
            }
            out.push('…');
            return out;
        }
        out.push(c);
        chars += 1;
    }
    out.trim_end().to_string()
}

/// Embedding, override and isolate controls: they make text display in another order than it
/// is written (`gpj.exe` shown as `exe.jpg`).
pub(super) fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// Text of a body part: controls other than line breaks and tabs, and bidi controls, become
/// U+FFFD (a NUL or an escape sequence has nothing to do in a mail); cut to [`BODY_LIMIT`].
pub(super) fn clean(text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| {
            if (c.is_control() && c != '\n' && c != '\t') || is_bidi_control(c) {
                '\u{FFFD}'
            } else {
                c
            }
        })
        .collect();
    fit(&cleaned, BODY_LIMIT)
}

/// The message's text and its links, within [`BODY_LIMIT`]: what is too long is cut from the
/// text, never the links.
fn with_links(msg: &Message) -> String {
    fit_before(
        &msg.text,
        &links_suffix(msg, crate::template::Escape::Text),
        BODY_LIMIT,
    )
}

/// The plain-text part: the message as the chat channels get it (a digest's lines included).
pub fn plain_body(msg: &Message) -> String {
    let mut out = clean(&with_links(msg));
    out.push('\n');
    out
}

/// The HTML part: everything escaped, line breaks as `<br>`, a digest's events as a list, and
/// only the `http(s)://` links keywatch or the rule's author wrote made clickable (in key text
/// `://` is broken by the channel's escaping, so no key makes a link).
pub fn html_body(msg: &Message) -> String {
    let mut out = String::from(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n",
    );
    if msg.digest && !msg.items.is_empty() {
        if msg.count > 1 {
            out.push_str(&format!(
                "<p>{} {} events:</p>\n",
                msg.count,
                html_escape(&msg.event)
            ));
        }
        out.push_str("<ul>\n");
        let mut budget = BODY_LIMIT;
        let mut shown = 0;
        for item in &msg.items {
            let li = format!("<li>{}</li>\n", html_text(&item.text));
            if li.len() > budget {
                break;
            }
            budget -= li.len();
            out.push_str(&li);
            shown += 1;
        }
        out.push_str("</ul>\n");
        let more = msg.count.saturating_sub(shown);
        if more > 0 {
            out.push_str(&format!("<p>… and {more} more</p>\n"));
        }
    } else {
        out.push_str(&format!("<p>{}</p>\n", html_text(&with_links(msg))));
    }
    out.push_str("</body></html>\n");
    out
}

/// Escaped text with line breaks as `<br>` and `http(s)://` links as links.
pub(super) fn html_text(text: &str) -> String {
    let text = clean(text);
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push_str("<br>\n");
        }
        let mut rest = line;
        while let Some(start) = find_link(rest) {
            out.push_str(&html_escape(&rest[..start]));
            let end = rest[start..]
                .find(|c: char| c.is_whitespace() || matches!(c, '<' | '>' | '"'))
                .map_or(rest.len(), |n| start + n);
            let url = html_escape(&rest[start..end]);
            out.push_str(&format!("<a href=\"{url}\">{url}</a>"));
            rest = &rest[end..];
        }
        out.push_str(&html_escape(rest));
    }
    out
}

pub(super) fn find_link(s: &str) -> Option<usize> {
    [s.find("https://"), s.find("http://")]
        .into_iter()
        .flatten()
        .min()
}

pub(super) fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
