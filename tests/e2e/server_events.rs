//! Where Redis and Valkey publish different events for the same command, keywatch fires the rules
//! of the event the server published. Runs on whichever server the harness starts
//! (`KEYWATCH_REDIS_SERVER`; `.ci/valkey-tests` runs it on Valkey) and checks that server's way.

use crate::common;

use common::{Daemon, HttpReceiver, PATIENCE, RedisServer};

/// Whether the server reports a key removed by a TTL set in the past (`EXPIRE k 0`,
/// `GETEX k PXAT <past>`) as `expired`: Valkey since 8.1 (valkey PR #1517). Redis says `del`.
fn past_ttl_is_expired(flavor: &(String, Vec<u32>)) -> bool {
    let (name, version) = flavor;
    name == "valkey" && version.as_slice() >= [8, 1].as_slice()
}

#[test]
fn a_ttl_set_in_the_past_fires_the_rules_of_the_event_the_server_publishes() {
    let receiver = HttpReceiver::start();
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}"
rules:
  - name: on-expired
    match: "gone:{{id}}"
    on: [expired]
    notify: {{ to: [hook] }}
  - name: on-deleted
    match: "gone:{{id}}"
    on: [deleted]
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    );
    let daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &[]);
    let flavor = daemon.redis.flavor();
    let mut conn = daemon.conn();
    let _: () = redis::cmd("SET")
        .arg("gone:1")
        .arg("v")
        .query(&mut conn)
        .unwrap();
    let removed: i64 = redis::cmd("EXPIRE")
        .arg("gone:1")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    assert_eq!(removed, 1);
    let _: () = redis::cmd("SET")
        .arg("gone:2")
        .arg("v")
        .query(&mut conn)
        .unwrap();
    let _: Option<String> = redis::cmd("GETEX")
        .arg("gone:2")
        .arg("PXAT")
        .arg(1)
        .query(&mut conn)
        .unwrap();

    let got = receiver.wait_for(2, PATIENCE);
    // Then a key that expires for real (an `expired` event on every server): the other rule's
    // notification for gone:1 or gone:2 would have come before it.
    daemon.expire("gone:sentinel");
    let mut fired: Vec<(String, String, String)> = receiver
        .wait_past(&["gone:sentinel"], PATIENCE)
        .iter()
        .map(|r| {
            let j = r.json();
            let text = |f: &str| j[f].as_str().unwrap_or_default().to_owned();
            (text("key"), text("rule"), text("event"))
        })
        .collect();
    fired.sort();
    let (rule, event) = if past_ttl_is_expired(&flavor) {
        ("on-expired", "expired")
    } else {
        ("on-deleted", "deleted")
    };
    let expected: Vec<(String, String, String)> = ["gone:1", "gone:2"]
        .iter()
        .map(|k| (k.to_string(), rule.to_owned(), event.to_owned()))
        .collect();
    assert_eq!(fired, expected, "on {flavor:?}; requests: {got:?}");
    daemon.stop();
}
