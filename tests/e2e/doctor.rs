//! `keywatch doctor` against real redis-server children: notifications off (exit 1 with the exact
//! `CONFIG SET`, which then makes it ready), a replica (exit 1, names the master), users lacking a
//! permission (exit 1 naming the command and the `ACL SETUSER` that grants it), a ready Redis
//! (exit 0), and a password in the URL that never reaches the output.

use crate::common;

use std::process::Output;

use common::{RedisServer, run_keywatch, write_rules};

const RULES: &str = r#"
channels:
  audit: { type: webhook, url: "http://127.0.0.1:9/hook", rate: 10/s }
rules:
  - name: order-lock
    match: "order_lock:{id}"
    notify: { to: [audit] }
  - name: sessions
    match: "session:{sid}"
    cleanup:
      delete: ["session:{{ sid }}:*", "cart:{{ sid }}"]
      hdel: [{ key: "online_users", field: "{{ sid }}" }]
"#;

struct Doctor {
    _dir: tempfile::TempDir,
    rules: String,
}

impl Doctor {
    fn new(yaml: &str) -> Doctor {
        let dir = tempfile::tempdir().unwrap();
        let rules = write_rules(dir.path(), "rules.yaml", yaml)
            .display()
            .to_string();
        Doctor { _dir: dir, rules }
    }

