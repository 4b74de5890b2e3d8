//! Arbitrary pub/sub messages (channel and payload bytes, message shapes of RESP2 and RESP3,
//! huge and non-UTF-8 keys) through the subscriber's decoding into signals.
//!
//! A keyevent keeps the key's exact bytes and its channel's database; a channel that is not a
//! canonical keyevent channel never becomes an event.
#![no_main]

use chrono::Utc;
use keywatch::source::notifications::{Channel, Signal, decode, parse_channel};
use libfuzzer_sys::fuzz_target;
use redis::{Msg, PushKind, Value};

// The input is raw bytes, not `Arbitrary` data: `shape`, then the channel up to the first NUL,
// then the payload. `Arbitrary`'s `Vec<u8>` interleaves continuation bytes, which keeps the
// fuzzer from ever spelling `__keyevent@0__:expired` out of its dictionary.
fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let (channel, payload) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let bulk = |b: &[u8]| Value::BulkString(b.to_vec());
    let value = match shape % 4 {
        0 => Value::Array(vec![bulk(b"message"), bulk(channel), bulk(payload)]),
        1 => Value::Array(vec![
            bulk(b"pmessage"),
            bulk(b"__keyevent@*"),
            bulk(channel),
            bulk(payload),
        ]),
        2 => Value::Push {
            kind: PushKind::Message,
            data: vec![bulk(channel), bulk(payload)],
        },
        _ => Value::Array(vec![
            bulk(b"message"),
            bulk(channel),
            Value::Int(i64::from(shape)),
        ]),
    };
    let Some(msg) = Msg::from_owned_value(value) else {
        return;
    };
    let name = msg.get_channel_name().to_owned();
    let parsed = parse_channel(&name);
    if let Some((db, what)) = parsed {
        // Canonical: `__keyevent@<db>__:<event>` with the database as Redis writes it.
        let event = match what {
            Channel::Event(kind) => kind.redis_event().expect("Redis publishes it").to_string(),
            Channel::Deadline(_) => name.rsplit_once("__:").expect("parsed").1.to_string(),
        };
        assert_eq!(
            name,
            format!("__keyevent@{db}__:{event}"),
            "non-canonical channel accepted"
        );
    }
    match decode(&msg, "127.0.0.1:6379", Utc::now()) {
        Some(Signal::Event(e)) => {
            let (db, what) = parsed.expect("an event from a keyevent channel");
            assert_eq!(what, Channel::Event(e.kind));
            assert_eq!(e.db, db);
            assert_eq!(e.key, msg.get_payload_bytes());
            assert!(!e.recovered && e.deadline.is_none());
            let _ = e.key_lossy();
        }
        Some(Signal::Deadline { db, key, note }) => {
            assert_eq!(parsed, Some((db, Channel::Deadline(note))));
            assert_eq!(key, msg.get_payload_bytes());
        }
        Some(Signal::Marker { payload: m, .. }) => {
            assert!(
                !name.starts_with("__keyevent@"),
                "keyevent channel as marker: {name:?}"
            );
            assert_eq!(m, msg.get_payload_bytes());
        }
        Some(other) => panic!("decode produced {other:?}"),
        None => assert!(
            name.starts_with("__keyevent@") && parsed.is_none(),
            "{name:?} dropped"
        ),
    }
});
