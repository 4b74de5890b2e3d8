//! End to end through the whole pipeline: the real `keywatch` binary against a real
//! redis-server, with real HTTP receivers and real child processes. Keys are made to expire at
//! once (see `common::expire_now`), so no test waits for Redis's expiry cycle.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    ATTEMPTED, HttpReceiver, Logs, PATIENCE, RedisServer, Response, Rig, SUBSCRIBED, field_is,
    field_u64, notify_flags, run_keywatch, spawn_run, wait_until, write_rules,
};
use redis::Commands;

/// The internal event of each change of readiness (`/readyz`).
const READINESS: &str = "readiness";

/// The sum of the samples of `/metrics` lines starting with `prefix` and holding `label`.
fn metric_of(rig: &Rig, prefix: &str, label: &str) -> f64 {
    let (_, metrics) = common::get(&common::endpoint(&rig.process), "/metrics");
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The letters of a `notify-keyspace-events` value.
fn letters(flags: &str) -> BTreeSet<char> {
    flags.chars().collect()
}

/// The key of a keywatch event JSON body.
fn event_key(req: &common::Request) -> String {
    req.json()["key"].as_str().unwrap_or_default().to_owned()
}

const LOG_RULES: &str = r#"
channels:
  console: { type: log }
rules:
  - name: lock
    match: "lock:{id}"
    notify: { to: [console] }
"#;

// ---------------------------------------------------------------------------------------------
// notify-keyspace-events

/// Runs `keywatch run` with `notifications: check` (the default) against `redis` and returns the
/// value of the `CONFIG SET notify-keyspace-events VALUE` fix it printed, after checking it
/// exited 1 without touching the server.
fn refused_fix(redis: &common::RedisServer) -> String {
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(dir.path(), "rules.yaml", LOG_RULES);
    let before = notify_flags(&mut redis.conn());
    let out = run_keywatch(
        [
            "run",
            "-r",
            &rules.to_string_lossy(),
            "--redis",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    let prefix = format!(
        "redis-cli -h 127.0.0.1 -p {} CONFIG SET notify-keyspace-events ",
        redis.port()
    );
    let line = stderr
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no `{prefix}...` line in stderr:\n{stderr}"));
    assert_eq!(
        notify_flags(&mut redis.conn()),
        before,
        "check mode changed the server's flags"
    );
    line[prefix.len()..].to_owned()
}

#[test]
fn check_mode_refuses_a_server_without_flags_and_its_fix_works() {
    let redis = RedisServer::with_events("");
    let fix = refused_fix(&redis);
    assert_eq!(
        letters(&fix),
        letters("Exg"),
        "E and x for expiries, g to learn deadlines: {fix}"
    );

    // The printed fix is enough: applied by hand, `run` starts.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg(&fix)
        .query(&mut redis.conn())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(dir.path(), "rules.yaml", LOG_RULES);
    let mut keywatch = spawn_run(&redis.url(), &rules, Logs::Text, &[]);
    keywatch.wait_for_event(SUBSCRIBED, "of the subscriber in place", |_| true);
    keywatch.sigterm();
    assert!(keywatch.wait_timeout(PATIENCE).is_some_and(|s| s.success()));
}

#[test]
fn check_mode_fix_keeps_the_flags_already_set() {
    let redis = RedisServer::with_events("Kl");
    let fix = refused_fix(&redis);
    assert_eq!(
        letters(&fix),
        letters("KlExg"),
        "the fix must keep K and l and add E, x and g, nothing else: {fix}"
    );
}

#[test]
fn enable_mode_adds_only_the_missing_flags() {
    let rig = Rig::start(
        "Kl",
        &format!("redis: {{ notifications: enable }}\n{LOG_RULES}"),
    );
    let flags = notify_flags(&mut rig.conn());
    assert_eq!(letters(&flags), letters("KlExg"), "after enable: {flags}");
    let added = rig.process.events("notify_flags_added");
    assert_eq!(added.len(), 1, "{}", rig.stderr());
    assert_eq!(letters(added[0]["from"].as_str().unwrap()), letters("Kl"));
    assert_eq!(letters(added[0]["to"].as_str().unwrap()), letters("KlExg"));
    rig.stop();
}

#[test]
fn ignore_mode_starts_without_flags() {
    let rig = Rig::start(
        "",
        &format!("redis: {{ notifications: ignore }}\n{LOG_RULES}"),
    );
    assert_eq!(
        notify_flags(&mut rig.conn()),
        "",
        "ignore must not set flags"
    );
    // Said at start, and again at each check after a subscription.
    let missing = rig.process.events("notify_flags_missing");
    assert!(!missing.is_empty(), "no warning:\n{}", rig.stderr());
    for m in &missing {
        assert_eq!(
            letters(m["missing"].as_str().unwrap()),
            letters("Exg"),
            "{m}"
        );
    }
    // And the gauge the `KeywatchNotificationFlagsMissing` alert reads says so.
    let addr = common::endpoint(&rig.process);
    let line = common::poll(
        "keywatch_notify_flags_ok for the node",
        common::PATIENCE,
        || {
            let (_, body) = common::get(&addr, "/metrics");
            body.lines()
                .find(|l| l.starts_with("keywatch_notify_flags_ok{"))
                .map(str::to_string)
        },
        || rig.stderr(),
    );
    assert!(line.ends_with(" 0"), "{line}");
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// detail

#[test]
fn detail_from_a_hash_field_or_a_key_reaches_the_reload_and_is_removed() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: close-order
    match: "delay:task:{id}"
    detail: { hash: "delay:detail", field: "{{ id }}", remove: true }
    reload: { url: "@RECEIVER@/hash/{{ id }}", body: "{{ detail | tojson }}" }
  - name: job-done
    match: "job:{id}"
    detail: { key: "job-detail:{{ id }}" }
    reload: { url: "@RECEIVER@/key/{{ id }}", body: "{{ detail | tojson }}" }
"#,
    );
    let mut conn = rig.conn();
    let order = r#"{"order_id": 1001, "user": "u-7", "amount": "99.00"}"#;
    let _: () = conn.hset("delay:detail", "1", order).unwrap();
    let _: () = conn.hset("delay:detail", "2", "another order").unwrap();
    let _: () = conn.set("job-detail:9", "plain text").unwrap();
    rig.expire_all(&["delay:task:1", "delay:task:404", "job:9"]);

    let requests = rig.receiver.wait_for(3, PATIENCE);
    let by_path: BTreeMap<String, &common::Request> =
        requests.iter().map(|r| (r.target.clone(), r)).collect();
    let body = |path: &str| {
        by_path
            .get(path)
            .unwrap_or_else(|| panic!("no request to {path}: {requests:#?}"))
            .json()
    };
    assert_eq!(
        body("/hash/1"),
        serde_json::from_str::<serde_json::Value>(order).unwrap()
    );
    assert_eq!(body("/key/9"), serde_json::json!("plain text"));
    // No detail beside the key: the action still runs, with `detail` null.
    assert_eq!(body("/hash/404"), serde_json::Value::Null);
    assert_eq!(
        by_path["/hash/1"].header("content-type"),
        Some("application/json")
    );

    // `remove: true` deletes the field it read, and only that one; `{ key }` without remove keeps it.
    wait_until("the detail field is removed", PATIENCE, || {
        !conn.hexists::<_, _, bool>("delay:detail", "1").unwrap()
    });
    assert!(conn.hexists::<_, _, bool>("delay:detail", "2").unwrap());
    assert_eq!(
        conn.get::<_, Option<String>>("job-detail:9").unwrap(),
        Some("plain text".into())
    );
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// reload

#[test]
fn reload_percent_encodes_captures_and_sends_method_headers_and_idempotency_key() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: prewarm
    match: "cache:{name}"
    reload:
      url: "@RECEIVER@/reload/{{ name }}?n={{ name }}"
      method: PUT
      headers: { X-Source: "keywatch {{ rule }}", Content-Type: "text/plain" }
      body: "{{ name }}"
"#,
    );
    rig.expire_all(&["cache:a/../b?x=1#", "cache:100% sure"]);
    let requests = rig.receiver.wait_for(2, PATIENCE);
    let mut targets: Vec<&str> = requests.iter().map(|r| r.target.as_str()).collect();
    targets.sort();
    assert_eq!(
        targets,
        [
            "/reload/100%25%20sure?n=100%25%20sure",
            "/reload/a%2F..%2Fb%3Fx%3D1%23?n=a%2F..%2Fb%3Fx%3D1%23",
        ]
    );
    for r in &requests {
        assert_eq!(r.method, "PUT");
        assert_eq!(r.header("x-source"), Some("keywatch prewarm"));
        assert_eq!(r.header_all("content-type"), ["text/plain"]);
        let key = r.header("idempotency-key").expect("Idempotency-Key");
        let (id, action) = key.split_once(':').expect("ID:reload");
        assert_eq!(action, "reload");
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{key}"
        );
    }
    // The body is not a URL: the capture arrives as it is.
    let body = requests
        .iter()
        .find(|r| r.target.starts_with("/reload/a"))
        .unwrap()
        .body_str()
        .to_owned();
    assert_eq!(body, "a/../b?x=1#");
    assert_ne!(
        requests[0].header("idempotency-key"),
        requests[1].header("idempotency-key")
    );
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// exec

#[test]
fn exec_passes_captures_as_single_arguments_with_keywatch_env() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: report
    match: "report:{day}"
    exec:
      command:
        - /bin/sh
        - -c
        - 'printf "%s\n" "$$@" > "$$0.args"; printf "%s\n" "$$KEYWATCH_KEY" "$$KEYWATCH_RULE" "$$KEYWATCH_EVENT" > "$$0.env"'
        - "@DIR@/out"
        - "{{ day }}"
        - "--flag"
"#,
    );
    let canary = rig.path("canary");
    let pwned = rig.path("pwned");
    std::fs::write(&canary, "still here").unwrap();
    let day = format!(
        "x; rm -f {c}; touch {p} $(touch {p}) `touch {p}`",
        c = canary.display(),
        p = pwned.display()
    );
    let key = format!("report:{day}");
    rig.expire_all(&[key.as_str()]);

    let env_file = rig.path("out.env");
    wait_until("the command ran", PATIENCE, || env_file.exists());
    wait_until("the command finished", PATIENCE, || {
        std::fs::read_to_string(&env_file).is_ok_and(|s| s.lines().count() == 3)
    });
    let args = std::fs::read_to_string(rig.path("out.args")).unwrap();
    assert_eq!(args.lines().collect::<Vec<_>>(), [day.as_str(), "--flag"]);
    let env = std::fs::read_to_string(&env_file).unwrap();
    assert_eq!(
        env.lines().collect::<Vec<_>>(),
        [key.as_str(), "report", "expired"]
    );
    assert!(canary.exists(), "the capture ran as shell code");
    assert!(!pwned.exists(), "the capture ran as shell code");
    rig.stop();
}

