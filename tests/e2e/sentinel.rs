//! Replication and Sentinel: a replica is never watched as if it were the master, and with
//! `redis.sentinel` keywatch follows the master through a failover.

use std::sync::{Arc, Condvar, Mutex};

use crate::common;

use common::{
    HttpReceiver, RedisSentinels, RedisServer, endpoint, field_is, get, metric, spawn_run,
    wait_until,
};

/// The internal event of each step of following a failover (`step`: `selected`, `promoted`,
/// `not_promoted`, `moved`).
const SENTINEL_SWITCH: &str = "sentinel_switch";

/// How many `ROLE` commands `server` has run (`INFO commandstats`).
fn role_calls(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.conn())
        .expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_role:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A replica given as `--redis`: keywatch runs but is not ready, says why and where the master
/// is, and reports its subscriber down; it never subscribes there.
#[test]
fn a_replica_given_as_redis_is_not_watched() {
    let master = RedisServer::builder().notify_keyspace_events("Exg").start();
    let replica = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .replica_of(&master.addr())
        .start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let mut kw = spawn_run(&replica.url(), &rules, common::Logs::Text, &[]);
    let addr = common::wait_for_endpoint(&mut kw);
    let refused = kw.wait_for_event("node_refused", "of the replica", |_| true);
    assert!(field_is(&refused, "node", &replica.addr()), "{refused}");
    assert!(
        refused["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&format!("--redis redis://{}", master.addr()))),
        "the log should say what to point keywatch at: {refused}"
    );
    // The engine takes the refusal in right after the subscriber logged it.
    wait_until(
        "/readyz says why the node is not watched",
        common::PATIENCE,
        || get(&addr, "/readyz").1.contains("not watched"),
    );
    let (status, body) = get(&addr, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&master.addr()), "{body}");
    let (_, metrics) = get(&addr, "/metrics");
    assert_eq!(
        metric(&metrics, "keywatch_subscriber_up{"),
        0.0,
        "{metrics}"
    );
    // It stays that way: the next attempts find a replica again (each asks the node's ROLE).
    let asked = role_calls(&replica);
    wait_until(
        "keywatch asked the replica's role twice more",
        common::PATIENCE,
        || role_calls(&replica) >= asked + 2,
    );
    assert_eq!(get(&addr, "/readyz").0, 503);
    assert!(
        kw.events(common::SUBSCRIBED).is_empty(),
        "subscribed on a replica:\n{}",
        kw.describe_output()
    );

    // Promoted, it is watched: readiness follows.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut replica.conn())
        .unwrap();
    wait_until(
        "/readyz says ready after the promotion",
        common::PATIENCE,
        || get(&addr, "/readyz").0 == 200,
    );
    kw.stop();
}

/// The rule `lock:{id}` → webhook `hook` at `receiver`, on the master `set`'s sentinels name, with
/// missing notification flags added (`notifications: enable`).
fn lock_rules_through(
    set: &RedisSentinels,
    dir: &std::path::Path,
    receiver: &HttpReceiver,
) -> std::path::PathBuf {
    common::hook_rules(
        dir,
        receiver,
        &format!(
            "redis:\n  notifications: enable\n  sentinel:\n    master: {}\n    nodes: {}\nrules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n",
            common::redis_sentinel::MASTER_NAME,
            set.nodes_yaml()
        ),
    )
}

