//! The intake against a real redis-server: one winner per event however many instances claim it,
//! no keyevent published per claim (in a mass expiry that doubled what Redis published), an
//! expiry handled minutes late still found, and a taken event left by one instance taken over
//! by another.

use crate::common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{RedisServer, ledger};
use keywatch::engine::intake::{Intake, Mode};
use keywatch::event::{EventKind, KeyEvent};
use keywatch::keyspace::Keyspace;

fn expired(key: &str, deadline_ms: Option<i64>) -> KeyEvent {
    KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: key.as_bytes().to_vec().into(),
        field: None,
        observed_at: Utc::now(),
        deadline: deadline_ms.and_then(DateTime::from_timestamp_millis),
        ttl_ms: None,
        recovered: false,
        source: "test".into(),
        place: None,
    }
}

async fn intake(redis: &RedisServer, me: &str) -> Intake {
    let config = common::rules::log_rule_config();
    let keyspace = Keyspace::new(
        keywatch::config::Secret::new(redis.url()),
        config.redis.clone(),
    )
    .unwrap();
    Intake::new(keyspace.conn(0).await.unwrap(), "kw:", me)
}

/// Takes `events` as `mode`; true where this instance won.
async fn take(i: &Intake, events: &[&KeyEvent], mode: Mode) -> Vec<bool> {
    let with: Vec<(&KeyEvent, Mode)> = events.iter().map(|e| (*e, mode.clone())).collect();
    i.take(0, &with)
        .await
        .unwrap()
        .iter()
        .map(Option::is_some)
        .collect()
}

/// The one key matching `pattern` (fails if there are none or several).
fn the_only_key(conn: &mut redis::Connection, pattern: &str) -> String {
    let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(conn).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys.into_iter().next().unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn each_event_is_won_once_by_one_of_two_instances() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let now = Utc::now().timestamp_millis();
        // Deadlines spread over three minutes, some without one; "k:0" twice with two deadlines
        // (set again after it expired) is two events.
        let mut events: Vec<KeyEvent> = (0..300)
            .map(|i| expired(&format!("k:{i}"), (i % 7 != 0).then_some(now - i * 600)))
            .collect();
        events.push(expired("k:0", Some(now + 1)));
        let refs: Vec<&KeyEvent> = events.iter().collect();
        let (first, second) =
            tokio::join!(take(&a, &refs, Mode::Plain), take(&b, &refs, Mode::Plain));
        for (i, (x, y)) in first.iter().zip(&second).enumerate() {
            assert!(x ^ y, "event {i}: a won {x}, b won {y}");
        }
        // A copy arriving later (a slow instance) loses too.
        let again = take(&a, &refs, Mode::Plain).await;
        assert!(again.iter().all(|w| !w), "{again:?}");
    });
}

#[test]
fn claims_with_a_deadline_publish_no_keyevent_each() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut sub = client.get_async_pubsub().await.unwrap();
        sub.psubscribe("__keyevent@0__:*").await.unwrap();
        let c = intake(&redis, "a").await;
        let now = Utc::now().timestamp_millis();
        let events: Vec<KeyEvent> = (0..1000)
            .map(|i| expired(&format!("k:{i}"), Some(now - 30_000 + i)))
            .collect();
        let won = take(&c, &events.iter().collect::<Vec<_>>(), Mode::Plain).await;
        assert!(won.iter().all(|w| *w));
        // A marker: everything Redis published before it has arrived once it does.
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("SET")
            .arg("marker")
            .arg("1")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut stream = sub.on_message();
        let mut published = Vec::new();
        loop {
            let m = tokio::time::timeout(
                Duration::from_secs(10),
                futures_util::StreamExt::next(&mut stream),
            )
            .await
            .expect("the marker's keyevent")
            .unwrap();
            let key: String = m.get_payload().unwrap();
            if key == "marker" {
                break;
            }
            published.push(key);
        }
        // One `expire` per hash (16 per deadline minute; the 1,000 deadlines span at most two
        // minutes), not one per claim.
        assert!(published.len() <= 32, "{published:?}");
    });
}

#[test]
fn a_late_claim_is_kept_ten_minutes_from_now() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let c = intake(&redis, "a").await;
        let now = Utc::now().timestamp_millis();
        // A recovery an hour after the deadline: its minute's hash would be long gone by then.
        let won = take(&c, &[&expired("k", Some(now - 3_600_000))], Mode::Plain).await;
        assert_eq!(won, [true]);
        let mut conn = redis.conn();
        let key = the_only_key(&mut conn, "kw:claims:*");
        let until: i64 = redis::cmd("PEXPIRETIME")
            .arg(&key)
            .query(&mut conn)
            .unwrap();
        assert!(until >= now + 600_000, "kept until {until}, now {now}");
        assert!(until <= now + 720_000, "kept until {until}, now {now}");
    });
}

