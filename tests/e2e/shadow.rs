//! `keywatch run --shadow` (docs/operations.md#rolling-out-beside-existing-code): everything `run`
//! does up to the action, and then a record of what it would have done instead of doing it.
//! Nothing is sent, run, cleaned or removed, and its state lives under its own prefix, so a real
//! keywatch beside it on the same Redis acts exactly as it would alone.

use std::ffi::OsStr;

use serde_json::Value;

use crate::common;

use common::{
    HttpReceiver, KeywatchProcess, Logs, PATIENCE, RedisServer, spawn_keywatch, wait_until,
};

/// A lock's expiry notifies `hook`; an unpaid order's task reloads with its detail (removed once
/// read); a session's expiry cleans up its keys.
fn rules(hook: &HttpReceiver) -> String {
    format!(
        r#"
channels:
  audit: {{ type: webhook, url: "{notify}" }}
rules:
  - name: lock-expired
    match: "lock:{{id}}"
    notify: {{ to: [audit] }}
  - name: close-unpaid
    match: "delay:task:{{id}}"
    detail: {{ hash: "delay:detail", field: "{{{{ id }}}}", remove: true }}
    reload: {{ url: "{reload}", body: "{{{{ detail | tojson }}}}" }}
  - name: session-cleanup
    match: "session:{{sid}}"
    cleanup: {{ delete: ["session:{{{{ sid }}}}:*"] }}
"#,
        notify = hook.url_for("/notify"),
        reload = hook.url_for("/reload"),
    )
}

/// `keywatch run --shadow` on `redis`, once subscribed.
fn shadow(redis: &RedisServer, rules: &std::path::Path) -> KeywatchProcess {
    let url = redis.url();
    let args: Vec<&OsStr> = [
        OsStr::new("--log-format"),
        OsStr::new("json"),
        OsStr::new("run"),
        OsStr::new("--shadow"),
        OsStr::new("-r"),
        rules.as_os_str(),
        OsStr::new("--redis"),
        OsStr::new(&url),
        OsStr::new("--listen"),
        OsStr::new("127.0.0.1:0"),
    ]
    .into();
    let mut kw = spawn_keywatch(args, &[]);
    kw.wait_for_event(common::SUBSCRIBED, "of the shadow subscribed", |_| true);
    kw
}

/// `keywatch history --json` (`--shadow`: the shadow's), by key.
fn history(redis: &RedisServer, rules: &std::path::Path, shadow: bool) -> Vec<Value> {
    let extra: &[&str] = if shadow { &["--shadow"] } else { &[] };
    common::history_json(&redis.url(), rules, extra)
}

/// The `(action, outcome, rendered)` of `key`'s firing in `list`.
fn actions_of(list: &[Value], key: &str) -> Vec<(String, String, String)> {
    list.iter()
        .filter(|r| r["key"] == key)
        .flat_map(|r| r["actions"].as_array().cloned().unwrap_or_default())
        .map(|a| {
            let s = |f: &str| a[f].as_str().unwrap_or_default().to_string();
            (s("action"), s("outcome"), s("rendered"))
        })
        .collect()
}

