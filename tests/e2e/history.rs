//! History end to end: every firing and its actions' outcomes recorded in Redis, read back by
//! `keywatch history` (with its filters), `GET /api/history` and the status page after the
//! instance that did the work has stopped.

use crate::common;

use common::{
    Daemon, HttpReceiver, PATIENCE, RedisServer, Response, endpoint, field_is, get, run_keywatch,
    run_on, wait_until,
};
use serde_json::Value;

fn history(daemon: &Daemon, extra: &[&str]) -> Vec<Value> {
    common::history_json(&daemon.redis.url(), &daemon.rules.path, extra)
}

fn keys(list: &[Value]) -> Vec<&str> {
    list.iter().map(|r| r["key"].as_str().unwrap()).collect()
}

#[test]
fn history_lists_every_firing_with_its_outcomes_after_a_restart() {
    let good = HttpReceiver::start();
    let gone = HttpReceiver::with_default(Response::status(404).body("no such hook"));
    let yaml = format!(
        r#"
history: {{ keep: 1d }}
channels:
  audit:
    type: webhook
    url: "{good}"
  retired:
    type: webhook
    url: "{gone}"
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify: {{ to: [audit, retired] }}
  - name: session-cleanup
    match: "session:{{sid}}"
    notify: {{ to: [audit] }}
"#,
        good = good.url_for("/hook"),
        gone = gone.url_for("/old-hook"),
    );
    let mut daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &[]);
    daemon.expire_all(&["order_lock:1", "order_lock:2", "session:abc"]);
    good.wait_for(3, PATIENCE);
    gone.wait_for(2, PATIENCE);
    daemon.wait_for_events(common::DEAD_LETTERED, 2, "of both 404s", |e| {
        field_is(e, "channel", "retired")
    });
    daemon.process.stop();

    // Read with the instance gone: it is all in Redis.
    let all = history(&daemon, &[]);
    let mut ks = keys(&all);
    ks.sort();
    assert_eq!(
        ks,
        ["order_lock:1", "order_lock:2", "session:abc"],
        "{all:#?}"
    );
    let lock = all.iter().find(|r| r["key"] == "order_lock:1").unwrap();
    assert_eq!(lock["rule"], "order-lock-timeout");
    assert_eq!(lock["event"], "expired");
    assert_eq!(lock["captures"]["order_id"], "1");
    assert_eq!(lock["id"].as_str().unwrap().len(), 32);
    let actions = lock["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{lock:#}");
    assert_eq!(actions[0]["action"], "notify");
    assert_eq!(actions[0]["channel"], "audit");
    assert_eq!(actions[0]["outcome"], "sent");
    assert_eq!(actions[0]["attempts"], 1);
    assert_eq!(actions[0]["last_error"], Value::Null);
    assert_eq!(actions[1]["channel"], "retired");
    assert_eq!(actions[1]["outcome"], "dead");
    assert_eq!(actions[1]["attempts"], 1);
    let error = actions[1]["last_error"].as_str().unwrap();
    assert!(error.contains("404"), "{error}");
    assert!(actions[1]["at"].as_str().unwrap().ends_with('Z'));
    // Newest first.
    let observed: Vec<&str> = all
        .iter()
        .map(|r| r["observed_at"].as_str().unwrap())
        .collect();
    let mut sorted = observed.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(observed, sorted);

    // The filters.
    assert_eq!(
        keys(&history(&daemon, &["--rule", "session-cleanup"])),
        ["session:abc"]
    );
    let mut locks = keys(&history(&daemon, &["--key", "order_lock:*"])).len();
    assert_eq!(locks, 2);
    locks = history(&daemon, &["--key", "order_lock:{id}", "--limit", "1"]).len();
    assert_eq!(locks, 1);
    assert_eq!(history(&daemon, &["--since", "1h"]).len(), 3);
    assert!(history(&daemon, &["--rule", "nope"]).is_empty());

    // The table for people.
    let url = daemon.redis.url();
    let rules = daemon.rules.path.to_string_lossy().into_owned();
    let out = run_keywatch(["history", "--redis", &url, "-r", &rules], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("order_lock:2"), "{text}");
    assert!(text.contains("notify:retired"), "{text}");

    // A new instance serves the same history on /api/history and its status page.
    let restarted = run_on(&daemon.redis, &daemon.rules.path);
    let addr = endpoint(&restarted);
    let (status, body) = get(&addr, "/api/history?rule=order-lock-timeout&since=1h");
    assert_eq!(status, 200, "{body}");
    let api: Vec<Value> = serde_json::from_str(&body).unwrap();
    let mut ks = keys(&api);
    ks.sort();
    assert_eq!(ks, ["order_lock:1", "order_lock:2"]);
    assert_eq!(api[0]["actions"].as_array().unwrap().len(), 2);
    let (status, body) = get(&addr, "/api/history?since=soon");
    assert_eq!(status, 400, "{body}");
    wait_until("the status page lists the firings", PATIENCE, || {
        let (_, page) = get(&addr, "/");
        page.contains("session:abc") && page.contains("notify:retired: dead")
    });
}

