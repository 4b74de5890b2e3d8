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
    /// Microsoft Teams Adaptive Card Markdown: [`Escape::Markdown`], plus a zero-width space
    /// after `{` (a TextBlock formats `{{DATE(…)}}`), and control and bidi characters shown.
    Teams,
    /// Telegram's HTML: `&` `<` `>` `"` as entities, plus [`Escape::Text`]'s zero-width space
    /// after `@` (a `@username` would mention), and control and bidi characters shown.
    Html,
}

/// Backslash-escaped in [`Escape::Markdown`]: emphasis, code, links/images, headings, quotes,
/// strikethrough, tables, and the backslash itself (CommonMark backslash escapes).
const MARKDOWN_SPECIALS: &[char] = &['\\', '`', '*', '_', '[', ']', '(', ')', '#', '>', '~', '|'];

/// Redis glob metacharacters (`stringmatchlen`): `^` and `-` only mean something inside `[…]`,
/// which cannot open once `[` is escaped.
const GLOB_SPECIALS: &[char] = &['*', '?', '[', ']', '\\'];

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

    /// Writes `s` (an encoded string) escaped for this mode.
    pub(crate) fn write_escaped<W: Write>(self, out: &mut W, s: &str) -> fmt::Result {
        // A bare link in key text (`http://evil`) is made a link by every chat app; a zero-width
        // space after the colon keeps it text, as it does for `@`.
        let defused;
        let s = if self.is_chat() && s.contains("://") {
            defused = s.replace("://", ":\u{200B}//");
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
            Escape::Teams => write_replacing(out, s, |c| {
                if MARKDOWN_SPECIALS.contains(&c) {
                    Some(Replacement::Prefix('\\'))
                } else if c == '{' {
                    Some(Replacement::Str("{\u{200B}"))
                } else if let Some(shown) = hidden_char_shown(c) {
                    // The backslash of `\u202E` escaped too, so Markdown shows it.
                    Some(Replacement::Owned(format!("\\{shown}")))
                } else {
                    text_replacement(c)
                }
            }),
            Escape::Html => write_replacing(out, s, |c| match c {
                '&' => Some(Replacement::Str("&amp;")),
                '<' => Some(Replacement::Str("&lt;")),
                '>' => Some(Replacement::Str("&gt;")),
                '"' => Some(Replacement::Str("&quot;")),
                '@' => Some(Replacement::Str("@\u{200B}")),
                _ => hidden_char_shown(c)
                    .map(Replacement::Owned)
                    .or_else(|| line_break_replacement(c)),
            }),
        }
    }
}

fn text_replacement(c: char) -> Option<Replacement> {
    match c {
        '@' => Some(Replacement::Str("@\u{200B}")),
        '<' => Some(Replacement::Str("<\u{200B}")),
        _ => line_break_replacement(c),
    }
}

/// A line break in key text would let it write a line of its own (a fake heading, a line that
/// looks like keywatch's): in chat it is shown as `\n` / `\r`, as people write it.
fn line_break_replacement(c: char) -> Option<Replacement> {
    match c {
        '\n' => Some(Replacement::Str("\\n")),
        '\r' => Some(Replacement::Str("\\r")),
        _ => None,
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
    hidden.then(|| format!("\\u{:04X}", u32::from(c)))
}

enum Replacement {
    Str(&'static str),
    Owned(String),
    Prefix(char),
}

/// Copies `s` in runs, replacing the few chars `f` names: output goes through minijinja's
/// `dyn Write`, where one call per run is much cheaper than one per char.
fn write_replacing<W: Write>(
    out: &mut W,
    s: &str,
    f: impl Fn(char) -> Option<Replacement>,
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
    fn teams_escapes_markdown_card_functions_and_hidden_characters() {
        assert_eq!(
            esc(Escape::Teams, "[x](http://evil) **b** @channel <at>x</at>"),
            "\\[x\\]\\(http:\u{200B}//evil\\) \\*\\*b\\*\\* @\u{200B}channel <\u{200B}at\\>x<\u{200B}/at\\>"
        );
        assert_eq!(
            esc(Escape::Teams, "{{DATE(2017-02-14T06:08:39Z, SHORT)}}"),
            "{\u{200B}{\u{200B}DATE\\(2017-02-14T06:08:39Z, SHORT\\)}}"
        );
        assert_eq!(esc(Escape::Teams, "a\u{202E}b\r\n"), "a\\\\u202Eb\\r\\n");
    }

    #[test]
    fn html_escapes_markup_mentions_links_and_hidden_characters() {
        assert_eq!(
            esc(
                Escape::Html,
                "<b>x</b> <a href=\"http://evil\">y</a> & @channel"
            ),
            "&lt;b&gt;x&lt;/b&gt; &lt;a href=&quot;http:\u{200B}//evil&quot;&gt;y&lt;/a&gt; &amp; @\u{200B}channel"
        );
        assert_eq!(
            esc(Escape::Html, "[x](http://evil) *b*"),
            "[x](http:\u{200B}//evil) *b*"
        );
        assert_eq!(
            esc(Escape::Html, "a\u{202E}b\u{2066}c\u{1b}[31m\u{0}\nd\te"),
            "a\\u202Eb\\u2066c\\u001B[31m\\u0000\\nd\te"
        );
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