    fn run(&self, url: &str, extra: &[&str]) -> Output {
        let mut args = vec!["doctor", "--redis", url, "-r", &self.rules];
        args.extend_from_slice(extra);
        run_keywatch(args, &[])
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn code(out: &Output) -> Option<i32> {
    out.status.code()
}

/// The ACL lines of the least-privilege section of docs/redis.md, `PASSWORD` replaced.
fn documented_acl(password: &str) -> Vec<Vec<String>> {
    common::documented_acl_lines()
        .into_iter()
        .map(|l| {
            l.split_whitespace()
                .map(|w| w.replace("PASSWORD", password))
                .collect()
        })
        .collect()
}

fn acl(redis: &RedisServer, words: &[String]) {
    let mut cmd = redis::cmd(&words[0]);
    for w in &words[1..] {
        cmd.arg(w);
    }
    let () = cmd
        .query(&mut redis.conn())
        .unwrap_or_else(|e| panic!("{words:?}: {e}"));
}

#[test]
fn notifications_off_fail_with_the_exact_config_set_that_then_makes_it_ready() {
    let redis = RedisServer::start();
    let doctor = Doctor::new(RULES);
    let out = doctor.run(&redis.url(), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(t.contains("FAIL  notifications"), "{t}");
    let port = redis.port();
    let prefix =
        format!("fix: redis-cli -h 127.0.0.1 -p {port} CONFIG SET notify-keyspace-events ");
    let line = t
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no CONFIG SET fix in:\n{t}"));
    let flags: std::collections::BTreeSet<char> = line.chars().collect();
    assert_eq!(flags, "Exg".chars().collect(), "{t}");

    let json = doctor.run(&redis.url(), &["--json"]);
    assert_eq!(code(&json), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(j["ready"], false);
    let n = j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "notifications")
        .unwrap();
    assert_eq!(n["verdict"], "fail", "{j}");

    // The printed fix is all it takes.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg(line)
        .query(&mut redis.conn())
        .unwrap();
    let again = doctor.run(&redis.url(), &[]);
    let t = text(&again);
    assert_eq!(code(&again), Some(0), "{t}");
    assert!(t.contains("ok    notifications"), "{t}");
}

#[test]
fn a_ready_redis_passes_with_every_check_and_the_rules_sampled() {
    let redis = RedisServer::builder().notify_keyspace_events("KEA").start();
    let mut conn = redis.conn();
    for k in ["order_lock:1", "order_lock:2", "other:1"] {
        let () = redis::cmd("SET")
            .arg(k)
            .arg("v")
            .arg("EX")
            .arg(3600)
            .query(&mut conn)
            .unwrap();
    }
    let out = Doctor::new(RULES).run(&redis.url(), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(0), "{t}");
    for line in [
        "ok    reachable",
        "ok    server",
        "Redis ",
        "ok    role",
        "is a master",
        "ok    notifications",
        "ok    permissions",
        "ACL DRYRUN",
        "db0: 3 keys, 3 with a TTL",
        "ok    expiry backlog",
        "order_lock:{id} (SCAN MATCH order_lock:*): 2 matching key(s) (every key of db0 walked)",
        "Ready:",
    ] {
        assert!(t.contains(line), "no {line:?} in:\n{t}");
    }
}

/// A typo in a pattern (`order-lock:` for `order_lock:`) passes `check`; a full walk that finds
/// no key for a rule warns, and names the keys it saw that come closest.
#[test]
fn a_rule_no_key_matches_warns_and_names_the_closest_keys() {
    let redis = RedisServer::builder().notify_keyspace_events("KEA").start();
    let mut conn = redis.conn();
    for k in ["order_lock:1", "order_lock:2", "session:s1", "cart:s1"] {
        let () = redis::cmd("SET").arg(k).arg("v").query(&mut conn).unwrap();
    }
    let rules = r#"
channels:
  log: { type: log }
rules:
  - name: order-lock
    match: "order-lock:{id}"
    notify: { to: [log] }
  - name: sessions
    match: "session:{sid}"
    notify: { to: [log] }
"#;
    let out = Doctor::new(rules).run(&redis.url(), &["--json"]);
    assert_eq!(code(&out), Some(0), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = |name: &str| {
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no check {name:?} in {report:#}"))
            .clone()
    };
    let typo = check("rule order-lock");
    assert_eq!(typo["verdict"], "warn", "{typo:#}");
    let detail = typo["detail"].as_str().unwrap();
    assert!(detail.contains("no key matches"), "{typo:#}");
    assert!(detail.contains("order_lock:1"), "{typo:#}");
    assert!(!detail.contains("session:s1"), "{typo:#}");
    assert!(
        typo["fix"].as_str().unwrap().contains("explain"),
        "{typo:#}"
    );
    assert_eq!(check("rule sessions")["verdict"], "ok");

    // A database with no key yet shows no typo: nothing to warn about in any rule.
    let empty = RedisServer::builder().notify_keyspace_events("KEA").start();
    let out = Doctor::new(rules).run(&empty.url(), &["--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let warnings: Vec<&serde_json::Value> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["verdict"] == "warn" && c["check"].as_str().is_some_and(|n| n.starts_with("rule "))
        })
        .collect();
    assert!(warnings.is_empty(), "{report:#}");
}

#[test]
fn a_replica_fails_and_names_its_master() {
    let master = RedisServer::builder().notify_keyspace_events("Exg").start();
    let replica = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .arg("--replicaof")
        .arg(format!("127.0.0.1 {}", master.port()))
        .start();
    let out = Doctor::new(RULES).run(&replica.url(), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(t.contains("FAIL  role"), "{t}");
    assert!(
        t.contains(&format!("is a replica of 127.0.0.1:{}", master.port())),
        "{t}"
    );
    assert!(
        t.contains(&format!(
            "fix: point keywatch at the master: --redis redis://127.0.0.1:{}",
            master.port()
        )),
        "{t}"
    );
}

/// The documented user with `drop` taken out of its line, and doctor run as that user.
fn doctor_as_documented_user_without(drop: &str) -> (RedisServer, String, Option<i32>) {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let lines = documented_acl("kw-pass");
    let base: Vec<String> = lines[0].iter().filter(|w| *w != drop).cloned().collect();
    assert_ne!(base, lines[0], "the documented line has no {drop:?}");
    acl(&redis, &base);
    let url = format!("redis://keywatch:kw-pass@{}", redis.addr());
    let out = Doctor::new(RULES).run(&url, &[]);
    let t = text(&out);
    let c = code(&out);
    (redis, t, c)
}

#[test]
fn a_user_without_config_get_fails_naming_the_command_and_the_grant() {
    let (_redis, t, code) = doctor_as_documented_user_without("+config|get");
    assert_eq!(code, Some(1), "{t}");
    assert!(t.contains("FAIL  permissions (command)"), "{t}");
    assert!(
        t.contains("CONFIG GET notify-keyspace-events (reads notify-keyspace-events"),
        "{t}"
    );
    assert!(t.contains("fix: ACL SETUSER keywatch +config|get"), "{t}");
    // Without CONFIG GET the flags cannot be read either, and doctor says what to do instead.
    assert!(t.contains("FAIL  notifications"), "{t}");
    assert!(t.contains("parameter group"), "{t}");
}

/// A reload that stops watching a database leaves its channels: without `+unsubscribe` that
/// ends the session (and loses events), so doctor checks it like any command `run` sends.
#[test]
fn a_user_without_unsubscribe_fails_naming_the_command_and_the_grant() {
    let (_redis, t, code) = doctor_as_documented_user_without("+unsubscribe");
    assert_eq!(code, Some(1), "{t}");
    assert!(t.contains("UNSUBSCRIBE"), "{t}");
    assert!(t.contains("fix: ACL SETUSER keywatch +unsubscribe"), "{t}");
}

#[test]
fn a_user_without_its_state_prefix_fails_naming_the_keys_and_the_grant() {
    let (_redis, t, code) = doctor_as_documented_user_without("~keywatch:*");
    assert_eq!(code, Some(1), "{t}");
    assert!(t.contains("FAIL  permissions (key)"), "{t}");
    assert!(t.contains("ZADD keywatch:intake"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.trim().starts_with("fix: ACL SETUSER keywatch ")
                && l.split_whitespace().any(|w| w == "~keywatch:*")),
        "{t}"
    );
}

#[test]
fn the_documented_user_without_the_cleanup_line_fails_on_cleanup_only() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let lines = documented_acl("kw-pass");
    acl(&redis, &lines[0]);
    let url = format!("redis://keywatch:kw-pass@{}", redis.addr());
    let doctor = Doctor::new(RULES);
    let out = doctor.run(&url, &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(
        t.contains("UNLINK cart:keywatch-doctor (cleanup of rule sessions)"),
        "{t}"
    );
    assert!(!t.contains("FAIL  permissions (channel)"), "{t}");
    assert!(!t.contains("ZADD keywatch:"), "{t}");
    // With the documented cleanup line, everything keywatch sends is allowed, every permission
    // checked (MULTI … DISCARD: nothing ran).
    acl(&redis, &lines[1]);
    let out = doctor.run(&url, &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(0), "{t}");
    assert!(t.contains("ok    permissions"), "{t}");
    assert!(t.contains("queued in MULTI and discarded"), "{t}");
    assert!(!t.contains("could not be checked"), "{t}");
}

#[test]
fn the_password_of_the_url_never_reaches_the_output() {
    let secret = "s3cr3t-Doctor-Pass";
    let redis = RedisServer::builder().requirepass(secret).start();
    let doctor = Doctor::new(RULES);
    let good = format!("redis://:{secret}@{}", redis.addr());
    let wrong = format!("redis://:wr0ng-{secret}@{}", redis.addr());
    let port = common::ports::closed_port();
    let closed = format!("redis://:{secret}@127.0.0.1:{}", port.port);
    for (url, expect) in [(&good, 1), (&wrong, 1), (&closed, 1)] {
        for extra in [&[][..], &["--json"][..]] {
            let out = doctor.run(url, extra);
            let t = text(&out);
            assert_eq!(code(&out), Some(expect), "{t}");
            assert!(!t.contains(secret), "the password leaked:\n{t}");
        }
    }
    // The good URL got as far as the checks (it fails only on the flags).
    let t = text(&doctor.run(&good, &[]));
    assert!(t.contains("ok    reachable"), "{t}");
    let t = text(&doctor.run(&wrong, &[]));
    assert!(t.contains("FAIL  reachable"), "{t}");
}

/// A server answering whatever arrives as an HTTP server answers a request line it cannot
/// read (nginx, Python's `http.server`): `400 Bad Request`, then it closes. Its port.
fn http_server_refusing_every_request() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    common::ports::reserve(port);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\nContent-Length: 11\r\nConnection: close\r\n\r\n<html></ht>",
            );
        }
    });
    port
}

/// `--redis` pointed at an HTTP port: the server answered, but not as Redis does, and the
/// error says so and asks about the port, instead of redis-rs's `Parse error at 1 / Unexpected
/// 33` (doctor, run and the state commands alike).
#[test]
fn a_server_that_does_not_speak_redis_is_named_as_such() {
    let port = http_server_refusing_every_request();
    let url = format!("redis://127.0.0.1:{port}");
    let want = format!("does not answer as a Redis server (is {port} the right port?)");
    let doctor = Doctor::new(RULES);
    let t = text(&doctor.run(&url, &[]));
    assert!(t.contains("FAIL  reachable"), "{t}");
    assert!(t.contains(&want), "{t}");
    assert!(!t.contains("Parse error"), "{t}");
    for args in [&["run"][..], &["silence", "list"][..]] {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["-r", &doctor.rules, "--redis", &url]);
        let out = run_keywatch(&all, &[]);
        let t = text(&out);
        assert_ne!(code(&out), Some(0), "{t}");
        assert!(t.contains(&want), "{args:?}: {t}");
        assert!(!t.contains("Parse error"), "{args:?}: {t}");
    }
}

