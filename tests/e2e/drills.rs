//! Fault drills: Redis killed and restarted with and without persistence, and the subscriber cut
//! off by Redis's pub/sub output-buffer limit in a storm of long keys. Each drill states what
//! keywatch promises (docs/reliability.md#guarantees) and checks it on real `redis-server` children.
//!
//! The retry side of "a receiver down for an hour" is replayed in virtual time beside the code
//! (`delivery::tests`); a real receiver failing for a while is in `tests/e2e/pipeline.rs`.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{HttpReceiver, RedisServer, Request, wait_until, write_rules};

/// Upper bound for deliveries after a fault; a healthy run needs a few seconds.
const AFTER_FAULT: Duration = Duration::from_secs(90);

fn zcard(redis: &RedisServer, key: &str) -> i64 {
    redis::cmd("ZCARD")
        .arg(key)
        .query(&mut redis.conn())
        .unwrap_or_else(|e| panic!("ZCARD {key}: {e}"))
}

/// Webhook requests received per key: (how many, how many marked `recovered`).
fn deliveries(requests: &[Request]) -> BTreeMap<String, (usize, usize)> {
    let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for r in requests {
        let j = r.json();
        let key = j["key"].as_str().expect("event JSON has a key").to_string();
        let e = out.entry(key).or_default();
        e.0 += 1;
        e.1 += usize::from(j["recovered"] == true);
    }
    out
}

/// A key of the drills' rule, expired after the drill's own keys.
const SENTINEL: &str = "lock:sentinel";

/// Waits for `keys` distinct keys, then for [`SENTINEL`], expired after them through the same
/// pipeline (so a duplicate of theirs would have come before it), and asserts that each came
/// exactly once. Returns the deliveries, without the sentinel.
fn each_exactly_once(
    redis: &RedisServer,
    receiver: &HttpReceiver,
    keys: usize,
) -> BTreeMap<String, (usize, usize)> {
    wait_until(&format!("{keys} keys are delivered"), AFTER_FAULT, || {
        deliveries(&receiver.requests()).len() >= keys
    });
    common::set_and_expire_now(&mut redis.conn(), &[SENTINEL]);
    let d = deliveries(&receiver.wait_past(&[SENTINEL], AFTER_FAULT));
    assert_eq!(d.len(), keys, "keys delivered: {:?}", d.keys());
    let doubled: Vec<_> = d.iter().filter(|(_, (n, _))| *n != 1).collect();
    assert!(doubled.is_empty(), "delivered more than once: {doubled:?}");
    d
}