#[test]
fn a_claim_without_a_deadline_lasts_five_seconds() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let e = expired("k", None);
        assert_eq!(take(&a, &[&e], Mode::Plain).await, [true]);
        assert_eq!(take(&b, &[&e], Mode::Plain).await, [false]);
        let mut conn = redis.conn();
        let key = the_only_key(&mut conn, "kw:claim:*");
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    });
}

/// The handled memory is kept by when an expiry was handled, not by its deadline: an instance
/// that reads an `expired` two minutes after its deadline (a backlog) must still find the
/// deadline another instance took, compute the same claim, and lose. Trimmed by deadline (a
/// minute), the second instance found nothing, claimed without a deadline, and fired again.
#[test]
fn an_expiry_handled_minutes_late_still_finds_its_first_handling() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let deadline = Utc::now().timestamp_millis() - 120_000;
        ledger::put(&mut redis.conn(), "kw:", "k", deadline);
        let heard = expired("k", None);
        let at = Some(deadline.div_euclid(1000));
        let first = a
            .take(0, &[(&heard, Mode::Live { fire: true, at })])
            .await
            .unwrap();
        let first = first[0].as_ref().expect("the first instance takes it");
        assert_eq!(first.record.deadline_ms, Some(deadline));
        // Late with the deadline in its index, or without (past the window it looks in).
        for at in [at, None] {
            let late = b
                .take(0, &[(&heard, Mode::Live { fire: true, at })])
                .await
                .unwrap();
            assert!(
                late[0].is_none(),
                "the late instance fired it a second time (at: {at:?})"
            );
        }
    });
}

/// A deadline is kept in its second's hash as the milliseconds into that second; the take writes
/// it back whole (the record's, the answer's, the handled memory's) by joining the two as text,
/// not by computing it. Offsets of one, two and three digits, and 0, in a second on time and
/// in one past the window a late instance looks in: each comes back exactly, and the handled
/// memory holds the same text Redis would write for the number.
#[test]
fn a_deadline_taken_live_keeps_its_milliseconds_whatever_their_digits() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let i = intake(&redis, "a").await;
        let now = Utc::now().timestamp_millis();
        let on_time = (now - 2_000).div_euclid(1000) * 1000;
        let late = (now - 70_000).div_euclid(1000) * 1000;
        let mut deadlines = Vec::new();
        for second in [on_time, late] {
            for off in [0, 7, 42, 999] {
                deadlines.push(second + off);
            }
        }
        let events: Vec<KeyEvent> = deadlines
            .iter()
            .map(|d| {
                let key = format!("k:{d}");
                ledger::put(&mut redis.conn(), "kw:", &key, *d);
                expired(&key, None)
            })
            .collect();
        let with: Vec<(&KeyEvent, Mode)> = events
            .iter()
            .zip(&deadlines)
            .map(|(e, d)| {
                let at = Some(d.div_euclid(1000));
                (e, Mode::Live { fire: true, at })
            })
            .collect();
        let taken = i.take(0, &with).await.unwrap();
        let got: Vec<Option<i64>> = taken
            .iter()
            .map(|t| t.as_ref().expect("taken").record.deadline_ms)
            .collect();
        let want: Vec<Option<i64>> = deadlines.iter().map(|d| Some(*d)).collect();
        assert_eq!(got, want);
        let mut c = redis.conn();
        let memory = the_only_key(&mut c, "kw:ledger:0:handled:*");
        for d in &deadlines {
            let held: String = redis::cmd("HGET")
                .arg(&memory)
                .arg(format!("k:{d}"))
                .query(&mut c)
                .unwrap();
            assert_eq!(held, d.to_string());
            assert_eq!(ledger::deadline(&mut c, "kw:", &format!("k:{d}")), None);
        }
    });
}

/// The ledger's index lives in each instance's memory and may miss (an instance just started,
/// another instance's fill recorded the key). An instance that misses claims the expiry without
/// its deadline, or finds it where every instance looks (the last minute's hashes); one that
/// knows the deadline removes it from its hash. Both orders, on time and minutes late: the
/// expiry fires once.
#[test]
fn an_instance_that_misses_a_deadline_and_one_that_knows_it_fire_once() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let now = Utc::now().timestamp_millis();
        for (i, ago) in [5_000, 120_000].into_iter().enumerate() {
            for knows_first in [true, false] {
                let key = format!("k:{i}:{knows_first}");
                let deadline = now - ago;
                ledger::put(&mut redis.conn(), "kw:", &key, deadline);
                let heard = expired(&key, None);
                let knows = Mode::Live {
                    fire: true,
                    at: Some(deadline.div_euclid(1000)),
                };
                let misses = Mode::Live {
                    fire: true,
                    at: None,
                };
                let (first, second) = if knows_first {
                    ((&a, knows), (&b, misses))
                } else {
                    ((&a, misses), (&b, knows))
                };
                let one = first.0.take(0, &[(&heard, first.1)]).await.unwrap();
                let two = second.0.take(0, &[(&heard, second.1)]).await.unwrap();
                let fired = one.iter().chain(&two).filter(|t| t.is_some()).count();
                assert_eq!(
                    fired, 1,
                    "{key}: deadline {ago} ms ago, the instance that knows it first: {knows_first}"
                );
                // Whoever knew it, or found it, removed it.
                assert_eq!(
                    ledger::deadline(&mut redis.conn(), "kw:", &key),
                    None,
                    "{key}: left in the ledger"
                );
            }
        }
    });
}

