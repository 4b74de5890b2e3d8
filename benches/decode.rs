//! Messages per second through the subscriber's decoding ([`decode`]): every pub/sub message a
//! node sends goes through it before anything else, so during an expiry storm it runs once per
//! expired key, on the subscriber's task.
//!
//! `cargo bench --bench decode`. Each iteration decodes 1,000 prebuilt messages of one kind (keys
//! differ, as in a storm); throughput is per message. The kinds: `expired` with short keys, with
//! 1 KB keys and with non-UTF-8 keys; an `expire` (a deadline for the ledger); a marker on
//! keywatch's marker channel; and a keyevent keywatch does not act on (`set`), which decodes to
//! nothing. Building the `redis::Msg` (parsing RESP) and reading the clock are outside the
//! measurement: the timestamp is fixed.

use std::hint::black_box;

use chrono::Utc;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use keywatch::source::Signal;
use keywatch::source::ledger::Ledger;
use keywatch::source::notifications::decode;
use redis::{Msg, Value};

const MESSAGES: usize = 1_000;
const NODE: &str = "10.0.3.17:6379";

/// A RESP2 `message` as the subscriber's connection delivers it.
fn msg(channel: &[u8], payload: Vec<u8>) -> Msg {
    Msg::from_owned_value(Value::Array(vec![
        Value::BulkString(b"message".to_vec()),
        Value::BulkString(channel.to_vec()),
        Value::BulkString(payload),
    ]))
    .expect("a pub/sub message")
}

fn short_key(i: usize) -> Vec<u8> {
    format!(
        "session:{:016x}",
        (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    )
    .into_bytes()
}

/// 1,024 bytes: a prefix and a serialized-looking body, as caches keyed by a request do.
fn long_key(i: usize) -> Vec<u8> {
    let mut key = format!("cache:render:{i:08}:").into_bytes();
    let mut n = i as u64 + 1;
    while key.len() < 1024 {
        n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        key.push(b'a' + (n >> 59) as u8 % 26);
    }
    key
}

/// A binary id after a text prefix: invalid UTF-8 (0xff, 0xfe, a lone continuation byte).
fn binary_key(i: usize) -> Vec<u8> {
    let mut key = b"blob:".to_vec();
    key.extend_from_slice(&[0xff, 0xfe, 0x80]);
    key.extend_from_slice(&(i as u64).to_le_bytes());
    key.extend_from_slice(b":\xc3\x28");
    key
}

fn bench(c: &mut Criterion) {
    let marker = Ledger::marker_channel("keywatch:");
    // A case: MESSAGES messages on one channel, the payload of message i from `payload(i)`.
    let case = |name, channel: &[u8], payload: &dyn Fn(usize) -> Vec<u8>| -> (&str, Vec<Msg>) {
        (
            name,
            (0..MESSAGES).map(|i| msg(channel, payload(i))).collect(),
        )
    };
    let cases: Vec<(&str, Vec<Msg>)> = vec![
        case("expired_short_key", b"__keyevent@0__:expired", &short_key),
        case("expired_1k_key", b"__keyevent@0__:expired", &long_key),
        case(
            "expired_non_utf8_key",
            b"__keyevent@3__:expired",
            &binary_key,
        ),
        case("expire_deadline", b"__keyevent@0__:expire", &short_key),
        case("marker", marker.as_bytes(), &|i| {
            format!("kw-7f3a9c:0:{i}").into_bytes()
        }),
        case("ignored_keyevent_set", b"__keyevent@0__:set", &short_key),
    ];

    let now = Utc::now();
    // Each case decodes to what its name says, with the key's exact bytes.
    for (name, msgs) in &cases {
        for m in msgs {
            let signal = decode(m, NODE, now);
            let ok = match (*name, &signal) {
                ("expire_deadline", Some(Signal::Deadline { key, .. })) => {
                    key == m.get_payload_bytes()
                }
                ("marker", Some(Signal::Marker { payload, .. })) => {
                    payload == m.get_payload_bytes()
                }
                ("ignored_keyevent_set", None) => true,
                (_, Some(Signal::Event(e))) if name.starts_with("expired") => {
                    e.key == m.get_payload_bytes()
                }
                _ => false,
            };
            assert!(ok, "{name}: {signal:?}");
        }
    }
    assert!(std::str::from_utf8(cases[2].1[0].get_payload_bytes()).is_err());
    assert_eq!(cases[1].1[0].get_payload_bytes().len(), 1024);

    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(MESSAGES as u64));
    for (name, msgs) in &cases {
        group.bench_function(*name, |b| {
            b.iter(|| {
                let mut decoded = 0;
                for m in msgs {
                    decoded += usize::from(decode(black_box(m), NODE, now).is_some());
                }
                decoded
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
