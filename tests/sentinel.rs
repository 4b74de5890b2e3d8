//! Replication: a replica is never watched as if it were the master.

mod common;

use std::time::Duration;

use common::{HttpReceiver, RedisServer, endpoint, get, metric, spawn_run, wait_until};

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
    kw.wait_for_output("HTTP endpoint listening", common::PATIENCE);
    let addr = endpoint(&kw);
    let line = kw.wait_for_output("is a replica of", common::PATIENCE);
    assert!(
        line.contains(&format!("--redis redis://{}", master.addr())),
        "the log should say what to point keywatch at: {line}"
    );
    let (status, body) = get(&addr, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not watched"), "{body}");
    assert!(body.contains(&master.addr()), "{body}");
    let (_, metrics) = get(&addr, "/metrics");
    assert_eq!(
        metric(&metrics, "keywatch_subscriber_up{"),
        0.0,
        "{metrics}"
    );
    // It stays that way: the next attempts find a replica again.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(get(&addr, "/readyz").0, 503);
    assert!(
        !kw.stderr().contains(common::SUBSCRIBED) && !kw.stdout().contains(common::SUBSCRIBED),
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