fn webhook_rules(dir: &Path, receiver: &HttpReceiver, top: &str) -> PathBuf {
    let yaml = format!(
        "{top}channels:\n  hook: {{ type: webhook, url: \"{}\" }}\nrules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n",
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
}

fn in_ledger(redis: &RedisServer, key: &str) -> bool {
    common::ledger::deadline(&mut redis.conn(), "keywatch:", key).is_some()
}

fn info_field(redis: &RedisServer, section: &str, field: &str) -> Option<String> {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query(&mut redis.conn())
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}

/// How often Redis has closed a client for its output-buffer limit: `INFO stats` counts it since
/// Redis 7.2; older servers only log it.
fn cut_offs(redis: &RedisServer) -> usize {
    match info_field(redis, "stats", "client_output_buffer_limit_disconnections") {
        Some(n) => n.parse().expect("a count"),
        None => redis
            .log()
            .matches("overcoming of output buffer limits")
            .count(),
    }
}

#[test]
fn redis_killed_and_restarted_with_aof_keeps_deadlines_and_queued_jobs() {
    let mut redis = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .config("appendonly", "yes")
        .start();
    assert_eq!(
        info_field(&redis, "persistence", "aof_enabled").as_deref(),
        Some("1")
    );
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = webhook_rules(dir.path(), &receiver, "");
    let mut kw = common::run_on(&redis, &rules);
    let mut c = redis.conn();

    // Jobs waiting in the queue for a retry: the receiver is down when their keys expire.
    receiver.down();
    for i in 0..5 {
        common::set_px(&mut c, format!("lock:queued:{i}"), 50);
    }
    wait_until("5 jobs wait in the queue", common::PATIENCE, || {
        zcard(&redis, "keywatch:queue") == 5
    });
    // Deadlines that pass while Redis is down.
    // Far enough ahead for a loaded machine to learn them before they fall due.
    let due: Vec<String> = (0..20).map(|i| format!("lock:due:{i}")).collect();
    let due_at = std::time::Instant::now() + Duration::from_millis(6000);
    for key in &due {
        common::set_px(&mut c, key, 6000);
    }
    wait_until(
        "the ledger knows the 20 deadlines",
        common::PATIENCE,
        || due.iter().all(|k| in_ledger(&redis, k)),
    );
    drop(c);

    redis.kill();
    // Scenario, not synchronisation: the 20 deadlines pass while Redis is down.
    std::thread::sleep(
        due_at.saturating_duration_since(std::time::Instant::now()) + Duration::from_millis(500),
    );
    redis.start_again();
    receiver.up();

    let d = each_exactly_once(&redis, &receiver, 25);
    assert!(
        kw.try_status().is_none(),
        "keywatch exited\n{}",
        kw.describe_output()
    );
    assert!(
        due.iter().all(|k| d.contains_key(k)),
        "{:?}",
        d.keys().collect::<Vec<_>>()
    );
    // Whether an expiry is "recovered" depends on who got there first after the restart:
    // Redis's own expiry cycle while keywatch was still reconnecting (missed: recovered) or
    // keywatch's poke once subscribed (seen: not recovered). Both are one delivery each.
    let recovered = due.iter().filter(|k| d[*k].1 == 1).count();
    eprintln!("drill: {recovered} of 20 due keys marked recovered");
    assert!(
        !kw.events("subscription_lost").is_empty(),
        "{}",
        kw.describe_output()
    );
}

#[test]
fn redis_killed_and_restarted_without_persistence_is_relearnt_and_later_keys_alerted() {
    // No flags on the command line: a restarted server has forgotten what `enable` set.
    let mut redis = RedisServer::start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = webhook_rules(dir.path(), &receiver, "redis: { notifications: enable }\n");
    let mut kw = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    for i in 0..10 {
        common::set_px(&mut c, format!("lock:lost:{i}"), 60_000);
    }
    wait_until(
        "the ledger knows the 10 deadlines",
        common::PATIENCE,
        || common::ledger::len(&mut redis.conn(), "keywatch:") == 10,
    );
    drop(c);

    redis.kill();
    redis.start_again();
    // Everything is gone: the keys, the ledger, the flags. Keys set now, before keywatch has
    // resubscribed and re-added the flags, can only be learnt by its scan after reconnecting.
    // (Only the watched keys are checked: keywatch may already be writing its own again.)
    let mut c = redis.conn();
    let left: i64 = redis::cmd("EXISTS")
        .arg(
            (0..10)
                .map(|i| format!("lock:lost:{i}"))
                .collect::<Vec<_>>(),
        )
        .query(&mut c)
        .unwrap();
    assert_eq!(left, 0, "a server without persistence kept keys?");
    let early: Vec<String> = (0..10).map(|i| format!("lock:early:{i}")).collect();
    for key in &early {
        common::set_px(&mut c, key, 4000);
    }
    wait_until("keywatch re-adds the flags", common::PATIENCE, || {
        let flags: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query(&mut redis.conn())
            .unwrap();
        ['E', 'x', 'g'].iter().all(|f| flags[1].contains(*f))
    });
    kw.wait_for_event("subscription_lost", "of the killed Redis", |_| true);
    // And keys set once keywatch is back are learnt from their `expire` events.
    let late: Vec<String> = (0..10).map(|i| format!("lock:late:{i}")).collect();
    wait_until("keywatch has resubscribed", common::PATIENCE, || {
        kw.events(common::SUBSCRIBED).len() >= 2
    });
    for key in &late {
        common::set_px(&mut c, key, 1500);
    }

    let d = each_exactly_once(&redis, &receiver, 20);
    for key in early.iter().chain(&late) {
        assert!(d.contains_key(key), "{key} never alerted: {:?}", d.keys());
    }
    for r in receiver.wait_past(&[SENTINEL], common::PATIENCE) {
        let j = r.json();
        assert!(j["deadline"].is_string(), "deadline not relearnt for {j}");
    }
    assert!(
        kw.try_status().is_none(),
        "keywatch exited\n{}",
        kw.describe_output()
    );
}

#[test]
fn a_storm_that_cuts_the_subscriber_off_still_alerts_every_ledgered_key_once() {
    const KEYS: usize = 3000;
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = webhook_rules(dir.path(), &receiver, "");
    let kw = common::run_on(&redis, &rules);
    let mut c = redis.conn();

    // Long names, one deadline for all, far enough ahead for the ledger to learn every one.
    let now_ms: i64 = {
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut c).unwrap();
        secs * 1000 + micros / 1000
    };
    let deadline = now_ms + 12_000;
    let pad = "x".repeat(500);
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(100) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("SET")
                .arg(format!("lock:{pad}:{i}"))
                .arg("v")
                .arg("PXAT")
                .arg(deadline)
                .ignore();
        }
        let () = pipe.query(&mut c).unwrap();
    }
    wait_until("the ledger knows every deadline", common::PATIENCE, || {
        common::ledger::len(&mut redis.conn(), "keywatch:") == KEYS as i64
    });
    let before = cut_offs(&redis);
    // 64 kB at most, 32 kB for a second: one poke of the due keys is far more than that.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("client-output-buffer-limit")
        .arg("pubsub 64kb 32kb 1")
        .query(&mut c)
        .unwrap();

    let d = each_exactly_once(&redis, &receiver, KEYS);
    let cuts = cut_offs(&redis) - before;
    assert!(
        cuts > 0,
        "Redis never cut the subscriber off: the drill did not drill\n{}",
        kw.describe_output()
    );
    let recovered = d.values().filter(|(_, r)| *r == 1).count();
    eprintln!("drill: {cuts} cut-off(s), {recovered} of {KEYS} keys recovered");
    assert!(recovered > 0, "a cut-off without a recovered key");
}

