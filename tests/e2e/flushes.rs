//! Keys that leave a watched database without a keyevent (docs/how-it-works.md#flushes-and-swaps):
//! `FLUSHDB`, `FLUSHALL` and `SWAPDB` publish none. A key they take away is never reported as
//! expired, nor recovered, where it was; one a swap brings into a watched database is handled
//! there on time.
//!
//! keywatch's own state stays out of what is flushed or swapped (database 0, or a server of its
//! own for `FLUSHALL`): a flush of the state's database takes the ledger itself away.

use crate::common;

use std::time::Duration;

use common::{HttpReceiver, PATIENCE, RedisServer, delivered, set_and_expire_now, wait_until};

const PREFIX: &str = "keywatch:";

/// Expired after every other key of a test, in database 1, through the same pipeline: once it
/// is delivered, whatever the earlier keys caused (a recovered expiry) has arrived too.
const SENTINEL: &str = "lock:sentinel";

/// Rules on `lock:{id}` in `dbs`, posting to `receiver`, with `state` (YAML) before them.
fn rules_in(
    dir: &std::path::Path,
    receiver: &HttpReceiver,
    dbs: &str,
    state: &str,
) -> std::path::PathBuf {
    common::hook_rules(
        dir,
        receiver,
        &format!(
            "{state}redis: {{ databases: [{dbs}] }}\nrules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n"
        ),
    )
}

/// The keys whose deadlines the ledger on `state` holds for database `db`.
fn ledger_in(state: &RedisServer, db: u32) -> Vec<String> {
    common::ledger::entries_in(&mut state.conn(), PREFIX, db)
        .into_keys()
        .collect()
}

/// A connection to database `db`.
fn conn_in(redis: &RedisServer, db: u32) -> redis::Connection {
    let mut c = redis.conn();
    let () = redis::cmd("SELECT").arg(db).query(&mut c).unwrap();
    c
}

/// Redis's clock, in unix ms.
fn redis_ms(redis: &RedisServer) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    s * 1000 + us / 1000
}

/// Waits until every deadline up to `until_ms` is a second behind (Redis's clock): what the
/// poker found gone at them has been recovered by then, if it was going to be.
fn wait_past_deadlines(redis: &RedisServer, until_ms: i64) {
    wait_until(
        "the deadlines are a second past",
        Duration::from_secs(30),
        || redis_ms(redis) > until_ms + 1000,
    );
}

