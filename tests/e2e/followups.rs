//! Follow-ups for on-call, end to end: mentions per rule taken from the event's detail.
//!
//! The real binary on a real `redis-server`, keys that really expire, and local HTTP receivers
//! that record the exact bytes sent.

use crate::common;

use common::{Daemon, HttpReceiver, PATIENCE, Response, wait_until};
use serde_json::json;

fn dingtalk_ok() -> Response {
    Response::json(&json!({"errcode": 0, "errmsg": "ok"}))
}

#[test]
fn a_templated_mention_reaches_dingtalk_at_mobiles_and_the_text_and_bad_values_are_dropped() {
    let robot = HttpReceiver::with_default(dingtalk_ok());
    let yaml = format!(
        r#"
channels:
  oncall:
    type: dingtalk
    url: "{url}"
    msgtype: text
    mention: {{ mobiles: ["13800000000"] }}
rules:
  - name: payment-lock-timeout
    match: "pay_lock:{{order_id}}"
    detail: {{ key: "pay_lock_owner:{{{{ order_id }}}}" }}
    notify:
      to: [oncall]
      title: "Payment lock"
      message: "Payment lock of {{{{ order_id }}}} expired."
      mention: {{ mobiles: ["{{{{ detail.mobile }}}}", "{{{{ detail.other }}}}"], user_ids: ["{{{{ detail.user }}}}"] }}
"#,
        url = robot.url_for("/robot/send?access_token=t"),
    );
    let daemon = Daemon::start(&yaml);
    let mut conn = daemon.conn();
    // The owner's mobile is a plausible number; `other` would mention everyone if it were
    // taken as it is; `user` is not an id at all.
    let _: () = redis::cmd("SET")
        .arg("pay_lock_owner:42")
        .arg(r#"{"mobile": "13911112222", "other": "@all", "user": "all"}"#)
        .query(&mut conn)
        .unwrap();
    daemon.expire("pay_lock:42");

    let requests = robot.wait_for(1, PATIENCE);
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0].json(),
        json!({
            "msgtype": "text",
            "text": {"content": "Payment lock\nPayment lock of 42 expired.\n@13800000000 @13911112222"},
            "at": {"atMobiles": ["13800000000", "13911112222"], "atUserIds": [], "isAtAll": false},
        })
    );
    daemon.wait_for_event("mention_dropped", "of `@all`", |e| e["value"] == "@all");
}

/// Rules with an alert to `oncall`, an escalation to `leader` after `after` and, when `resolved`
/// is set, a resolved notice to `team`; every channel a webhook (the event JSON is the body).
fn escalation_rules(
    oncall: &HttpReceiver,
    leader: &HttpReceiver,
    team: &HttpReceiver,
    after: &str,
) -> String {
    format!(
        r#"
channels:
  oncall: {{ type: webhook, url: "{oncall}" }}
  leader: {{ type: webhook, url: "{leader}" }}
  team: {{ type: webhook, url: "{team}" }}
rules:
  - name: payment-lock-timeout
    match: "pay_lock:{{order_id}}"
    notify: {{ to: [oncall] }}
    escalate:
      after: {after}
      to: [leader]
      message: "Payment lock of {{{{ order_id }}}} still not re-acquired after {{{{ gap }}}}."
    resolved:
      within: 1h
      to: [team]
      message: "Payment lock of {{{{ order_id }}}} re-acquired after {{{{ gap }}}}."
"#,
        oncall = oncall.url_for("/oncall"),
        leader = leader.url_for("/leader"),
        team = team.url_for("/team"),
    )
}

fn queue_is_empty(conn: &mut redis::Connection) -> bool {
    redis::cmd("ZCARD")
        .arg("keywatch:queue")
        .query::<i64>(conn)
        .unwrap()
        == 0
}

/// Whether the escalation job of the alert `alert` has left the queue (sent or cancelled).
fn escalation_done(conn: &mut redis::Connection, alert: &common::Request) -> bool {
    let id = format!("{}:escalate:leader", alert.json()["id"].as_str().unwrap());
    redis::cmd("ZSCORE")
        .arg("keywatch:queue")
        .arg(id)
        .query::<Option<f64>>(conn)
        .unwrap()
        .is_none()
}

/// Ms from the event of `alert` being observed to `later` arriving. A follow-up's `after`
/// counts from the firing, which comes between the event's `observed_at` and the alert's
/// arrival: measured from the arrival, a busy machine's slow alert made a punctual escalation
/// look early (CI saw it). `observed_at` is in ms of Redis's clock as keywatch reckons it, a few
/// ms either way.
fn ms_since_observed(alert: &common::Request, later: &common::Request) -> i64 {
    let observed = alert.json()["observed_at"].as_str().unwrap().to_string();
    let observed: std::time::SystemTime = chrono::DateTime::parse_from_rfc3339(&observed)
        .unwrap()
        .into();
    ms_between(observed, later.received_at)
}