/// docs/redis.md#keep-applications-out-of-keywatchs-state: on a Redis whose default user (every
/// client that does not log in) may write `keywatch:*`, doctor warns and prints the ACL lines
/// that keep applications out; with them applied (and keywatch's documented user), it is
/// content.
#[test]
fn doctor_warns_when_applications_may_write_keywatchs_state_and_prints_the_acl() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let doctor = Doctor::new(RULES);
    let t = text(&doctor.run(&redis.url(), &[]));
    let warning = t
        .split("\nwarn  state access")
        .nth(1)
        .unwrap_or_else(|| panic!("no state access warning:\n{t}"));
    assert!(
        warning.contains("user(s) \"default\" may write keywatch's state (keywatch:*)"),
        "{t}"
    );
    let fix: Vec<&str> = warning
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("ACL SETUSER"))
        .collect();
    assert_eq!(
        fix,
        [
            "ACL SETUSER app on >APP_PASSWORD resetkeys ~order_lock:* ~session:* +@all -@admin -@dangerous",
            "ACL SETUSER default off"
        ],
        "{t}"
    );
    // Applied, with an administrator to run doctor as and keywatch's documented user.
    acl(
        &redis,
        &"ACL SETUSER admin on >adm-pass ~* &* +@all"
            .split(' ')
            .map(String::from)
            .collect::<Vec<_>>(),
    );
    for line in documented_acl("kw-pass") {
        acl(&redis, &line);
    }
    for line in fix {
        let line = line.replace("APP_PASSWORD", "app-pass");
        acl(
            &redis,
            &line.split(' ').map(String::from).collect::<Vec<_>>(),
        );
    }
    let admin = format!("redis://admin:adm-pass@{}", redis.addr());
    let t = text(&doctor.run(&admin, &[]));
    assert!(
        t.contains(
            "ok    state access     no user but keywatch's may write its state (keywatch:*)"
        ),
        "{t}"
    );
}

