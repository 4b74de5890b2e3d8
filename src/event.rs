//! What happened to which key: the vocabulary shared by sources, matching and actions.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The kinds of event a rule can react to (`on:` in a rule).
///
/// `Deleted` is Redis's `del` keyevent; `Expiring` is produced by keywatch's own scanner or
/// ledger before a deadline, never by Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    Expired,
    Evicted,
    Deleted,
    Expiring,
    /// A field of a hash expired (Redis 7.4+, Valkey 9+); the event names the field.
    Hexpired,
}

impl EventKind {
    pub const ALL: [EventKind; 5] = [
        EventKind::Expired,
        EventKind::Evicted,
        EventKind::Deleted,
        EventKind::Expiring,
        EventKind::Hexpired,
    ];

    /// The name used in rule files, event JSON and templates.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Expired => "expired",
            EventKind::Evicted => "evicted",
            EventKind::Deleted => "deleted",
            EventKind::Expiring => "expiring",
            EventKind::Hexpired => "hexpired",
        }
    }

    pub fn parse(s: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The keyevent channel name Redis publishes this kind on, if Redis publishes it at all.
    /// `hexpired` names only the hash: its channels are [`crate::source::fields`]'s.
    pub fn redis_event(self) -> Option<&'static str> {
        match self {
            EventKind::Expired => Some("expired"),
            EventKind::Evicted => Some("evicted"),
            EventKind::Deleted => Some("del"),
            EventKind::Expiring | EventKind::Hexpired => None,
        }
    }

    /// The `notify-keyspace-events` class letter that makes Redis publish this kind.
    pub fn notify_flag(self) -> Option<char> {
        match self {
            EventKind::Expired => Some('x'),
            EventKind::Evicted => Some('e'),
            EventKind::Deleted => Some('g'),
            EventKind::Expiring => None,
            // Valkey 9.1 publishes `hexpired` under `x` (checked); `h` is added for learning.
            EventKind::Hexpired => Some('x'),
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One observation of one key, as a source reports it, before any rule is applied.
///
/// Keys are bytes: Redis keys need not be UTF-8, and actions on Redis must use the exact bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyEvent {
    pub kind: EventKind,
    pub db: u32,
    /// Shared, not copied, by the record, the firings and their captures of the event: a key
    /// may be megabytes long (docs/reliability.md#bounded-whatever-the-key).
    pub key: bytes::Bytes,
    /// The hash field, for `hexpired` events.
    pub field: Option<Vec<u8>>,
    /// When keywatch received or produced the event.
    pub observed_at: DateTime<Utc>,
    /// The key's deadline when keywatch knew it (ledger or scanner), else `None`.
    pub deadline: Option<DateTime<Utc>>,
    /// Remaining time to live, for `expiring` events.
    pub ttl_ms: Option<i64>,
    /// True when keywatch found the event after the fact (it missed the notification).
    pub recovered: bool,
    /// The node that published or held the key, `host:port`.
    pub source: String,
    /// Where the event lies in its node's stream, for an event that may come without a
    /// deadline (`del`, `evicted`, `expired`): how instances tell one such event from another
    /// (`crate::source::places`). `None` from any other source.
    pub place: Option<Place>,
}

/// An event's place in its node's stream (`crate::source::places`): the mark before it (hex of
/// the mark's SHA-256, 16 digits) and its number among the events of its kind, database and key
/// since that mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub mark: std::sync::Arc<str>,
    pub n: u32,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.mark, self.n)
    }
}

/// Bytes as one line of text for people and logs: control characters (C0, DEL, C1: ESC, BEL,
/// CR, LF…) and the characters that reorder or break text (bidi overrides, embeddings, isolates
/// and marks; line and paragraph separators) written out as Rust escapes (`\u{1b}`,
/// `\u{202e}`), and each byte that is not UTF-8 as `\xNN`. Key text is anyone's: raw, it
/// repaints a terminal, writes a log line of its own, or turns the sentence around it
/// backwards; replaced by U+FFFD, two keys look the same, and a key shown cannot be typed back
/// (`explain` takes `\xNN`, docs/commands.md). Beyond [`crate::long_key::IN_TEXT`] bytes it is
/// the cut view of the bytes ([`crate::long_key::view`]): a key of 16 MB is not a log line of
/// 16 MB, per attempt.
pub fn printable(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match crate::long_key::view(bytes, crate::long_key::IN_TEXT) {
        std::borrow::Cow::Borrowed(b) => printable_whole(b),
        std::borrow::Cow::Owned(cut) => std::borrow::Cow::Owned(printable_whole(&cut).into_owned()),
    }
}

/// [`printable`] without the cut: for text whose length its author chose (a rendered message,
/// a program's output), never for key text alone.
pub fn printable_whole(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    if let Ok(text) = std::str::from_utf8(bytes)
        && !text.chars().any(hidden)
    {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(bytes.len() + 8);
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if hidden(c) {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A character shown escaped to people ([`printable`]): a control character, or one that
/// changes the direction or the lines of the text around it.
pub fn hidden(c: char) -> bool {
    c.is_control() || reorders(c)
}

/// Unicode's bidirectional formatting characters (LRE, RLE, PDF, LRO, RLO; LRI, RLI, FSI, PDI;
/// LRM, RLM, ALM) and the line and paragraph separators: invisible, they reorder or break
/// what is shown after them (U+202E makes `txt.exe` read `exe.txt`).
pub fn reorders(c: char) -> bool {
    matches!(
        c,
        '\u{202A}'..='\u{202E}'
            | '\u{2066}'..='\u{2069}'
            | '\u{200E}'
            | '\u{200F}'
            | '\u{061C}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

impl KeyEvent {
    /// Milliseconds between the deadline and the observation, when the deadline is known.
    pub fn late_ms(&self) -> Option<i64> {
        self.deadline
            .map(|d| (self.observed_at - d).num_milliseconds().max(0))
    }

    /// The key as text for people and logs ([`printable`]): control characters written out
    /// (`\n`, `\u{1b}`), so a key holding a line break cannot forge a log line of its own, and
    /// bytes that are not UTF-8 as `\xNN`.
    pub fn key_lossy(&self) -> std::borrow::Cow<'_, str> {
        printable(&self.key)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_in_logs_cannot_break_the_line() {
        assert_eq!(super::printable(b"a\r\nX-Evil: 1"), "a\\r\\nX-Evil: 1");
        assert_eq!(super::printable(b"k:\x1b[31m"), "k:\\u{1b}[31m");
        assert_eq!(super::printable("订单:42".as_bytes()), "订单:42");
        assert_eq!(super::printable(b"k:\xff\xfe:1"), "k:\\xff\\xfe:1");
        assert_eq!(super::printable(b"\xe2\x80"), "\\xe2\\x80");
        assert_eq!(super::printable(b"\xff\x1b"), "\\xff\\u{1b}");
        assert_eq!(
            super::printable("a\u{202e}txt.exe\u{2066}b\u{85}".as_bytes()),
            "a\\u{202e}txt.exe\\u{2066}b\\u{85}"
        );
    }

    #[test]
    fn a_long_key_is_shown_cut_with_its_length() {
        let key = [b"k:\x1b".as_slice(), &[b'x'; 100_000]].concat();
        let shown = super::printable(&key);
        assert!(shown.len() < 1100, "{}", shown.len());
        assert!(shown.starts_with("k:\\u{1b}xxx"), "{shown:.20}");
        assert!(shown.contains("100003 bytes, sha256 "), "{shown}");
        assert_eq!(super::printable_whole(&key).len(), 100_008);
    }
}