/// keywatch's environment holds its secrets; a child printing its whole environment sees
/// `PATH`, `HOME`, the event's `KEYWATCH_*` and what the rule's `env` names, and none of them
/// (before, it inherited every variable: a job could forge links with KEYWATCH_LINK_SECRET).
#[test]
fn exec_children_get_a_clean_environment_without_keywatchs_secrets() {
    let rules = common::Rules::new_with(|dir| {
        format!(
            r#"
rules:
  - name: report
    match: "report:{{day}}"
    exec:
      command: ["/bin/sh", "-c", 'env > "$$0.tmp" && mv "$$0.tmp" "$$0"', "{dir}/env.out"]
      env:
        REPORT_DAY: "day {{{{ day }}}}"
        PASSED_ON: "${{PASSED_ON}}"
"#,
            dir = dir.display()
        )
    });
    let envs = [
        ("KEYWATCH_LINK_SECRET", "link-secret-0123456789"),
        ("SECRET_TOKEN", "token-9876543210"),
        ("PASSED_ON", "named in env"),
        ("HOME", "/home/keywatch-test"),
    ];
    let out = rules.dir.path().join("env.out");
    let daemon = common::Daemon::launch(RedisServer::with_events("Exg"), rules, Logs::Text, &envs);
    daemon.expire("report:2026-12-04");
    wait_until("the command ran", PATIENCE, || out.exists());
    let env = std::fs::read_to_string(&out).unwrap();
    let vars: BTreeMap<&str, &str> = env.lines().filter_map(|l| l.split_once('=')).collect();
    assert!(!env.contains("link-secret-0123456789"), "{env}");
    assert!(!env.contains("token-9876543210"), "{env}");
    assert_eq!(
        vars.get("KEYWATCH_KEY"),
        Some(&"report:2026-12-04"),
        "{env}"
    );
    assert_eq!(vars.get("KEYWATCH_RULE"), Some(&"report"), "{env}");
    assert_eq!(vars.get("KEYWATCH_EVENT"), Some(&"expired"), "{env}");
    assert_eq!(vars.get("REPORT_DAY"), Some(&"day 2026-12-04"), "{env}");
    assert_eq!(vars.get("PASSED_ON"), Some(&"named in env"), "{env}");
    assert_eq!(vars.get("HOME"), Some(&"/home/keywatch-test"), "{env}");
    assert!(vars.contains_key("PATH"), "{env}");
    // `sh` adds PWD (and SHLVL, `_`) of its own; nothing else comes from keywatch.
    let extra: Vec<&&str> = vars
        .keys()
        .filter(|k| {
            !k.starts_with("KEYWATCH_")
                && ![
                    "PATH",
                    "HOME",
                    "REPORT_DAY",
                    "PASSED_ON",
                    "PWD",
                    "SHLVL",
                    "_",
                    "OLDPWD",
                ]
                .contains(k)
        })
        .collect();
    assert!(extra.is_empty(), "inherited {extra:?}:\n{env}");
    let kw: Vec<&&str> = vars.keys().filter(|k| k.starts_with("KEYWATCH_")).collect();
    assert_eq!(
        kw,
        [
            &"KEYWATCH_DB",
            &"KEYWATCH_EVENT",
            &"KEYWATCH_ID",
            &"KEYWATCH_KEY",
            &"KEYWATCH_RULE"
        ],
        "{env}"
    );
    daemon.stop();
}

