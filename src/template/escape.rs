//! How a value interpolated by `{{ … }}` is written for each target, so that key text can never
//! widen an action (docs/rules.md): no extra keys matched by a cleanup glob, no other URL path or query,
//! no mention or link in a chat message.
//!
//! Escaping works on the encoded strings of [`super::bytestr`]: every char that needs escaping is
//! ASCII, and the chars that stand for raw bytes are never ASCII, so the exact modes stay
//! byte-exact. Only values are escaped; the template's literal text is the author's and is kept.

use std::fmt::{self, Write};

use minijinja::value::Value;
use minijinja::{AutoEscape, Error, ErrorKind, Output, State};

use super::bytestr;

/// Where a rendered template goes, which decides how interpolated values are escaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Escape {
    /// No escaping: webhook custom bodies (users write `| tojson`) and log lines.
    Raw,
    /// No escaping, byte-exact: detail key/field, cleanup `hdel` key/field, exec argv.
    RedisKey,
    /// Byte-exact, values glob-escaped for Redis `SCAN MATCH` (`* ? [ ] \`): `cleanup.delete`.
    Glob,
    /// Byte-exact, values percent-encoded (all but unreserved `A-Z a-z 0-9 - . _ ~`): `reload.url`.
    Url,
    /// `&` `<` `>` → `&amp;` `&lt;` `&gt;`, which kills `<!channel>` and `<@U1>`.
    Slack,
    /// [`Escape::Text`] plus Markdown metacharacters backslash-escaped (DingTalk/WeCom/Feishu).
    Markdown,
    /// Chat plain text: `@` and `<` get a zero-width space after them, so `@all`, `@13800000000`,
    /// `<at user_id="all">` and `<@userid>` can no longer mention anyone.
    Text,
    /// Microsoft Teams Adaptive Card Markdown, which is bold, italic, lists and links
    /// (docs/rules.md#teams): [`Escape::Text`], plus a zero-width space after a `]` that would
    /// start a link's target and a `{` that would open a card function (`{{DATE(…)}}`), a
    /// backslash before `*` and before a `_` that could delimit emphasis, and control and bidi
    /// characters shown. Some Teams clients show backslash escapes, so nothing else gets one.
    Teams,
    /// Telegram's HTML: `&` `<` `>` `"` as entities, control and bidi characters shown, and the
    /// value marked ([`VALUE_OPEN`], [`VALUE_CLOSE`]) so that [`Escape::finish`] makes it a
    /// `<code>` entity, which Telegram never makes a link, mention, hashtag or command of: the
    /// key needs no zero-width space and copies as it is (docs/rules.md#telegram).
    Html,
}

/// Backslash-escaped in [`Escape::Markdown`]: emphasis, code, links/images, headings, quotes,
/// strikethrough, tables, and the backslash itself (CommonMark backslash escapes).
const MARKDOWN_SPECIALS: &[char] = &['\\', '`', '*', '_', '[', ']', '(', ')', '#', '>', '~', '|'];

/// Redis glob metacharacters (`stringmatchlen`): `^` and `-` only mean something inside `[…]`,
/// which cannot open once `[` is escaped.
const GLOB_SPECIALS: &[char] = &['*', '?', '[', ']', '\\'];

/// Where an [`Escape::Html`] value starts and ends until [`Escape::finish`]: Unicode
/// noncharacters, which are for a program's internal use and which a value's own are shown
/// (`\uFDD0`) rather than written.
pub(crate) const VALUE_OPEN: char = '\u{FDD0}';
pub(crate) const VALUE_CLOSE: char = '\u{FDD1}';

/// Telegram elements that cannot hold a `code` entity (Bot API "Formatting options": code and
/// pre contain no other entity, a link's text is no entity of its own); a value inside one is
/// plain text there, and already safe.
const NO_CODE_INSIDE: &[&str] = &["code", "pre", "a", "tg-emoji"];

impl Escape {
    pub const ALL: [Escape; 9] = [
        Escape::Raw,
        Escape::RedisKey,
        Escape::Glob,
        Escape::Url,
        Escape::Slack,
        Escape::Markdown,
        Escape::Text,
        Escape::Teams,
        Escape::Html,
    ];

