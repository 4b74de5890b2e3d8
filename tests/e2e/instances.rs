//! Several keywatch instances on one Redis: every event fires once, not once per instance.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{HttpReceiver, RedisServer, jobs_in, set_and_expire_now, wait_until, write_rules};

#[test]
fn three_instances_fire_each_event_once() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: lock-expired
    match: "lock:{{id}}"
    notify: {{ to: [hook] }}
  - name: job-deleted
    match: "job:{{id}}"
    on: [deleted]
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    );
    let rules = write_rules(dir.path(), "rules.yaml", &yaml);
    let _a = common::run_on(&redis, &rules);
    let _b = common::run_on(&redis, &rules);
    let _c = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    for i in 0..30 {
        common::set_px(&mut c, format!("lock:{i}"), 700 + i * 20);
        let _: () = redis::cmd("SET")
            .arg(format!("job:{i}"))
            .arg("w")
            .query(&mut c)
            .unwrap();
    }
    for i in 0..30 {
        let _: i64 = redis::cmd("DEL")
            .arg(format!("job:{i}"))
            .query(&mut c)
            .unwrap();
    }
    receiver.wait_for(60, Duration::from_secs(30));
    // Sentinels through the same pipeline, a few so that more than one instance is likely to
    // take one: once they are delivered, any duplicate of the 60 has arrived too.
    let sentinels = ["lock:sentinel-a", "lock:sentinel-b", "lock:sentinel-c"];
    common::set_and_expire_now(&mut c, &sentinels);
    let mut seen: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in receiver.wait_past(&sentinels, common::PATIENCE) {
        let j = r.json();
        *seen
            .entry((
                j["event"].as_str().unwrap().to_string(),
                j["key"].as_str().unwrap().to_string(),
            ))
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 60, "{seen:?}");
    let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "fired more than once: {doubled:?}");
}

#[test]
fn a_channel_rate_is_shared_by_all_instances() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    // A burst of 5, then one every 200 ms: 30 messages need at least 5 s in all, however many
    // instances send them. Three unshared buckets would need about 1 s.
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
    rate: 5/s
rules:
  - name: lock-expired
    match: "lock:{{id}}"
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    );
    let rules = write_rules(dir.path(), "rules.yaml", &yaml);
    let _a = common::run_on(&redis, &rules);
    let _b = common::run_on(&redis, &rules);
    let _c = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    for i in 0..30 {
        common::set_px(&mut c, format!("lock:{i}"), 300);
    }
    let got = receiver.wait_for(30, Duration::from_secs(60));
    let first = got.iter().map(|r| r.received_instant).min().unwrap();
    let last = got.iter().map(|r| r.received_instant).max().unwrap();
    // A lower bound only: a slow machine can make it longer, never shorter.
    assert!(
        last - first >= Duration::from_millis(4000),
        "30 messages at 5/s (burst 5) took only {:?}: the instances did not share the bucket",
        last - first
    );
}

fn queued(redis: &RedisServer) -> i64 {
    redis::cmd("ZCARD")
        .arg("keywatch:queue")
        .query(&mut redis.conn())
        .unwrap()
}