#[test]
fn exec_non_zero_exit_is_retried_and_a_timeout_kills_the_process() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: flaky
    match: "flaky:{n}"
    exec:
      command: ["/bin/sh", "-c", 'echo run >> "$$0"; [ "$$(wc -l < "$$0")" -ge 3 ]', "@DIR@/flaky.runs"]
  - name: slow
    match: "slow:{n}"
    exec:
      command: ["/bin/sh", "-c", 'echo $$$$ >> "$$0"; exec sleep 60', "@DIR@/slow.pids"]
      timeout: 300ms
"#,
    );
    rig.expire_all(&["flaky:1", "slow:1"]);

    // Timeout: the first process is killed (not left to sleep its 60 s), and that is a failure.
    let pids = rig.path("slow.pids");
    wait_until("the slow command started", PATIENCE, || {
        std::fs::read_to_string(&pids).is_ok_and(|s| s.ends_with('\n'))
    });
    let pid: u32 = std::fs::read_to_string(&pids)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let cmdline = format!("/proc/{pid}/cmdline");
    wait_until("the timed-out command is killed", PATIENCE, || {
        std::fs::read(&cmdline).map_or(true, |c| !c.starts_with(b"sleep"))
    });
    let mut keywatch = rig.daemon.process;
    let killed = keywatch.wait_for_event("exec_timed_out", "of the slow command", |e| {
        field_is(e, "rule", "slow")
    });
    assert!(field_is(&killed, "timeout", "300ms"), "{killed}");

    // Non-zero exit: retried (with backoff) until it succeeds on the third run, then no more.
    let runs = rig.daemon.rules.dir.path().join("flaky.runs");
    let sent = keywatch.wait_for_event(ATTEMPTED, "of the flaky command sent", |e| {
        field_is(e, "rule", "flaky") && field_is(e, "outcome", "sent")
    });
    assert_eq!(field_u64(&sent, "attempt"), Some(3), "{sent}");
    let flaky: Vec<serde_json::Value> = keywatch
        .events(ATTEMPTED)
        .into_iter()
        .filter(|e| field_is(e, "rule", "flaky"))
        .collect();
    assert_eq!(
        flaky
            .iter()
            .filter(|e| field_is(e, "outcome", "retry"))
            .count(),
        2,
        "{flaky:#?}"
    );
    assert_eq!(std::fs::read_to_string(&runs).unwrap().lines().count(), 3);

    keywatch.sigterm();
    assert!(keywatch.wait_timeout(PATIENCE).is_some_and(|s| s.success()));
    assert_eq!(
        std::fs::read_to_string(&runs).unwrap().lines().count(),
        3,
        "a succeeded exec ran again"
    );
}

