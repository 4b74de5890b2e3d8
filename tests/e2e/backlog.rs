//! A channel whose backlog outgrows its rate: the waiting notifications merge into digests
//! instead of trickling out for hours, and none is lost.

use crate::common;

use std::time::Duration;

use common::{HttpReceiver, RedisServer};

const KEYS: usize = 200;

fn queued(redis: &RedisServer) -> i64 {
    redis::cmd("ZCARD")
        .arg("keywatch:queue")
        .query(&mut redis.conn())
        .unwrap()
}

/// The events a request stands for: 1 for a single event, `count` for a digest.
fn events_in(body: &serde_json::Value) -> usize {
    match body["count"].as_u64() {
        Some(n) => n as usize,
        None => 1,
    }
}

#[test]
fn a_backlog_beyond_the_rate_merges_into_digests_whose_counts_add_up() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    // 20/min: 200 notifications one by one would take nine minutes.
    let rules = common::lock_rules(dir.path(), &receiver, "    rate: 20/min\n");
    let kw = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    // One deadline for every key, after all are set: the whole backlog is there at once however
    // slowly a loaded machine runs this loop (a trickle would be sent as it comes, token by token).
    let deadline = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 3000;
    for i in 0..KEYS {
        let _: () = redis::cmd("SET")
            .arg(format!("lock:{i}"))
            .arg("w")
            .arg("PXAT")
            .arg(deadline)
            .query(&mut c)
            .unwrap();
    }
    let total = || {
        receiver
            .requests()
            .iter()
            .map(|r| events_in(&r.json()))
            .sum::<usize>()
    };
    common::wait_until(
        "the receiver's messages stand for every expired key",
        Duration::from_secs(90),
        || total() >= KEYS,
    );
    common::wait_until("every job is acknowledged", common::PATIENCE, || {
        queued(&redis) == 0
    });
    // One more key through the same channel and bucket: anything sent twice comes before it.
    common::set_and_expire_now(&mut c, &["lock:sentinel"]);
    let requests = receiver.wait_past(&["lock:sentinel"], Duration::from_secs(30));
    let bodies: Vec<serde_json::Value> = requests.iter().map(|r| r.json()).collect();
    assert_eq!(
        bodies.iter().map(events_in).sum::<usize>(),
        KEYS,
        "counts do not add up to {KEYS}: {bodies:#?}\n{}",
        kw.describe_output()
    );
    let digests: Vec<&serde_json::Value> = bodies.iter().filter(|b| b["count"].is_u64()).collect();
    assert!(
        !digests.is_empty(),
        "no digest among {} requests",
        bodies.len()
    );
    // The burst of 20 and a few more tokens at most: far fewer messages than keys.
    assert!(
        bodies.len() <= 30,
        "{} messages for {KEYS} keys at 20/min",
        bodies.len()
    );
    let mut keys: Vec<String> = Vec::new();
    for b in &bodies {
        match b["events"].as_array() {
            Some(events) => {
                let count = b["count"].as_u64().unwrap() as usize;
                assert_eq!(b["rule"], "lock-expired");
                assert_eq!(
                    events.len() + b["omitted"].as_u64().unwrap() as usize,
                    count
                );
                assert!(events.len() <= 20, "{b}");
                keys.extend(
                    events
                        .iter()
                        .map(|e| e["key"].as_str().unwrap().to_string()),
                );
            }
            None => keys.push(b["key"].as_str().unwrap().to_string()),
        }
    }
    let listed = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), listed, "a key was sent twice: {bodies:#?}");
}