fn seed(redis: &RedisServer, n: u32) {
    let mut c = redis.conn();
    let () = redis::cmd("HSET")
        .arg("delay:detail")
        .arg(n)
        .arg(format!(r#"{{"order": {n}}}"#))
        .query(&mut c)
        .unwrap();
    let () = redis::cmd("SET")
        .arg(format!("session:{n}:cart"))
        .arg("x")
        .query(&mut c)
        .unwrap();
}

fn exists(redis: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

fn detail_kept(redis: &RedisServer, n: u32) -> bool {
    redis::cmd("HEXISTS")
        .arg("delay:detail")
        .arg(n)
        .query::<i64>(&mut redis.conn())
        .unwrap()
        == 1
}

/// A shadow alone, then beside a real keywatch: it records every event with what its actions
/// would have rendered, and sends, runs, cleans and removes nothing; the real one acts once per
/// event as it would alone.
#[test]
fn a_shadow_records_what_it_would_do_and_a_real_keywatch_beside_it_acts_once() {
    let redis = RedisServer::with_events("Exg");
    let hook = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_rules(dir.path(), "rules.yaml", &rules(&hook));
    let mut shadow_kw = shadow(&redis, &path);

    // The shadow alone.
    seed(&redis, 1);
    common::set_and_expire_now(&mut redis.conn(), &["lock:1", "delay:task:1", "session:1"]);
    wait_until("the shadow recorded the three events", PATIENCE, || {
        let h = history(&redis, &path, true);
        ["lock:1", "delay:task:1", "session:1"]
            .iter()
            .all(|k| actions_of(&h, k).iter().any(|(_, o, _)| o == "shadow"))
    });
    let h = history(&redis, &path, true);
    let lock = actions_of(&h, "lock:1");
    assert_eq!(lock.len(), 1, "{h:#?}");
    assert_eq!(
        (lock[0].0.as_str(), lock[0].1.as_str()),
        ("notify", "shadow")
    );
    assert!(lock[0].2.starts_with("notify audit:"), "{lock:?}");
    let reload = actions_of(&h, "delay:task:1");
    assert!(
        reload[0].2.starts_with("reload POST http://") && reload[0].2.contains(r#""order": 1"#),
        "{reload:?}"
    );
    let cleanup = actions_of(&h, "session:1");
    assert!(cleanup[0].2.contains(r#"session:1:*"#), "{cleanup:?}");
    assert!(hook.requests().is_empty(), "the shadow sent something");
    assert!(detail_kept(&redis, 1), "the shadow removed the detail");
    assert!(exists(&redis, "session:1:cart"), "the shadow cleaned up");
    assert!(
        history(&redis, &path, false).is_empty(),
        "the shadow wrote the real keywatch's history"
    );
    let addr = common::endpoint(&shadow_kw);
    let (_, metrics) = common::get(&addr, "/metrics");
    assert_eq!(
        common::metric(
            &metrics,
            "keywatch_actions_total{rule=\"lock-expired\",action=\"notify\",outcome=\"shadow\"}"
        ),
        1.0,
        "{metrics}"
    );

    // A real keywatch beside it: it acts once on each event; the shadow still only records.
    let mut real = common::run_subscribed(&redis.url(), &path, Logs::Json, &[]);
    seed(&redis, 2);
    common::set_and_expire_now(&mut redis.conn(), &["lock:2", "delay:task:2", "session:2"]);
    let got = hook.wait_for(2, PATIENCE);
    wait_until(
        "the real keywatch cleaned up and removed the detail",
        PATIENCE,
        || !exists(&redis, "session:2:cart") && !detail_kept(&redis, 2),
    );
    wait_until("the shadow recorded the new events", PATIENCE, || {
        let h = history(&redis, &path, true);
        ["lock:2", "delay:task:2", "session:2"]
            .iter()
            .all(|k| actions_of(&h, k).iter().any(|(_, o, _)| o == "shadow"))
    });
    let real_history = history(&redis, &path, false);
    for key in ["lock:2", "delay:task:2", "session:2"] {
        assert_eq!(
            actions_of(&real_history, key)
                .iter()
                .map(|(_, o, _)| o.as_str())
                .collect::<Vec<_>>(),
            ["sent"],
            "{key}: {real_history:#?}"
        );
    }
    assert_eq!(
        got.iter().filter(|r| r.target == "/notify").count(),
        1,
        "lock:2 notified more than once: {got:?}"
    );
    assert_eq!(got.iter().filter(|r| r.target == "/reload").count(), 1);
    // What the shadow saw of the first events stays the shadow's: still unsent, still there.
    assert!(detail_kept(&redis, 1) && exists(&redis, "session:1:cart"));
    real.stop();
    shadow_kw.stop();
    assert_eq!(hook.requests().len(), 2, "something sent after the fact");
}
