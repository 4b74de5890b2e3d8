//! Hash-field expiry end to end (`on: [hexpired]`, `field:`): the real binary against the pinned
//! valkey-server 9.1.2 (which has hash-field expiry; the default redis-server 7.0 has not), with a
//! real HTTP receiver. Fields expire on their own deadlines here: keywatch's point is telling which
//! field went, on time, and nothing else can make a field expire at a chosen moment.
//!
//! On Redis 7.0, `check`, `run` and `doctor` must say which server version `hexpired` needs.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::tools::valkey_server_bin;
use common::{
    HttpReceiver, Logs, PATIENCE, RedisServer, Request, Rules, run_keywatch, run_subscribed,
    wait_until,
};

const RULES: &str = r#"
channels:
  hook: { type: webhook, url: "@RECEIVER@/hook" }
rules:
  - name: hold
    match: "holds:{warehouse}"
    field: "{sku}:{order_id}"
    on: [hexpired]
    notify: { to: [hook] }
  - name: lock
    match: "lock:{id}"
    notify: { to: [hook] }
"#;

/// A valkey-server 9.1.2 with the flags `hexpired` rules need (`x`, `h`), and `g` for the key
/// ledger of the `lock` rule.
fn valkey() -> RedisServer {
    RedisServer::builder()
        .binary(valkey_server_bin())
        .notify_keyspace_events("Exgh")
        .start()
}

fn rules_for(receiver: &HttpReceiver) -> Rules {
    Rules::new(&RULES.replace("@RECEIVER@", &receiver.url()))
}

/// Milliseconds on the server's clock.
fn server_ms(conn: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    s * 1000 + us / 1000
}

/// Sets `field` of `key` to expire at `at_ms` (server clock).
fn hold(conn: &mut redis::Connection, key: &str, field: &str, at_ms: i64) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg(field)
        .arg(1)
        .query(conn)
        .unwrap();
    let set: Vec<i64> = redis::cmd("HPEXPIREAT")
        .arg(key)
        .arg(at_ms)
        .arg("FIELDS")
        .arg(1)
        .arg(field)
        .query(conn)
        .unwrap();
    assert_eq!(set, [1], "HPEXPIREAT {key} {field}");
}

/// (key, field) → (times alerted, recovered, the request's JSON) of the `hold` rule's alerts.
fn field_alerts(requests: &[Request]) -> BTreeMap<(String, String), (usize, serde_json::Value)> {
    let mut out: BTreeMap<(String, String), (usize, serde_json::Value)> = BTreeMap::new();
    for r in requests {
        let j = r.json();
        if j["rule"] != "hold" {
            continue;
        }
        let k = (
            j["key"].as_str().unwrap().to_string(),
            j["field"].as_str().unwrap_or("<no field>").to_string(),
        );
        let e = out.entry(k).or_insert((0, j.clone()));
        e.0 += 1;
    }
    out
}

/// `doctor --json` on `redis`: its exit code and its `hash-fields` check.
fn doctor_hash_fields(rules: &Rules, redis: &RedisServer) -> (Option<i32>, serde_json::Value) {
    let doctor = rules.run(&["doctor", "--redis", &redis.url(), "--json"], &[]);
    let report: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "hash-fields")
        .unwrap_or_else(|| panic!("no hash-fields check: {report}"))
        .clone();
    (doctor.status.code(), check)
}

/// The field ledger's size in db 0.
fn known_fields(conn: &mut redis::Connection) -> usize {
    common::ledger::fields(conn, "keywatch:").len()
}