/// With `redis.sentinel`, keywatch follows the master through `SENTINEL FAILOVER`: keys that
/// expire before, during and after the switch are each alerted once (those due while no node
/// was watched are recovered by the ledger), the promoted replica gets the notification flags
/// it lacked (`notifications: enable`), and `/readyz` is back on the new master. The time from
/// the failover to readiness on the new master is printed (`switch took`), not asserted.
#[test]
fn keywatch_follows_the_master_through_a_failover() {
    let set = RedisSentinels::start("Exg");
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = lock_rules_through(&set, dir.path(), &receiver);
    let first = set.data[0].addr();
    // The URL gives credentials (none here); the node is the sentinels' to name.
    let mut kw = common::run_subscribed(&set.data[0].url(), &rules, common::Logs::Text, &[]);
    let addr = endpoint(&kw);
    wait_until("/readyz says ready", common::PATIENCE, || {
        get(&addr, "/readyz").0 == 200
    });
    assert!(get(&addr, "/readyz").1.contains(&first));

    let before: Vec<String> = (0..5).map(|i| format!("lock:before-{i}")).collect();
    common::set_and_expire_now(&mut set.data[0].conn(), &before);
    receiver.wait_past(&before, common::PATIENCE);

    // Deadlines spread over the switch: some fall before the old master is demoted, some while
    // no node is watched, some after.
    let mut during = Vec::new();
    {
        let mut c = set.data[0].conn();
        // Every 25 ms over the first half second (the switch takes a few hundred), then later.
        let ttls = (0..20u64).map(|i| 50 + 25 * i).chain([1000, 2000, 3000]);
        for (i, ms) in ttls.enumerate() {
            let key = format!("lock:during-{i}");
            common::set_px(&mut c, &key, ms);
            during.push(key);
        }
        // The replica must hold them before it is promoted.
        let _: i64 = redis::cmd("WAIT").arg(1).arg(5000).query(&mut c).unwrap();
    }
    let started = set.failover();
    let promoted = set.data[1].addr();
    let mut switched = None;
    wait_until(
        "/readyz says ready on the promoted replica",
        common::PATIENCE,
        || {
            let (status, body) = get(&addr, "/readyz");
            let ready = status == 200 && body.contains(&format!("{promoted}: subscribed"));
            if ready && switched.is_none() {
                switched = Some(started.elapsed());
            }
            ready
        },
    );
    let switched = switched.unwrap();
    eprintln!(
        "switch took {} ms (SENTINEL FAILOVER to /readyz 200 on the new master)",
        switched.as_millis()
    );
    // keywatch follows the promotion itself, so it may be ready before the sentinels announce
    // the switch; they do so soon after.
    wait_until(
        "the sentinels name the promoted replica",
        common::PATIENCE,
        || set.master_addr_by(0).as_deref() == Some(promoted.as_str()),
    );
    // The promoted replica had no flags; `notifications: enable` gave it what the rules need.
    let flags = common::notify_flags(&mut set.data[1].conn());
    assert!(flags.contains('E') && flags.contains('x'), "{flags}");

    let after: Vec<String> = (0..5).map(|i| format!("lock:after-{i}")).collect();
    common::set_and_expire_now(&mut set.data[1].conn(), &after);
    let all: Vec<String> = before
        .iter()
        .chain(&during)
        .chain(&after)
        .cloned()
        .collect();
    // Every key in (not `wait_past`, which fails on a double before keywatch's log is shown:
    // doubles are told below, with it).
    receiver.wait_until("every key alerted", common::PATIENCE, |rs| {
        let got = common::delivered(rs);
        all.iter().all(|k| got.contains_key(k))
    });
    // Late duplicates (a recovery of something already alerted) would come from a deadline
    // still in the ledger, an event still in the intake or a job still in the queue: once none
    // is left on the master, keywatch has decided every key.
    common::wait_no_work_left(&mut set.data[1].conn());
    // Once, not "at most twice": a failover may double only what the old master recorded and
    // had not replicated when the replica was promoted (docs/reliability.md#guarantees), and
    // this replica on loopback is microseconds behind while the sentinels promote it about
    // 100 ms after `+selected-slave`, from which on keywatch writes nothing to the old master.
    // A double here is a bug (one was a job acknowledged during the promotion: see the drill
    // below).
    let got = common::delivered(&receiver.requests());
    let wrong: Vec<(&String, usize)> = all
        .iter()
        .map(|k| (k, got.get(k).map_or(0, |d| d.0)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        wrong.is_empty(),
        "each key should be alerted once: {wrong:?}\n{}",
        kw.describe_output()
    );
    let recovered: Vec<&String> = during.iter().filter(|k| got[*k].1).collect();
    eprintln!(
        "recovered {} of {} keys due around the switch: {recovered:?}",
        recovered.len(),
        during.len()
    );
    kw.stop();
}

/// The drill for a job sent while a failover's promotion is under way (a double seen in the
/// failover test above on a loaded machine): keywatch's state follows the master, so from
/// `+selected-slave` on its commands are meant for the replica being promoted, which refuses
/// every write until it is master. The job's acknowledgement was refused and dropped, and the
/// job ran again when its lease ended, 15 s later. Here the replica cannot be promoted at all
/// (its ACL refuses the sentinels' `REPLICAOF NO ONE`), so whatever keywatch sends it during
/// the promotion is refused, and keywatch gives up on it after 10 s and goes back to the old
/// master, which the sentinels still name. The job was sent once: its acknowledgement waited
/// for the promotion's end and was written there.
#[test]
fn a_job_sent_while_a_replica_is_being_promoted_runs_once() {
    let set = RedisSentinels::start("Exg");
    let receiver = HttpReceiver::start();
    // The webhook holds the first request until the failover is under way.
    let held = Arc::new((Mutex::new(true), Condvar::new()));
    {
        let held = held.clone();
        receiver.set_handler(move |_| {
            let (lock, cv) = &*held;
            let _unused = cv
                .wait_while(lock.lock().unwrap(), |holding| *holding)
                .unwrap();
            None
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let rules = lock_rules_through(&set, dir.path(), &receiver);
    let first = set.data[0].addr();
    let mut kw = common::run_subscribed(&set.data[0].url(), &rules, common::Logs::Text, &[]);
    let addr = endpoint(&kw);
    wait_until("/readyz says ready", common::PATIENCE, || {
        get(&addr, "/readyz").0 == 200
    });
    // The sentinels' promotion (`MULTI`, `SLAVEOF NO ONE`, … `EXEC`) is refused whole.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-slaveof")
        .arg("-replicaof")
        .query(&mut set.data[1].conn())
        .unwrap();

    common::set_and_expire_now(&mut set.data[0].conn(), &["lock:held"]);
    receiver.wait_for(1, common::PATIENCE);
    set.failover();
    kw.wait_for_event(SENTINEL_SWITCH, "of the replica selected", |e| {
        field_is(e, "step", "selected")
    });
    {
        let (lock, cv) = &*held;
        *lock.lock().unwrap() = false;
        cv.notify_all();
    }
    kw.wait_for_event(SENTINEL_SWITCH, "of the replica not promoted", |e| {
        field_is(e, "step", "not_promoted")
    });
    // A job whose acknowledgement was lost is still in the queue, leased: it comes back when
    // the lease ends, and leaves once sent again.
    common::wait_no_work_left(&mut set.data[0].conn());
    let got = common::delivered(&receiver.requests());
    assert_eq!(
        got.get("lock:held").map(|d| d.0),
        Some(1),
        "the job should have been sent once\n{}",
        kw.describe_output()
    );
    // The replica given up on is no longer waited for.
    common::poll(
        "/readyz says ready on the old master again",
        common::PATIENCE,
        || {
            let (status, body) = get(&addr, "/readyz");
            (status == 200 && body.contains(&format!("{first}: subscribed"))).then_some(())
        },
        || kw.describe_output(),
    );
    kw.stop();
}

/// `doctor` with `redis.sentinel`: every sentinel answers and they agree, the quorum is there,
/// and the master they name is the node checked (role, flags). With a sentinel gone, that
/// sentinel fails by name.
#[test]
fn doctor_checks_the_sentinels_and_the_master_they_name() {
    let mut set = RedisSentinels::start("Exg");
    let rules = common::Rules::new(&format!(
        "redis:\n  sentinel:\n    master: {}\n    nodes: {}\nchannels:\n  log: {{ type: log }}\nrules:\n  - name: r\n    match: \"k:*\"\n    notify: {{ to: [log] }}\n",
        common::redis_sentinel::MASTER_NAME,
        set.nodes_yaml()
    ));
    // The URL names the replica: with Sentinel, the sentinels decide which node is checked.
    let url = set.data[1].url();
    let out = rules.run(&["doctor", "--redis", &url], &[]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let master = set.data[0].addr();
    assert!(text.contains(&format!("Redis at {master}")), "{text}");
    assert!(
        text.contains(&format!("3 of 3 sentinels name {master}")),
        "{text}"
    );
    assert!(
        text.contains("Quorum and failover authorization can be reached"),
        "{text}"
    );
    assert!(text.contains(&format!("{master} is a master")), "{text}");

    let gone = set.sentinels[2].addr();
    set.sentinels[2].kill();
    let out = rules.run(&["doctor", "--redis", &url], &[]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("cannot connect to the sentinel at {gone}")),
        "{text}"
    );
}
