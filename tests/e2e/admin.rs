//! `keywatch silence` and `keywatch dead` against running instances.

use crate::common;

use std::time::Duration;

use common::{HttpReceiver, PATIENCE, RedisServer, Response, run_keywatch, wait_until};

fn cli(redis: &RedisServer, rules: &std::path::Path, args: &[&str]) -> (i32, String) {
    let mut all: Vec<&str> = args.to_vec();
    let url = redis.url();
    all.extend(["-r", rules.to_str().unwrap(), "--redis", &url]);
    let out = run_keywatch(all, &[]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn expire(redis: &RedisServer, key: &str) {
    let mut c = redis.conn();
    common::set_px(&mut c, key, 50);
}

/// Expires `key` and waits for its notification's dead letter (the receiver refuses it).
fn dead_letter_of(redis: &RedisServer, rules: &std::path::Path, key: &str) {
    expire(redis, key);
    wait_until("the dead letter is stored", Duration::from_secs(10), || {
        cli(redis, rules, &["dead", "list"]).1.contains(key)
    });
}

/// Waits until no job is left in the queue.
fn queue_drained(redis: &RedisServer) {
    wait_until("the queue is empty", Duration::from_secs(10), || {
        redis::cmd("ZCARD")
            .arg("keywatch:queue")
            .query::<i64>(&mut redis.conn())
            .unwrap()
            == 0
    });
}

/// Two instances on one Redis, with the lock rule posting to a receiver.
struct TwoInstances {
    redis: RedisServer,
    receiver: HttpReceiver,
    rules: std::path::PathBuf,
    a: common::KeywatchProcess,
    b: common::KeywatchProcess,
    _dir: tempfile::TempDir,
}

fn two_instances() -> TwoInstances {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let a = common::run_on(&redis, &rules);
    let b = common::run_on(&redis, &rules);
    TwoInstances {
        redis,
        receiver,
        rules,
        a,
        b,
        _dir: dir,
    }
}

#[test]
fn silences_are_obeyed_by_every_instance_and_lifted_on_time() {
    let TwoInstances {
        redis,
        receiver,
        rules,
        a,
        b,
        _dir,
    } = two_instances();

    let (code, out) = cli(
        &redis,
        &rules,
        &[
            "silence",
            "add",
            "--rule",
            "lock-expired",
            "--match",
            "lock:1*",
            "--for",
            "4s",
            "--comment",
            "maintenance",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("muted until"), "{out}");
    let (code, out) = cli(&redis, &rules, &["silence", "list"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("lock-expired") && out.contains("maintenance"),
        "{out}"
    );
    let (code, out) = cli(
        &redis,
        &rules,
        &[
            "silence",
            "add",
            "--rule",
            "lock-expird",
            "--for",
            "1h",
            "--comment",
            "x",
        ],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("did you mean `lock-expired`"), "{out}");

    // Wait until both instances obey the silence (their status pages list the silences they
    // hold), then expire a silenced and a free key.
    for kw in [&a, &b] {
        let addr = common::endpoint(kw);
        wait_until(
            "the instance holds the silence",
            Duration::from_secs(10),
            || {
                let (_, page) = common::get(&addr, "/");
                page.split_once("<section id=\"silences\">")
                    .is_some_and(|(_, silences)| silences.contains("maintenance"))
            },
        );
    }
    expire(&redis, "lock:10");
    expire(&redis, "lock:20");
    let got = receiver.wait_for(1, Duration::from_secs(10));
    // Then a free key, after them: an alert for lock:10 would have come before it.
    expire(&redis, "lock:21");
    let keys: Vec<String> = receiver
        .wait_past(&["lock:21"], Duration::from_secs(10))
        .iter()
        .map(|r| r.json()["key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys, ["lock:20"], "{got:?}");

    // After the silence ends, the same keys alert again.
    wait_until("the silence ended", Duration::from_secs(10), || {
        cli(&redis, &rules, &["silence", "list"])
            .1
            .contains("no silences")
    });
    expire(&redis, "lock:11");
    receiver.wait_for(3, Duration::from_secs(10));
    assert_eq!(receiver.requests()[2].json()["key"], "lock:11");
}

/// Whether the status page of `kw` lists a silence with `comment`.
fn holds_silence(kw: &common::KeywatchProcess, comment: &str) -> bool {
    let (_, page) = common::get(&common::endpoint(kw), "/");
    page.split_once("<section id=\"silences\">")
        .is_some_and(|(_, silences)| silences.contains(comment))
}

/// docs/operations.md#silences-and-dead-letters: a silence added or removed with `keywatch
/// silence` applies on every running instance at once (the command's notice), not at their next
/// read of silences (every 30 s without one; every second before notices, whatever changed).
#[test]
fn a_silence_added_or_removed_applies_on_every_instance_at_once() {
    let t = two_instances();
    let (redis, rules, a, b) = (&t.redis, &t.rules, &t.a, &t.b);
    let add = |comment: &str| {
        let args = [
            "silence",
            "add",
            "--rule",
            "lock-expired",
            "--for",
            "1h",
            "--comment",
        ];
        let (code, out) = cli(redis, rules, &[&args[..], &[comment]].concat());
        assert_eq!(code, 0, "{out}");
        out.split_whitespace().nth(1).unwrap().to_string()
    };
    // Both instances settled: they hold a first silence, however they came to read it.
    let first = add("first");
    for kw in [a, b] {
        wait_until("the instance holds the first silence", PATIENCE, || {
            holds_silence(kw, "first")
        });
    }
    // Within a second of the notice (3 s for a loaded machine).
    add("second");
    for kw in [a, b] {
        wait_until(
            "the instance holds the second silence",
            Duration::from_secs(3),
            || holds_silence(kw, "second"),
        );
    }
    let (code, out) = cli(redis, rules, &["silence", "remove", &first]);
    assert_eq!(code, 0, "{out}");
    for kw in [a, b] {
        wait_until(
            "the instance dropped the first silence",
            Duration::from_secs(3),
            || !holds_silence(kw, "first"),
        );
    }
}

#[test]
fn dead_letters_are_kept_listed_redriven_and_dropped() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::with_default(Response::status(404).body("no such hook"));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let _kw = common::run_on(&redis, &rules);

    dead_letter_of(&redis, &rules, "lock:1");
    let (code, out) = cli(&redis, &rules, &["dead", "list", "--json"]);
    assert_eq!(code, 0, "{out}");
    let letter: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(letter["rule"], "lock-expired");
    assert!(
        letter["reason"].as_str().unwrap().contains("HTTP 404"),
        "{letter}"
    );

    // The hook is fixed; re-drive: a running instance sends it within a second or two.
    receiver.set_default(Response::ok_body("ok"));
    let (code, out) = cli(&redis, &rules, &["dead", "retry", "--all"]);
    assert_eq!(code, 0, "{out}");
    let got = receiver.wait_for(2, Duration::from_secs(10));
    assert_eq!(got[1].json()["key"], "lock:1");
    assert!(
        cli(&redis, &rules, &["dead", "list"])
            .1
            .contains("no dead letters")
    );

    receiver.set_default(Response::status(410).body("gone"));
    expire(&redis, "lock:2");
    wait_until(
        "the second dead letter is stored",
        Duration::from_secs(10),
        || cli(&redis, &rules, &["dead", "list"]).1.contains("lock:2"),
    );
    let (code, out) = cli(&redis, &rules, &["dead", "drop", "--all"]);
    assert_eq!((code, out.trim()), (0, "1 dead letter(s) dropped"));
    assert!(
        cli(&redis, &rules, &["dead", "list"])
            .1
            .contains("no dead letters")
    );
}

/// A dead letter is re-driven through the durable queue: an attempt that fails again with a
/// retryable answer is retried, not dropped (docs/operations.md#silences-and-dead-letters).
#[test]
fn a_redriven_dead_letter_that_fails_again_is_retried_not_dropped() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::with_default(Response::status(404).body("no such hook"));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let _kw = common::run_on(&redis, &rules);

    dead_letter_of(&redis, &rules, "lock:1");
    // The hook comes back busy once, then well.
    receiver.push(Response::status(503).body("busy"));
    receiver.set_default(Response::ok_body("ok"));
    let (code, out) = cli(&redis, &rules, &["dead", "retry", "--all"]);
    assert_eq!(code, 0, "{out}");
    let got = receiver.wait_for(3, Duration::from_secs(15));
    assert_eq!(got[1].json()["key"], "lock:1");
    assert_eq!(got[2].json()["key"], "lock:1", "the 503 was not retried");
    queue_drained(&redis);
    assert!(
        cli(&redis, &rules, &["dead", "list"])
            .1
            .contains("no dead letters")
    );
}

/// `dead retry` while no instance runs: the letter waits in the queue, not in memory, and the
/// next instance sends it; a digest's letter goes out as one digest again.
#[test]
fn a_digest_retried_while_no_instance_runs_is_sent_as_one_digest_by_the_next() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::with_default(Response::status(404).body("no such hook"));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        &format!(
            "channels:\n  hook: {{ type: webhook, url: \"{}\" }}\nrules:\n  - name: burst\n    match: \"burst:{{n}}\"\n    notify: {{ to: [hook], group: {{ window: 1s }} }}\n",
            receiver.url_for("/hook")
        ),
    );
    let mut kw = common::run_on(&redis, &rules);
    {
        let mut c = redis.conn();
        for i in 0..5 {
            common::set_px(&mut c, format!("burst:{i}"), 50);
        }
    }
    wait_until("the digest is dead", Duration::from_secs(15), || {
        cli(&redis, &rules, &["dead", "list"]).1.contains("burst")
    });
    let sent = receiver.count();
    assert_eq!(
        receiver
            .requests()
            .iter()
            .map(|r| r.json()["count"].as_u64().unwrap())
            .sum::<u64>(),
        5
    );
    kw.stop();

    receiver.set_default(Response::ok_body("ok"));
    let (code, out) = cli(&redis, &rules, &["dead", "retry", "--all"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        cli(&redis, &rules, &["dead", "list"])
            .1
            .contains("no dead letters")
    );
    let _kw = common::run_on(&redis, &rules);
    let got = receiver.wait_for(sent + 1, Duration::from_secs(15));
    let digest = got[sent].json();
    assert_eq!(digest["count"], 5, "{digest}");
    let mut keys: Vec<&str> = digest["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["burst:0", "burst:1", "burst:2", "burst:3", "burst:4"]
    );
}
