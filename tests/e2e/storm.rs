//! Storms stay within fixed limits (docs/reliability.md#guarantees): no more requests in flight than each channel's
//! `concurrency`, what waits waits in the queue in Redis, and a slow channel does not hold back
//! another.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{Daemon, HttpReceiver, Logs, PATIENCE, RedisServer, Rig, Rules, jobs_in};

/// Requests a receiver holds right now, and the most it held at once.
#[derive(Default)]
struct Held {
    now: AtomicUsize,
    most: AtomicUsize,
}

/// Makes `receiver` hold each request `hold` before answering, counting what it holds at once.
fn hold_each(receiver: &HttpReceiver, hold: Duration) -> Arc<Held> {
    let held = Arc::new(Held::default());
    let h = held.clone();
    receiver.set_handler(move |_| {
        let now = h.now.fetch_add(1, Ordering::SeqCst) + 1;
        h.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(hold);
        h.now.fetch_sub(1, Ordering::SeqCst);
        None
    });
    held
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sets `keys` to expire together, 2 s from now: a storm however slowly this loop runs.
fn expire_together(redis: &RedisServer, keys: impl Iterator<Item = String>) {
    set_due(&mut redis.conn(), keys, unix_ms() + 2000);
}

/// Sets each of `keys` to expire at `deadline` (unix ms), in one pipeline.
fn set_due(c: &mut redis::Connection, keys: impl Iterator<Item = String>, deadline: u64) {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("SET")
            .arg(k)
            .arg("v")
            .arg("PXAT")
            .arg(deadline)
            .ignore();
    }
    let _: () = pipe.query(c).unwrap();
}

/// Jobs waiting in Redis, not leased to an instance: due in the queue (a lease runs 15 s from
/// the take), or waiting for their target in its own set.
fn waiting_in_redis(redis: &RedisServer) -> usize {
    let mut c = redis.conn();
    let due: Vec<String> = redis::cmd("ZRANGE")
        .arg("keywatch:queue")
        .arg("-inf")
        .arg(unix_ms() + 7000)
        .arg("BYSCORE")
        .query(&mut c)
        .unwrap();
    let due = jobs_in(&due);
    let targets: Vec<String> = redis::cmd("SMEMBERS")
        .arg("keywatch:queue:waits")
        .query(&mut c)
        .unwrap();
    due + targets
        .iter()
        .map(|t| {
            let members: Vec<String> = redis::cmd("ZRANGE")
                .arg(format!("keywatch:queue:wait:{t}"))
                .arg(0)
                .arg(-1)
                .query(&mut c)
                .unwrap();
            jobs_in(&members)
        })
        .sum::<usize>()
}