/// A Redis that keeps the queue across a restart (AOF, every write synced), and keywatch on it
/// with `rules`, a 5 s lease and its acknowledgements held back 3 s
/// (`KEYWATCH_DRILL_ACK_DELAY`).
fn acknowledgements_held_back(rules: &Path) -> (RedisServer, common::KeywatchProcess) {
    let redis = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .config("appendonly", "yes")
        .config("appendfsync", "always")
        .start();
    let kw = common::run_subscribed(
        &redis.url(),
        rules,
        common::Logs::Text,
        &[("KEYWATCH_LEASE", "5s"), ("KEYWATCH_DRILL_ACK_DELAY", "3s")],
    );
    (redis, kw)
}

/// Redis goes down while an acknowledgement is held back, keywatch fails to write it, and Redis
/// comes back.
fn redis_down_under_an_acknowledgement(redis: &mut RedisServer, kw: &mut common::KeywatchProcess) {
    redis.kill();
    kw.wait_for_event(
        "state_error",
        "of the acknowledgement Redis did not take",
        |e| e["operation"] == "acknowledge",
    );
    redis.start_again();
}

/// The requests received and keywatch's logs, for a failed assertion.
fn requests_and_logs(got: &[Request], kw: &common::KeywatchProcess) -> String {
    let requests: Vec<String> = got.iter().map(Request::summary).collect();
    format!("{}\n{}", requests.join("\n"), kw.describe_output())
}

/// A sent job's acknowledgement that meets Redis down is written again once Redis is back, not
/// dropped: dropped, the job came due when its lease ended and was sent a second time
/// (docs/reliability.md#guarantees). The acknowledgement is held back
/// (`KEYWATCH_DRILL_ACK_DELAY`) until Redis is down; the restart keeps the queue (AOF, every
/// write synced).
#[test]
fn an_acknowledgement_that_meets_a_redis_restart_is_written_again_not_sent_twice() {
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = webhook_rules(dir.path(), &receiver, "");
    let (mut redis, mut kw) = acknowledgements_held_back(&rules);
    common::set_px(&mut redis.conn(), "lock:1", 50);
    receiver.wait_for(1, common::PATIENCE);
    // Sent; its acknowledgement waits, and goes out while Redis is down; Redis comes back.
    redis_down_under_an_acknowledgement(&mut redis, &mut kw);
    // Dropped, the acknowledgement left the job queued until its lease ended and it was sent
    // again; written again, the job leaves the queue without a second request.
    wait_until("the queue is empty", AFTER_FAULT, || {
        zcard(&redis, "keywatch:queue") == 0
    });
    let got = receiver.requests();
    assert_eq!(
        deliveries(&got).get("lock:1").map(|d| d.0),
        Some(1),
        "{}",
        requests_and_logs(&got, &kw)
    );
}

/// The same for a digest: the window's members that a sent digest leaves are removed once Redis
/// is back, not sent again as a second digest when their lease ends.
#[test]
fn a_digests_acknowledgement_that_meets_a_redis_restart_is_written_again_not_sent_twice() {
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(
        dir.path(),
        "rules.yaml",
        &format!(
            "channels:\n  hook: {{ type: webhook, url: \"{}\" }}\nrules:\n  - name: burst\n    match: \"burst:{{n}}\"\n    notify: {{ to: [hook], group: {{ window: 1s }} }}\n",
            receiver.url_for("/hook")
        ),
    );
    let (mut redis, mut kw) = acknowledgements_held_back(&rules);
    {
        let mut c = redis.conn();
        for i in 0..3 {
            common::set_px(&mut c, format!("burst:{i}"), 50);
        }
    }
    receiver.wait_for(1, common::PATIENCE);
    redis_down_under_an_acknowledgement(&mut redis, &mut kw);
    wait_until("the window is empty", AFTER_FAULT, || {
        zcard(&redis, "keywatch:group:burst:hook") == 0
    });
    let got = receiver.requests();
    let counted: u64 = got
        .iter()
        .map(|r| r.json()["count"].as_u64().unwrap())
        .sum();
    assert_eq!(
        (got.len(), counted),
        (1, 3),
        "{}",
        requests_and_logs(&got, &kw)
    );
}