    /// The minijinja auto-escape name; it is also the suffix of the template's name in the
    /// environment, which is how the auto-escape callback learns a template's mode.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Escape::Raw => "raw",
            Escape::RedisKey => "rediskey",
            Escape::Glob => "glob",
            Escape::Url => "url",
            Escape::Slack => "slack",
            Escape::Markdown => "markdown",
            Escape::Text => "text",
            Escape::Teams => "teams",
            Escape::Html => "html",
        }
    }

    pub(crate) fn from_tag(tag: &str) -> Option<Escape> {
        Escape::ALL.into_iter().find(|e| e.tag() == tag)
    }

    /// A chat message, read by people: values may not start a line or a link of their own.
    pub fn is_chat(self) -> bool {
        matches!(
            self,
            Escape::Slack | Escape::Markdown | Escape::Text | Escape::Teams | Escape::Html
        )
    }

    /// `s`, plain text an integration writes into a message itself (a card's facts: the key,
    /// the rule), escaped as a value of this chat mode is, so it can no more widen the message
    /// than a value in a template can.
    pub fn escape_value(self, s: &str) -> String {
        let mut out = String::with_capacity(s.len() + 8);
        // Writing to a String cannot fail.
        let _ = self.write_escaped(&mut out, s);
        out
    }

    /// A rendered template as its target takes it. [`Escape::Html`]: each marked value becomes
    /// `<code>…</code>`, except inside a tag (an attribute) or an element that cannot hold code,
    /// where it stays plain; every other mode is left as it is.
    pub(crate) fn finish(self, rendered: String) -> String {
        if self != Escape::Html || !rendered.contains([VALUE_OPEN, VALUE_CLOSE]) {
            return rendered;
        }
        let mut out = String::with_capacity(rendered.len() + 32);
        let mut elements: Vec<String> = Vec::new();
        // Per value open: whether it was written as `<code>`.
        let mut values: Vec<bool> = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(c) = rest.chars().next() {
            if c == '<'
                && let Some(end) = rest.find('>')
            {
                let tag = &rest[..=end];
                let name = tag[1..tag.len() - 1]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_ascii_lowercase();
                if let Some(closing) = name.strip_prefix('/') {
                    if let Some(i) = elements.iter().rposition(|e| e == closing) {
                        elements.truncate(i);
                    }
                } else if !name.is_empty() {
                    elements.push(name);
                }
                out.extend(
                    tag.chars()
                        .filter(|c| !matches!(*c, VALUE_OPEN | VALUE_CLOSE)),
                );
                rest = &rest[end + 1..];
                continue;
            }
            match c {
                VALUE_OPEN => {
                    let code = !elements
                        .iter()
                        .any(|e| NO_CODE_INSIDE.contains(&e.as_str()));
                    if code {
                        out.push_str("<code>");
                    }
                    values.push(code);
                }
                VALUE_CLOSE => {
                    if values.pop() == Some(true) {
                        out.push_str("</code>");
                    }
                }
                c => out.push(c),
            }
            rest = &rest[c.len_utf8()..];
        }
        out
    }

    /// Writes `s` (an encoded string) escaped for this mode.
    pub(crate) fn write_escaped<W: Write>(self, out: &mut W, s: &str) -> fmt::Result {
        // A bare link in key text (`http://evil`, `evil.com/login`) is made a link by chat
        // apps and mail clients; a zero-width space after the colon or the dot keeps it text,
        // as it does for `@`. Telegram's values are code, which is never a link.
        let defused;
        let s = if self.is_chat() && self != Escape::Html {
            defused = defuse_host_names(&s.replace("://", ":\u{200B}//"));
            defused.as_str()
        } else {
            s
        };
        match self {
            Escape::Raw | Escape::RedisKey => out.write_str(s),
            Escape::Glob => write_replacing(out, s, |c| {
                GLOB_SPECIALS
                    .contains(&c)
                    .then_some(Replacement::Prefix('\\'))
            }),
            Escape::Url => write_url(out, s),
            Escape::Slack => write_replacing(out, s, |c| match c {
                '&' => Some(Replacement::Str("&amp;")),
                '<' => Some(Replacement::Str("&lt;")),
                '>' => Some(Replacement::Str("&gt;")),
                _ => line_break_replacement(c),
            }),
            Escape::Text => write_replacing(out, s, text_replacement),
            Escape::Markdown => write_replacing(out, s, |c| {
                if MARKDOWN_SPECIALS.contains(&c) {
                    Some(Replacement::Prefix('\\'))
                } else {
                    text_replacement(c)
                }
            }),
            Escape::Teams => write_in_context(out, s, teams_replacement),
            Escape::Html if s.is_empty() => Ok(()),
            Escape::Html => {
                out.write_char(VALUE_OPEN)?;
                write_replacing(out, s, |c| match c {
                    '&' => Some(Replacement::Str("&amp;")),
                    '<' => Some(Replacement::Str("&lt;")),
                    '>' => Some(Replacement::Str("&gt;")),
                    '"' => Some(Replacement::Str("&quot;")),
                    '\u{FDD0}'..='\u{FDEF}' => Some(Replacement::Owned(shown(c))),
                    _ => hidden_char_shown(c)
                        .map(Replacement::Owned)
                        .or_else(|| line_break_replacement(c)),
                })?;
                out.write_char(VALUE_CLOSE)
            }
        }
    }
}