/// The pid a test command wrote to `file`, once it is there.
fn pid_in(file: &std::path::Path) -> u32 {
    wait_until("the command wrote its child's pid", PATIENCE, || {
        std::fs::read_to_string(file).is_ok_and(|s| s.ends_with('\n'))
    });
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Whether `pid` is a `sleep` still running (not gone, not a zombie left to be reaped).
fn sleeping(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    cmdline.starts_with(b"sleep") && !state.contains(") Z ")
}

#[test]
fn exec_whose_child_keeps_the_output_open_does_not_block_its_rule_and_a_timeout_kills_the_group() {
    let rig = Rig::start(
        "Exg",
        r#"
channels:
  hook: { type: webhook, url: "@RECEIVER@/hook", rate: 100/s }
rules:
  - name: background
    match: "bg:{n}"
    exec:
      command: ["/bin/sh", "-c", 'sleep 600 & echo $$! > "$$0"; echo started', "@DIR@/bg.pid"]
      timeout: 60s
    notify: { to: [hook] }
  - name: slow-group
    match: "sg:{n}"
    exec:
      command: ["/bin/sh", "-c", 'sleep 600 & echo $$! > "$$0"; wait', "@DIR@/sg.pid"]
      timeout: 500ms
"#,
    );
    rig.expire_all(&["bg:1", "sg:1"]);

    // The shell exits at once; its `sleep` holds stdout. The rule's notify still runs, soon.
    let started = Instant::now();
    let got = rig.receiver.wait_for(1, PATIENCE);
    assert_eq!(event_key(&got[0]), "bg:1");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    let bg = pid_in(&rig.path("bg.pid"));
    wait_until(
        "the child left holding the output is killed",
        PATIENCE,
        || !sleeping(bg),
    );

    // A timeout kills the whole group, not only the shell.
    let sg = pid_in(&rig.path("sg.pid"));
    wait_until("the timed-out command's child is killed", PATIENCE, || {
        !sleeping(sg)
    });
    rig.wait_for_event("exec_timed_out", "of the timed-out command", |_| true);
    rig.wait_for_event(
        "exec_group_killed",
        "of the command whose child kept its output",
        |_| true,
    );
    rig.stop();
}

#[test]
fn keys_no_attempt_can_serve_fail_at_once_with_the_reason() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: nul
    match: "nul:{id}"
    exec: { command: ["/bin/sh", "-c", 'touch "$$0"', "@DIR@/nul.ran", "{{ id }}"] }
  - name: crlf
    match: "crlf:{id}"
    reload: { url: "@RECEIVER@/reload", headers: { X-Id: "{{ id }}" } }
  - name: dash-bare
    match: "dash:{id}"
    exec: { command: ["/bin/sh", "-c", 'touch "$$0"', "@DIR@/bare.ran", "{{ id }}"] }
  - name: dash-after-double-dash
    match: "dash:{id}"
    exec: { command: ["/bin/sh", "-c", 'printf "%s" "$$2" > "$$0"', "@DIR@/after.out", "--", "{{ id }}"] }
"#,
    );
    rig.expire_all(&[
        b"nul:a\0b".as_slice(),
        b"crlf:a\r\nX-Evil: 1".as_slice(),
        b"dash:-rf".as_slice(),
    ]);
    let after = rig.path("after.out");
    wait_until("the argument after `--` is passed", PATIENCE, || {
        std::fs::read_to_string(&after).is_ok_and(|s| s == "-rf")
    });
    let failures = rig.wait_for_events(ATTEMPTED, 3, "that failed for good", |e| {
        field_is(e, "outcome", "failed")
    });
    for (rule, why) in [
        ("nul", "contains a NUL byte"),
        ("crlf", "holds a character no HTTP header may carry"),
        (
            "dash-bare",
            "starts with `-`, so the program would take it as an option",
        ),
    ] {
        let failure = failures
            .iter()
            .find(|f| field_is(f, "rule", rule))
            .unwrap_or_else(|| panic!("no failure of {rule}: {failures:#?}"));
        assert_eq!(field_u64(failure, "attempt"), Some(1), "{failure}");
        assert!(
            failure["reason"].as_str().unwrap_or_default().contains(why),
            "{failure}"
        );
    }
    let retried = metric_of(&rig, "keywatch_actions_total{", "outcome=\"retry\"");
    assert_eq!(retried, 0.0, "retried:\n{}", rig.stderr());
    assert!(!rig.path("nul.ran").exists() && !rig.path("bare.ran").exists());
    assert_eq!(
        rig.receiver.count(),
        0,
        "a request with CR/LF in a header was sent"
    );
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// cleanup