#[test]
fn history_is_bounded_by_keep() {
    let (good, daemon) = notifying_daemon("history: { keep: 1s }");
    daemon.expire("k:1");
    good.wait_for(1, PATIENCE);
    wait_until("the firing is recorded", PATIENCE, || {
        history(&daemon, &[]).len() == 1
    });
    // Each firing's hash expires with `keep`, and the next firing trims the index.
    wait_until("the firing's record expires", PATIENCE, || {
        history(&daemon, &[]).is_empty()
    });
    daemon.expire("k:2");
    good.wait_for(2, PATIENCE);
    wait_until("only the new firing is indexed", PATIENCE, || {
        let n: usize = redis::cmd("ZCARD")
            .arg("keywatch:history")
            .query(&mut daemon.conn())
            .unwrap();
        n == 1 && history(&daemon, &[]).len() == 1
    });
}

/// keywatch with one rule notifying a local receiver of every expired `k:…`, `head` in front
/// of its rules.
fn notifying_daemon(head: &str) -> (HttpReceiver, Daemon) {
    let good = HttpReceiver::start();
    let yaml = format!(
        r#"
{head}
channels:
  audit: {{ type: webhook, url: "{good}" }}
rules:
  - name: r
    match: "k:{{id}}"
    notify: {{ to: [audit] }}
"#,
        good = good.url_for("/hook"),
    );
    let daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &[]);
    (good, daemon)
}

#[test]
fn a_storm_is_kept_in_one_hash_per_minute_not_a_key_per_firing() {
    let (good, daemon) = notifying_daemon("");
    let mut conn = daemon.conn();
    let mut p = redis::pipe();
    for i in 0..300 {
        p.cmd("SET")
            .arg(format!("k:{i}"))
            .arg(1)
            .arg("PX")
            .arg(50)
            .ignore();
    }
    let _: () = p.query(&mut conn).unwrap();
    good.wait_for(300, PATIENCE);
    wait_until("every firing is listed as sent", PATIENCE, || {
        let list = history(&daemon, &["--limit", "1000"]);
        list.len() == 300
            && list.iter().all(|r| {
                r["actions"].as_array().unwrap().len() == 1 && r["actions"][0]["outcome"] == "sent"
            })
    });
    let hashes: Vec<String> = redis::cmd("KEYS")
        .arg("keywatch:history:*")
        .query(&mut conn)
        .unwrap();
    assert!(
        !hashes.is_empty()
            && hashes.len() <= 2
            && hashes.iter().all(|h| h.starts_with("keywatch:history:@")),
        "{hashes:?}"
    );
    // Each minute's hash lasts `keep` (default 7 days) after its latest firing.
    for h in &hashes {
        let ttl: i64 = redis::cmd("PTTL").arg(h).query(&mut conn).unwrap();
        assert!(ttl > 6 * 86_400_000 && ttl <= 7 * 86_400_000, "{h}: {ttl}");
    }
}

/// An instance killed right after it stored an event's jobs (`KEYWATCH_DRILL_CRASH_AT=stored`):
/// another instance runs them, and history shows the firing with their outcome. The firing's
/// record is kept by the transaction that stores its jobs; before, it went to history through a
/// writer that batches for 20 ms, the kill lost it, and the outcome the next instance recorded
/// belonged to no firing history could show (what made an Alertmanager test flaky: history
/// empty after a kill).
#[test]
fn a_firing_whose_instance_died_right_after_storing_its_jobs_is_in_history() {
    let hook = HttpReceiver::start();
    let yaml = format!(
        "channels:\n  audit: {{ type: webhook, url: \"{}\" }}\nrules:\n  - name: order-lock-timeout\n    match: \"order_lock:{{order_id}}\"\n    notify: {{ to: [audit] }}\n",
        hook.url_for("/hook")
    );
    // A short lease: what the killed instance leaves is taken over soon.
    let envs = [("KEYWATCH_LEASE", "2s")];
    let mut crashing = envs.to_vec();
    crashing.push(("KEYWATCH_DRILL_CRASH_AT", "stored"));
    let mut daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &crashing);
    daemon.expire("order_lock:7");
    let killed = daemon.process.wait_timeout(PATIENCE);
    assert!(
        killed.is_some_and(|s| !s.success()),
        "the drill did not kill keywatch at `stored`\n{}",
        daemon.process.describe_output()
    );
    daemon.process = common::run_subscribed(
        &daemon.redis.auth_url(),
        &daemon.rules.path,
        common::Logs::Json,
        &envs,
    );
    hook.wait_for(1, PATIENCE);
    let mut listed = Vec::new();
    wait_until("history shows the firing sent", PATIENCE, || {
        listed = history(&daemon, &[]);
        listed.len() == 1 && listed[0]["actions"][0]["outcome"] == "sent"
    });
    assert_eq!(keys(&listed), ["order_lock:7"], "{listed:#?}");
}