#[test]
fn jobs_being_retried_survive_a_restart_while_the_target_is_down() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    receiver.down();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let mut kw = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    for i in 0..10 {
        common::set_px(&mut c, format!("lock:{i}"), 200);
    }
    common::wait_until(
        "10 jobs wait in the queue for a retry",
        Duration::from_secs(20),
        || {
            queued(&redis) == 10
                && kw
                    .events(common::ATTEMPTED)
                    .iter()
                    .filter(|e| common::field_is(e, "outcome", "retry"))
                    .count()
                    >= 10
        },
    );
    kw.sigterm();
    assert!(
        kw.wait_timeout(Duration::from_secs(15))
            .is_some_and(|s| s.success())
    );
    assert_eq!(
        queued(&redis),
        10,
        "the jobs stay in Redis while keywatch is stopped"
    );

    receiver.up();
    let _kw = common::run_on(&redis, &rules);
    receiver.wait_for(10, Duration::from_secs(60));
    let keys: std::collections::BTreeSet<String> = receiver
        .requests()
        .iter()
        .map(|r| r.json()["key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 10, "{keys:?}");
    common::wait_until("the queue is empty", Duration::from_secs(10), || {
        queued(&redis) == 0
    });
}

#[test]
fn an_instance_killed_mid_run_loses_nothing() {
    const KEYS: usize = 300;
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    // The receiver fails until every key has had a failed first attempt (however long a loaded
    // machine takes for that; each instance sends at most its channel's concurrency at once).
    let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let still_failing = failing.clone();
    receiver.set_handler(move |_| {
        still_failing
            .load(std::sync::atomic::Ordering::SeqCst)
            .then(|| common::Response::status(500).body("warming up"))
    });
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let mut a = common::run_on(&redis, &rules);
    let b = common::run_on(&redis, &rules);
    let _c = common::run_on(&redis, &rules);
    let mut conn = redis.conn();
    // 300 keys expiring over 600 ms; the kill comes while their first attempts have failed and
    // the jobs wait in the queue, some leased to the instance that dies.
    for i in 0..KEYS {
        common::set_px(&mut conn, format!("lock:{i}"), 300 + i as u64 * 2);
    }
    common::wait_until(
        "every key has had a failed first attempt",
        Duration::from_secs(60),
        || {
            let tried: std::collections::BTreeSet<String> = receiver
                .requests()
                .iter()
                .map(|r| r.json()["key"].as_str().unwrap().to_string())
                .collect();
            tried.len() == KEYS
        },
    );
    a.sigkill();
    // Answers from now on succeed: requests received from here on are the deliveries.
    let failing_until = std::time::Instant::now();
    failing.store(false, std::sync::atomic::Ordering::SeqCst);

    let delivered_keys = || -> std::collections::BTreeSet<String> {
        receiver
            .requests()
            .iter()
            .filter(|r| r.received_instant >= failing_until)
            .map(|r| r.json()["key"].as_str().unwrap().to_string())
            .collect()
    };
    // On a timeout, what is missing and where the work stands: a key lost and a key still
    // waiting for its retry look alike from the receiver.
    common::poll(
        "every key delivered",
        Duration::from_secs(120),
        || (delivered_keys().len() == KEYS).then_some(()),
        || {
            let got = delivered_keys();
            let missing: Vec<String> = (0..KEYS)
                .map(|i| format!("lock:{i}"))
                .filter(|k| !got.contains(k))
                .collect();
            format!(
                "{} missing: {missing:?}; queued: {}; ledger: {}; instance b: {}",
                missing.len(),
                queued(&redis),
                common::ledger::len(&mut redis.conn(), "keywatch:"),
                b.describe_output()
            )
        },
    );
    let delivered: Vec<String> = receiver
        .requests()
        .iter()
        .filter(|r| r.received_instant >= failing_until)
        .map(|r| r.json()["key"].as_str().unwrap().to_string())
        .collect();
    let duplicates = delivered.len() - KEYS;
    eprintln!(
        "delivered {KEYS} keys with {duplicates} duplicate(s) (only jobs in flight at the kill may double)"
    );
    assert!(duplicates <= 5, "{duplicates} duplicates: {delivered:?}");
}

#[test]
fn a_storm_of_ten_thousand_expiries_becomes_a_handful_of_digests() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: storm
    match: "cache:{{id}}"
    notify: {{ to: [hook], group: {{ window: 2s, max_items: 20 }} }}
"#,
        receiver.url_for("/hook")
    );
    let rules = write_rules(dir.path(), "rules.yaml", &yaml);
    let _a = common::run_on(&redis, &rules);
    let _b = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    let deadline = chrono::Utc::now().timestamp_millis() + 1500;
    let mut pipe = redis::pipe();
    for i in 0..10_000 {
        pipe.cmd("SET")
            .arg(format!("cache:{i}"))
            .arg("v")
            .arg("PXAT")
            .arg(deadline)
            .ignore();
    }
    let _: () = pipe.query(&mut c).unwrap();

    common::wait_until(
        "the digests cover all 10,000 expiries",
        Duration::from_secs(60),
        || {
            receiver
                .requests()
                .iter()
                .map(|r| r.json()["count"].as_u64().unwrap_or(0))
                .sum::<u64>()
                >= 10_000
        },
    );
    let digests = past_window_sentinel(&redis, &receiver);
    let total: u64 = digests
        .iter()
        .map(|r| r.json()["count"].as_u64().unwrap())
        .sum();
    assert_eq!(
        total, 10_000,
        "counts add up to exactly the expiries (no event twice, none lost)"
    );
    assert!(
        digests.len() <= 10,
        "{} digests for one storm: not a handful",
        digests.len()
    );
    for d in &digests {
        let j = d.json();
        let events = j["events"].as_array().unwrap().len() as u64;
        assert!(events <= 20, "{j}");
        assert_eq!(
            j["omitted"].as_u64().unwrap(),
            j["count"].as_u64().unwrap() - events
        );
    }
}