#[test]
fn every_expired_field_is_alerted_once_with_its_field_and_captures_and_nothing_else() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    let start = server_ms(&mut conn) + 2500;
    let mut expected = Vec::new();
    // 200 fields over 4 hashes, due one every 15 ms from 2.5 s on.
    for i in 0..200 {
        let key = format!("holds:wh{}", i % 4);
        let field = format!("sku-{}:order-{i}", i % 7);
        hold(&mut conn, &key, &field, start + i * 15);
        expected.push((key, field));
    }
    for w in 0..4 {
        let key = format!("holds:wh{w}");
        // No TTL: never expires.
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg(format!("sku-x:kept-{w}"))
            .arg(1)
            .query(&mut conn)
            .unwrap();
        // A deadline, then persisted: never expires.
        hold(
            &mut conn,
            &key,
            &format!("sku-p:persisted-{w}"),
            start + 500,
        );
        let _: Vec<i64> = redis::cmd("HPERSIST")
            .arg(&key)
            .arg("FIELDS")
            .arg(1)
            .arg(format!("sku-p:persisted-{w}"))
            .query(&mut conn)
            .unwrap();
        // A deadline, then deleted before it (paid): nothing fires.
        hold(&mut conn, &key, &format!("sku-d:paid-{w}"), start + 1000);
        let _: () = redis::cmd("HDEL")
            .arg(&key)
            .arg(format!("sku-d:paid-{w}"))
            .query(&mut conn)
            .unwrap();
        // A field the pattern does not match: never alerted.
        hold(&mut conn, &key, &format!("unmatched-{w}"), start + 200);
    }
    // Ordinary key rules work alongside.
    for i in 0..20 {
        let _: () = redis::cmd("SET")
            .arg(format!("lock:{i}"))
            .arg(1)
            .arg("PX")
            .arg(1500 + i * 50)
            .query(&mut conn)
            .unwrap();
    }
    let requests = receiver.wait_for(220, PATIENCE + Duration::from_secs(10));
    // Anything extra (a second alert, a persisted or deleted field) would come from a deadline
    // still in a ledger, an event still in the intake or a job still in the queue: once none
    // is left, keywatch has decided every field.
    common::wait_no_work_left(&mut conn);
    let requests = {
        let mut all = receiver.requests();
        all.sort_by_key(|r| r.json()["rule"].as_str().unwrap_or_default().to_string());
        assert!(all.len() >= requests.len());
        all
    };
    let alerts = field_alerts(&requests);
    let got: Vec<&(String, String)> = alerts.keys().collect();
    let mut want: Vec<&(String, String)> = expected.iter().collect();
    want.sort();
    assert_eq!(
        got,
        want,
        "exactly the 200 fields with deadlines are alerted\n{}",
        kw.describe_output()
    );
    for ((key, field), (n, j)) in &alerts {
        assert_eq!(*n, 1, "{key} {field} alerted {n} times");
        assert_eq!(j["event"], "hexpired");
        assert_eq!(j["recovered"], false, "{j}");
        let (sku, order) = field.split_once(':').unwrap();
        assert_eq!(
            j["captures"]["warehouse"],
            key.strip_prefix("holds:").unwrap()
        );
        assert_eq!(j["captures"]["sku"], sku);
        assert_eq!(j["captures"]["order_id"], order);
        assert!(j["deadline"].is_string() && j["late_ms"].is_i64(), "{j}");
    }
    let locks: Vec<String> = requests
        .iter()
        .map(Request::json)
        .filter(|j| j["rule"] == "lock")
        .map(|j| {
            assert!(j.get("field").is_none(), "a key event has no field: {j}");
            j["key"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(locks.len(), 20, "each lock alerted once: {locks:?}");
    assert_eq!(requests.len(), 220, "nothing else was sent");
    assert_eq!(
        known_fields(&mut conn),
        0,
        "the field ledger let go of every field"
    );
    kw.stop();
}

#[test]
fn fields_due_while_keywatch_was_killed_are_recovered_once_after_a_restart() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    let start = server_ms(&mut conn) + 3000;
    for i in 0..60 {
        hold(
            &mut conn,
            &format!("holds:wh{}", i % 3),
            &format!("sku-{i}:order-{i}"),
            start + i * 10,
        );
    }
    // One due after the restart: fired on time, not recovered.
    hold(&mut conn, "holds:wh0", "sku-late:order-late", start + 9000);
    wait_until("keywatch learnt the 61 field deadlines", PATIENCE, || {
        known_fields(&mut conn) == 61
    });
    kw.sigkill();
    // Every one of the 60 falls due while nobody listens.
    wait_until("the 60 fields are gone", PATIENCE, || {
        server_ms(&mut conn) > start + 60 * 10 + 500
    });
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    receiver.wait_for(61, PATIENCE + Duration::from_secs(10));
    common::wait_no_work_left(&mut conn);
    let requests = receiver.requests();
    assert!(requests.len() >= 61);
    let alerts = field_alerts(&requests);
    assert_eq!(
        alerts.len(),
        61,
        "{:?}\n{}",
        alerts.keys(),
        kw.describe_output()
    );
    for ((key, field), (n, j)) in &alerts {
        assert_eq!(*n, 1, "{key} {field} alerted {n} times");
        let late = field == "sku-late:order-late";
        assert_eq!(j["recovered"], !late, "{j}");
    }
    assert_eq!(requests.len(), 61, "nothing else was sent");
    kw.stop();
}

/// Upgrading from a keywatch whose field ledger was one sorted set: the new instance converts it
/// in place. Fields that went while no instance ran are recovered from the converted entries
/// (nothing else knows their deadlines), and a field still to come fires on time.
#[test]
fn an_earlier_sorted_set_field_ledger_is_converted_without_losing_a_deadline() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut conn = redis.conn();
    let now = server_ms(&mut conn);
    // What the earlier keywatch left: the sorted set of `LEN:KEYFIELD` members and each hash's
    // index, for five fields already gone with their hash (no walk of the keyspace finds them)
    // and one due in 3 s.
    let mut old = redis::pipe();
    for i in 0..6 {
        let key = if i < 5 { "holds:wh1" } else { "holds:wh0" };
        let field = format!("sku-{i}:order-{i}");
        let deadline = if i < 5 { now - 2_000 - i } else { now + 3_000 };
        old.cmd("ZADD")
            .arg("keywatch:fields:0")
            .arg(deadline)
            .arg(format!("{}:{key}{field}", key.len()))
            .ignore();
        old.cmd("HSET")
            .arg(format!("keywatch:fields:0:h:{key}"))
            .arg(&field)
            .arg(deadline)
            .ignore();
    }
    let () = old.query(&mut conn).unwrap();
    hold(&mut conn, "holds:wh0", "sku-5:order-5", now + 3_000);

    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    receiver.wait_for(6, PATIENCE);
    common::wait_no_work_left(&mut conn);
    let alerts = field_alerts(&receiver.requests());
    assert_eq!(
        alerts.len(),
        6,
        "{:?}\n{}",
        alerts.keys(),
        kw.describe_output()
    );
    for ((_, field), (n, j)) in &alerts {
        assert_eq!(*n, 1, "{field} alerted {n} times");
        assert_eq!(j["recovered"], field != "sku-5:order-5", "{j}");
    }
    let exists: i64 = redis::cmd("EXISTS")
        .arg("keywatch:fields:0")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0, "the old sorted set is gone");
    kw.stop();
}

