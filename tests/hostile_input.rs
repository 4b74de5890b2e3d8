//! Hostile key text and hostile answers, end to end: the real binary on a real `redis-server`,
//! keys written by an attacker, and local HTTP receivers that check the exact bytes that arrive
//! (the raw request path, the body's size) or answer like a hostile service (echoing a
//! credential, redirecting elsewhere).
//!
//! Each test has its own Redis, receivers and daemon, so the tests run in parallel.

mod common;

use common::daemon::Logs;
use common::{
    Daemon, HttpReceiver, PATIENCE, RedisServer, Response, Rules, field_is, run_keywatch,
};
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

// ---------------------------------------------------------------------------------------------
// Secrets in answers, and redirects

/// The `GET /api/history` body of `daemon`'s endpoint.
fn api_history(daemon: &Daemon) -> String {
    let (status, body) = common::get(&common::endpoint(&daemon.process), "/api/history");
    assert_eq!(status, 200, "{body}");
    body
}

/// An answer that echoes a credential is masked before it is cut: a token straddling the
/// 300-byte edge left its first bytes in the log, history, `/api/history` and `dead list`; a
/// 400 echoing `Authorization: Basic …` showed the base64 of the URL's `user:password`.
#[test]
fn a_secret_echoed_in_an_answer_never_shows_even_cut() {
    use base64::Engine;
    let token = "tk9Zq-Secret-0123456789abcdef";
    let password = "pa55-W0rd-xyz\"q";
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("svc-user:{password}"));
    let hook = HttpReceiver::with_default(
        // 294 bytes, then the token across byte 300 of the answer.
        Response::status(400).body(format!("{} token={token} rest", "e".repeat(287))),
    );
    let basic_hook = HttpReceiver::start();
    basic_hook.set_handler(|r| {
        let auth = r.header("authorization").unwrap_or("none").to_string();
        Some(Response::status(401).body(format!(
            "{{\"error\":\"bad credentials\",\"got\":\"{auth}\",\"url\":\"{}\"}}",
            r.target
        )))
    });
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}/hook?token=${{HOOK_TOKEN}}"
  basic:
    type: webhook
    url: "http://svc-user:{}@127.0.0.1:{}/basic"
rules:
  - name: echo
    match: "echo:{{id}}"
    notify: {{ to: [hook, basic] }}
"#,
        hook.url(),
        password.replace('"', "%22"),
        basic_hook.port()
    );
    let redis = RedisServer::with_events("Exg");
    let daemon = Daemon::launch(
        redis,
        Rules::new(&yaml),
        Logs::Json,
        &[("HOOK_TOKEN", token)],
    );
    daemon.expire("echo:1");
    for channel in ["hook", "basic"] {
        daemon.wait_for_log(&format!("of the dead letter on {channel}"), |l| {
            field_is(l, "channel", channel)
                && l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("Dead letter"))
        });
    }
    let sent = format!("Basic {basic}");
    assert!(
        basic_hook.requests()[0].header("authorization") == Some(sent.as_str()),
        "the receiver got the credentials: {}",
        basic_hook.requests()[0].summary()
    );
    let (code, dead, err) = cli(&daemon.rules, Some(&daemon.redis), &["dead", "list"]);
    assert_eq!(code, 0, "{dead}{err}");
    let (_, dead_json, _) = cli(
        &daemon.rules,
        Some(&daemon.redis),
        &["dead", "list", "--json"],
    );
    let (_, history, _) = cli(&daemon.rules, Some(&daemon.redis), &["history"]);
    let leaks = [
        &token[..6],
        token,
        password,
        "pa55-W0rd",
        basic.as_str(),
        &basic[..12],
    ];
    for (what, text) in [
        ("the log", daemon.stderr()),
        ("dead list", dead),
        ("dead list --json", dead_json),
        ("history", history),
        ("/api/history", api_history(&daemon)),
    ] {
        common::assert_no_secret(what, &text, &leaks);
    }
    daemon.stop();
}

/// A 307 to another origin carried `X-Token` and the `?token=` query to it: a redirect is
/// followed only within the origin the rules named; elsewhere it fails for good, saying where
/// it pointed (its origin only).
#[test]
fn a_redirect_to_another_origin_is_not_followed() {
    let token = "tok-0123456789-redirect";
    let elsewhere = HttpReceiver::start();
    let hook = HttpReceiver::with_default(Response::status(307).header(
        "Location",
        &elsewhere.url_for(&format!("/steal?token={token}")),
    ));
    let same = HttpReceiver::start();
    same.set_handler(|r| {
        Some(match r.path() {
            "/start" => Response::status(307).header("Location", "/final?token=kept"),
            _ => Response::ok_body("ok"),
        })
    });
    let yaml = format!(
        r#"
channels:
  away:
    type: webhook
    url: "{}/hook?token=${{HOOK_TOKEN}}"
    headers: {{ X-Token: "${{HOOK_TOKEN}}" }}
  near:
    type: webhook
    url: "{}/start"
    headers: {{ X-Token: "${{HOOK_TOKEN}}" }}
rules:
  - name: moved
    match: "moved:{{id}}"
    notify: {{ to: [away, near] }}
"#,
        hook.url(),
        same.url()
    );
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Json,
        &[("HOOK_TOKEN", token)],
    );
    daemon.expire("moved:1");
    let failed = daemon.wait_for_log("of the redirect's failure", |l| {
        field_is(l, "channel", "away") && field_is(l, "outcome", "failed")
    });
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("redirect"), "{failed}");
    assert!(reason.contains(&elsewhere.url()), "{failed}");
    daemon.wait_for_log("of the same-origin redirect sent", |l| {
        field_is(l, "channel", "near") && field_is(l, "outcome", "sent")
    });
    assert_eq!(
        elsewhere.count(),
        0,
        "the other origin got {:#?}",
        elsewhere
            .requests()
            .iter()
            .map(|r| r.summary())
            .collect::<Vec<_>>()
    );
    let got = same.requests();
    let last = got.last().unwrap();
    assert_eq!(last.target, "/final?token=kept", "{}", last.summary());
    assert_eq!(last.header("x-token"), Some(token));
    common::assert_no_secret("the log", &daemon.stderr(), &[token]);
    daemon.stop();
}