/// Teams Markdown is CommonMark's bold, italic, lists and links, and card functions
/// (docs/rules.md#teams). A backslash is the only way to keep `*` and `_` from making emphasis,
/// but `_` inside a word never does (CommonMark's flanking rules), so `order_lock` keeps its
/// underscore bare; a link needs its `](` (or a reference's `]:`) and a card function its `{{`,
/// which a zero-width space breaks; a backslash is literal unless punctuation follows.
fn teams_replacement(prev: Option<char>, c: char, next: Option<char>) -> Option<Replacement> {
    let alnum = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    match c {
        '*' => Some(Replacement::Prefix('\\')),
        '_' if !(alnum(prev) && alnum(next)) => Some(Replacement::Prefix('\\')),
        '\\' if next.is_none_or(|n| n.is_ascii_punctuation()) => Some(Replacement::Prefix('\\')),
        ']' if next.is_none_or(|n| n == '(' || n == ':') => Some(Replacement::Str("]\u{200B}")),
        '{' if next.is_none_or(|n| n == '{') => Some(Replacement::Str("{\u{200B}")),
        _ => hidden_char_shown(c)
            .map(Replacement::Owned)
            .or_else(|| text_replacement(c)),
    }
}

/// `s` with a zero-width space after each dot that would make a host name of the text around
/// it (`evil.com/login`, `www.evil.co.uk`): a letter, digit or `-` before it and, after it, a
/// top-level domain (a label the public suffix list knows, as the link finders of chat apps and
/// mail clients check), or `www` before it. Other dots stay, so the keys people copy out of an
/// alert stay exact where nothing could be a link: `config.yaml`, `alice.smith`, `user.42`,
/// `10.0.0.1`.
fn defuse_host_names(s: &str) -> String {
    let is_label = |c: char| c.is_alphanumeric() || c == '-';
    let mut out = String::with_capacity(s.len() + 8);
    let mut label_start = 0;
    for (i, c) in s.char_indices() {
        out.push(c);
        if c != '.' {
            if !is_label(c) {
                label_start = i + c.len_utf8();
            }
            continue;
        }
        let before = &s[label_start..i];
        label_start = i + 1;
        if before.is_empty() {
            continue;
        }
        let after = s[i + 1..]
            .split(|l: char| !is_label(l))
            .next()
            .unwrap_or("");
        if before.eq_ignore_ascii_case("www") || is_top_level_domain(after) {
            out.push('\u{200B}');
        }
    }
    out
}

/// Whether `label` is a top-level domain: two or more letters the public suffix list knows
/// (`com`, `co`, `zip`, `рф`; not `yaml`, `html`, `example`).
fn is_top_level_domain(label: &str) -> bool {
    label.chars().nth(1).is_some()
        && label.chars().all(char::is_alphabetic)
        && psl::suffix(label.to_lowercase().as_bytes()).is_some_and(|s| s.is_known())
}

fn text_replacement(c: char) -> Option<Replacement> {
    match c {
        '@' => Some(Replacement::Str("@\u{200B}")),
        '<' => Some(Replacement::Str("<\u{200B}")),
        _ => line_break_replacement(c),
    }
}