#[test]
fn on_redis_7_0_check_run_and_doctor_say_which_server_hexpired_needs() {
    let redis = RedisServer::with_events("Exgh");
    let (flavor, version) = redis.flavor();
    assert!(
        flavor == "redis" && version < vec![7, 4],
        "this test needs a server without hash-field expiry; the default is {flavor} {version:?}"
    );
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let needed = "Redis 7.4 or later, Valkey 9.0 or later";

    let check = rules.run(&["check"], &[]);
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{stderr}");
    assert!(stderr.contains("warning: rule `hold`: `hexpired` needs a server with hash-field expiry (Redis 7.4 or later, Valkey 9.0 or later)"), "{stderr}");
    assert!(String::from_utf8_lossy(&check.stdout).contains("`Exgh`"));

    let run = run_keywatch(
        [
            "run",
            "-r",
            &rules.arg(),
            "--redis",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "`hexpired` rules need hash-field expiry, which {} lacks: it runs Redis 7.0",
            redis.addr()
        )) && stderr.contains("Redis 7.4 or later, or Valkey 9.0 or later, is needed"),
        "{stderr}"
    );

    let (code, hash) = doctor_hash_fields(&rules, &redis);
    assert_eq!(code, Some(1));
    assert_eq!(hash["verdict"], "fail", "{hash}");
    assert!(
        hash["detail"]
            .as_str()
            .unwrap()
            .contains("it runs Redis 7.0"),
        "{hash}"
    );
    assert_eq!(
        hash["fix"],
        format!("upgrade to {}", needed.replace(", V", ", or V"))
    );
}