fn keys_of(requests: &[common::Request]) -> Vec<String> {
    requests
        .iter()
        .map(|r| r.json()["key"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// 2,000 notifications at once to a webhook that takes 20 ms, with `concurrency: 8`: never more
/// than 8 requests at once, the rest waiting in the queue in Redis meanwhile (not taken into
/// keywatch's memory), and every one delivered exactly once.
#[test]
fn a_storm_stays_within_the_channels_concurrency_and_waits_in_redis() {
    const KEYS: usize = 2000;
    let receiver = HttpReceiver::start();
    let held = hold_each(&receiver, Duration::from_millis(20));
    let rig = Rig::start_with(
        RedisServer::with_events("Exg"),
        receiver,
        "channels:\n  hook:\n    type: webhook\n    url: \"@RECEIVER@/hook\"\n    concurrency: 8\nrules:\n  - name: storm\n    match: \"storm:{id}\"\n    notify: { to: [hook] }\n",
    );
    expire_together(&rig.redis, (0..KEYS).map(|i| format!("storm:{i}")));
    let mut most_waiting = 0;
    common::wait_until("every notification is delivered", PATIENCE * 2, || {
        most_waiting = most_waiting.max(waiting_in_redis(&rig.redis));
        rig.receiver.count() >= KEYS
    });
    // One more through the same channel: a duplicate would come before it.
    common::set_and_expire_now(&mut rig.redis.conn(), &["storm:sentinel"]);
    let requests = rig
        .receiver
        .wait_past(&["storm:sentinel"], Duration::from_secs(60));
    let mut keys = keys_of(&requests);
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), KEYS, "distinct keys delivered");
    assert_eq!(requests.len(), KEYS, "requests: a key was sent twice");
    let most = held.most.load(Ordering::SeqCst);
    assert!(
        (1..=8).contains(&most),
        "{most} requests at once with concurrency 8"
    );
    // The storm waited in Redis: far more than the channel's width and line were not leased.
    assert!(
        most_waiting > 1000,
        "at most {most_waiting} jobs waited in the queue unleased"
    );
    rig.stop();
}

/// A channel that takes 50 ms with `concurrency: 2` has 1,500 notifications to send (about 40 s);
/// notifications to another channel that come after them are delivered while the slow one still
/// works through its backlog, not behind it.
#[test]
fn a_slow_channel_does_not_hold_back_another() {
    let slow = HttpReceiver::start();
    let _held = hold_each(&slow, Duration::from_millis(50));
    let fast = HttpReceiver::start();
    let rig = Rig::start_with(
        RedisServer::with_events("Exg"),
        slow,
        &format!(
            "channels:\n  slow:\n    type: webhook\n    url: \"@RECEIVER@/slow\"\n    concurrency: 2\n  fast:\n    type: webhook\n    url: \"{}\"\nrules:\n  - name: a\n    match: \"a:{{id}}\"\n    notify: {{ to: [slow] }}\n  - name: b\n    match: \"b:{{id}}\"\n    notify: {{ to: [fast] }}\n",
            fast.url_for("/fast")
        ),
    );
    expire_together(&rig.redis, (0..1500).map(|i| format!("a:{i}")));
    common::wait_until("the slow channel has started", PATIENCE, || {
        rig.receiver.count() > 0
    });
    common::set_and_expire_now(
        &mut rig.redis.conn(),
        &(0..20).map(|i| format!("b:{i}")).collect::<Vec<_>>(),
    );
    fast.wait_for(20, PATIENCE);
    let slow_done = rig.receiver.count();
    assert!(
        slow_done < 1500,
        "the fast channel's 20 came only after the slow channel's whole backlog ({slow_done})"
    );
}

/// A storm the engine cannot keep up with: each subscriber holds what it read up to a limit,
/// then lets go of its connection as Redis does at its output-buffer limit, so keywatch's memory
/// stays bounded however big the storm. Nothing is lost for it: what the subscriber held is still
/// handed on, what Redis published meanwhile comes back from the deadline ledger, and each event
/// is delivered once. The drill shrinks the engine's channel to 16 signals and the backlog to
/// 8 KiB, and pauses the state Redis across the deadline so that the engine stalls.
#[test]
fn a_subscriber_that_falls_behind_lets_go_and_nothing_is_lost() {
    const KEYS: usize = 600;
    let state = RedisServer::start();
    let receiver = HttpReceiver::start();
    let rules = Rules::new(&format!(
        "state:\n  url: \"{}\"\nchannels:\n  hook:\n    type: webhook\n    url: \"{}\"\nrules:\n  - name: storm\n    match: \"storm:{{id}}\"\n    notify: {{ to: [hook] }}\n",
        state.url(),
        receiver.url_for("/hook")
    ));
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        rules,
        Logs::Text,
        &[("KEYWATCH_DRILL_BACKLOG", "16:8192")],
    );
    let deadline = unix_ms() + 3000;
    set_due(
        &mut daemon.conn(),
        (0..KEYS).map(|i| format!("storm:{i}")),
        deadline,
    );
    common::wait_until("the ledger has learnt every deadline", PATIENCE, || {
        common::ledger::len(&mut state.conn(), "keywatch:") as usize >= KEYS
    });
    let pause_at = deadline.saturating_sub(300);
    std::thread::sleep(Duration::from_millis(pause_at.saturating_sub(unix_ms())));
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(4000)
        .query(&mut state.conn())
        .unwrap();
    common::wait_until("every notification is delivered", PATIENCE * 2, || {
        receiver.count() >= KEYS
    });
    common::set_and_expire_now(&mut daemon.conn(), &["storm:sentinel"]);
    let requests = receiver.wait_past(&["storm:sentinel"], Duration::from_secs(60));
    assert!(
        !daemon.events("fell_behind").is_empty(),
        "the subscriber never let go; its log:\n{}",
        daemon.stderr()
    );
    let mut keys = keys_of(&requests);
    let recovered = requests
        .iter()
        .filter(|r| r.json()["recovered"] == serde_json::json!(true))
        .count();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), KEYS, "distinct keys delivered");
    assert_eq!(requests.len(), KEYS, "requests: a key was sent twice");
    assert!(
        recovered > 0,
        "none came back from the ledger: the subscriber lost nothing to let go of"
    );
}
