//! keywatch under exactly the least-privilege user docs/redis.md documents: an expiry reaches a
//! webhook with the deadline the ledger learnt, a cleanup deletes and `HDEL`s, and Redis refused
//! nothing (`ACL LOG` stays empty).

use crate::common;

use common::{
    HttpReceiver, Logs, PATIENCE, RedisServer, field_is, run_subscribed, set_px, wait_until,
    write_rules,
};

const PASSWORD: &str = "kw-Acl-pass";

/// `ACL LOG` entries, but for redis-rs naming its connections (`CLIENT SETINFO`, Redis ≥ 7.2):
/// it ignores a refusal, and Redis 7.0 cannot even grant it (docs/redis.md says so).
fn acl_refusals(redis: &RedisServer) -> Vec<String> {
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut redis.conn())
        .expect("ACL LOG");
    log.iter()
        .map(|e| format!("{e:?}"))
        .filter(|e| !e.contains("setinfo"))
        .collect()
}

/// Redis refused nothing of `kw`'s, up to its exit: `ACL LOG` is empty, and keywatch counted no
/// read or write of its state that failed.
fn stop_having_refused_nothing(redis: &RedisServer, mut kw: common::KeywatchProcess) {
    let addr = common::endpoint(&kw);
    let (_, metrics) = common::get(&addr, "/metrics");
    assert_eq!(
        common::metric(&metrics, "keywatch_state_errors_total"),
        0.0,
        "{metrics}\n{}",
        kw.describe_output()
    );
    kw.stop();
    let refusals = acl_refusals(redis);
    assert!(
        refusals.is_empty(),
        "Redis refused commands of the documented user: {refusals:?}\n{}",
        kw.describe_output()
    );
}

/// Runs the `ACL SETUSER` lines of docs/redis.md on `redis`; returns the user's URL.
fn documented_user(redis: &RedisServer) -> String {
    let mut conn = redis.conn();
    for line in common::documented_acl_lines() {
        let words: Vec<String> = line
            .split_whitespace()
            .map(|w| w.replace("PASSWORD", PASSWORD))
            .collect();
        let mut cmd = redis::cmd(&words[0]);
        for w in &words[1..] {
            cmd.arg(w);
        }
        let () = cmd
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    format!("redis://keywatch:{PASSWORD}@{}", redis.addr())
}

#[test]
fn keywatch_runs_under_exactly_the_documented_user() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let mut conn = redis.conn();
    let url = documented_user(&redis);
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(
        dir.path(),
        "rules.yaml",
        &format!(
            r#"
channels:
  hook: {{ type: webhook, url: "{}", rate: 100/s }}
rules:
  - name: order-lock
    match: "order_lock:{{id}}"
    notify: {{ to: [hook] }}
  - name: session-cleanup
    match: "session:{{sid}}"
    cleanup:
      delete: ["session:{{{{ sid }}}}:*", "cart:{{{{ sid }}}}"]
      hdel: [{{ key: "online_users", field: "{{{{ sid }}}}" }}]
"#,
            receiver.url_for("/hook")
        ),
    );
    let kw = run_subscribed(&url, &rules, Logs::Text, &[]);

    // The ledger learns the deadline from the `expire` event, then the expiry is delivered.
    set_px(&mut conn, "order_lock:42", 3000);
    wait_until("the ledger knows order_lock:42", PATIENCE, || {
        common::ledger::deadline(&mut conn, "keywatch:", "order_lock:42").is_some()
    });
    let got = receiver.wait_for(1, PATIENCE);
    let event = got[0].json();
    assert_eq!(event["key"], "order_lock:42", "{event}");
    assert_eq!(event["recovered"], false, "{event}");
    assert!(event["deadline"].is_string(), "no deadline: {event}");

    // The cleanup deletes exactly its keys and field, through the documented cleanup line.
    for k in ["session:7:a", "session:7:b", "cart:7", "cart:8"] {
        let () = redis::cmd("SET").arg(k).arg("v").query(&mut conn).unwrap();
    }
    let () = redis::cmd("HSET")
        .arg("online_users")
        .arg("7")
        .arg("1")
        .arg("8")
        .arg("1")
        .query(&mut conn)
        .unwrap();
    set_px(&mut conn, "session:7", 300);
    wait_until("the cleanup of session 7 ran", PATIENCE, || {
        let left: i64 = redis::cmd("EXISTS")
            .arg("session:7:a")
            .arg("session:7:b")
            .arg("cart:7")
            .query(&mut conn)
            .unwrap();
        let field: bool = redis::cmd("HEXISTS")
            .arg("online_users")
            .arg("7")
            .query(&mut conn)
            .unwrap();
        left == 0 && !field
    });
    let kept: i64 = redis::cmd("EXISTS").arg("cart:8").query(&mut conn).unwrap();
    assert_eq!(kept, 1, "cart:8 was deleted");

    stop_having_refused_nothing(&redis, kw);
}

