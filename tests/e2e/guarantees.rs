//! docs/reliability.md#guarantees at its edges, each scenario as a new user met it: a task deleted while keywatch was
//! down must not be acted on as expired (`recover`), one unreadable detail must not send its
//! whole batch with `detail: null`, and a host clock that is off must neither double nor drop
//! work. Real redis-server children, real HTTP receivers, the real binary.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{HttpReceiver, Logs, RedisServer, wait_until};

const PATIENCE: Duration = Duration::from_secs(60);

/// Requests per key, and the detail of the last one.
fn by_key(receiver: &HttpReceiver) -> BTreeMap<String, (usize, serde_json::Value, bool)> {
    let mut out: BTreeMap<String, (usize, serde_json::Value, bool)> = BTreeMap::new();
    for r in receiver.requests() {
        let j = r.json();
        let key = j["key"].as_str().expect("event JSON has a key").to_string();
        let e = out
            .entry(key)
            .or_insert((0, serde_json::Value::Null, false));
        e.0 += 1;
        e.1 = j["detail"].clone();
        e.2 = j["recovered"] == true;
    }
    out
}

/// A scenario's start: a Redis, a receiver, and rules in a directory of their own.
fn rig() -> (RedisServer, HttpReceiver, tempfile::TempDir) {
    (
        RedisServer::builder().notify_keyspace_events("Exg").start(),
        HttpReceiver::start(),
        tempfile::tempdir().unwrap(),
    )
}

fn task_rules(dir: &Path, receiver: &HttpReceiver, detail: &str) -> PathBuf {
    common::hook_rules(
        dir,
        receiver,
        &format!(
            "rules:\n  - name: close-unpaid\n    match: \"delay:task:{{id}}\"\n    detail: {detail}\n    notify: {{ to: [hook] }}\n"
        ),
    )
}

