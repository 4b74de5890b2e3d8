//! Several keywatch instances on one Redis: every event fires once, not once per instance.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{HttpReceiver, Keywatch, KeywatchProcess, RedisServer, write_rules};

fn start(redis: &RedisServer, rules: &std::path::Path) -> KeywatchProcess {
    let mut kw = Keywatch::spawn(
        [
            "run",
            "-r",
            rules.to_str().unwrap(),
            "--redis",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    kw.wait_for_output("Subscribed to keyspace events.", Duration::from_secs(20));
    kw
}

#[test]
fn three_instances_fire_each_event_once() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: lock-expired
    match: "lock:{{id}}"
    notify: {{ to: [hook] }}
  - name: job-deleted
    match: "job:{{id}}"
    on: [deleted]
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    );
    let rules = write_rules(dir.path(), "rules.yaml", &yaml);
    let _a = start(&redis, &rules);
    let _b = start(&redis, &rules);
    let _c = start(&redis, &rules);
    let mut c = redis.conn();
    for i in 0..30 {
        let _: () = redis::cmd("SET")
            .arg(format!("lock:{i}"))
            .arg("w")
            .arg("PX")
            .arg(700 + i * 20)
            .query(&mut c)
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg(format!("job:{i}"))
            .arg("w")
            .query(&mut c)
            .unwrap();
    }
    for i in 0..30 {
        let _: i64 = redis::cmd("DEL")
            .arg(format!("job:{i}"))
            .query(&mut c)
            .unwrap();
    }
    receiver.wait_for(60, Duration::from_secs(30));
    // Time for any duplicate to arrive.
    std::thread::sleep(Duration::from_millis(2000));
    let mut seen: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in receiver.requests() {
        let j = r.json();
        *seen
            .entry((
                j["event"].as_str().unwrap().to_string(),
                j["key"].as_str().unwrap().to_string(),
            ))
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 60, "{seen:?}");
    let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "fired more than once: {doubled:?}");
}
