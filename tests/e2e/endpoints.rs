//! `/healthz`, `/readyz` and `/metrics` of a running keywatch: readiness follows the
//! subscription, and metrics move as events flow.

use crate::common;

use std::time::Duration;

use common::{HttpReceiver, RedisServer, wait_until};

use common::{endpoint, get, metric};

#[test]
fn readiness_follows_the_subscription_and_metrics_follow_events() {
    let mut redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let kw = common::run_on(&redis, &rules);
    let addr = endpoint(&kw);

    assert_eq!(get(&addr, "/healthz"), (200, "ok\n".to_string()));
    wait_until("/readyz says ready", Duration::from_secs(10), || {
        get(&addr, "/readyz").0 == 200
    });
    let (_, metrics) = get(&addr, "/metrics");
    assert_eq!(
        metric(&metrics, "keywatch_subscriber_up{"),
        1.0,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "keywatch_rules_loaded "), 1.0);
    let before = metric(&metrics, "keywatch_events_total{");

    let _: () = redis::cmd("SET")
        .arg("lock:1")
        .arg("w")
        .arg("PX")
        .arg(50)
        .query(&mut redis.conn())
        .unwrap();
    receiver.wait_for(1, Duration::from_secs(10));
    wait_until(
        "the metrics count the event and the action",
        Duration::from_secs(10),
        || {
            let (_, m) = get(&addr, "/metrics");
            metric(&m, "keywatch_events_total{") > before
                && m.lines().any(|l| {
                    l.starts_with("keywatch_actions_total{")
                        && l.contains("outcome=\"sent\"")
                        && l.ends_with(" 1")
                })
        },
    );

    // Redis goes away: the subscription is gone, so keywatch is not ready (but alive).
    redis.kill();
    wait_until("/readyz says not ready", Duration::from_secs(20), || {
        get(&addr, "/readyz").0 == 503
    });
    assert_eq!(get(&addr, "/healthz").0, 200);
    let (_, m) = get(&addr, "/metrics");
    assert_eq!(metric(&m, "keywatch_subscriber_up{"), 0.0, "{m}");
}

#[test]
fn not_ready_until_subscribed() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    // A user that may do everything but subscribe (Redis 7 gives new users no channels).
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "kw", "on", ">kw-pass", "~*", "+@all"][..])
        .query(&mut redis.conn())
        .unwrap();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::lock_rules(dir.path(), &receiver, "");
    let url = format!("redis://kw:kw-pass@127.0.0.1:{}", redis.port());
    let mut kw = common::spawn_run(&url, &rules, common::Logs::Text, &[]);
    let addr = common::wait_for_endpoint(&mut kw);
    // Refused its subscription at least once.
    kw.wait_for_event("subscription_lost", "of the refused SUBSCRIBE", |_| true);
    let (status, body) = get(&addr, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not subscribed"), "{body}");
    assert_eq!(get(&addr, "/healthz").0, 200);

    // Allowed to subscribe, keywatch gets there on its next attempt, and is ready.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "kw", "allchannels"][..])
        .query(&mut redis.conn())
        .unwrap();
    wait_until("/readyz says ready", common::PATIENCE, || {
        get(&addr, "/readyz").0 == 200
    });
    common::set_and_expire_now(&mut redis.conn(), &["lock:ready"]);
    receiver.wait_for(1, common::PATIENCE);
}
