//! `/healthz`, `/readyz` and `/metrics` of a running keywatch: readiness follows the
//! subscription, and metrics move as events flow.

mod common;
mod support;

use std::time::Duration;

use common::{HttpReceiver, RedisServer, wait_until};

fn endpoint(kw: &common::KeywatchProcess) -> String {
    kw.http_addr()
}

fn get(addr: &str, path: &str) -> (u16, String) {
    common::http_get(addr, path)
}

fn metric(body: &str, prefix: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn readiness_follows_the_subscription_and_metrics_follow_events() {
    let mut redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = support::lock_rules(dir.path(), &receiver, "");
    let kw = support::run_on(&redis, &rules);
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