fn exists(conn: &mut redis::Connection, key: &str) -> bool {
    conn.exists(key).unwrap()
}

fn fields(conn: &mut redis::Connection, hash: &str) -> BTreeSet<String> {
    conn.hkeys(hash).unwrap()
}

#[test]
fn cleanup_deletes_exactly_the_intended_keys() {
    let rig = Rig::start(
        "Exg",
        r#"
rules:
  - name: sessions
    match: "session:{sid}"
    cleanup:
      delete: ["session:{{ sid }}:*", "cart:{{ sid }}"]
      hdel: [{ key: "online_users", field: "{{ sid }}" }]
  - name: purge
    match: "purge:{p}"
    cleanup:
      delete: ["{{ p }}*", "{{ p }}:ledger"]
      hdel: [{ key: "{{ p }}:silences", field: "x" }]
"#,
    );
    let mut conn = rig.conn();
    for k in [
        "session:42:a",
        "session:42:b",
        "session:421:a",
        "session:4:a",
        "session:7:a",
        "session:*:a",
        "cart:42",
        "cart:421",
        "cart:*",
        "cart:7",
        // Under keywatch's prefix, but none of its working keys (a string where its queue
        // is would stop the queue itself).
        "keywatch:planted",
        "keywatch:ledger",
        "keywatchers",
    ] {
        let _: () = conn.set(k, "v").unwrap();
    }
    for f in ["42", "421", "*", "7"] {
        let _: () = conn.hset("online_users", f, "1").unwrap();
    }
    let _: () = conn.hset("keywatch:silences", "x", "1").unwrap();
    let mut done = 0;
    let mut wait_cleanup = |rig: &Rig, key: &str| {
        rig.expire_all(&[key]);
        done += 1;
        let n = done;
        rig.wait_for_events(ATTEMPTED, n, "of cleanups sent", |e| {
            field_is(e, "action", "cleanup") && field_is(e, "outcome", "sent")
        });
    };

    wait_cleanup(&rig, "session:42");
    for gone in ["session:42:a", "session:42:b", "cart:42"] {
        assert!(!exists(&mut conn, gone), "{gone} was not deleted");
    }
    for kept in ["session:421:a", "session:4:a", "cart:421", "session:*:a"] {
        assert!(exists(&mut conn, kept), "{kept} was deleted");
    }
    assert_eq!(
        fields(&mut conn, "online_users"),
        BTreeSet::from(["421".into(), "*".into(), "7".into()])
    );

    // A key named `session:*` cleans up after the session called `*`, not after every session.
    wait_cleanup(&rig, "session:*");
    for gone in ["session:*:a", "cart:*"] {
        assert!(!exists(&mut conn, gone), "{gone} was not deleted");
    }
    for kept in [
        "session:421:a",
        "session:4:a",
        "session:7:a",
        "cart:421",
        "cart:7",
    ] {
        assert!(exists(&mut conn, kept), "{kept} was deleted");
    }
    assert_eq!(
        fields(&mut conn, "online_users"),
        BTreeSet::from(["421".into(), "7".into()])
    );

    // keywatch's own keys (state.prefix, default `keywatch:`) survive a pattern that covers them.
    wait_cleanup(&rig, "purge:keywatch");
    assert!(
        !exists(&mut conn, "keywatchers"),
        "the cleanup did not run at all"
    );
    for kept in ["keywatch:planted", "keywatch:ledger"] {
        assert!(exists(&mut conn, kept), "keywatch's own {kept} was deleted");
    }
    assert_eq!(
        fields(&mut conn, "keywatch:silences"),
        BTreeSet::from(["x".into()])
    );
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// order of steps

/// What the receiver saw of the other steps when a request arrived.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    id: String,
    /// The exec step's marker file was there.
    exec_done: bool,
    /// The key the cleanup step deletes was still there.
    tmp_left: bool,
}

