//! Hostile key text and hostile answers, end to end: the real binary on a real `redis-server`,
//! keys written by an attacker, and local HTTP receivers that check the exact bytes that arrive
//! (the raw request path, the body's size) or answer like a hostile service (echoing a
//! credential, redirecting elsewhere).
//!
//! Each test has its own Redis, receivers and daemon, so the tests run in parallel.

mod common;

use common::daemon::Logs;
use common::{Daemon, HttpReceiver, PATIENCE, RedisServer, Rules, field_is, run_keywatch};
use serde_json::Value;

/// `keywatch ARGS -r RULES` (and `--redis` when given): exit code and stdout + stderr.
fn cli(rules: &Rules, redis: Option<&RedisServer>, args: &[&str]) -> (i32, String, String) {
    let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    all.extend(["-r".into(), rules.arg()]);
    if let Some(r) = redis {
        all.extend(["--redis".into(), r.url()]);
    }
    let out = run_keywatch(all, &[]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The JSON log line of the attempt on `key` that ended with `outcome`.
fn attempt_on(daemon: &Daemon, key: &str, outcome: &str) -> Value {
    daemon.wait_for_log(&format!("of outcome {outcome} for {key:?}"), |l| {
        field_is(l, "key", key) && field_is(l, "outcome", outcome)
    })
}

// ---------------------------------------------------------------------------------------------
// A capture in a reload URL's path

const RELOAD_RULES: &str = r#"
rules:
  - name: cache-reload
    match: "cache:{user_id}:{kind}"
    reload: { url: "@RECEIVER@/reload/{{ kind }}/{{ user_id }}" }
"#;

/// SPEC §2: key text never widens an action. `cache:flushall:..` made keywatch POST to
/// `/flushall`: a capture that would make a whole path segment `.` or `..` is refused (the URL
/// standard resolves dot segments however they are spelled, `%2E%2E` included, so no spelling
/// reaches the receiver as written), and every other capture arrives percent-encoded inside
/// its own segment, as the receiver reads the raw request line.
#[test]
fn a_capture_cannot_climb_out_of_a_reload_path() {
    let receiver = HttpReceiver::start();
    let redis = RedisServer::with_events("Exg");
    let rules = Rules::new(&RELOAD_RULES.replace("@RECEIVER@", &receiver.url()));
    let daemon = Daemon::launch(redis, rules, Logs::Json, &[]);

    let hostile = [
        "cache:flushall:..",
        "cache:..:..",
        "cache:x:.",
        "cache:..:%2E",
    ];
    let fine = [
        ("cache:a/b:x", "/reload/x/a%2Fb"),
        ("cache:u1:...", "/reload/.../u1"),
        ("cache:%2e%2e:k", "/reload/k/%252e%252e"),
        ("cache:..\\x:k", "/reload/k/..%5Cx"),
        ("cache:u7:ok", "/reload/ok/u7"),
    ];
    let mut keys: Vec<&str> = hostile.to_vec();
    keys.extend(fine.iter().map(|(k, _)| *k));
    daemon.expire_all(&keys);

    for key in hostile {
        let line = attempt_on(&daemon, key, "failed");
        let reason = line["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("segment") && reason.contains("not sent"),
            "{key}: {line}"
        );
    }
    let requests = receiver.wait_for(fine.len(), PATIENCE);
    let mut paths: Vec<String> = requests.iter().map(|r| r.target.clone()).collect();
    paths.sort();
    let mut want: Vec<String> = fine.iter().map(|(_, p)| p.to_string()).collect();
    want.sort();
    assert_eq!(paths, want, "the raw paths the receiver saw");

    // `explain` shows the URL exactly as it is requested, or says it is never sent.
    let (code, out, err) = cli(&daemon.rules, None, &["explain", "cache:a/b:x"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("{}/reload/x/a%2Fb", receiver.url())),
        "{out}"
    );
    let (code, out, err) = cli(&daemon.rules, None, &["explain", "cache:flushall:.."]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("never sent"), "{out}");
    assert!(!out.contains("/reload/../flushall"), "{out}");
    daemon.stop();
}