/// Ten tasks with details; keywatch stops; the application completes five of them (key and
/// detail deleted: the orders were paid); every deadline passes; keywatch starts again. The
/// five unpaid ones fire, recovered, with their details; the five paid ones do not fire, and are
/// counted and logged as skipped. Before `recover`, all ten fired, the paid ones with
/// `detail: null` — "close unpaid order" for orders that were paid.
#[test]
fn a_task_deleted_while_keywatch_was_down_is_not_acted_on_as_expired() {
    let (redis, receiver, dir) = rig();
    let rules = task_rules(
        dir.path(),
        &receiver,
        r#"{ hash: "delay:detail", field: "{{ id }}", remove: true }"#,
    );
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let mut c = redis.conn();
    for i in 0..10 {
        let () = redis::cmd("HSET")
            .arg("delay:detail")
            .arg(i)
            .arg(format!(r#"{{"order": {i}}}"#))
            .query(&mut c)
            .unwrap();
        common::set_px(&mut c, format!("delay:task:{i}"), 3000);
    }
    wait_until("the ledger knows the ten deadlines", PATIENCE, || {
        common::ledger::len(&mut redis.conn(), "keywatch:") == 10
    });
    kw.sigkill();
    for i in 0..5 {
        let () = redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(format!("delay:task:{i}"))
            .ignore()
            .cmd("HDEL")
            .arg("delay:detail")
            .arg(i)
            .ignore()
            .query(&mut c)
            .unwrap();
    }
    wait_until("every deadline has passed", PATIENCE, || {
        (5..10).all(|i| {
            redis::cmd("EXISTS")
                .arg(format!("delay:task:{i}"))
                .query::<i64>(&mut redis.conn())
                .unwrap()
                == 0
        })
    });
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    wait_until("the five unpaid tasks are recovered", PATIENCE, || {
        by_key(&receiver).len() >= 5
    });
    let addr = common::endpoint::endpoint(&kw);
    wait_until(
        "the five paid tasks are counted as skipped",
        PATIENCE,
        || {
            let (_, body) = common::endpoint::get(&addr, "/metrics");
            common::endpoint::metric(
                &body,
                "keywatch_recovery_skipped_total{rule=\"close-unpaid\"}",
            ) == 5.0
        },
    );
    let d = by_key(&receiver);
    let keys: Vec<&String> = d.keys().collect();
    assert_eq!(
        keys,
        (5..10)
            .map(|i| format!("delay:task:{i}"))
            .collect::<Vec<_>>()
            .iter()
            .collect::<Vec<_>>()
    );
    for (key, (n, detail, recovered)) in &d {
        assert_eq!(*n, 1, "{key}");
        assert!(recovered, "{key}");
        assert!(detail["order"].is_number(), "{key}: {detail}");
    }
    // Each skip is said with its key and why (the line may follow its count by a moment).
    let skipped = kw.wait_for_events("recovery_skipped", 5, "of the paid tasks", |_| true);
    let keys: BTreeSet<&str> = skipped.iter().filter_map(|e| e["key"].as_str()).collect();
    let paid: BTreeSet<String> = (0..5).map(|i| format!("delay:task:{i}")).collect();
    assert_eq!(
        keys,
        paid.iter().map(String::as_str).collect(),
        "{}",
        kw.stderr()
    );
    assert!(
        skipped
            .iter()
            .all(|e| e["reason"].as_str().is_some_and(|r| !r.is_empty())),
        "{skipped:#?}"
    );
}

/// `recover: never`: nothing found afterwards fires; `always`: even a deleted task fires.
#[test]
fn recover_never_and_always_do_what_they_say() {
    let (redis, receiver, dir) = rig();
    let rules = common::hook_rules(
        dir.path(),
        &receiver,
        r#"rules:
  - name: quiet
    match: "quiet:{id}"
    recover: never
    notify: { to: [hook] }
  - name: loud
    match: "loud:{id}"
    detail: { key: "loud-detail:{{ id }}" }
    recover: always
    notify: { to: [hook] }
"#,
    );
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let mut c = redis.conn();
    common::set_px(&mut c, "quiet:1", 2000);
    common::set_px(&mut c, "loud:1", 2000);
    wait_until("the ledger knows both deadlines", PATIENCE, || {
        common::ledger::len(&mut redis.conn(), "keywatch:") == 2
    });
    kw.sigkill();
    wait_until("both deadlines have passed", PATIENCE, || {
        redis::cmd("EXISTS")
            .arg("quiet:1")
            .arg("loud:1")
            .query::<i64>(&mut redis.conn())
            .unwrap()
            == 0
    });
    let kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let addr = common::endpoint::endpoint(&kw);
    wait_until("`never` counted its skip", PATIENCE, || {
        let (_, body) = common::endpoint::get(&addr, "/metrics");
        common::endpoint::metric(&body, "keywatch_recovery_skipped_total{rule=\"quiet\"}") == 1.0
    });
    wait_until("`always` fired without its detail", PATIENCE, || {
        by_key(&receiver).contains_key("loud:1")
    });
    let d = by_key(&receiver);
    assert!(!d.contains_key("quiet:1"), "{d:?}");
    assert_eq!(d["loud:1"].0, 1);
    assert!(d["loud:1"].2, "not marked recovered");
}

/// 50 tasks whose details are keys of their own; one of them is a hash (`WRONGTYPE` for `GET`).
/// The 49 healthy tasks fire at once with their details; the broken one does not fire with
/// `detail: null`: it waits, is retried, and fires with its detail once the key is fixed. Before,
/// one error failed the whole pipeline: all 50 fired with `detail: null`, and the broken one was
/// never retried.
#[test]
fn one_unreadable_detail_holds_back_only_its_own_task_until_it_can_be_read() {
    let (redis, receiver, dir) = rig();
    let rules = task_rules(
        dir.path(),
        &receiver,
        r#"{ key: "delay:detail:{{ id }}", remove: true }"#,
    );
    let kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let mut c = redis.conn();
    for i in 0..50 {
        if i == 13 {
            let () = redis::cmd("HSET")
                .arg("delay:detail:13")
                .arg("order")
                .arg(13)
                .query(&mut c)
                .unwrap();
        } else {
            let () = redis::cmd("SET")
                .arg(format!("delay:detail:{i}"))
                .arg(format!(r#"{{"order": {i}}}"#))
                .query(&mut c)
                .unwrap();
        }
    }
    let keys: Vec<String> = (0..50).map(|i| format!("delay:task:{i}")).collect();
    common::set_and_expire_now(&mut c, &keys);
    wait_until("the 49 healthy tasks are delivered", PATIENCE, || {
        by_key(&receiver).len() >= 49
    });
    let d = by_key(&receiver);
    assert!(
        !d.contains_key("delay:task:13"),
        "fired without its detail: {:?}",
        d.get("delay:task:13")
    );
    for (key, (n, detail, _)) in &d {
        assert_eq!(*n, 1, "{key}");
        assert!(detail["order"].is_number(), "{key}: {detail}");
    }
    // Fixed by the application: the retry finds it.
    let () = redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg("delay:detail:13")
        .ignore()
        .cmd("SET")
        .arg("delay:detail:13")
        .arg(r#"{"order": 13}"#)
        .ignore()
        .query(&mut c)
        .unwrap();
    wait_until(
        "the broken task is delivered once readable",
        PATIENCE,
        || by_key(&receiver).contains_key("delay:task:13"),
    );
    let d = by_key(&receiver);
    assert_eq!(d["delay:task:13"].0, 1);
    assert_eq!(d["delay:task:13"].1["order"], 13);
    let addr = common::endpoint::endpoint(&kw);
    let (_, body) = common::endpoint::get(&addr, "/metrics");
    assert!(
        common::endpoint::metric(&body, "keywatch_detail_read_failures_total") >= 1.0,
        "{body}"
    );
    wait_until("every detail is removed", PATIENCE, || {
        redis::cmd("KEYS")
            .arg("delay:detail:*")
            .query::<Vec<String>>(&mut redis.conn())
            .unwrap()
            .is_empty()
    });
}

/// Two instances, one of them on a host whose clock runs 20 s fast (libfaketime), share jobs
/// whose receiver takes 3 s to answer. Compared against its own clock, the fast instance saw the
/// other's leases as long over, took jobs still being sent and sent them again; its poker
/// touched keys 20 s before they were due. Against Redis's clock, every task is delivered once.
/// Both run with a 5 s lease (`KEYWATCH_LEASE`): still far shorter than the clock is off.
#[test]
fn a_host_clock_twenty_seconds_fast_neither_doubles_nor_drops_work() {
    let faketime = common::tools::libfaketime();
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver =
        HttpReceiver::with_default(common::Response::status(200).delay(Duration::from_secs(3)));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let _honest = common::run_subscribed(
        &redis.url(),
        &rules,
        Logs::Text,
        &[("KEYWATCH_LEASE", "5s")],
    );
    let mut fast = common::run_subscribed(
        &redis.url(),
        &rules,
        Logs::Text,
        &[
            ("KEYWATCH_LEASE", "5s"),
            ("LD_PRELOAD", faketime.as_str()),
            ("FAKETIME", "+20s"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("FAKETIME_NO_CACHE", "1"),
        ],
    );
    // The drill itself works: the instance's host clock is off, and it says so.
    let offset = fast.wait_for_event("clock_offset", "of the faked clock", |_| true);
    let offset_ms = offset["offset_ms"]
        .as_str()
        .and_then(|s| s.parse::<i64>().ok());
    assert!(
        offset_ms.is_some_and(|ms| (-25_000..=-15_000).contains(&ms)),
        "the host is 20 s ahead: {offset}"
    );
    let mut c = redis.conn();
    for i in 0..40 {
        common::set_px(&mut c, format!("lock:{i}"), 1500);
    }
    wait_until("40 keys are delivered", PATIENCE, || {
        by_key(&receiver).len() >= 40
    });
    // Every job done: nothing is left in the queue or the intake to be taken twice, and every
    // attempt's request has reached the receiver (it counts a request when it arrives).
    wait_until("the queue and the intake are empty", PATIENCE, || {
        let queued: i64 = redis::cmd("ZCARD")
            .arg("keywatch:queue")
            .query(&mut c)
            .unwrap();
        let taken: i64 = redis::cmd("ZCARD")
            .arg("keywatch:intake")
            .query(&mut c)
            .unwrap();
        queued == 0 && taken == 0
    });
    let d = by_key(&receiver);
    assert_eq!(d.len(), 40);
    let doubled: Vec<_> = d.iter().filter(|(_, v)| v.0 != 1).collect();
    assert!(doubled.is_empty(), "delivered twice: {doubled:?}");
    assert!(
        d.values().all(|v| !v.2),
        "recovered instead of on time: {d:?}"
    );
}

/// The queue cannot be written (here a string sits where keywatch keeps it; in life, a full or
/// read-only state Redis): the task must neither run from memory nor lose its detail. It waits,
/// taken, and fires with its detail once the queue can be written again. Before, keywatch ran
/// the jobs from memory without bound and removed the details anyway: a crash then lost both.
#[test]
fn a_queue_that_cannot_be_written_holds_the_task_and_keeps_its_detail() {
    let (redis, receiver, dir) = rig();
    let rules = task_rules(
        dir.path(),
        &receiver,
        r#"{ hash: "delay:detail", field: "{{ id }}", remove: true }"#,
    );
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let mut c = redis.conn();
    let () = redis::cmd("SET")
        .arg("keywatch:queue")
        .arg("in the way")
        .query(&mut c)
        .unwrap();
    let () = redis::cmd("HSET")
        .arg("delay:detail")
        .arg(7)
        .arg(r#"{"order": 7}"#)
        .query(&mut c)
        .unwrap();
    common::set_and_expire_now(&mut c, &["delay:task:7"]);
    kw.wait_for_event("state_error", "saying the jobs could not be stored", |e| {
        e["operation"] == "store"
    });
    assert!(receiver.requests().is_empty(), "ran from memory");
    let detail: Option<String> = redis::cmd("HGET")
        .arg("delay:detail")
        .arg(7)
        .query(&mut c)
        .unwrap();
    assert!(
        detail.is_some(),
        "the detail was removed though no job was stored"
    );
    let () = redis::cmd("DEL")
        .arg("keywatch:queue")
        .query(&mut c)
        .unwrap();
    wait_until(
        "the task fires once the queue can be written",
        PATIENCE,
        || by_key(&receiver).contains_key("delay:task:7"),
    );
    let d = by_key(&receiver);
    assert_eq!(d["delay:task:7"].0, 1);
    assert_eq!(d["delay:task:7"].1["order"], 7);
    wait_until("the detail is removed", PATIENCE, || {
        redis::cmd("HLEN")
            .arg("delay:detail")
            .query::<i64>(&mut redis.conn())
            .unwrap()
            == 0
    });
}

/// `recover: { when, max_late }`: keywatch is down while two keys expire and starts again more
/// than 2 s after their deadline. The rule with `max_late: 2s` skips its key (counted, logged,
/// kept in history with why); the one with `max_late: 1h` fires it, recovered.
#[test]
fn an_expiry_found_later_than_max_late_is_skipped_and_one_within_it_fires() {
    let (redis, receiver, dir) = rig();
    let rules = common::hook_rules(
        dir.path(),
        &receiver,
        r#"rules:
  - name: stale
    match: "stale:{id}"
    recover: { when: always, max_late: 2s }
    notify: { to: [hook] }
  - name: fresh
    match: "fresh:{id}"
    recover: { when: always, max_late: 1h }
    notify: { to: [hook] }
"#,
    );
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let mut c = redis.conn();
    let deadline = std::time::SystemTime::now() + Duration::from_millis(1500);
    let at_ms = deadline
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for key in ["stale:1", "fresh:1"] {
        let () = redis::cmd("SET")
            .arg(key)
            .arg("x")
            .arg("PXAT")
            .arg(at_ms)
            .query(&mut c)
            .unwrap();
    }
    wait_until("the ledger knows both deadlines", PATIENCE, || {
        common::ledger::len(&mut redis.conn(), "keywatch:") == 2
    });
    kw.sigkill();
    // Down until well past `max_late` of `stale`: 2 s after the deadline, and a margin.
    wait_until("3 s past the deadline", PATIENCE, || {
        std::time::SystemTime::now() > deadline + Duration::from_secs(3)
    });
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    wait_until("`fresh` fired its recovered expiry", PATIENCE, || {
        by_key(&receiver).contains_key("fresh:1")
    });
    let addr = common::endpoint::endpoint(&kw);
    wait_until("`stale` counted its skip", PATIENCE, || {
        let (_, body) = common::endpoint::get(&addr, "/metrics");
        common::endpoint::metric(&body, "keywatch_recovery_skipped_total{rule=\"stale\"}") == 1.0
    });
    let d = by_key(&receiver);
    assert!(!d.contains_key("stale:1"), "{d:?}");
    assert_eq!(d["fresh:1"].0, 1);
    assert!(d["fresh:1"].2, "not marked recovered");
    let skip = kw.wait_for_event("recovery_skipped", "of `stale`", |e| {
        common::field_is(e, "rule", "stale")
    });
    assert!(
        skip["reason"]
            .as_str()
            .is_some_and(|r| r.contains("max_late")),
        "the skip is logged with its reason: {skip}"
    );
    wait_until("the skip is kept in history with why", PATIENCE, || {
        let (_, body) = common::endpoint::get(&addr, "/api/history?rule=stale");
        body.contains("skipped") && body.contains("max_late")
    });
}
