//! Keys as minijinja strings without losing a byte.
//!
//! minijinja only knows Rust strings, but Redis keys are bytes and actions on Redis, argv and URLs
//! must use exactly those bytes. Like Python's `surrogateescape`, each byte `b` of an invalid UTF-8
//! sequence becomes the private-use char `U+F700 + b` (`b` is always `0x80..=0xFF`, so the range
//! `U+F780..=U+F7FF`). To make the mapping bijective, a genuine char of that range is written as
//! its own three UTF-8 bytes, each mapped the same way; decoding turns every char of the range back
//! into one byte, so `decode(encode(b)) == b` for every byte string. Chars `U+F700..=U+F77F` are
//! never produced for bytes, so they are left alone in both directions.
//!
//! Every string that enters a template (sources, context values, detail JSON) goes through
//! [`encode_str`] or [`encode`], so rendered output is one consistent encoded string that
//! [`decode`] turns into bytes.

use std::borrow::Cow;

const BASE: u32 = 0xF700;
const FIRST: char = '\u{F780}';
const LAST: char = '\u{F7FF}';

/// True for the chars that stand for one byte.
pub(crate) fn is_byte_char(c: char) -> bool {
    (FIRST..=LAST).contains(&c)
}

/// The char standing for byte `b`; only meaningful for `b >= 0x80`.
fn byte_char(b: u8) -> char {
    debug_assert!(b >= 0x80);
    // U+F780..=U+F7FF are all valid scalar values.
    char::from_u32(BASE + u32::from(b)).unwrap_or(char::REPLACEMENT_CHARACTER)
}

fn push_escaped_str(out: &mut String, s: &str) {
    for c in s.chars() {
        if is_byte_char(c) {
            let mut buf = [0u8; 4];
            for &b in c.encode_utf8(&mut buf).as_bytes() {
                out.push(byte_char(b));
            }
        } else {
            out.push(c);
        }
    }
}

/// Bytes (maybe not UTF-8) as an encoded string.
pub(crate) fn encode(bytes: &[u8]) -> Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(bytes) {
        return encode_str(s);
    }
    let mut out = String::with_capacity(bytes.len() + bytes.len() / 2);
    for chunk in bytes.utf8_chunks() {
        push_escaped_str(&mut out, chunk.valid());
        for &b in chunk.invalid() {
            out.push(byte_char(b));
        }
    }
    Cow::Owned(out)
}

/// A genuine string as an encoded string: only chars of the reserved range change.
pub(crate) fn encode_str(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_byte_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() * 2);
    push_escaped_str(&mut out, s);
    Cow::Owned(out)
}

/// The bytes an encoded string stands for.
pub(crate) fn decode(s: &str) -> Cow<'_, [u8]> {
    if !s.chars().any(is_byte_char) {
        return Cow::Borrowed(s.as_bytes());
    }
    let mut out = Vec::with_capacity(s.len());
    let mut buf = [0u8; 4];
    for c in s.chars() {
        if is_byte_char(c) {
            out.push((u32::from(c) - BASE) as u8);
        } else {
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    Cow::Owned(out)
}

/// Appends the bytes char `c` stands for (one byte for a byte char, else its UTF-8).
pub(crate) fn char_bytes(c: char, buf: &mut [u8; 4]) -> &[u8] {
    if is_byte_char(c) {
        buf[0] = (u32::from(c) - BASE) as u8;
        &buf[..1]
    } else {
        c.encode_utf8(buf).as_bytes()
    }
}

/// Encodes every string inside a JSON value, map keys included, cloning only when one changes.
pub(crate) fn encode_json(value: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    fn needs(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::String(s) => s.chars().any(is_byte_char),
            serde_json::Value::Array(items) => items.iter().any(needs),
            serde_json::Value::Object(map) => map
                .iter()
                .any(|(k, v)| k.chars().any(is_byte_char) || needs(v)),
            _ => false,
        }
    }
    fn convert(value: &serde_json::Value) -> serde_json::Value {
        match value {
            serde_json::Value::String(s) => serde_json::Value::String(encode_str(s).into_owned()),
            serde_json::Value::Array(items) => {
                serde_json::Value::Array(items.iter().map(convert).collect())
            }
            serde_json::Value::Object(map) => serde_json::Value::Object(
                map.iter()
                    .map(|(k, v)| (encode_str(k).into_owned(), convert(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
    if needs(value) {
        Cow::Owned(convert(value))
    } else {
        Cow::Borrowed(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn valid_utf8_is_borrowed() {
        assert!(matches!(
            encode(b"order_lock:42"),
            Cow::Borrowed("order_lock:42")
        ));
        assert!(matches!(
            decode("order_lock:42"),
            Cow::Borrowed(b"order_lock:42")
        ));
    }

    #[test]
    fn invalid_bytes_map_to_private_chars() {
        assert_eq!(encode(b"a\xffb\x80"), "a\u{F7FF}b\u{F780}");
        assert_eq!(decode("a\u{F7FF}b\u{F780}").as_ref(), b"a\xffb\x80");
    }

    #[test]
    fn genuine_private_chars_survive() {
        let s = "x\u{F7AB}y\u{F700}";
        let e = encode_str(s);
        assert_ne!(e, s);
        assert_eq!(decode(&e).as_ref(), s.as_bytes());
        // U+F700..U+F77F is outside the reserved range and left alone.
        assert_eq!(encode_str("\u{F700}"), "\u{F700}");
    }

    #[test]
    fn json_strings_and_keys_are_encoded() {
        let v = serde_json::json!({"a\u{F7AB}": ["\u{F7FF}", 1, null]});
        let e = encode_json(&v);
        assert!(matches!(e, Cow::Owned(_)));
        let key = e.as_object().unwrap().keys().next().unwrap().clone();
        assert_eq!(decode(&key).as_ref(), "a\u{F7AB}".as_bytes());
        let plain = serde_json::json!({"a": "b"});
        assert!(matches!(encode_json(&plain), Cow::Borrowed(_)));
    }

    proptest! {
        #[test]
        fn round_trip(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let back = decode(&encode(&bytes)).into_owned();
            prop_assert_eq!(back, bytes);
        }

        #[test]
        fn round_trip_private_heavy(chars in proptest::collection::vec(
            prop_oneof![Just('\u{F780}'), Just('\u{F7FF}'), Just('\u{F700}'), Just('a'), Just('é')], 0..16),
            junk in proptest::collection::vec(128u8..=255, 0..4)) {
            let mut bytes = chars.iter().collect::<String>().into_bytes();
            bytes.extend_from_slice(&junk);
            let back = decode(&encode(&bytes)).into_owned();
            prop_assert_eq!(back, bytes);
        }

        #[test]
        fn concatenation_decodes_piecewise(a in proptest::collection::vec(any::<u8>(), 0..32),
                                           b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let joined = format!("{}{}", encode(&a), encode(&b));
            let mut want = a.clone();
            want.extend_from_slice(&b);
            let back = decode(&joined).into_owned();
            prop_assert_eq!(back, want);
        }
    }
}