/// What arrived before the sentinel (expired in watched database `db` after everything else):
/// key, database and whether it was recovered, each once, sorted.
fn reported_past(
    redis: &RedisServer,
    db: u32,
    receiver: &HttpReceiver,
) -> Vec<(String, u64, bool)> {
    set_and_expire_now(&mut conn_in(redis, db), &[SENTINEL]);
    let got = receiver.wait_past(&[SENTINEL], PATIENCE);
    let counts = delivered(&got);
    assert!(counts.values().all(|(n, _)| *n == 1), "{counts:?}");
    let mut out: Vec<(String, u64, bool)> = got
        .iter()
        .map(|r| r.json())
        .map(|j| {
            (
                j["key"].as_str().unwrap().to_string(),
                j["db"].as_u64().unwrap(),
                j["recovered"].as_bool().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// [`reported_past`] a sentinel in database 1.
fn reported(redis: &RedisServer, receiver: &HttpReceiver) -> Vec<(String, u64, bool)> {
    reported_past(redis, 1, receiver)
}

/// keywatch watching database `db` of `redis` as `url`'s user, with its state at `state`, and
/// five keys `lock:N` there due `ttl_ms` on, whose deadlines the ledger knows.
struct FiveLocks {
    receiver: HttpReceiver,
    kw: common::KeywatchProcess,
    /// The latest of their deadlines (Redis's clock).
    last: i64,
    _dir: tempfile::TempDir,
}

impl FiveLocks {
    fn start(
        redis: &RedisServer,
        url: &str,
        db: u32,
        state: &RedisServer,
        ttl_ms: u64,
    ) -> FiveLocks {
        let receiver = HttpReceiver::start();
        let dir = tempfile::tempdir().unwrap();
        let state_url = match state.url() == redis.url() {
            true => String::new(),
            false => format!("state:\n  url: \"{}\"\n", state.url()),
        };
        let rules = rules_in(dir.path(), &receiver, &db.to_string(), &state_url);
        let kw = common::run_subscribed(url, &rules, common::Logs::Text, &[]);
        let mut c = conn_in(redis, db);
        for i in 0..5 {
            common::set_px(&mut c, format!("lock:{i}"), ttl_ms);
        }
        let last = redis_ms(redis) + ttl_ms as i64;
        wait_until("the ledger knows the 5 deadlines", PATIENCE, || {
            ledger_in(state, db).len() == 5
        });
        FiveLocks {
            receiver,
            kw,
            last,
            _dir: dir,
        }
    }
}

/// FLUSHDB of a watched database: the keys it took away (deadlines 1.5 s on, soon after the
/// flush) are reported neither as expired nor as recovered, and their deadlines leave the ledger.
#[test]
fn a_flushed_database_reports_no_expiry() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let mut t = FiveLocks::start(&redis, &redis.url(), 1, &redis, 1500);
    let () = redis::cmd("FLUSHDB")
        .query(&mut conn_in(&redis, 1))
        .unwrap();
    t.kw.wait_for_event("keys_left_unannounced", "after FLUSHDB", |e| {
        e["how"] == "flush"
    });
    wait_past_deadlines(&redis, t.last);
    assert_eq!(ledger_in(&redis, 1), Vec::<String>::new());
    assert_eq!(reported(&redis, &t.receiver), []);
}

/// Where the user may not turn client-side tracking on (docs/redis.md#least-privilege-acl
/// without `+client|tracking`), keywatch is ready all the same, says what it does without, and notices a
/// flush by `INFO commandstats` within a second: keys due 2.5 s after it are not reported.
#[test]
fn without_client_tracking_a_flush_is_noticed_all_the_same() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let state = RedisServer::builder().start();
    let mut admin = redis.conn();
    for line in common::documented_acl_lines() {
        let mut cmd = redis::cmd("ACL");
        for w in line.split_whitespace().skip(1) {
            cmd.arg(w.replace("PASSWORD", "kw-pass"));
        }
        let () = cmd.query(&mut admin).unwrap();
    }
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("keywatch")
        .arg("-client|tracking")
        .query(&mut admin)
        .unwrap();
    let url = format!("redis://keywatch:kw-pass@{}", redis.addr());
    let mut t = FiveLocks::start(&redis, &url, 0, &state, 2500);
    t.kw.wait_for_event(
        "flush_tracking_refused",
        "under a user without +client|tracking",
        |_| true,
    );
    t.kw.wait_for_event("readiness", "ready without tracking", |e| {
        e["ready"] == true || e["ready"] == "true"
    });
    let () = redis::cmd("FLUSHDB").query(&mut admin).unwrap();
    t.kw.wait_for_event("keys_left_unannounced", "after FLUSHDB", |e| {
        e["how"] == "flush"
    });
    wait_past_deadlines(&redis, t.last);
    assert_eq!(ledger_in(&state, 0), Vec::<String>::new());
    assert_eq!(reported_past(&redis, 0, &t.receiver), []);
}

/// FLUSHALL with two watched databases (keywatch's state on a server of its own): nothing
/// reported in either.
#[test]
fn flushall_reports_no_expiry_in_any_database() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let state = RedisServer::builder().start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_in(
        dir.path(),
        &receiver,
        "1, 2",
        &format!("state:\n  url: \"{}\"\n", state.url()),
    );
    let _kw = common::run_on(&redis, &rules);
    for db in [1, 2] {
        let mut c = conn_in(&redis, db);
        for i in 0..3 {
            common::set_px(&mut c, format!("lock:{db}:{i}"), 1500);
        }
    }
    let last = redis_ms(&redis) + 1500;
    wait_until("the ledger knows the 6 deadlines", PATIENCE, || {
        ledger_in(&state, 1).len() == 3 && ledger_in(&state, 2).len() == 3
    });
    let () = redis::cmd("FLUSHALL").query(&mut redis.conn()).unwrap();
    wait_past_deadlines(&redis, last);
    assert_eq!(ledger_in(&state, 1), Vec::<String>::new());
    assert_eq!(ledger_in(&state, 2), Vec::<String>::new());
    assert_eq!(reported(&redis, &receiver), []);
}

/// SWAPDB of two watched databases: each key's deadline follows it, and it expires on time
/// (with its deadline, not recovered) in the database it went to; none is reported where it was.
#[test]
fn swapped_watched_databases_keep_their_keys_deadlines() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_in(dir.path(), &receiver, "1, 2", "");
    let mut kw = common::run_on(&redis, &rules);
    common::set_px(&mut conn_in(&redis, 1), "lock:was-in-1", 3000);
    common::set_px(&mut conn_in(&redis, 2), "lock:was-in-2", 3000);
    let last = redis_ms(&redis) + 3000;
    wait_until("the ledger knows both deadlines", PATIENCE, || {
        ledger_in(&redis, 1) == ["lock:was-in-1"] && ledger_in(&redis, 2) == ["lock:was-in-2"]
    });
    let () = redis::cmd("SWAPDB")
        .arg(1)
        .arg(2)
        .query(&mut redis.conn())
        .unwrap();
    kw.wait_for_event("keys_left_unannounced", "after SWAPDB", |e| {
        e["how"] == "swap"
    });
    wait_until("each ledger follows its keys", PATIENCE, || {
        ledger_in(&redis, 1) == ["lock:was-in-2"] && ledger_in(&redis, 2) == ["lock:was-in-1"]
    });
    let got = receiver.wait_for(2, Duration::from_secs(20));
    for j in got.iter().map(|r| r.json()) {
        assert!(j["deadline"].is_string(), "poked on time: {j}");
    }
    wait_past_deadlines(&redis, last);
    assert_eq!(
        reported(&redis, &receiver),
        [
            ("lock:was-in-1".to_string(), 2, false),
            ("lock:was-in-2".to_string(), 1, false),
        ]
    );
}