fn ms_between(a: std::time::SystemTime, b: std::time::SystemTime) -> i64 {
    b.duration_since(a).map_or_else(
        |e| -(e.duration().as_millis() as i64),
        |d| d.as_millis() as i64,
    )
}

#[test]
fn an_escalation_fires_once_after_after_and_not_before_on_one_of_two_instances() {
    let (oncall, leader, team) = (
        HttpReceiver::start(),
        HttpReceiver::start(),
        HttpReceiver::start(),
    );
    let daemon = Daemon::start(&escalation_rules(&oncall, &leader, &team, "2s"));
    let mut second = common::run_subscribed(
        &daemon.redis.url(),
        &daemon.rules.path,
        common::Logs::Text,
        &[],
    );
    daemon.expire("pay_lock:42");
    let alert = oncall.wait_for(1, PATIENCE).remove(0);
    let escalation = leader.wait_for(1, PATIENCE).remove(0);
    let since_observed = ms_since_observed(&alert, &escalation);
    let waited = ms_between(alert.received_at, escalation.received_at);
    eprintln!(
        "escalated {since_observed} ms after the event was observed, {waited} ms after the alert arrived (after: 2s)"
    );
    assert!(
        since_observed >= 2_000 - 10,
        "escalated {since_observed} ms after the event was observed, before `after`"
    );
    assert!(
        waited <= 2_000 + 1_500,
        "escalated {waited} ms after the alert"
    );
    let body = escalation.json();
    assert_eq!(body["followup"], "escalation", "{body}");
    assert_eq!(
        body["id"],
        alert.json()["id"],
        "the escalation carries the alert's id"
    );
    assert_eq!(body["key"], "pay_lock:42");
    // Once, across both instances: nothing is left that could send it again.
    wait_until("the escalation is done", PATIENCE, || {
        escalation_done(&mut daemon.conn(), &alert)
    });
    assert_eq!(leader.count(), 1);
    assert_eq!(
        team.count(),
        0,
        "no resolved notice: the key never came back"
    );
    let escalated: f64 = [&daemon.process, &second]
        .into_iter()
        .map(|kw| {
            let metrics = common::get(&common::endpoint(kw), "/metrics").1;
            common::metric(
                &metrics,
                "keywatch_escalations_total{rule=\"payment-lock-timeout\"}",
            )
        })
        .sum();
    assert_eq!(escalated, 1.0, "counted once, by the instance that sent it");
    second.stop();
}

#[test]
fn re_creating_the_key_cancels_the_escalation_and_sends_one_resolved() {
    let (oncall, leader, team) = (
        HttpReceiver::start(),
        HttpReceiver::start(),
        HttpReceiver::start(),
    );
    let daemon = Daemon::start(&escalation_rules(&oncall, &leader, &team, "3s"));
    daemon.expire("pay_lock:7");
    let alert = oncall.wait_for(1, PATIENCE).remove(0);
    // The lock is taken again, with a TTL as locks are: keywatch hears its `expire` event.
    common::set_px(&mut daemon.conn(), "pay_lock:7", 60_000);
    let resolved = team.wait_for(1, PATIENCE).remove(0);
    let body = resolved.json();
    assert_eq!(body["followup"], "resolved", "{body}");
    assert_eq!(body["id"], alert.json()["id"]);
    assert!(
        ms_between(alert.received_at, resolved.received_at) < 3_000,
        "the resolved notice waited for the escalation's time"
    );
    // The escalation is gone from the queue without being sent.
    wait_until("the queue is empty", PATIENCE, || {
        queue_is_empty(&mut daemon.conn())
    });
    assert_eq!(leader.count(), 0, "escalated although the key came back");
    assert_eq!(team.count(), 1, "one resolved notice");
    let addr = common::endpoint(&daemon.process);
    let metrics = common::get(&addr, "/metrics").1;
    assert_eq!(
        common::metric(
            &metrics,
            "keywatch_resolved_total{rule=\"payment-lock-timeout\"}"
        ),
        1.0
    );
    assert_eq!(common::metric(&metrics, "keywatch_escalations_total"), 0.0);
    // History shows the alert, the resolved notice, and the escalation skipped.
    wait_until("history shows the follow-ups", PATIENCE, || {
        let (_, body) = common::get(&addr, "/api/history");
        let list: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        let actions = list[0]["actions"].to_string();
        actions.contains("\"action\":\"escalate\"")
            && actions.contains("\"outcome\":\"skipped\"")
            && actions.contains("\"action\":\"resolved\"")
    });
}