#[test]
fn steps_run_reload_exec_cleanup_notify_and_a_failing_reload_does_not_stop_notify() {
    let redis = RedisServer::with_events("Exg");
    let receiver = HttpReceiver::start();
    // What the receiver saw of the other steps when each request arrived.
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let probe = Arc::new(Mutex::new(redis.conn()));
    let dir_for_handler: Arc<Mutex<Option<std::path::PathBuf>>> = Arc::default();
    {
        let seen = seen.clone();
        let dir = dir_for_handler.clone();
        receiver.set_handler(move |req| {
            let id = if req.path().starts_with("/reload/") {
                req.path()["/reload/".len()..].to_owned()
            } else {
                event_key(req)["order:".len()..].to_owned()
            };
            let marker = dir
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .join(format!("exec-{id}"));
            let tmp: bool = probe
                .lock()
                .unwrap()
                .exists(format!("order:{id}:tmp"))
                .unwrap();
            seen.lock().unwrap().push(Seen {
                path: req.path().to_owned(),
                id: id.clone(),
                exec_done: marker.exists(),
                tmp_left: tmp,
            });
            (id == "fail" && req.path().starts_with("/reload/")).then(|| Response::status(500))
        });
    }
    let rig = Rig::start_with(
        redis,
        receiver,
        r#"
channels:
  hook: { type: webhook, url: "@RECEIVER@/notify" }
rules:
  - name: ordered
    match: "order:{id}"
    reload: { url: "@RECEIVER@/reload/{{ id }}" }
    exec: { command: ["/bin/sh", "-c", 'touch "$$0"', "@DIR@/exec-{{ id }}"] }
    cleanup: { delete: ["order:{{ id }}:tmp"] }
    notify: { to: [hook] }
"#,
    );
    *dir_for_handler.lock().unwrap() = Some(rig.daemon.rules.dir.path().to_owned());
    let mut conn = rig.conn();
    for id in ["1", "fail"] {
        let _: () = conn.set(format!("order:{id}:tmp"), "v").unwrap();
    }
    rig.expire_all(&["order:1", "order:fail"]);

    // Counted in what the handler saw, not in the receiver's log: the receiver records a request
    // before its handler runs, so the log can hold both notifications while the handler is still
    // looking at the second one.
    wait_until("both notifications arrive", PATIENCE, || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|s| s.path == "/notify")
            .count()
            == 2
    });
    let seen = seen.lock().unwrap().clone();
    for id in ["1", "fail"] {
        let first = |path: &str| {
            seen.iter()
                .find(|s| s.path.starts_with(path) && s.id == id)
                .unwrap_or_else(|| panic!("no {path} for {id}: {seen:#?}"))
                .clone()
        };
        let reload = first("/reload/");
        assert!(
            !reload.exec_done && reload.tmp_left,
            "{id}: reload ran after exec or cleanup: {seen:#?}"
        );
        let notify = first("/notify");
        assert!(
            notify.exec_done && !notify.tmp_left,
            "{id}: notify ran before exec or cleanup: {seen:#?}"
        );
    }
    rig.wait_for_event(ATTEMPTED, "of the failed reload", |e| {
        field_is(e, "rule", "ordered")
            && field_is(e, "key", "order:fail")
            && field_is(e, "action", "reload")
            && !field_is(e, "outcome", "sent")
    });
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// digests