/// A key of the grouped rules, expired after the test's own.
const SENTINEL: &str = "cache:sentinel";

/// Expires [`SENTINEL`] and returns the requests received until its digest arrived, without it.
/// Its window opens after the test's own windows have ended, so whatever they were going to send
/// (another instance's digest of the same window, a digest sent twice) has arrived by then.
fn past_window_sentinel(redis: &RedisServer, receiver: &HttpReceiver) -> Vec<common::Request> {
    common::set_and_expire_now(&mut redis.conn(), &[SENTINEL]);
    receiver.wait_past(&[SENTINEL], Duration::from_secs(30))
}

/// Rules with one grouped rule whose window is `window`, notifying the receiver's `/hook`.
fn grouped_rules(
    dir: &std::path::Path,
    receiver: &HttpReceiver,
    window: &str,
) -> std::path::PathBuf {
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: cache-gone
    match: "cache:{{id}}"
    notify: {{ to: [hook], group: {{ window: {window}, max_items: 100 }} }}
"#,
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
}

/// `SET cache:0..n` all expiring at one instant `ms` from now.
fn expire_together(c: &mut redis::Connection, n: usize, ms: i64) {
    let at = chrono::Utc::now().timestamp_millis() + ms;
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.cmd("SET")
            .arg(format!("cache:{i}"))
            .arg("v")
            .arg("PXAT")
            .arg(at)
            .ignore();
    }
    let _: () = pipe.query(c).unwrap();
}

/// The window is shared: three instances claim different events of one window, and still one
/// digest covers them all (each used to send its own).
#[test]
fn three_instances_send_one_digest_per_window() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = grouped_rules(dir.path(), &receiver, "3s");
    let _a = common::run_on(&redis, &rules);
    let _b = common::run_on(&redis, &rules);
    let _c = common::run_on(&redis, &rules);
    expire_together(&mut redis.conn(), 90, 300);
    receiver.wait_for(1, Duration::from_secs(30));
    let digests = past_window_sentinel(&redis, &receiver);
    let counts: Vec<u64> = digests
        .iter()
        .map(|r| r.json()["count"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [90], "one digest for the window, covering all 90");
    let keys: std::collections::BTreeSet<String> = digests[0].json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 90, "each event listed once: {keys:?}");
}

/// The notifications waiting in a window: a member is one, or a batch's bundle (`#N#…`) of N.
fn in_window(c: &mut redis::Connection, zset: &str) -> usize {
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(zset)
        .arg(0)
        .arg(-1)
        .query(c)
        .unwrap();
    jobs_in(&members)
}