#[test]
fn an_escalation_survives_a_restart_between_alert_and_escalation() {
    let (oncall, leader, team) = (
        HttpReceiver::start(),
        HttpReceiver::start(),
        HttpReceiver::start(),
    );
    let mut daemon = Daemon::start(&escalation_rules(&oncall, &leader, &team, "3s"));
    daemon.expire("pay_lock:9");
    let alert = oncall.wait_for(1, PATIENCE).remove(0);
    daemon.process.stop();
    assert_eq!(leader.count(), 0);
    let _restarted = common::run_on(&daemon.redis, &daemon.rules.path);
    let escalation = leader.wait_for(1, PATIENCE).remove(0);
    let since_observed = ms_since_observed(&alert, &escalation);
    assert!(
        since_observed >= 3_000 - 10,
        "escalated {since_observed} ms after the event was observed, before `after`"
    );
    assert_eq!(escalation.json()["followup"], "escalation");
    wait_until("the escalation is done", PATIENCE, || {
        escalation_done(&mut daemon.conn(), &alert)
    });
    assert_eq!(leader.count(), 1);
    assert_eq!(oncall.count(), 1, "the alert is not sent again");
}

#[test]
fn a_link_s_get_is_inert_its_post_acknowledges_and_a_forged_one_is_refused() {
    use base64::Engine;
    let secret = "link-secret-0123456789";
    let team = HttpReceiver::with_default(Response::ok_body("ok"));
    let leader = HttpReceiver::start();
    let yaml = format!(
        r#"
links:
  base_url: "https://keywatch.example.internal/"
  secret: "${{LINK_SECRET}}"
channels:
  team: {{ type: slack, url: "{team}" }}
  leader: {{ type: webhook, url: "{leader}" }}
rules:
  - name: payment-lock-timeout
    match: "pay_lock:{{order_id}}"
    notify: {{ to: [team], message: "Payment lock of {{{{ order_id }}}} expired." }}
    escalate: {{ after: 3s, to: [leader] }}
"#,
        team = team.url_for("/slack"),
        leader = leader.url_for("/leader"),
    );
    let daemon = Daemon::start_with(
        common::RedisServer::with_events("Exg"),
        &yaml,
        &[("LINK_SECRET", secret)],
    );
    let addr = common::endpoint(&daemon.process);
    daemon.expire("pay_lock:5");
    let message = team.wait_for(1, PATIENCE).remove(0).json()["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!message.contains(secret), "{message}");
    // Slack's link syntax, acknowledge first, both at the end of the message.
    let links: Vec<&str> = message
        .split("<https://keywatch.example.internal/l/")
        .skip(1)
        .map(|rest| rest.split('|').next().unwrap())
        .collect();
    assert_eq!(links.len(), 2, "{message}");
    assert!(message.ends_with("|Silence 1h>"), "{message}");
    assert!(message.contains("|Acknowledge> · <"), "{message}");
    let ack = links[0];
    let claim: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(ack.split('.').next().unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(claim["act"], "ack");
    let id = claim["id"].as_str().unwrap().to_string();
    let acked = |conn: &mut redis::Connection| -> bool {
        redis::cmd("EXISTS")
            .arg(format!("keywatch:ack:{id}"))
            .query::<i64>(conn)
            .unwrap()
            == 1
    };

    // GET shows one button and changes nothing (chat apps prefetch links).
    let (status, page) = common::get(&addr, &format!("/l/{ack}"));
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("<form method=\"post\"><button type=\"submit\">Acknowledge</button></form>"),
        "{page}"
    );
    assert!(page.contains("payment-lock-timeout"), "{page}");
    assert!(!page.contains(secret));
    assert!(!acked(&mut daemon.conn()), "a GET acknowledged");

    // A forged link (the claim changed: another event) and a mangled one get 403, and do nothing.
    let (_, sig) = ack.split_once('.').unwrap();
    let mut other = claim.clone();
    other["id"] = "0".repeat(32).into();
    let forged = format!(
        "{}.{sig}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(other.to_string())
    );
    for bad in [forged.as_str(), "not-a-token", &ack[..ack.len() - 2]] {
        assert_eq!(common::get(&addr, &format!("/l/{bad}")).0, 403, "{bad}");
        let (status, page) = common::post(&addr, &format!("/l/{bad}"));
        assert_eq!(status, 403, "{bad}");
        assert!(!page.contains(secret));
    }
    assert!(!acked(&mut daemon.conn()));

    // POST acknowledges: the escalation is not sent.
    let (status, page) = common::post(&addr, &format!("/l/{ack}"));
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Acknowledged"), "{page}");
    assert!(acked(&mut daemon.conn()));
    let job = format!("{id}:escalate:leader");
    wait_until("the escalation's job is done", PATIENCE, || {
        redis::cmd("ZSCORE")
            .arg("keywatch:queue")
            .arg(&job)
            .query::<Option<f64>>(&mut daemon.conn())
            .unwrap()
            .is_none()
    });
    assert_eq!(leader.count(), 0, "escalated although acknowledged");
    assert!(
        !daemon.stderr().contains(secret),
        "the secret is in the log"
    );
}

#[test]
fn check_says_where_follow_ups_are_wrong() {
    let rules = common::Rules::new(
        r#"
links: { base_url: "keywatch.internal", secret: "short" }
channels:
  team: { type: feishu, url: "https://open.feishu.cn/open-apis/bot/v2/hook/x" }
rules:
  - name: lic
    match: "license:{customer}"
    on: [expiring]
    warn_before: 7d
    notify: { to: [team], message: "{{ customer }} after {{ gap }}" }
    escalate: { after: 1h, to: [team] }
  - name: lock
    match: "lock:{id}"
    notify: { to: [team], mention: { mobiles: ["{{ id }}"] } }
    escalate: { to: [team], unless: never }
"#,
    );
    let out = common::run_keywatch(["check", "-r", rules.path.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for expected in [
        "rules.yaml:2:20: `links.base_url` must be an http(s) URL",
        "rules.yaml:10:36: rule `lic` `notify.message` uses `gap`, but it is set only in `escalate` and `resolved` messages",
        "rules.yaml:11:15: rule `lic` `escalate` follows alerts of keys that are gone",
        "rules.yaml:15:15: rule `lock` `escalate` needs `after`",
        "rule `lock` `escalate` `unless` must be `recreated` or `acknowledged`, found `never`",
        "rules.yaml:14:36: warning: rule `lock` `notify.mention.mobiles`: channel `team` (feishu) cannot mention by mobile number",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
}

#[test]
fn a_rule_s_mentions_take_each_integration_s_form() {
    let wecom = HttpReceiver::with_default(dingtalk_ok());
    let feishu = HttpReceiver::with_default(Response::json(&json!({"code": 0, "msg": "ok"})));
    let slack = HttpReceiver::with_default(Response::ok_body("ok"));
    let yaml = format!(
        r#"
channels:
  wecom: {{ type: wecom, url: "{wecom}", mention: {{ user_ids: ["wangqing"] }} }}
  feishu: {{ type: feishu, url: "{feishu}" }}
  slack: {{ type: slack, url: "{slack}" }}
rules:
  - name: lock
    match: "lock:{{id}}"
    detail: {{ key: "owner:{{{{ id }}}}" }}
    notify:
      to: [wecom, feishu, slack]
      title: "Lock"
      message: "Lock {{{{ id }}}} expired."
      mention: {{ mobiles: ["{{{{ detail.mobile }}}}"], user_ids: ["{{{{ detail.user }}}}"] }}
"#,
        wecom = wecom.url_for("/wecom"),
        feishu = feishu.url_for("/feishu"),
        slack = slack.url_for("/slack"),
    );
    let daemon = Daemon::start(&yaml);
    let _: () = redis::cmd("SET")
        .arg("owner:1")
        .arg(r#"{"mobile": "13911112222", "user": "U012AB3CD"}"#)
        .query(&mut daemon.conn())
        .unwrap();
    daemon.expire("lock:1");
    assert_eq!(
        wecom.wait_for(1, PATIENCE)[0].json(),
        json!({"msgtype": "text", "text": {
            "content": "Lock\nLock 1 expired.",
            "mentioned_list": ["wangqing", "U012AB3CD"],
            "mentioned_mobile_list": ["13911112222"],
        }})
    );
    assert_eq!(
        feishu.wait_for(1, PATIENCE)[0].json(),
        json!({"msg_type": "text", "content": {
            "text": "Lock\nLock 1 expired.\n<at user_id=\"U012AB3CD\"></at>",
        }})
    );
    assert_eq!(
        slack.wait_for(1, PATIENCE)[0].json(),
        json!({"text": "*Lock*\nLock 1 expired.\n<@U012AB3CD>"})
    );
}

#[test]
fn explain_shows_the_follow_ups_of_the_payment_lock_example() {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    let out = common::run_keywatch(
        ["explain", "pay_lock:42", "-r", rules.to_str().unwrap()],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for expected in [
        "  6. escalate leader (after 15m, unless the key exists again or it is acknowledged)\n     message: Payment lock of order 42 still not re-acquired after 15m.",
        "  6. resolved oncall (when the key exists again within 1h)\n     message: Payment lock of order 42 re-acquired after 1h.",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}