#[test]
fn grouped_notifications_arrive_as_a_few_digests_covering_every_key() {
    let rig = Rig::start(
        "Exg",
        r#"
channels:
  hook: { type: webhook, url: "@RECEIVER@/digest" }
rules:
  - name: burst
    match: "burst:{n}"
    notify: { to: [hook], group: { window: 2s, max_items: 5 } }
"#,
    );
    let keys: Vec<String> = (0..50).map(|i| format!("burst:{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    rig.expire_all(&refs);

    let total = |reqs: &[common::Request]| -> u64 {
        reqs.iter()
            .map(|r| r.json()["count"].as_u64().unwrap())
            .sum()
    };
    wait_until("digests cover all 50 keys", PATIENCE, || {
        total(&rig.receiver.requests()) >= 50
    });
    // One more key, in a window that opens after theirs ended: nothing is sent twice before
    // its digest.
    rig.expire_all(&["burst:sentinel"]);
    let digests = rig.receiver.wait_past(&["burst:sentinel"], PATIENCE);
    assert_eq!(total(&digests), 50);
    assert!(
        (1..=3).contains(&digests.len()),
        "50 keys in one window came as {} digests",
        digests.len()
    );
    let mut listed = BTreeSet::new();
    for d in &digests {
        let body = d.json();
        assert_eq!(body["version"], 1);
        assert_eq!(body["rule"], "burst");
        assert_eq!(body["event"], "expired");
        let count = body["count"].as_u64().unwrap();
        let events = body["events"].as_array().unwrap();
        assert!(!events.is_empty() && events.len() <= 5, "{}", d.summary());
        assert_eq!(
            body["omitted"].as_u64().unwrap(),
            count - events.len() as u64
        );
        for e in events {
            let key = e["key"].as_str().unwrap().to_owned();
            assert!(keys.contains(&key), "{key}");
            assert!(listed.insert(key), "an event is listed twice");
        }
    }
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// Redis restart

#[test]
fn redis_restart_is_survived_and_enable_reapplies_the_flags() {
    let mut rig = Rig::start(
        "",
        r#"
redis: { notifications: enable }
channels:
  hook: { type: webhook, url: "@RECEIVER@/hook" }
rules:
  - name: watched
    match: "restart:{n}"
    notify: { to: [hook] }
"#,
    );
    assert!(letters(&notify_flags(&mut rig.conn())).is_superset(&letters("Exg")));
    rig.expire_all(&["restart:before"]);
    rig.receiver.wait_for(1, PATIENCE);

    // A restarted server has forgotten the CONFIG SET (its command line has no flags).
    rig.redis.restart();
    wait_until("subscribed again after the restart", PATIENCE, || {
        rig.process.events(SUBSCRIBED).len() >= 2
    });
    assert!(
        !rig.process.events("subscription_lost").is_empty(),
        "{}",
        rig.stderr()
    );
    let readded = |rig: &Rig| letters(&notify_flags(&mut rig.conn())).is_superset(&letters("Exg"));
    common::poll(
        "keywatch re-adds the flags",
        PATIENCE,
        || readded(&rig).then_some(()),
        || rig.process.describe_output(),
    );
    rig.expire_all(&["restart:after"]);
    let requests = rig.receiver.wait_for(2, PATIENCE);
    let keys: BTreeSet<String> = requests.iter().map(event_key).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["restart:before".into(), "restart:after".into()])
    );
    rig.stop();
}

/// A restarted (or promoted) server lacks the flags; keywatch is ready again only once `enable`
/// has added them. Before, it was ready (`/readyz` 200) a few ms before the `CONFIG SET`, and a
/// `del` or `evicted` in that gap was lost while keywatch said it was ready.
#[test]
fn ready_again_only_after_enable_has_added_the_flags() {
    let mut rig = Rig::start(
        "",
        r#"
redis: { notifications: enable }
channels:
  console: { type: log }
rules:
  - name: gone
    match: "gone:{n}"
    on: [deleted, evicted]
    notify: { to: [console] }
"#,
    );
    let ready = |e: &serde_json::Value| field_is(e, "ready", "true");
    rig.wait_for_events(READINESS, 1, "ready", ready);
    rig.redis.restart();
    rig.wait_for_events(READINESS, 2, "ready again", ready);
    // Which came first, by their order in the log: the second `ready` after the second
    // addition of the flags.
    let order = rig
        .process
        .events_in_order(&[READINESS, "notify_flags_added"]);
    let nth = |n: usize, what: &dyn Fn(&serde_json::Value) -> bool| {
        order
            .iter()
            .enumerate()
            .filter(|(_, e)| what(e))
            .nth(n)
            .map(|(at, _)| at)
    };
    let added = nth(1, &|e| field_is(e, "internal_event", "notify_flags_added"))
        .unwrap_or_else(|| panic!("the flags were not added again:\n{}", rig.stderr()));
    let ready_again = nth(1, &ready).unwrap();
    assert!(
        added < ready_again,
        "ready again before the flags were added:\n{}",
        rig.stderr()
    );
    rig.stop();
}

// ---------------------------------------------------------------------------------------------
// SIGTERM

#[test]
fn sigterm_exits_zero_within_ten_seconds_when_idle() {
    let mut rig = Rig::start("Exg", LOG_RULES);
    let started = Instant::now();
    rig.process.sigterm();
    let status = rig.process.wait_timeout(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        rig.process.describe_output()
    );
    eprintln!("idle shutdown took {:?}", started.elapsed());
}

#[test]
fn sigterm_exits_zero_within_ten_seconds_while_a_webhook_is_slow() {
    let receiver =
        HttpReceiver::with_default(Response::ok_body("ok").delay(Duration::from_secs(30)));
    let mut rig = Rig::start_with(
        RedisServer::with_events("Exg"),
        receiver,
        r#"
channels:
  slow: { type: webhook, url: "@RECEIVER@/slow", timeout: 60s }
rules:
  - name: slowpoke
    match: "slow:{n}"
    notify: { to: [slow] }
"#,
    );
    rig.expire_all(&["slow:1"]);
    rig.receiver.wait_for(1, PATIENCE);
    let started = Instant::now();
    rig.process.sigterm();
    let status = rig.process.wait_timeout(Duration::from_secs(10));
    eprintln!("shutdown with a slow webhook took {:?}", started.elapsed());
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?} after {:?}\n{}",
        started.elapsed(),
        rig.process.describe_output()
    );
}

