//! `rediss://` end to end: redis-server started with `--tls-port` and a CA, server and client
//! certificates generated in the test, and the real `keywatch` binary connecting through the
//! `redis.tls` files of its rules (every connection: subscriber, keyspace, state, admin CLI).

use crate::common;

use std::sync::Arc;

use common::{
    ClientCert, Daemon, HttpReceiver, PATIENCE, RedisServer, Rules, TestPki, assert_no_secret,
    set_px,
};

/// Rules with `redis.tls` = `tls` (a flow mapping), `extra` top-level lines, a webhook channel
/// `hook` to `receiver` and one rule, `lock-expired`, on `lock:{id}`.
fn tls_rules(tls: &str, extra: &str, receiver: &HttpReceiver) -> String {
    format!(
        "redis:\n  tls: {tls}\n{extra}channels:\n  hook:\n    type: webhook\n    url: \"{}\"\nrules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n",
        receiver.url_for("/hook")
    )
}

fn tls_server(pki: &Arc<TestPki>, client_cert: ClientCert) -> RedisServer {
    RedisServer::builder()
        .notify_keyspace_events("Exg")
        .tls(pki, client_cert)
        .start()
}

/// Waits for `n` webhook deliveries and returns their keys, in order.
fn delivered_keys(receiver: &HttpReceiver, n: usize) -> Vec<String> {
    receiver
        .wait_for(n, PATIENCE)
        .iter()
        .map(|r| r.json()["key"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// `keywatch ARGS -r RULES`, with `envs`; returns the exit code and stdout + stderr.
fn cli(rules: &Rules, args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = rules.run(args, envs);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn expiries_over_tls_with_a_custom_ca_reach_the_webhook_and_state_lives_in_another_tls_redis() {
    let pki = Arc::new(TestPki::generate());
    let redis = tls_server(&pki, ClientCert::NotAsked);
    let state = RedisServer::builder()
        .tls(&pki, ClientCert::NotAsked)
        .start();
    let receiver = HttpReceiver::start();
    let yaml = tls_rules(
        &pki.rules_block(false),
        &format!("state:\n  url: \"{}\"\n", state.url()),
        &receiver,
    );
    let daemon = Daemon::start_with(redis, &yaml, &[]);

    // One key expired at once (the notification path), one whose deadline keywatch learns
    // first (the ledger, kept in the state Redis).
    daemon.expire("lock:1");
    assert_eq!(delivered_keys(&receiver, 1), ["lock:1"]);
    set_px(&mut daemon.conn(), "lock:2", 300);
    assert_eq!(delivered_keys(&receiver, 2), ["lock:1", "lock:2"]);

    let own: Vec<String> = redis::cmd("KEYS")
        .arg("keywatch:*")
        .query(&mut state.conn())
        .expect("KEYS on the state Redis");
    assert!(
        !own.is_empty(),
        "keywatch kept no state in the state Redis (state.url over TLS)"
    );
    let watched: Vec<String> = redis::cmd("KEYS")
        .arg("keywatch:*")
        .query(&mut daemon.conn())
        .expect("KEYS on the watched Redis");
    assert!(
        watched.is_empty(),
        "state keys in the watched Redis: {watched:?}"
    );
    daemon.stop();
}

#[test]
fn a_server_that_requires_client_certificates_accepts_the_configured_one_and_refuses_none() {
    let pki = Arc::new(TestPki::generate());
    let redis = tls_server(&pki, ClientCert::Required);
    let receiver = HttpReceiver::start();

    // Without a client certificate: refused at start-up, exit 1, a reason, no panic.
    let without = Rules::new(&tls_rules(&pki.rules_block(false), "", &receiver));
    let (code, out) = cli(
        &without,
        &["run", "--redis", &redis.url(), "--listen", "127.0.0.1:0"],
        &[],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("cannot connect to Redis at"), "{out}");
    assert!(
        out.contains("set `redis.tls.cert_file` and `redis.tls.key_file`"),
        "{out}"
    );
    assert!(!out.contains("panicked"), "{out}");

    let daemon = Daemon::start_with(
        redis,
        &tls_rules(&pki.rules_block(true), "", &receiver),
        &[],
    );
    daemon.expire("lock:7");
    assert_eq!(delivered_keys(&receiver, 1), ["lock:7"]);
    daemon.stop();
}

#[test]
fn a_server_certificate_from_another_ca_is_refused_with_a_clear_error_and_no_secret() {
    let pki = Arc::new(TestPki::generate());
    let other = TestPki::generate();
    let password = "tlsTestSecretPw42";
    let redis = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .tls(&pki, ClientCert::NotAsked)
        .requirepass(password)
        .start();
    let receiver = HttpReceiver::start();
    let rules = Rules::new(&tls_rules(&other.rules_block(false), "", &receiver));
    let url = redis.auth_url();
    assert!(
        url.contains(password),
        "the test must put the password in the URL"
    );

    let (code, out) = cli(
        &rules,
        &["run", "--redis", &url, "--listen", "127.0.0.1:0"],
        &[],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("cannot connect to Redis at"), "{out}");
    assert!(
        out.contains("invalid peer certificate: UnknownIssuer")
            && out.contains("set `redis.tls.ca_file` to the CA that signed it"),
        "the error should say the certificate is not trusted and what to set:\n{out}"
    );
    assert!(!out.contains("panicked"), "{out}");
    assert_no_secret("`run` with the wrong CA", &out, &[password]);

    // A one-shot command fails the same way.
    let (code, out) = cli(&rules, &["upcoming", "--redis", &url], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("redis.tls.ca_file"), "{out}");
    assert_no_secret("`upcoming` with the wrong CA", &out, &[password]);

    // And `doctor`, whose verdict on reachability says the same.
    let (code, out) = cli(&rules, &["doctor", "--json", "--redis", &url], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("redis.tls.ca_file"), "{out}");
    assert_no_secret("`doctor` with the wrong CA", &out, &[password]);
}

#[test]
fn a_plain_url_to_a_tls_port_is_refused_with_a_hint_and_tls_files_unused_are_warned_about() {
    let pki = Arc::new(TestPki::generate());
    let redis = tls_server(&pki, ClientCert::NotAsked);
    let receiver = HttpReceiver::start();
    let rules = Rules::new(&tls_rules(&pki.rules_block(false), "", &receiver));
    let plain = redis.url().replacen("rediss://", "redis://", 1);
    let (code, out) = cli(
        &rules,
        &["run", "--redis", &plain, "--listen", "127.0.0.1:0"],
        &[],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("`redis.tls` is set but the Redis URL is not `rediss://`"),
        "{out}"
    );
    assert!(
        out.contains("if the server speaks TLS on this port, use `rediss://`"),
        "{out}"
    );
}

#[test]
fn an_acl_user_works_over_tls_for_run_upcoming_and_silence() {
    let pki = Arc::new(TestPki::generate());
    let password = "acl-user-pw";
    let redis = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .tls(&pki, ClientCert::Required)
        // The default user is off: nothing works without the ACL user's credentials.
        .args(["--user", "default", "off"])
        .args(["--user", "kw", "on", ">acl-user-pw", "~*", "&*", "+@all"])
        .client_credentials(Some("kw"), password)
        .start();
    let receiver = HttpReceiver::start();
    // The daemon gets `rediss://kw:PASSWORD@…` (`Daemon` passes the URL with credentials); the
    // CLI commands below get a bare URL and the credentials from the rules, the password from
    // the environment.
    let yaml = tls_rules(&pki.rules_block(true), "", &receiver).replacen(
        "redis:\n",
        "redis:\n  username: kw\n  password: \"${KW_TEST_PASSWORD}\"\n",
        1,
    );
    let envs = [("KW_TEST_PASSWORD", password)];
    let daemon = Daemon::start_with(redis, &yaml, &envs);
    daemon.expire("lock:2");
    assert_eq!(delivered_keys(&receiver, 1), ["lock:2"]);

    let url = daemon.redis.url();
    assert!(url.starts_with("rediss://127.0.0.1:"), "{url}");
    set_px(&mut daemon.conn(), "lock:9", 600_000);
    let (code, out) = cli(
        &daemon.rules,
        &["upcoming", "--within", "1h", "--json", "--redis", &url],
        &envs,
    );
    assert_eq!(code, Some(0), "{out}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0]["key"], "lock:9", "{out}");
    assert_eq!(
        rows[0]["rules"],
        serde_json::json!(["lock-expired"]),
        "{out}"
    );

    let (code, out) = cli(
        &daemon.rules,
        &[
            "silence",
            "add",
            "--rule",
            "lock-expired",
            "--for",
            "1h",
            "--comment",
            "over tls",
            "--redis",
            &url,
        ],
        &envs,
    );
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = cli(&daemon.rules, &["silence", "list", "--redis", &url], &envs);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("lock-expired") && out.contains("over tls"),
        "{out}"
    );
    assert_no_secret("the CLI over TLS", &out, &[password]);

    let (code, out) = cli(&daemon.rules, &["doctor", "--json", "--redis", &url], &envs);
    let report: serde_json::Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}):\n{out}"));
    assert_eq!(report["ready"], true, "{out}");
    assert_eq!(code, Some(0), "{out}");
    assert_no_secret("`doctor` over TLS", &out, &[password]);

    // Without the password the same command is refused, saying why, without a panic.
    let (code, out) = cli(&daemon.rules, &["silence", "list", "--redis", &url], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("cannot connect to Redis at") && out.contains("AuthenticationFailed"),
        "{out}"
    );
    assert!(
        out.contains("KW_TEST_PASSWORD"),
        "the unset variable is named: {out}"
    );
    assert!(!out.contains("panicked"), "{out}");
    daemon.stop();
}
