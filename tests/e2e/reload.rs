//! Reloading the rules of a running keywatch (docs/reliability.md#guarantees): a change in the files is picked up without
//! a signal, a broken edit leaves the old rules firing, and SIGHUP and `POST /-/reload` reload
//! on demand. Real redis-server, real HTTP receiver, the real binary.

use crate::common;

use common::{
    Daemon, HttpReceiver, PATIENCE, endpoint, field_is, get, metric, post, wait_until, write_rules,
};

fn rules(receiver: &HttpReceiver, rule: &str, pattern: &str, on: &str) -> String {
    format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{}\"\nrules:\n  - name: {rule}\n    match: \"{pattern}\"\n    on: [{on}]\n    notify: {{ to: [hook] }}\n",
        receiver.url_for("/hook")
    )
}

/// The keys the receiver got so far, in order.
fn keys(receiver: &HttpReceiver) -> Vec<String> {
    receiver
        .requests()
        .iter()
        .map(|r| r.json()["key"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn wait_for_key(receiver: &HttpReceiver, key: &str) -> serde_json::Value {
    wait_until(&format!("{key} is delivered"), PATIENCE, || {
        keys(receiver).iter().any(|k| k == key)
    });
    receiver
        .requests()
        .iter()
        .map(|r| r.json())
        .find(|j| j["key"] == key)
        .expect("found above")
}

fn metrics(addr: &str) -> String {
    get(addr, "/metrics").1
}

#[test]
fn edits_are_picked_up_without_a_signal_and_broken_edits_keep_the_old_rules() {
    let receiver = HttpReceiver::start();
    let daemon = Daemon::start(&rules(&receiver, "locks", "lock:{id}", "expired"));
    let addr = endpoint(&daemon.process);
    daemon.expire("lock:1");
    wait_for_key(&receiver, "lock:1");

    // A broken edit: logged with its place, counted, and the old rules keep firing.
    std::fs::write(
        &daemon.rules.path,
        "rules:\n  - name: locks\n    match: \"lock:{id\"\n",
    )
    .unwrap();
    wait_until("the failed reload is counted", PATIENCE, || {
        let m = metrics(&addr);
        metric(&m, "keywatch_reload_failures_total ") >= 1.0
            && metric(&m, "keywatch_config_last_reload_successful ") == 0.0
    });
    let failure = daemon.wait_for_event("reload_failed", "saying why", |_| true);
    let error = failure["error"].as_str().unwrap();
    assert!(
        error.contains("rules.yaml:3:"),
        "the failure names the place: {error}"
    );
    assert!(field_is(&failure, "cause", "a rule file changed"));
    assert!(field_is(&failure, "level", "ERROR"));
    daemon.expire("lock:2");
    wait_for_key(&receiver, "lock:2");

    // A good edit, with no signal: a new rule on a new pattern and a new event (`deleted`, a
    // channel keywatch was not subscribed to), and the old rule gone.
    std::fs::write(
        &daemon.rules.path,
        rules(&receiver, "leases", "lease:{id}", "expired, deleted"),
    )
    .unwrap();
    wait_until("the new rules are in force", PATIENCE, || {
        let m = metrics(&addr);
        metric(&m, "keywatch_config_last_reload_successful ") == 1.0
            && daemon
                .events("reload_applied")
                .iter()
                .any(|e| field_is(e, "cause", "a rule file changed") && e["rules"] == 1)
    });
    daemon.expire("lock:3");
    daemon.expire("lease:1");
    let _: () = redis::cmd("SET")
        .arg("lease:2")
        .arg("v")
        .query(&mut daemon.conn())
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg("lease:2")
        .query(&mut daemon.conn())
        .unwrap();
    let expired = wait_for_key(&receiver, "lease:1");
    assert_eq!(expired["rule"], "leases");
    let deleted = wait_for_key(&receiver, "lease:2");
    assert_eq!(deleted["event"], "deleted");
    assert!(
        !keys(&receiver).contains(&"lock:3".to_string()),
        "the removed rule still fired: {:?}",
        keys(&receiver)
    );
    assert_eq!(metric(&metrics(&addr), "keywatch_rules_loaded "), 1.0);
    daemon.stop();
}

#[test]
fn sighup_and_post_reload_on_demand_and_refuse_what_needs_a_restart() {
    let receiver = HttpReceiver::start();
    let mut daemon = Daemon::start(&rules(&receiver, "locks", "lock:{id}", "expired"));
    let addr = endpoint(&daemon.process);

    // POST /-/reload answers once the outcome is known, like Prometheus's.
    let (status, body) = post(&addr, "/-/reload");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("Rules reloaded (POST /-/reload): 1 rule(s)"),
        "{body}"
    );
    let before = metric(&metrics(&addr), "keywatch_reload_failures_total ");

    // Where keywatch keeps its state cannot change under it: refused, said why, counted.
    let moved = format!(
        "state: {{ prefix: \"other:\" }}\n{}",
        rules(&receiver, "locks", "lock:{id}", "expired")
    );
    write_rules(daemon.rules.dir.path(), "rules.yaml", &moved);
    let (status, body) = post(&addr, "/-/reload");
    assert_eq!(status, 500, "{body}");
    assert!(
        body.contains("`state.prefix`") && body.contains("restart keywatch"),
        "{body}"
    );
    assert!(metric(&metrics(&addr), "keywatch_reload_failures_total ") > before);

    // SIGHUP: a new pattern is in force afterwards.
    write_rules(
        daemon.rules.dir.path(),
        "rules.yaml",
        &rules(&receiver, "leases", "lease:{id}", "expired"),
    );
    daemon.process.sighup();
    daemon.wait_for_event("reload_applied", "of the SIGHUP", |e| {
        field_is(e, "cause", "SIGHUP")
    });
    assert_eq!(
        metric(&metrics(&addr), "keywatch_config_last_reload_successful "),
        1.0
    );
    daemon.expire("lease:7");
    let got = wait_for_key(&receiver, "lease:7");
    assert_eq!(got["rule"], "leases");
    assert!(
        daemon.process.try_status().is_none(),
        "SIGHUP ended keywatch"
    );
    assert!(daemon.events("panicked").is_empty(), "{}", daemon.stderr());
    daemon.stop();
}

#[test]
fn a_reload_that_needs_notification_flags_redis_lacks_is_refused_with_the_fix() {
    let receiver = HttpReceiver::start();
    let daemon = Daemon::start(&rules(&receiver, "locks", "lock:{id}", "expired"));
    let addr = endpoint(&daemon.process);
    // `evicted` needs `e`, which this Redis (Exg) does not publish; `notifications: check`.
    std::fs::write(
        &daemon.rules.path,
        rules(&receiver, "locks", "lock:{id}", "expired, evicted"),
    )
    .unwrap();
    let (status, body) = post(&addr, "/-/reload");
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("notify-keyspace-events"), "{body}");
    // The old rules still fire.
    daemon.expire("lock:9");
    wait_for_key(&receiver, "lock:9");
    daemon.stop();
}
