//! The scanner end to end: `expiring` warnings for keys set before and after start, none for keys
//! due later than `warn_before`, once per key and deadline over many scans and across two
//! instances, again after a renewal only when the new deadline comes near; and `upcoming`.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{
    Daemon, HttpReceiver, KeywatchProcess, Logs, PATIENCE, RedisServer, Rules, run_subscribed,
    set_with_ttl, wait_until,
};

fn rules_yaml(receiver: &HttpReceiver, warn_before: &str) -> String {
    format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
scanner:
  schedule: "@every 1s"
rules:
  - name: lock-held-long
    match: "lock:{{id}}"
    on: [expiring]
    warn_before: {warn_before}
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    )
}

/// Warnings received so far: key → the events (JSON) for it.
fn warnings(receiver: &HttpReceiver) -> BTreeMap<String, Vec<serde_json::Value>> {
    let mut out: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
    for r in receiver.requests() {
        let j = r.json();
        out.entry(j["key"].as_str().unwrap().to_string())
            .or_default()
            .push(j);
    }
    out
}

fn pexpiretime(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME").arg(key).query(conn).unwrap()
}

fn rfc3339_ms(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn ms_of(rfc3339: &serde_json::Value) -> i64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339.as_str().unwrap())
        .unwrap()
        .timestamp_millis()
}

/// The internal event of each scanner run.
const SCAN_DONE: &str = "scan_done";

fn wait_for_scans(daemon: &Daemon, more: usize) {
    let target = daemon.events(SCAN_DONE).len() + more;
    daemon.wait_for_events(SCAN_DONE, target, "more", |_| true);
}

#[test]
fn keys_set_before_and_after_start_are_warned_once_and_far_ones_not_at_all() {
    let receiver = HttpReceiver::start();
    let redis = RedisServer::with_events("Exg");
    let mut c = redis.conn();
    set_with_ttl(&mut c, "lock:before", "w", Duration::from_secs(40));
    set_with_ttl(&mut c, "lock:far", "w", Duration::from_secs(600));
    set_with_ttl(&mut c, "other:near", "w", Duration::from_secs(40));
    let daemon = Daemon::start_with(redis, &rules_yaml(&receiver, "60s"), &[]);
    set_with_ttl(&mut c, "lock:after", "w", Duration::from_secs(40));

    receiver.wait_for(2, PATIENCE);
    // Many scans later, still one warning per key.
    wait_for_scans(&daemon, 4);
    // Each run hands the engine the keys within `warn_before`, and the engine warns each once
    // per deadline: the log counts them as due, not as warnings sent (issue 45).
    for run in daemon.events("scan_done") {
        assert!(run.get("warned").is_none(), "{run}");
        assert!(run["due"].is_u64(), "{run}");
    }
    let got = warnings(&receiver);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        ["lock:after", "lock:before"],
        "{got:#?}"
    );
    for (key, events) in &got {
        assert_eq!(events.len(), 1, "{key} warned more than once: {events:#?}");
        let e = &events[0];
        assert_eq!(e["event"], "expiring", "{e}");
        assert_eq!(e["rule"], "lock-held-long", "{e}");
        assert_eq!(e["captures"]["id"], key.trim_start_matches("lock:"), "{e}");
        assert_eq!(e["deadline"], rfc3339_ms(pexpiretime(&mut c, key)), "{e}");
        let ttl = e["ttl_ms"].as_i64().expect("ttl_ms is known");
        assert!(ttl > 0 && ttl <= 40_000, "{e}");
    }
    daemon.stop();
}

#[test]
fn a_renewed_key_is_warned_again_only_near_its_new_deadline() {
    let receiver = HttpReceiver::start();
    let daemon = Daemon::start_with(
        RedisServer::with_events("Exg"),
        &rules_yaml(&receiver, "3s"),
        &[],
    );
    let mut c = daemon.conn();
    set_with_ttl(&mut c, "lock:r", "w", Duration::from_millis(2800));
    let first = receiver.wait_for(1, PATIENCE)[0].json();
    let d1 = ms_of(&first["deadline"]);

    // Renewed: due in 8 s, so not within `warn_before` (3 s) for about 5 s.
    let () = redis::cmd("PEXPIRE")
        .arg("lock:r")
        .arg(8000)
        .query(&mut c)
        .unwrap();
    let d2 = pexpiretime(&mut c, "lock:r");
    assert!(d2 > d1);
    wait_for_scans(&daemon, 2);
    assert_eq!(receiver.count(), 1, "warned again too early");

    let second = receiver.wait_for(2, PATIENCE)[1].json();
    assert_eq!(ms_of(&second["deadline"]), d2, "{second}");
    assert!(
        ms_of(&second["observed_at"]) >= d2 - 3000,
        "warned before the new deadline was within warn_before: {second}"
    );
    assert_ne!(first["id"], second["id"]);
    // And not a third time for the same deadline.
    wait_for_scans(&daemon, 2);
    assert_eq!(receiver.count(), 2, "{:#?}", warnings(&receiver));
    daemon.stop();
}