// ---------------------------------------------------------------------------------------------
// demo

#[test]
fn demo_exits_zero_and_shows_the_three_rules_firing() {
    let server = common::tools::redis_server_bin();
    let out = run_keywatch(
        ["demo"],
        &[("KEYWATCH_REDIS_SERVER", &server.to_string_lossy())],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!("{stdout}\n{stderr}");
    assert_eq!(out.status.code(), Some(0), "{all}");
    for fired in [
        "rule=order-lock-timeout",
        "Lock of order 42 expired",
        "rule=session-cleanup",
        "Session abc expired",
        "rule=close-unpaid-order",
        "Order 1001 of u-77 (99.00) was not paid in time.",
        "0 of the 2 session:abc:* keys left, 0 field(s) left in delay:detail",
    ] {
        assert!(
            all.contains(fired),
            "{fired:?} not in the demo output:\n{all}"
        );
    }
    assert!(
        !all.contains('\u{1b}'),
        "escape codes in piped output:\n{all}"
    );
}

// ---------------------------------------------------------------------------------------------
// retries

#[test]
fn a_receiver_failing_for_a_few_seconds_still_gets_every_key() {
    let receiver = HttpReceiver::start();
    let fail_until: Arc<Mutex<Option<Instant>>> = Arc::default();
    // Event id → whether it was answered 200, and every Idempotency-Key seen per key.
    let delivered: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let keys_seen: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
    {
        let (fail_until, delivered, keys_seen) =
            (fail_until.clone(), delivered.clone(), keys_seen.clone());
        receiver.set_handler(move |req| {
            let key = event_key(req);
            keys_seen
                .lock()
                .unwrap()
                .entry(key.clone())
                .or_default()
                .insert(req.header("idempotency-key").unwrap_or("").to_owned());
            if fail_until
                .lock()
                .unwrap()
                .is_some_and(|t| Instant::now() < t)
            {
                return Some(Response::status(500).body("down for maintenance"));
            }
            delivered.lock().unwrap().insert(key);
            None
        });
    }
    let rig = Rig::start_with(
        RedisServer::with_events("Exg"),
        receiver,
        r#"
channels:
  hook: { type: webhook, url: "@RECEIVER@/flaky" }
rules:
  - name: recover
    match: "recover:{n}"
    notify: { to: [hook] }
"#,
    );
    let keys: Vec<String> = (0..20).map(|i| format!("recover:{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    *fail_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(3));
    rig.expire_all(&refs);

    wait_until("every key is delivered", Duration::from_secs(60), || {
        delivered.lock().unwrap().len() == keys.len()
    });
    assert!(
        rig.receiver.count() > keys.len(),
        "nothing was retried: the receiver never failed?"
    );
    // Every retry of one event carries the same Idempotency-Key.
    for (key, ids) in keys_seen.lock().unwrap().iter() {
        assert_eq!(ids.len(), 1, "{key}: {ids:?}");
    }
    assert!(metric_of(&rig, "keywatch_actions_total{", "outcome=\"retry\"") > 0.0);
    rig.stop();
}