#[test]
fn a_url_that_does_not_parse_is_a_usage_error() {
    let out = Doctor::new(RULES).run("not a url", &[]);
    assert_eq!(code(&out), Some(2), "{}", text(&out));
}

#[test]
fn a_detail_removed_after_reading_needs_write_access_to_its_hash() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    for line in documented_acl("kw-pass") {
        acl(&redis, &line);
    }
    let doctor = Doctor::new(
        r#"
rules:
  - name: close-order
    match: "delay:task:{id}"
    detail: { hash: "order:detail", field: "{{ id }}", remove: true }
    notify: { to: [log] }
channels:
  log: { type: log }
"#,
    );
    let out = doctor.run(&format!("redis://keywatch:kw-pass@{}", redis.addr()), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(
        t.contains("HDEL order:detail keywatch-doctor (detail removal of rule close-order)"),
        "{t}"
    );
    assert!(
        !t.contains("HMGET order:detail"),
        "reading it is allowed:\n{t}"
    );
    assert!(t.contains("fix: ACL SETUSER keywatch ~order:detail"), "{t}");
}

#[test]
fn a_cluster_lists_its_masters_and_fails_on_the_one_without_flags() {
    let cluster = common::RedisCluster::builder()
        .masters(3)
        .notify_keyspace_events("Exg")
        .start();
    let masters = cluster.masters();
    let quiet = cluster.node(masters[1]);
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("")
        .query(&mut quiet.conn())
        .unwrap();
    let doctor = Doctor::new(&format!("redis: {{ cluster: true }}\n{RULES}"));
    let out = doctor.run(&cluster.seed_url(), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(t.contains("ok    cluster"), "{t}");
    assert!(t.contains("3 master(s) serving slots"), "{t}");
    for &m in &masters {
        let addr = cluster.node(m).addr();
        let verdict = if m == masters[1] { "FAIL" } else { "ok  " };
        assert!(
            t.contains(&format!("{verdict}  notifications {addr}")),
            "{addr} should be {verdict}:\n{t}"
        );
    }
    assert!(
        t.contains(&format!(
            "fix: redis-cli -h 127.0.0.1 -p {} CONFIG SET notify-keyspace-events",
            quiet.port()
        )),
        "{t}"
    );
    // Permissions are not confused by keys another node owns.
    assert!(t.contains("ok    permissions"), "{t}");

    // The same cluster with `redis.cluster` left false: keywatch would hear one node only.
    let out = Doctor::new(RULES).run(&cluster.seed_url(), &[]);
    let t = text(&out);
    assert_eq!(code(&out), Some(1), "{t}");
    assert!(t.contains("FAIL  cluster"), "{t}");
    assert!(t.contains("set `redis.cluster: true`"), "{t}");
}

#[test]
fn the_documented_user_has_every_permission_the_example_rules_need() {
    let redis = RedisServer::builder()
        .notify_keyspace_events("Exeg")
        .start();
    for line in documented_acl("kw-pass") {
        acl(&redis, &line);
    }
    // The hash-field example needs a server with hash-field expiry, which the default one is not:
    // tests/e2e/hash_fields.rs runs it, under all three documented lines, on Valkey.
    let rules = tempfile::tempdir().unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["rules", "extra-rules"] {
        for file in std::fs::read_dir(repo.join(dir)).unwrap() {
            let path = file.unwrap().path();
            if !std::fs::read_to_string(&path)
                .unwrap()
                .contains("on: [hexpired]")
            {
                std::fs::copy(&path, rules.path().join(path.file_name().unwrap())).unwrap();
            }
        }
    }
    let rules = rules.path();
    let url = format!("redis://keywatch:kw-pass@{}", redis.addr());
    let out = run_keywatch(
        ["doctor", "--redis", &url, "-r", rules.to_str().unwrap()],
        &[],
    );
    let t = text(&out);
    assert_eq!(code(&out), Some(0), "{t}");
    assert!(t.contains("ok    permissions"), "{t}");
}

#[test]
fn a_user_without_multi_gets_its_reads_checked_and_the_rest_reported_unchecked() {
    let (_redis, t, code) = doctor_as_documented_user_without("+multi");
    // keywatch stores jobs in a transaction: MULTI is refused, and said so with its grant.
    assert_eq!(code, Some(1), "{t}");
    assert!(t.contains("FAIL  permissions (command)"), "{t}");
    // The intake's record moves on with its jobs in one transaction too: named first.
    assert!(t.contains("MULTI (intake: claims and taken events)"), "{t}");
    // EXEC without a MULTI tells nothing of EXEC's own grant: not reported as refused.
    assert!(!t.contains("EXEC without MULTI"), "{t}");
    assert!(
        t.contains("MULTI is refused, so EXEC cannot be checked"),
        "{t}"
    );
    // Writes could not be checked without running them: a warning, not a guess.
    assert!(t.contains("warn  permissions"), "{t}");
    assert!(t.contains("could not be checked"), "{t}");
    assert!(t.contains("SET keywatch:claim:keywatch-doctor"), "{t}");
    assert!(
        !t.contains("PEXPIRETIME order_lock:keywatch-doctor:"),
        "reads are run for real, so they are checked:\n{t}"
    );
    assert!(t.contains("ACL SETUSER keywatch +multi +discard"), "{t}");
}