#[test]
fn two_instances_warn_once() {
    let receiver = HttpReceiver::start();
    let redis = RedisServer::with_events("Exg");
    let rules = Rules::new(&rules_yaml(&receiver, "60s"));
    let mut c = redis.conn();
    for i in 0..10 {
        set_with_ttl(&mut c, format!("lock:a{i}"), "w", Duration::from_secs(30));
    }
    let mut one = run_subscribed(&redis.url(), &rules.path, Logs::Json, &[]);
    let mut two = run_subscribed(&redis.url(), &rules.path, Logs::Json, &[]);
    for i in 0..10 {
        set_with_ttl(&mut c, format!("lock:b{i}"), "w", Duration::from_secs(30));
    }
    receiver.wait_for(20, PATIENCE);
    // Several scans since, between them (each instant is run by one of them).
    let done = |p: &KeywatchProcess| p.events(SCAN_DONE).len();
    let before = done(&one) + done(&two);
    wait_until("the instances ran more scans", PATIENCE, || {
        done(&one) + done(&two) >= before + 5
    });
    let got = warnings(&receiver);
    assert_eq!(got.len(), 20, "{got:#?}");
    for (key, events) in &got {
        assert_eq!(events.len(), 1, "{key} warned {} times", events.len());
    }
    one.sigterm();
    two.sigterm();
    assert!(one.wait_timeout(PATIENCE).is_some_and(|s| s.success()));
    assert!(two.wait_timeout(PATIENCE).is_some_and(|s| s.success()));
}

const UPCOMING_RULES: &str = r#"
channels:
  log: { type: log }
rules:
  - name: lock-expired
    match: "lock:{id}"
    notify: { to: [log] }
  - name: lock-held-long
    match: "lock:{id}"
    on: [expiring]
    warn_before: 1m
    notify: { to: [log] }
"#;

fn upcoming(redis: &RedisServer, rules: &Rules, extra: &[&str]) -> std::process::Output {
    let url = redis.url();
    let mut args = vec!["upcoming", "--redis", url.as_str()];
    args.extend_from_slice(extra);
    let out = rules.run(&args, &[]);
    assert!(
        out.status.success(),
        "upcoming failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn set_upcoming_keys(redis: &RedisServer) {
    let mut c = redis.conn();
    set_with_ttl(&mut c, "lock:1", "w", Duration::from_secs(500));
    set_with_ttl(&mut c, "lock:2", "w", Duration::from_secs(100));
    set_with_ttl(&mut c, "lock:3", "w", Duration::from_secs(300));
    set_with_ttl(&mut c, "lock:far", "w", Duration::from_secs(7200));
    set_with_ttl(&mut c, "other:x", "w", Duration::from_secs(200));
    // keywatch's own keys are never listed, even when a pattern matches them.
    set_with_ttl(&mut c, "keywatch:lock:9", "w", Duration::from_secs(50));
    let () = redis::cmd("SET")
        .arg("lock:forever")
        .arg("w")
        .query(&mut c)
        .unwrap();
}

fn assert_upcoming(redis: &RedisServer, rules: &Rules) {
    let mut c = redis.conn();
    let rows = json_lines(&upcoming(redis, rules, &["--within", "1h", "--json"]));
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["lock:2", "lock:3", "lock:1"], "{rows:#?}");
    for r in &rows {
        let key = r["key"].as_str().unwrap();
        assert_eq!(r["db"], 0);
        assert_eq!(
            r["rules"],
            serde_json::json!(["lock-expired", "lock-held-long"])
        );
        assert_eq!(r["deadline"], rfc3339_ms(pexpiretime(&mut c, key)), "{r}");
        let ttl = r["ttl_ms"].as_i64().unwrap();
        assert!(ttl > 0 && ttl <= 500_000, "{r}");
        assert_eq!(
            r.as_object().unwrap().keys().collect::<Vec<_>>(),
            ["db", "deadline", "key", "rules", "ttl_ms"]
        );
    }
    let rows = json_lines(&upcoming(redis, rules, &["--within", "4m", "--json"]));
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["lock:2"]);
}

#[test]
fn upcoming_lists_soonest_first_by_scan() {
    let redis = RedisServer::with_events("Exg");
    set_upcoming_keys(&redis);
    let rules = Rules::new(UPCOMING_RULES);
    assert_upcoming(&redis, &rules);

    // Another pattern: keys no rule matches, listed with no rules.
    let rows = json_lines(&upcoming(
        &redis,
        &rules,
        &["--match", "other:{x}", "--json"],
    ));
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0]["key"], "other:x");
    assert_eq!(rows[0]["rules"], serde_json::json!([]));
    let rows = json_lines(&upcoming(&redis, &rules, &["--match", "*lock:*", "--json"]));
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(
        keys,
        ["lock:2", "lock:3", "lock:1"],
        "own keys are never listed"
    );

    // A table for people.
    let out = upcoming(&redis, &rules, &[]);
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("TTL "), "{text}");
    assert!(lines[0].ends_with("RULES"), "{text}");
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[1].contains("lock:2") && lines[1].contains("lock-expired,lock-held-long"));
}

#[test]
fn upcoming_reads_the_ledger_when_keywatch_keeps_one() {
    let redis = RedisServer::with_events("Exg");
    set_upcoming_keys(&redis);
    let daemon = Daemon::start_with(redis, UPCOMING_RULES, &[]);
    wait_until("the ledger knows the deadlines", PATIENCE, || {
        common::ledger::len(&mut daemon.conn(), "keywatch:") == 4
    });
    assert_upcoming(&daemon.redis, &daemon.rules);
    let out = upcoming(&daemon.redis, &daemon.rules, &["--log-level", "debug"]);
    let logs = String::from_utf8_lossy(&out.stderr);
    let read = common::daemon::internal_events(&logs, "deadlines_read");
    assert!(
        !read.is_empty() && read.iter().all(|e| e["from"] == "ledger"),
        "{logs}"
    );
    daemon.stop();
}