#[test]
fn on_valkey_9_doctor_finds_hash_field_expiry() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let (_, hash) = doctor_hash_fields(&rules, &redis);
    assert_eq!(hash["verdict"], "ok", "{hash}");
}

#[test]
fn upcoming_lists_learnt_fields_and_explain_renders_one() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    let now = server_ms(&mut conn);
    hold(&mut conn, "holds:wh1", "sku-1:order-1", now + 600_000);
    hold(&mut conn, "holds:wh2", "sku-2:order-2", now + 300_000);
    wait_until("keywatch learnt both deadlines", PATIENCE, || {
        known_fields(&mut conn) == 2
    });
    kw.stop();
    let out = rules.run(&["upcoming", "--json", "--redis", &redis.url()], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[0]["key"], "holds:wh2", "soonest first: {stdout}");
    assert_eq!(rows[0]["field"], "sku-2:order-2");
    assert_eq!(rows[0]["rules"], serde_json::json!(["hold"]));
    let ttl = rows[0]["ttl_ms"].as_i64().unwrap();
    assert!((250_000..=300_000).contains(&ttl), "{ttl}");
    assert_eq!(rows[1]["field"], "sku-1:order-1");

    let out = rules.run(&["explain", "holds:wh1", "--field", "sku-1:order-1"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("key \"holds:wh1\" field \"sku-1:order-1\" (db 0, event hexpired)"),
        "{text}"
    );
    assert!(text.contains("field pattern: {sku}:{order_id}"), "{text}");
    assert!(
        text.contains("capture sku = \"sku-1\"") && text.contains("capture order_id = \"order-1\""),
        "{text}"
    );
    let out = rules.run(&["explain", "holds:wh1", "--field", "no-colon"], &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a field the pattern does not match fires nothing"
    );
}

#[test]
fn two_instances_alert_each_field_once() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut a = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut b = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    let start = server_ms(&mut conn) + 2000;
    for i in 0..100 {
        hold(
            &mut conn,
            &format!("holds:wh{}", i % 5),
            &format!("sku-{i}:order-{i}"),
            start + i * 10,
        );
    }
    receiver.wait_for(100, PATIENCE);
    common::wait_no_work_left(&mut conn);
    let alerts = field_alerts(&receiver.requests());
    assert_eq!(alerts.len(), 100);
    assert!(
        alerts.values().all(|(n, _)| *n == 1),
        "each once: {:?}",
        alerts
            .iter()
            .filter(|(_, (n, _))| *n > 1)
            .collect::<Vec<_>>()
    );
    assert_eq!(receiver.count(), 100);
    a.stop();
    b.stop();
}