/// A reload that stops watching a database leaves its channels (`UNSUBSCRIBE`) on the same
/// session: the documented user may, so the subscriber is not cut off and nothing published in
/// the meantime is lost.
#[test]
fn a_reload_that_drops_a_database_unsubscribes_without_a_reconnect() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let url = documented_user(&redis);
    // docs/redis.md: "`+select` only when `redis.databases` lists databases other than 0".
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "keywatch", "+select"][..])
        .query(&mut redis.conn())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules_for = |databases: &str| {
        format!(
            "redis: {{ databases: {databases} }}\nchannels:\n  console: {{ type: log }}\nrules:\n  - name: lock\n    match: \"lock:{{id}}\"\n    notify: {{ to: [console] }}\n"
        )
    };
    let rules = write_rules(dir.path(), "rules.yaml", &rules_for("[0, 1]"));
    let mut kw = run_subscribed(&url, &rules, Logs::Text, &[]);
    write_rules(dir.path(), "rules.yaml", &rules_for("[0]"));
    kw.sighup();
    let changed = kw.wait_for_event("subscriptions_changed", "of the reload", |_| true);
    let before = &kw.events(common::SUBSCRIBED)[0];
    let channels = |e: &serde_json::Value| common::field_u64(e, "channels").unwrap();
    assert!(
        channels(&changed) < channels(before),
        "database 1's channels left: {before} → {changed}"
    );
    let refusals = acl_refusals(&redis);
    assert!(
        refusals.is_empty(),
        "Redis refused: {refusals:?}\n{}",
        kw.describe_output()
    );
    // On the same connection: no subscription lost and made again.
    let (_, metrics) = common::get(&common::endpoint(&kw), "/metrics");
    assert_eq!(
        common::metric(&metrics, "keywatch_reconnects_total"),
        0.0,
        "{}",
        kw.describe_output()
    );
    assert_eq!(kw.events(common::SUBSCRIBED).len(), 1);
    stop_having_refused_nothing(&redis, kw);
}

/// Watching databases 0 and 1 as the documented user without `+select` (docs/redis.md says it is
/// needed for other databases): `run` stays not ready, and `/readyz` and the log name the missing
/// grant and the `ACL SETUSER` that adds it; once granted, it becomes ready without a restart.
/// Before, it became ready and only warned at every scan: db 1's deadlines were never learnt.
#[test]
fn a_missing_grant_keeps_run_not_ready_naming_it_until_it_is_granted() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let url = documented_user(&redis);
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(
        dir.path(),
        "rules.yaml",
        "redis: { databases: [0, 1] }\nchannels:\n  console: { type: log }\nrules:\n  - name: lock\n    match: \"lock:{id}\"\n    notify: { to: [console] }\n",
    );
    let mut kw = common::spawn_run(&url, &rules, Logs::Text, &[]);
    let addr = common::wait_for_endpoint(&mut kw);
    let missing = kw.wait_for_event("grants_missing", "of `+select`", |_| true);
    assert!(field_is(&missing, "missing", "+select"), "{missing}");
    assert!(
        missing["fix"]
            .as_str()
            .is_some_and(|f| f.contains("ACL SETUSER keywatch +select")),
        "{missing}"
    );
    kw.wait_for_event(common::SUBSCRIBED, "of the subscriber in place", |_| true);
    let (status, body) = common::endpoint::get(&addr, "/readyz");
    assert_eq!(status, 503, "{body}\n{}", kw.describe_output());
    assert!(body.contains("+select"), "{body}");
    // Still not ready a moment later: the check is not a one-off.
    assert_eq!(common::endpoint::get(&addr, "/readyz").0, 503);

    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "keywatch", "+select"][..])
        .query(&mut redis.conn())
        .unwrap();
    wait_until("keywatch is ready once granted", PATIENCE, || {
        common::endpoint::get(&addr, "/readyz").0 == 200
    });
    let complete = kw.wait_for_event("grants_complete", "once granted", |_| true);
    assert!(field_is(&complete, "user", "keywatch"), "{complete}");
    kw.stop();
}