/// A line break in key text would let it write a line of its own (a fake heading, a line that
/// looks like keywatch's): in chat it is shown as `\n` / `\r`, as people write it; and every
/// other control or bidi character as `\u202E` ([`hidden_char_shown`]), in every chat mode.
fn line_break_replacement(c: char) -> Option<Replacement> {
    match c {
        '\n' => Some(Replacement::Str("\\n")),
        '\r' => Some(Replacement::Str("\\r")),
        _ => hidden_char_shown(c).map(Replacement::Owned),
    }
}

/// A control character (other than a line break, which [`line_break_replacement`] shows, and
/// tab) or a bidirectional formatting character in key text, written as `\u202E`: invisible,
/// it could make text read in another order than it is (a key that shows as someone else's) or
/// carry a terminal escape into a notification.
fn hidden_char_shown(c: char) -> Option<String> {
    let hidden = (c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
        || matches!(
            c,
            '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{2028}' | '\u{2029}'
        )
        || ('\u{202A}'..='\u{202E}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c);
    hidden.then(|| shown(c))
}

/// `s` with each character [`hidden_char_shown`] shows written as `\u202E`: for text that
/// reaches people whole, template included, where such a character would reorder or hide what
/// it says (PagerDuty's summary, Alertmanager's annotations).
pub(crate) fn hidden_chars_shown(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match hidden_char_shown(c) {
            Some(shown) => out.push_str(&shown),
            None => out.push(c),
        }
    }
    out
}

/// `c` written as `\u202E`.
fn shown(c: char) -> String {
    format!("\\u{:04X}", u32::from(c))
}

enum Replacement {
    Str(&'static str),
    Owned(String),
    Prefix(char),
}

/// [`write_replacing`] for a mode whose replacement of a char depends on the chars beside it.
fn write_in_context<W: Write>(
    out: &mut W,
    s: &str,
    f: impl Fn(Option<char>, char, Option<char>) -> Option<Replacement>,
) -> fmt::Result {
    let mut prev = None;
    let mut chars = s.chars().peekable();
    write_replacing(out, s, |c| {
        chars.next();
        let r = f(prev, c, chars.peek().copied());
        prev = Some(c);
        r
    })
}

/// Copies `s` in runs, replacing the few chars `f` names: output goes through minijinja's
/// `dyn Write`, where one call per run is much cheaper than one per char.
fn write_replacing<W: Write>(
    out: &mut W,
    s: &str,
    mut f: impl FnMut(char) -> Option<Replacement>,
) -> fmt::Result {
    let mut start = 0;
    for (i, c) in s.char_indices() {
        if let Some(r) = f(c) {
            out.write_str(&s[start..i])?;
            match r {
                Replacement::Str(rep) => out.write_str(rep)?,
                Replacement::Owned(rep) => out.write_str(&rep)?,
                Replacement::Prefix(p) => {
                    out.write_char(p)?;
                    out.write_char(c)?;
                }
            }
            start = i + c.len_utf8();
        }
    }
    out.write_str(&s[start..])
}

/// Percent-encodes the bytes `s` stands for: a byte char becomes its single byte, anything else
/// its UTF-8 bytes.
fn write_url<W: Write>(out: &mut W, s: &str) -> fmt::Result {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut start = 0;
    let mut buf = [0u8; 4];
    for (i, c) in s.char_indices() {
        if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~') {
            continue;
        }
        out.write_str(&s[start..i])?;
        for &b in bytestr::char_bytes(c, &mut buf) {
            out.write_char('%')?;
            out.write_char(char::from(HEX[usize::from(b >> 4)]))?;
            out.write_char(char::from(HEX[usize::from(b & 0xF)]))?;
        }
        start = i + c.len_utf8();
    }
    out.write_str(&s[start..])
}

/// `safe` and `tojson` for chat messages: their output is a plain value there, escaped like any
/// other. `safe` is an opt-out meant for markup the author wrote, but in a chat message it is
/// mostly reached for to print key text or a detail unchanged, and that would let a key say
/// `@all` or `[x](http://evil)`; `tojson`'s strings are key text too. Elsewhere (bodies, URLs,
/// globs) they keep minijinja's meaning. `| e` still escapes once: it goes through [`format`].
pub(crate) fn add_chat_aware_filters(env: &mut minijinja::Environment<'static>) {
    use minijinja::filters;
    use minijinja::value::Kwargs;

    fn chat(state: &State) -> bool {
        matches!(state.auto_escape(), AutoEscape::Custom(tag) if Escape::from_tag(tag).is_some_and(Escape::is_chat))
    }
    env.add_filter("safe", |state: &State, v: Value| -> Value {
        match (v.is_safe(), chat(state)) {
            // Already escaped (`| e`, a macro's output): escaping it again would show `\\*`.
            (true, _) => v,
            (false, true) => Value::from(v.to_string()),
            (false, false) => filters::safe(v.to_string()),
        }
    });
    env.add_filter(
        "tojson",
        |state: &State, v: &Value, indent: Option<Value>, args: Kwargs| -> Result<Value, Error> {
            let json = filters::tojson(v, indent, args)?;
            Ok(match chat(state) {
                true => Value::from(json.as_str().unwrap_or_default()),
                false => json,
            })
        },
    );
}

/// The environment's formatter: every `{{ … }}` goes through here.
///
/// Safe strings (`| safe`, `| tojson`, `| escape`) are written untouched: `safe` is the explicit
/// opt-out and the others are already escaped (in chat messages `safe` and `tojson` give plain
/// values: [`add_chat_aware_filters`]). A template may switch modes with `{% autoescape %}`;
/// the built-in html/json/none modes then behave as in minijinja.
pub(crate) fn format(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    let mode = match state.auto_escape() {
        AutoEscape::Custom(tag) => match Escape::from_tag(tag) {
            Some(mode) => mode,
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("unknown escaping mode `{tag}`"),
                ));
            }
        },
        _ => return minijinja::escape_formatter(out, state, value),
    };
    if value.is_safe() {
        // A safe value is always a string.
        return out
            .write_str(value.as_str().unwrap_or_default())
            .map_err(Error::from);
    }
    let written = match value.as_str() {
        Some(s) => mode.write_escaped(out, s),
        None => mode.write_escaped(out, &value.to_string()),
    };
    written.map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn esc(mode: Escape, s: &str) -> String {
        let mut out = String::new();
        mode.write_escaped(&mut out, s).unwrap();
        out
    }

    #[test]
    fn tags_round_trip() {
        for e in Escape::ALL {
            assert_eq!(Escape::from_tag(e.tag()), Some(e));
        }
    }

    #[test]
    fn raw_and_redis_key_leave_everything() {
        let hostile = "*?[]\\ @all <!channel> ../%#&";
        assert_eq!(esc(Escape::Raw, hostile), hostile);
        assert_eq!(esc(Escape::RedisKey, hostile), hostile);
    }

    #[test]
    fn glob_escapes_redis_glob_metacharacters() {
        assert_eq!(esc(Escape::Glob, "a*b?c[d]e\\f"), "a\\*b\\?c\\[d\\]e\\\\f");
        assert_eq!(esc(Escape::Glob, "^-!{}"), "^-!{}");
    }

    #[test]
    fn url_encodes_all_but_unreserved() {
        assert_eq!(esc(Escape::Url, "a/../b?x=1#"), "a%2F..%2Fb%3Fx%3D1%23");
        assert_eq!(esc(Escape::Url, "100% & more"), "100%25%20%26%20more");
        assert_eq!(esc(Escape::Url, "AZaz09-._~"), "AZaz09-._~");
        assert_eq!(esc(Escape::Url, "é"), "%C3%A9");
        assert_eq!(esc(Escape::Url, "\u{F7FF}"), "%FF");
    }

    #[test]
    fn slack_escapes_control_sequences() {
        assert_eq!(esc(Escape::Slack, "<!channel>"), "&lt;!channel&gt;");
        assert_eq!(esc(Escape::Slack, "<@U123>"), "&lt;@U123&gt;");
        assert_eq!(esc(Escape::Slack, "a&b"), "a&amp;b");
        assert_eq!(esc(Escape::Slack, "*bold* _x_"), "*bold* _x_");
    }

    #[test]
    fn text_neutralises_mentions() {
        assert_eq!(esc(Escape::Text, "@all"), "@\u{200B}all");
        assert_eq!(esc(Escape::Text, "@13800000000"), "@\u{200B}13800000000");
        assert_eq!(
            esc(Escape::Text, "<at user_id=\"all\">x</at>"),
            "<\u{200B}at user_id=\"all\">x<\u{200B}/at>"
        );
        assert_eq!(esc(Escape::Text, "<@U123>"), "<\u{200B}@\u{200B}U123>");
        assert_eq!(esc(Escape::Text, "*_[]()#>`"), "*_[]()#>`");
    }

    #[test]
    fn chat_modes_show_line_breaks_and_defuse_bare_links() {
        for mode in [Escape::Slack, Escape::Text] {
            assert_eq!(esc(mode, "a\r\nb"), "a\\r\\nb", "{mode:?}");
            assert_eq!(esc(mode, "http://evil"), "http:\u{200B}//evil", "{mode:?}");
        }
        assert_eq!(esc(Escape::Markdown, "a\n# x"), "a\\n\\# x");
        assert_eq!(esc(Escape::Markdown, "https://e"), "https:\u{200B}//e");
        for mode in [Escape::Raw, Escape::RedisKey] {
            assert_eq!(esc(mode, "a\nhttp://b"), "a\nhttp://b", "{mode:?}");
        }
    }

    #[test]
    fn teams_escapes_what_card_markdown_means_without_backslashes_where_it_can() {
        // Links and card functions are broken by a zero-width space, not a backslash (some
        // Teams clients show backslash escapes: docs/rules.md#teams).
        assert_eq!(
            esc(
                Escape::Teams,
                "[x](http://evil) ![i](x) [d]: y @channel <at>x</at>"
            ),
            "[x]\u{200B}(http:\u{200B}//evil) ![i]\u{200B}(x) [d]\u{200B}: y @\u{200B}channel <\u{200B}at>x<\u{200B}/at>"
        );
        assert_eq!(
            esc(Escape::Teams, "{{DATE(2017-02-14T06:08:39Z, SHORT)}} {a}"),
            "{\u{200B}{DATE(2017-02-14T06:08:39Z, SHORT)}} {a}"
        );
        assert_eq!(esc(Escape::Teams, "{"), "{\u{200B}");
        // Emphasis: `*` always, `_` only where it could open or close it (never inside a word).
        assert_eq!(
            esc(Escape::Teams, "**b** _i_ order_lock_42 a_ _b é_é"),
            "\\*\\*b\\*\\* \\_i\\_ order_lock_42 a\\_ \\_b é_é"
        );
        // A backslash is one only before punctuation (or where the value ends).
        assert_eq!(
            esc(Escape::Teams, "C:\\dir \\* a\\"),
            "C:\\dir \\\\\\* a\\\\"
        );
        // What card Markdown does not have is left as it is.
        assert_eq!(
            esc(Escape::Teams, "# h > q `c` ~s~ |t| (p)"),
            "# h > q `c` ~s~ |t| (p)"
        );
        // Keys as they are in Redis stay as they are.
        for key in [
            "order_lock:42",
            "{user1}:cart",
            "cache:v2",
            "10.0.0.1:6379",
            "a-b_c/d",
        ] {
            assert_eq!(esc(Escape::Teams, key), key);
        }
        assert_eq!(
            esc(Escape::Teams, "a\u{202E}b\r\n\u{1b}"),
            "a\\u202Eb\\r\\n\\u001B"
        );
    }

    /// Every chat mode shows control and bidi characters as `\u202E`, so a key cannot reorder
    /// the text around it (`txt.exe` read as `exe.txt`) or carry a terminal escape into a
    /// message; tab stays, line breaks are shown as `\n`.
    #[test]
    fn every_chat_mode_shows_control_and_bidi_characters() {
        for mode in [Escape::Slack, Escape::Markdown, Escape::Text, Escape::Teams] {
            assert_eq!(
                esc(mode, "a\u{202E}b\u{2066}c\u{1b}2J\u{7}d\u{85}\ne\tf"),
                "a\\u202Eb\\u2066c\\u001B2J\\u0007d\\u0085\\ne\tf",
                "{mode:?}"
            );
        }
    }

    #[test]
    fn chat_modes_break_bare_host_names_and_leave_other_dots() {
        for mode in [Escape::Slack, Escape::Markdown, Escape::Text, Escape::Teams] {
            for (value, want) in [
                ("evil.com/login", "evil.\u{200B}com/login"),
                ("EVIL.COM", "EVIL.\u{200B}COM"),
                ("x.zip", "x.\u{200B}zip"),
                ("www.evil.co.uk", "www.\u{200B}evil.\u{200B}co.\u{200B}uk"),
                ("www.anything", "www.\u{200B}anything"),
                ("mail.\u{0440}\u{0444}", "mail.\u{200B}\u{0440}\u{0444}"),
                ("config.yaml", "config.yaml"),
                ("alice.smith", "alice.smith"),
                ("evil.example", "evil.example"),
                ("user.42", "user.42"),
                ("cache.v2", "cache.v2"),
                ("10.0.0.1:6379", "10.0.0.1:6379"),
                ("a.b", "a.b"),
                ("end.", "end."),
                (".com", ".com"),
                ("k:.com", "k:.com"),
            ] {
                assert_eq!(esc(mode, value), want, "{mode:?} {value}");
            }
        }
        for mode in [Escape::Raw, Escape::RedisKey, Escape::Glob] {
            assert_eq!(esc(mode, "evil.com"), "evil.com");
        }
    }

    /// Telegram: a value is marked as one and becomes a `<code>` entity ([`Escape::finish`]),
    /// which Telegram never makes a link, mention, hashtag or command of, so only HTML is
    /// escaped and the text stays as the key is.
    #[test]
    fn html_escapes_markup_and_shows_hidden_characters_in_a_marked_value() {
        let marked = |s: &str| format!("{VALUE_OPEN}{s}{VALUE_CLOSE}");
        assert_eq!(
            esc(
                Escape::Html,
                "<b>x</b> <a href=\"http://evil\">y</a> & @channel /start #tag evil.com/login"
            ),
            marked(
                "&lt;b&gt;x&lt;/b&gt; &lt;a href=&quot;http://evil&quot;&gt;y&lt;/a&gt; &amp; @channel /start #tag evil.com/login"
            )
        );
        assert_eq!(
            esc(
                Escape::Html,
                "a\u{202E}b\u{2066}c\u{1b}[31m\u{0}\nd\te\u{FDD0}"
            ),
            marked("a\\u202Eb\\u2066c\\u001B[31m\\u0000\\nd\te\\uFDD0")
        );
        assert_eq!(esc(Escape::Html, ""), "");
    }

    #[test]
    fn finish_makes_values_code_except_where_telegram_takes_no_code() {
        let v = |s: &str| format!("{VALUE_OPEN}{s}{VALUE_CLOSE}");
        let fin = |s: String| Escape::Html.finish(s);
        assert_eq!(
            fin(format!("<b>Lock {}</b> of {}", v("a@b"), v("42"))),
            "<b>Lock <code>a@b</code></b> of <code>42</code>"
        );
        // Inside the author's code, pre or link text it is already safe, and Telegram refuses
        // code there; in an attribute it is part of the URL.
        assert_eq!(
            fin(format!(
                "<code>{}</code> <pre>{}</pre> <a href=\"https://w/?k={}\">{}</a> <i>{}</i>",
                v("1"),
                v("2"),
                v("3"),
                v("4"),
                v("5")
            )),
            "<code>1</code> <pre>2</pre> <a href=\"https://w/?k=3\">4</a> <i><code>5</code></i>"
        );
        // Other modes are left alone.
        assert_eq!(Escape::Text.finish(v("x")), v("x"));
    }

    #[test]
    fn markdown_escapes_metacharacters_and_mentions() {
        assert_eq!(
            esc(Escape::Markdown, "*_[]()#>`~|\\"),
            "\\*\\_\\[\\]\\(\\)\\#\\>\\`\\~\\|\\\\"
        );
        assert_eq!(
            esc(Escape::Markdown, "[click](http://evil)"),
            "\\[click\\]\\(http:\u{200B}//evil\\)"
        );
        assert_eq!(esc(Escape::Markdown, "@all"), "@\u{200B}all");
        assert_eq!(
            esc(Escape::Markdown, "<at user_id=\"all\">"),
            "<\u{200B}at user\\_id=\"all\"\\>"
        );
    }
}