#[test]
fn the_documented_user_with_the_hash_field_line_has_what_the_example_rules_need_on_valkey() {
    let redis = RedisServer::builder()
        .binary(valkey_server_bin())
        .notify_keyspace_events("Exegh")
        .start();
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"),
    )
    .unwrap();
    let lines: Vec<&str> = docs
        .lines()
        .filter(|l| l.starts_with("ACL SETUSER keywatch "))
        .collect();
    assert!(
        lines.len() == 3 && lines[2].contains("+hpexpiretime"),
        "{lines:?}"
    );
    let mut conn = redis.conn();
    for line in lines {
        let words: Vec<String> = line
            .split_whitespace()
            .map(|w| w.replace("PASSWORD", "kw-pass"))
            .collect();
        let _: () = redis::cmd(&words[0])
            .arg(&words[1..])
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (rules, extra) = (repo.join("rules"), repo.join("extra-rules"));
    let url = format!("redis://keywatch:kw-pass@{}", redis.addr());
    let out = run_keywatch(
        [
            "doctor",
            "--redis",
            &url,
            "-r",
            rules.to_str().unwrap(),
            "-r",
            extra.to_str().unwrap(),
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("ok    permissions") && text.contains("ok    hash-fields"),
        "{text}"
    );
}

/// Follow-ups of a field's alert follow the field, not its hash: a field that stays gone is
/// escalated once after `after`, with its `field` and `"followup": "escalation"`; a field set
/// again before `after` cancels its escalation and sends one resolved notice, although its hash
/// held other fields all along.
#[test]
fn a_fields_alert_escalates_unless_the_field_exists_again() {
    let (alerts, leader, team) = (
        HttpReceiver::start(),
        HttpReceiver::start(),
        HttpReceiver::start(),
    );
    let redis = valkey();
    let rules = Rules::new(&format!(
        r#"
channels:
  oncall: {{ type: webhook, url: "{}" }}
  leader: {{ type: webhook, url: "{}" }}
  team: {{ type: webhook, url: "{}" }}
rules:
  - name: hold
    match: "holds:{{warehouse}}"
    field: "{{sku}}:{{order_id}}"
    on: [hexpired]
    notify: {{ to: [oncall] }}
    escalate:
      after: 3s
      unless: recreated
      to: [leader]
    resolved:
      within: 1h
      to: [team]
"#,
        alerts.url_for("/a"),
        leader.url_for("/l"),
        team.url_for("/t")
    ));
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    // The hash keeps a field without a TTL, so it exists throughout.
    let _: () = redis::cmd("HSET")
        .arg("holds:wh1")
        .arg("keep")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let due = server_ms(&mut conn) + 1500;
    hold(&mut conn, "holds:wh1", "sku-1:order-stays-gone", due);
    hold(&mut conn, "holds:wh1", "sku-2:order-comes-back", due);
    alerts.wait_for(2, PATIENCE);
    // One comes back well before `after`.
    let _: () = redis::cmd("HSET")
        .arg("holds:wh1")
        .arg("sku-2:order-comes-back")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let escalation = leader.wait_for(1, PATIENCE)[0].json();
    assert_eq!(escalation["followup"], "escalation", "{escalation}");
    assert_eq!(
        escalation["field"], "sku-1:order-stays-gone",
        "{escalation}"
    );
    let resolved = team.wait_for(1, PATIENCE)[0].json();
    assert_eq!(resolved["followup"], "resolved", "{resolved}");
    assert_eq!(resolved["field"], "sku-2:order-comes-back", "{resolved}");
    // Both follow-ups of the one that came back were made due when it came back; once the
    // queue holds only the resolved notice of the one that stays gone (due in an hour), the
    // escalation of the one that came back has been decided too. Nothing else may follow.
    common::wait_until(
        "the queue holds only the resolved notice of the field that stays gone",
        PATIENCE,
        || {
            let members: Vec<String> = redis::cmd("ZRANGE")
                .arg("keywatch:queue")
                .arg(0)
                .arg(-1)
                .query(&mut conn)
                .unwrap();
            common::jobs_in(&members) == 1
        },
    );
    assert_eq!(
        leader.count(),
        1,
        "the field that came back was escalated too:\n{}",
        kw.describe_output()
    );
    assert_eq!(team.count(), 1, "more than one resolved notice");
    assert_eq!(alerts.count(), 2, "{}", kw.describe_output());
    kw.stop();
}

/// A hash `MOVE`d to a database keywatch does not watch takes its fields' deadlines along
/// (docs/how-it-works.md#the-deadline-ledger): none of its fields is reported as expired where it
/// was, while a field of a hash that stayed is alerted at its deadline.
#[test]
fn a_hash_moved_away_takes_its_fields_deadlines_along() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_for(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut conn = redis.conn();
    let start = server_ms(&mut conn) + 2000;
    hold(&mut conn, "holds:moved", "sku-1:order-1", start);
    hold(&mut conn, "holds:moved", "sku-2:order-2", start + 10);
    hold(&mut conn, "holds:stayed", "sku-3:order-3", start + 500);
    wait_until("keywatch learnt the 3 field deadlines", PATIENCE, || {
        known_fields(&mut conn) == 3
    });
    let moved: i64 = redis::cmd("MOVE")
        .arg("holds:moved")
        .arg(2)
        .query(&mut conn)
        .unwrap();
    assert_eq!(moved, 1);
    wait_until("the moved hash's fields are forgotten", PATIENCE, || {
        known_fields(&mut conn) == 1
    });
    only_alerted(&receiver, &mut conn, ("holds:stayed", "sku-3:order-3"), &kw);
    kw.stop();
}

/// Waits for one alert, then for no work left, and checks it was the `hold` rule's of `field`
/// and that nothing else was sent.
fn only_alerted(
    receiver: &HttpReceiver,
    state: &mut redis::Connection,
    field: (&str, &str),
    kw: &common::KeywatchProcess,
) {
    receiver.wait_for(1, PATIENCE);
    common::wait_no_work_left(state);
    let alerts = field_alerts(&receiver.requests());
    assert_eq!(
        alerts.keys().collect::<Vec<_>>(),
        [&(field.0.to_string(), field.1.to_string())],
        "{}",
        kw.describe_output()
    );
    assert_eq!(receiver.count(), 1, "nothing else was sent");
}

/// The `hold` rule of [`RULES`] alone (no key ledger: the field ledger must hear of flushes and
/// swaps by itself), watching database 1 only: keywatch's state stays in database 0, out of what
/// a `FLUSHDB` or `SWAPDB` of database 1 takes.
fn rules_in_db_1(receiver: &HttpReceiver) -> Rules {
    let hold_only = RULES
        .split("  - name: lock")
        .next()
        .unwrap()
        .replace("@RECEIVER@", &receiver.url());
    Rules::new(&format!("redis: {{ databases: [1] }}\n{hold_only}"))
}

/// The field ledger's size in `db` (kept in database 0).
fn known_fields_in(conn: &mut redis::Connection, db: u32) -> usize {
    common::ledger::fields_in(conn, "keywatch:", db).len()
}

/// A connection to database `db`.
fn conn_in(redis: &RedisServer, db: u32) -> redis::Connection {
    let mut c = redis.conn();
    let () = redis::cmd("SELECT").arg(db).query(&mut c).unwrap();
    c
}

/// A `FLUSHDB` takes hashes away without a keyevent (docs/how-it-works.md#flushes-and-swaps):
/// their fields' deadlines are forgotten at once, and none is reported as expired when it comes,
/// while a field set after the flush is alerted at its deadline.
#[test]
fn a_flushdb_takes_its_hashes_fields_deadlines_away() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_in_db_1(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut state = redis.conn();
    let mut db1 = conn_in(&redis, 1);
    let start = server_ms(&mut db1) + 3000;
    hold(&mut db1, "holds:flushed", "sku-1:order-1", start);
    hold(&mut db1, "holds:flushed", "sku-2:order-2", start + 10);
    hold(&mut db1, "holds:also", "sku-3:order-3", start + 20);
    wait_until("keywatch learnt the 3 field deadlines", PATIENCE, || {
        known_fields_in(&mut state, 1) == 3
    });
    let () = redis::cmd("FLUSHDB").query(&mut db1).unwrap();
    wait_until("the flushed hashes' fields are forgotten", PATIENCE, || {
        known_fields_in(&mut state, 1) == 0
    });
    hold(&mut db1, "holds:after", "sku-4:order-4", start + 500);
    only_alerted(&receiver, &mut state, ("holds:after", "sku-4:order-4"), &kw);
    kw.stop();
}

/// A `SWAPDB` of a watched database with an unwatched one: the hashes it took away are forgotten
/// there, and those it brought in are learnt and alerted at their deadlines, once.
#[test]
fn a_swapdb_takes_fields_deadlines_out_and_brings_others_in() {
    let redis = valkey();
    let receiver = HttpReceiver::start();
    let rules = rules_in_db_1(&receiver);
    let mut kw = run_subscribed(&redis.url(), &rules.path, Logs::Text, &[]);
    let mut state = redis.conn();
    let mut db1 = conn_in(&redis, 1);
    let mut db2 = conn_in(&redis, 2);
    let start = server_ms(&mut db1) + 3000;
    hold(&mut db1, "holds:left", "sku-1:order-1", start);
    hold(&mut db2, "holds:came", "sku-2:order-2", start + 500);
    wait_until(
        "keywatch learnt the watched field's deadline",
        PATIENCE,
        || known_fields_in(&mut state, 1) == 1,
    );
    let () = redis::cmd("SWAPDB").arg(1).arg(2).query(&mut db1).unwrap();
    wait_until(
        "the field that left is forgotten, the one that came is learnt",
        PATIENCE,
        || {
            common::ledger::fields_in(&mut state, "keywatch:", 1)
                .keys()
                .map(|m| m.contains("holds:came"))
                .collect::<Vec<_>>()
                == [true]
        },
    );
    only_alerted(&receiver, &mut state, ("holds:came", "sku-2:order-2"), &kw);
    kw.stop();
}