/// A taken event is recorded until its work is done; one left by an instance (here handed back
/// at shutdown; after a crash, when its lease ends) is taken over by another, with its deadline,
/// and cleared once done.
#[test]
fn a_taken_event_left_behind_is_taken_over_and_cleared() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let e = expired("k\n\u{0}x", Some(Utc::now().timestamp_millis() - 5));
        assert_eq!(take(&a, &[&e], Mode::Plain).await, [true]);
        assert!(
            b.take_over(10).await.unwrap().is_empty(),
            "taken over while leased"
        );
        assert_eq!(a.hand_back().await.unwrap(), 1);
        let over = b.take_over(10).await.unwrap();
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].record.event().key, e.key);
        assert_eq!(over[0].record.event().deadline, e.deadline);
        b.clear(&[over[0].id.clone()]).await.unwrap();
        assert_eq!(b.len().await.unwrap(), 0);
    });
}

/// One batch holding every kind of event the take script knows, some keys twice, taken by one
/// instance and then again by another: the first wins exactly the events it should, with the
/// deadline each should carry, and the second wins none. (A storm's batch is expiries only and
/// takes the script's short path; a mixed batch takes the other.)
#[test]
fn a_mixed_batch_is_won_once_with_each_events_deadline() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    runtime().block_on(async {
        let (a, b) = (intake(&redis, "a").await, intake(&redis, "b").await);
        let now = Utc::now().timestamp_millis();
        let due = now - 5_000;
        let mut conn = redis.conn();
        ledger::put(&mut conn, "kw:", "k:ledger", due);
        ledger::put(&mut conn, "kw:", "k:quiet", due + 1);
        ledger::put(&mut conn, "kw:", "k:later", now + 3_600_000);
        let () = redis::pipe()
            .cmd("ZADD")
            .arg("kw:ledger:0:poked")
            .arg(1)
            .arg("k:poked")
            .ignore()
            .cmd("HSET")
            .arg("kw:ledger:0:poked-deadline")
            .arg("k:poked")
            .arg(due + 2)
            .ignore()
            .query(&mut conn)
            .unwrap();
        let deleted = |key: &str, deadline: Option<i64>| KeyEvent {
            kind: EventKind::Deleted,
            ..expired(key, deadline)
        };
        let warned = expired("k:warned", Some(now + 60_000));
        let events = [
            (
                expired("k:ledger", None),
                Mode::Live {
                    fire: true,
                    at: Some(due.div_euclid(1000)),
                },
            ),
            (
                expired("k:ledger", None),
                Mode::Live {
                    fire: true,
                    at: None,
                },
            ),
            (
                expired("k:quiet", None),
                Mode::Live {
                    fire: false,
                    at: None,
                },
            ),
            (deleted("k:dated", Some(due + 3)), Mode::Plain),
            (deleted("k:undated", None), Mode::Plain),
            (
                expired("k:unknown", None),
                Mode::Live {
                    fire: true,
                    at: None,
                },
            ),
            (expired("k:poked", None), Mode::Recovered { fire: true }),
            (
                warned,
                Mode::Warning {
                    rule: "r".to_string(),
                },
            ),
            (
                expired("k:later", None),
                Mode::Live {
                    fire: true,
                    at: Some((now + 3_600_000).div_euclid(1000)),
                },
            ),
        ];
        let with: Vec<(&KeyEvent, Mode)> = events.iter().map(|(e, m)| (e, m.clone())).collect();
        let first: Vec<Option<Option<i64>>> = a
            .take(0, &with)
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.map(|t| t.record.deadline_ms))
            .collect();
        assert_eq!(
            first,
            [
                Some(Some(due)),
                None,
                None,
                Some(Some(due + 3)),
                Some(None),
                Some(None),
                Some(Some(due + 2)),
                Some(Some(now + 60_000)),
                // Its deadline is an hour away: an older incarnation's `expired`.
                Some(None),
            ]
        );
        let second = b.take(0, &with).await.unwrap();
        assert!(second.iter().all(Option::is_none), "{second:?}");
        let left: Vec<String> = ledger::entries(&mut conn, "kw:").into_keys().collect();
        assert_eq!(left, ["k:later"]);
        let poked: i64 = redis::cmd("ZCARD")
            .arg("kw:ledger:0:poked")
            .query(&mut conn)
            .unwrap();
        assert_eq!(poked, 0);
    });
}