/// SWAPDB of a watched database with one keywatch does not watch: the key that left is reported
/// nowhere, the key that came is learnt and expires on time in the watched database.
#[test]
fn a_swap_with_an_unwatched_database_follows_the_keys() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_in(dir.path(), &receiver, "1", "");
    let _kw = common::run_on(&redis, &rules);
    common::set_px(&mut conn_in(&redis, 1), "lock:leaves", 3000);
    common::set_px(&mut conn_in(&redis, 3), "lock:comes", 3000);
    let last = redis_ms(&redis) + 3000;
    wait_until("the ledger knows the watched key", PATIENCE, || {
        ledger_in(&redis, 1) == ["lock:leaves"]
    });
    let () = redis::cmd("SWAPDB")
        .arg(1)
        .arg(3)
        .query(&mut redis.conn())
        .unwrap();
    wait_until("the ledger follows the keys", PATIENCE, || {
        ledger_in(&redis, 1) == ["lock:comes"]
    });
    let got = receiver.wait_for(1, Duration::from_secs(20));
    assert!(got[0].json()["deadline"].is_string(), "poked on time");
    wait_past_deadlines(&redis, last);
    assert_eq!(
        reported(&redis, &receiver),
        [("lock:comes".to_string(), 1, false)]
    );
}

/// A flush while keywatch is cut off (stopped, its connections killed), of keys due after it is
/// back: the reconnect's walk drops their deadlines, and none is reported. (Keys due while it
/// was cut off cannot be told from expiries: docs/how-it-works.md#flushes-and-swaps.)
#[test]
fn a_flush_while_disconnected_reports_no_expiry() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let mut t = FiveLocks::start(&redis, &redis.url(), 1, &redis, 4000);
    t.kw.signal(common::Signal::STOP);
    redis.cut_clients();
    let () = redis::cmd("FLUSHDB")
        .query(&mut conn_in(&redis, 1))
        .unwrap();
    t.kw.signal(common::Signal::CONT);
    t.kw.wait_for_events("subscribed", 2, "after the reconnect", |_| true);
    wait_past_deadlines(&redis, t.last);
    let output = t.kw.describe_output();
    assert_eq!(ledger_in(&redis, 1), Vec::<String>::new(), "{output}");
    assert_eq!(reported(&redis, &t.receiver), [], "{output}");
}