/// A window open when keywatch stops is not lost: its events wait in Redis, and the next
/// instance sends the digest when the window ends.
#[test]
fn a_window_open_at_shutdown_is_sent_after_restart() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = grouped_rules(dir.path(), &receiver, "5s");
    let mut a = common::run_on(&redis, &rules);
    let mut c = redis.conn();
    expire_together(&mut c, 20, 200);
    common::wait_until(
        "all 20 expiries are waiting in the window",
        Duration::from_secs(20),
        || in_window(&mut c, "keywatch:group:cache-gone:hook") == 20,
    );
    // A window's notifications are jobs waiting too: the backlog gauge counts them.
    let addr = common::endpoint(&a);
    common::wait_until(
        "keywatch_queue_pending counts the 20 waiting in the window",
        Duration::from_secs(10),
        || common::metric(&common::get(&addr, "/metrics").1, "keywatch_queue_pending ") == 20.0,
    );
    a.sigterm();
    assert!(
        a.wait_timeout(Duration::from_secs(20)).is_some(),
        "keywatch did not stop\n{}",
        a.describe_output()
    );
    assert!(
        receiver.requests().is_empty(),
        "nothing is sent before the window ends"
    );
    let _b = common::run_on(&redis, &rules);
    receiver.wait_for(1, Duration::from_secs(30));
    let counts: Vec<u64> = past_window_sentinel(&redis, &receiver)
        .iter()
        .map(|r| r.json()["count"].as_u64().unwrap())
        .collect();
    assert_eq!(
        counts,
        [20],
        "the window's digest, sent once by the new instance"
    );
    // The sentinel's window was sent too, and may be a moment from being removed.
    common::wait_until(
        "a sent window leaves nothing behind",
        common::PATIENCE,
        || {
            let left: i64 = redis::cmd("EXISTS")
                .arg("keywatch:group:cache-gone:hook")
                .arg("keywatch:groups")
                .query(&mut c)
                .unwrap();
            left == 0
        },
    );
}

/// A kill while a window's digest is in flight loses nothing and splits nothing: the window's
/// members (one per batch: 3,000 expiries come in several) stay leased to the dead instance
/// until the lease ends, then the next instance sends the same digest again, whole. Only the
/// digest that had reached the receiver before the kill is sent twice (docs/reliability.md#guarantees).
#[test]
fn a_digest_in_flight_at_a_kill_is_sent_again_whole() {
    const N: usize = 3000;
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    // The first digest gets no answer before the kill.
    receiver.push(common::Response::status(200).delay(Duration::from_secs(120)));
    let dir = tempfile::tempdir().unwrap();
    // A window long enough for a loaded machine to store every expiry in it before it ends.
    let rules = grouped_rules(dir.path(), &receiver, "5s");
    // A 5 s lease (`KEYWATCH_LEASE`): the take-over waits for it to end, not for 15 s.
    let lease = [("KEYWATCH_LEASE", "5s")];
    let mut a = common::run_subscribed(&redis.url(), &rules, common::Logs::Text, &lease);
    let mut c = redis.conn();
    expire_together(&mut c, N, 300);
    let first = receiver.wait_for(1, Duration::from_secs(60));
    assert_eq!(
        first[0].json()["count"].as_u64(),
        Some(N as u64),
        "one digest for the window: {}",
        first[0].summary()
    );
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg("keywatch:group:cache-gone:hook")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert!(
        members.len() > 1 && jobs_in(&members) == N,
        "the window holds its {N} notifications in several bundles: {members:?}"
    );
    a.sigkill();
    let _b = common::run_subscribed(&redis.url(), &rules, common::Logs::Text, &lease);
    let after = receiver.wait_for(2, Duration::from_secs(60));
    let again = &after[1];
    assert_eq!(
        again.json()["count"].as_u64(),
        Some(N as u64),
        "the same digest, whole: {}",
        again.summary()
    );
    assert_eq!(
        again.header("idempotency-key"),
        first[0].header("idempotency-key"),
        "sent again as the same digest"
    );
    let got = past_window_sentinel(&redis, &receiver);
    assert_eq!(got.len(), 2, "nothing else was sent: {got:?}");
    common::wait_until(
        "a sent window leaves nothing behind",
        common::PATIENCE,
        || {
            let left: i64 = redis::cmd("EXISTS")
                .arg("keywatch:group:cache-gone:hook")
                .query(&mut c)
                .unwrap();
            left == 0
        },
    );
}

/// A window's digest that fails goes back to its window with its attempt counted; whichever
/// instance takes it next sends the same digest (same `Idempotency-Key`) once.
#[test]
fn a_failed_window_digest_is_retried_by_any_instance() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    receiver.push(common::Response::status(503));
    let dir = tempfile::tempdir().unwrap();
    let rules = grouped_rules(dir.path(), &receiver, "1s");
    let _a = common::run_on(&redis, &rules);
    let _b = common::run_on(&redis, &rules);
    expire_together(&mut redis.conn(), 30, 200);
    receiver.wait_for(2, Duration::from_secs(30));
    let got = past_window_sentinel(&redis, &receiver);
    assert_eq!(got.len(), 2, "one failed attempt, one retry: {got:?}");
    for r in &got {
        assert_eq!(r.json()["count"].as_u64(), Some(30));
    }
    assert_eq!(
        got[0].header("idempotency-key"),
        got[1].header("idempotency-key"),
        "the retry is the same digest"
    );
}

