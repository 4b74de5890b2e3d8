//! Claims against a real redis-server: one winner per event however many instances claim it,
//! and no keyevent published per claim (in a mass expiry that doubled what Redis published).

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::RedisServer;
use keywatch::engine::claims::Claims;
use keywatch::event::{EventKind, KeyEvent};
use keywatch::keyspace::Keyspace;

fn expired(key: &str, deadline_ms: Option<i64>) -> KeyEvent {
    KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: key.as_bytes().to_vec(),
        observed_at: Utc::now(),
        deadline: deadline_ms.and_then(DateTime::from_timestamp_millis),
        ttl_ms: None,
        recovered: false,
        source: "test".into(),
    }
}

async fn claims(redis: &RedisServer) -> Claims {
    let config = common::rules::log_rule_config();
    let keyspace = Keyspace::new(
        keywatch::config::Secret::new(redis.url()),
        config.redis.clone(),
    )
    .unwrap();
    Claims::new(keyspace.conn(0).await.unwrap(), "kw:")
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
        let (a, b) = (claims(&redis).await, claims(&redis).await);
        let now = Utc::now().timestamp_millis();
        // Deadlines spread over three minutes, some without one; "k:0" twice with two deadlines
        // (set again after it expired) is two events.
        let mut events: Vec<KeyEvent> = (0..300)
            .map(|i| expired(&format!("k:{i}"), (i % 7 != 0).then_some(now - i * 600)))
            .collect();
        events.push(expired("k:0", Some(now + 1)));
        let refs: Vec<&KeyEvent> = events.iter().collect();
        let (first, second) = tokio::join!(a.claim(&refs, "a"), b.claim(&refs, "b"));
        for (i, (x, y)) in first.iter().zip(&second).enumerate() {
            assert!(x ^ y, "event {i}: a won {x}, b won {y}");
        }
        // A copy arriving later (a slow instance) loses too.
        let again = a.claim(&refs, "a").await;
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
        let c = claims(&redis).await;
        let now = Utc::now().timestamp_millis();
        let events: Vec<KeyEvent> = (0..1000)
            .map(|i| expired(&format!("k:{i}"), Some(now - 30_000 + i)))
            .collect();
        let won = c.claim(&events.iter().collect::<Vec<_>>(), "a").await;
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
        let c = claims(&redis).await;
        let now = Utc::now().timestamp_millis();
        // A recovery an hour after the deadline: its minute's hash would be long gone by then.
        let won = c.claim(&[&expired("k", Some(now - 3_600_000))], "a").await;
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
        let c = claims(&redis).await;
        let e = expired("k", None);
        assert_eq!(c.claim(&[&e], "a").await, [true]);
        assert_eq!(c.claim(&[&e], "b").await, [false]);
        let mut conn = redis.conn();
        let key = the_only_key(&mut conn, "kw:claim:*");
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    });
}
