//! Hostile capture values and keys (arbitrary bytes) through every escaping mode, and arbitrary
//! template sources through compile + render.
//!
//! The invariants are docs/rules.md's "untrusted key text can never widen an action": a value comes
//! out byte-exact where it must, as a valid percent-encoded URL component, as a glob matching
//! only itself, and in chat text with every mention and Slack control sequence defused (and
//! Markdown metacharacters escaped), no line break and no `://` left whole, while the unescaped
//! text is still the value (line breaks written `\n`/`\r`, a zero-width space after `:` of
//! `://`). Templates render with the engine's fuel on, so a source that loops forever ends.
#![no_main]

use chrono::Utc;
use keywatch::event::{EventKind, KeyEvent};
use keywatch::template::{Context, Escape, TemplateSet};
use libfuzzer_sys::fuzz_target;

const ZWSP: char = '\u{200B}';
const MARKDOWN_SPECIALS: &[char] = &['\\', '`', '*', '_', '[', ']', '(', ')', '#', '>', '~', '|'];

fuzz_target!(|input: (u8, Vec<u8>, Vec<u8>, String)| {
    let (selector, capture, key, source) = input;
    let event = KeyEvent {
        kind: EventKind::ALL[usize::from(selector >> 4) % EventKind::ALL.len()],
        db: u32::from(selector),
        key: key.clone(),
        field: None,
        observed_at: Utc::now(),
        deadline: None,
        ttl_ms: Some(1),
        recovered: false,
        source: "127.0.0.1:6379".into(),
    };
    let names = vec!["v".to_string()];
    let ctx = Context::for_event("rule", &event, &names, std::slice::from_ref(&capture), None);

    for mode in Escape::ALL {
        let mut set = TemplateSet::new();
        let v = set.add("{{ v }}", mode).expect("a plain template compiles");
        let k = set
            .add("{{ key }}", mode)
            .expect("a plain template compiles");
        for (id, raw) in [(v, &capture), (k, &key)] {
            let bytes = set.render(id, &ctx).expect("a plain template renders");
            let text = set.render_text(id, &ctx).expect("a plain template renders");
            check(mode, raw, &bytes, &text);
        }
    }

    // The author's own template text, however odd: an error or an output, never a panic.
    let mode = Escape::ALL[usize::from(selector) % Escape::ALL.len()];
    let mut set = TemplateSet::new();
    if let Ok(id) = set.add(&source, mode) {
        let _ = set.variables(id);
        let _ = set.render(id, &ctx);
        let sample = Context::sample("rule", event.kind, &names).with_sample_detail();
        let _ = set.render_text(id, &sample);
    }
});

fn check(mode: Escape, raw: &[u8], bytes: &[u8], text: &str) {
    let lossy = String::from_utf8_lossy(raw);
    match mode {
        Escape::Raw | Escape::RedisKey => assert_eq!(bytes, raw, "{mode:?} is not byte-exact"),
        Escape::Glob => {
            let mut out = Vec::new();
            let mut it = bytes.iter();
            while let Some(&b) = it.next() {
                match b {
                    b'\\' => {
                        let next = *it.next().expect("a glob ends in a lone backslash");
                        assert!(b"*?[]\\".contains(&next), "needless escape of {next:?}");
                        out.push(next);
                    }
                    b'*' | b'?' | b'[' | b']' => {
                        panic!("unescaped glob metacharacter in {bytes:?}")
                    }
                    _ => out.push(b),
                }
            }
            assert_eq!(out, raw, "the glob does not stand for the value");
        }
        Escape::Url => {
            for (i, &b) in bytes.iter().enumerate() {
                let unreserved = b.is_ascii_alphanumeric() || b"-._~".contains(&b);
                let hex = |j: usize| {
                    bytes
                        .get(j)
                        .is_some_and(|h| h.is_ascii_digit() || (b'A'..=b'F').contains(h))
                };
                assert!(
                    unreserved
                        || b == b'%'
                        || (i >= 1 && bytes[i - 1] == b'%')
                        || (i >= 2 && bytes[i - 2] == b'%'),
                    "byte {b:#x} not encoded in {bytes:?}"
                );
                if b == b'%' {
                    assert!(hex(i + 1) && hex(i + 2), "bad escape in {bytes:?}");
                }
            }
            let decoded: Vec<u8> = percent_encoding::percent_decode(bytes).collect();
            assert_eq!(
                decoded, raw,
                "percent-decoding does not give the value back"
            );
        }
        Escape::Slack | Escape::Text | Escape::Markdown => {
            assert!(
                !text.contains(['\n', '\r']) && !text.contains("://"),
                "line break or link left in {text:?}"
            );
            check_chat(mode, &chat_form(&lossy), text);
        }
    }
}

/// What a value reads as in chat: links defused and line breaks written out, as keywatch does
/// before escaping for the format.
fn chat_form(value: &str) -> String {
    value
        .replace("://", ":\u{200B}//")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

fn check_chat(mode: Escape, lossy: &str, text: &str) {
    match mode {
        Escape::Slack => {
            assert!(!text.contains('<') && !text.contains('>'), "{text:?}");
            let back = text.replace("&lt;", "<").replace("&gt;", ">");
            assert!(
                back.match_indices('&')
                    .all(|(i, _)| back[i..].starts_with("&amp;")),
                "bare & in {text:?}"
            );
            assert_eq!(back.replace("&amp;", "&"), lossy, "{text:?}");
        }
        Escape::Text => assert_eq!(unescape_chat(text, false), lossy, "{text:?}"),
        Escape::Markdown => assert_eq!(unescape_chat(text, true), lossy, "{text:?}"),
        _ => unreachable!("not a chat mode: {mode:?}"),
    }
}

/// Undoes chat escaping, panicking on anything left unescaped: every `@` and `<` must be
/// followed by a zero-width space (no `@all`, no `<at user_id="all">`), and in Markdown every
/// metacharacter must come backslash-escaped.
fn unescape_chat(text: &str, markdown: bool) -> String {
    let mut out = String::new();
    let mut it = text.chars();
    while let Some(c) = it.next() {
        match c {
            '\\' if markdown => {
                let next = it.next().expect("a lone backslash");
                // A line break, written out.
                if next == 'n' || next == 'r' {
                    out.push(c);
                    out.push(next);
                    continue;
                }
                assert!(
                    MARKDOWN_SPECIALS.contains(&next),
                    "needless escape of {next:?} in {text:?}"
                );
                out.push(next);
            }
            '@' | '<' => {
                assert_eq!(it.next(), Some(ZWSP), "mention not defused in {text:?}");
                out.push(c);
            }
            c if markdown && MARKDOWN_SPECIALS.contains(&c) => {
                panic!("unescaped Markdown {c:?} in {text:?}")
            }
            c => out.push(c),
        }
    }
    out
}