/// Sets each of `keys`, then deletes it: a `del` each.
fn set_and_delete(c: &mut redis::Connection, keys: impl IntoIterator<Item = String>) {
    for k in keys {
        let () = redis::cmd("SET").arg(&k).arg("w").query(c).unwrap();
        let _: i64 = redis::cmd("DEL").arg(&k).query(c).unwrap();
    }
}

/// Redis's clock, in milliseconds.
fn redis_ms(c: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(c).unwrap();
    s * 1000 + us / 1000
}

/// The events of a `deleted` rule keyed by key, counting each delivery.
fn deliveries_by_key(requests: &[common::Request]) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for r in requests {
        let j = r.json();
        *seen
            .entry(j["key"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    seen
}

/// An event without a deadline (a `DEL`, an `expired` the ledger did not know) has nothing in
/// Redis to claim but its name: an instance frozen while another takes it must not take it again
/// when it reads it seconds later, however late. And a key deleted again is a new event that
/// fires again, on whichever instance.
#[test]
fn an_instance_that_reads_events_late_does_not_fire_them_again() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rule = |extra: &str| {
        format!(
            r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: job-deleted
    match: "job:{{id}}"
    on: [deleted]
    notify: {{ to: [hook] }}
  - name: lock-expired
    match: "lock:{{id}}"
    notify: {{ to: [hook] }}
{extra}"#,
            receiver.url_for("/hook")
        )
    };
    let rules_a = write_rules(dir.path(), "a.yaml", &rule(""));
    // Only the late instance has a rule for `late:*`: its sentinel goes through its pipeline
    // after everything it read before.
    let rules_b = write_rules(
        dir.path(),
        "b.yaml",
        &rule(
            r#"  - name: late-sentinel
    match: "late:{id}"
    on: [deleted]
    notify: { to: [hook] }
"#,
        ),
    );
    let _a = common::run_on(&redis, &rules_a);
    let mut b = common::run_on(&redis, &rules_b);
    let mut c = redis.conn();

    b.signal(common::Signal::STOP);
    set_and_delete(&mut c, (0..10).map(|i| format!("job:{i}")));
    receiver.wait_for(10, common::PATIENCE);
    // The late instance reads them longer after than a claim that tells copies from repeats by
    // time lasted (5 s): a freeze, a stall of the VM, a storm's backlog.
    let deleted_at = redis_ms(&mut c);
    wait_until("the freeze has lasted 6 s", Duration::from_secs(30), || {
        redis_ms(&mut c) >= deleted_at + 6_000
    });
    b.signal(common::Signal::CONT);
    set_and_delete(&mut c, ["late:sentinel".to_string()]);
    receiver.wait_until("the late instance's sentinel", common::PATIENCE, |r| {
        r.iter().any(|r| r.body_str().contains("late:sentinel"))
    });
    wait_until("nothing left in the queue", common::PATIENCE, || {
        queued(&redis) == 0
    });
    let seen = deliveries_by_key(&receiver.requests());
    let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "fired more than once: {doubled:?}");
    assert_eq!(seen.len(), 11, "{seen:?}");

    // The same keys deleted again, twice in a row, are new events: each fires again.
    for _ in 0..2 {
        set_and_delete(&mut c, (0..10).map(|i| format!("job:{i}")));
    }
    receiver.wait_for(31, common::PATIENCE);
    set_and_expire_now(&mut c, &["lock:sentinel"]);
    receiver.wait_until("the sentinel", common::PATIENCE, |r| {
        r.iter().any(|r| r.body_str().contains("lock:sentinel"))
    });
    wait_until("nothing left in the queue", common::PATIENCE, || {
        queued(&redis) == 0
    });
    let seen = deliveries_by_key(&receiver.requests());
    let wrong: Vec<_> = seen
        .iter()
        .filter(|(k, n)| k.starts_with("job:") && **n != 3)
        .collect();
    assert!(
        wrong.is_empty(),
        "each key deleted three times fired: {wrong:?}"
    );
}
