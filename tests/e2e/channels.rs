//! Chat and webhook channels end to end: the real binary on a real `redis-server`, keys that
//! really expire, and local HTTP receivers that record the exact bytes each integration sends
//! and play the answers of the real services (`../shared/reference/chat-webhooks.md` beside the repository).
//!
//! Each test has its own Redis, receivers and daemon, so the tests run in parallel.

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{
    Daemon, HttpReceiver, PATIENCE, RedisServer, Request, Response, Rules, assert_no_secret,
    field_is, field_u64,
};
use serde_json::{Value, json};

/// HMAC-SHA256 of `message` keyed by `key`, base64 (standard alphabet, padded): the signature
/// primitive of DingTalk and Feishu, computed here independently of keywatch's code.
fn hmac_b64(key: &[u8], message: &[u8]) -> String {
    use base64::Engine;
    use hmac::{Hmac, KeyInit, Mac};
    let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key).unwrap();
    mac.update(message);
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

fn dingtalk_answer(errcode: i64, errmsg: &str) -> Response {
    Response::json(&json!({"errcode": errcode, "errmsg": errmsg}))
}

fn feishu_answer(code: i64, msg: &str) -> Response {
    Response::json(&json!({"code": code, "msg": msg, "data": {}}))
}

/// The one request of a receiver that must get exactly one so far.
fn one_request(receiver: &HttpReceiver) -> Request {
    let requests = receiver.wait_for(1, PATIENCE);
    assert_eq!(
        requests.len(),
        1,
        "expected one request, got {:#?}",
        requests.iter().map(Request::summary).collect::<Vec<_>>()
    );
    requests.into_iter().next().unwrap()
}

/// Checks the `Content-Type` every chat API expects.
fn assert_json_content_type(r: &Request) {
    assert_eq!(r.method, "POST", "{}", r.summary());
    assert_eq!(
        r.header("content-type"),
        Some("application/json; charset=utf-8"),
        "{}",
        String::from_utf8_lossy(&r.raw_head)
    );
}

/// The `attempted` event on `channel` that ended with `outcome`.
fn attempt_logged(daemon: &Daemon, channel: &str, outcome: &str) -> Value {
    daemon.attempt_on(channel, outcome)
}

/// The `dead_lettered` event of `channel`.
fn dead_letter_logged(daemon: &Daemon, channel: &str) -> Value {
    daemon.dead_letter_on(channel)
}

/// Asserts that the one dead-lettered action (its dead letter already logged) is not retried:
/// a job to be retried waits in the queue in Redis until its backoff has passed, so once the
/// queue is empty nothing more can come, and the receiver must have its one request.
fn assert_not_retried(daemon: &Daemon, receiver: &HttpReceiver, what: &str) {
    common::wait_until("no job waits in the queue", PATIENCE, || {
        redis::cmd("ZCARD")
            .arg("keywatch:queue")
            .query::<i64>(&mut daemon.conn())
            .unwrap()
            == 0
    });
    assert_eq!(receiver.count(), 1, "{what} was retried");
}

// ---------------------------------------------------------------------------------------------
// DingTalk

#[test]
fn dingtalk_requests_are_signed_and_only_configured_people_are_mentioned() {
    let md = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let text = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let secret = "SEC0123456789abcdef+/=";
    let yaml = format!(
        r#"
channels:
  md:
    type: dingtalk
    url: "{md_url}"
    secret: "{secret}"
    keyword: "[keywatch]"
    mention: {{ mobiles: ["13800000000"], user_ids: ["user123"] }}
  plain:
    type: dingtalk
    url: "{text_url}"
    msgtype: text
    keyword: "[keywatch]"
    mention: {{ all: true }}
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify:
      to: [md, plain]
      title: "Order lock expired"
      message: "Lock of order {{{{ order_id }}}} expired."
"#,
        md_url = md.url_for("/robot/send?access_token=tok-md"),
        text_url = text.url_for("/robot/send?access_token=tok-text"),
    );
    let daemon = Daemon::start(&yaml);
    let before = SystemTime::now();
    // Key text that would mention everyone, and a phone number, if it were not neutralised.
    daemon.expire("order_lock:@all @13800000000");
    let hostile = "@\u{200B}all @\u{200B}13800000000";

    // Markdown (the default), signed.
    let r = one_request(&md);
    assert_json_content_type(&r);
    assert_eq!(r.path(), "/robot/send");
    let names: Vec<String> = url::form_urlencoded::parse(r.query().unwrap().as_bytes())
        .map(|(n, _)| n.into_owned())
        .collect();
    assert_eq!(names, ["access_token", "timestamp", "sign"], "{}", r.target);
    assert_eq!(r.query_param("access_token").as_deref(), Some("tok-md"));
    let timestamp = r.query_param("timestamp").unwrap();
    let ts: i64 = timestamp.parse().expect("timestamp is milliseconds");
    assert!(
        unix_ms(before) - 1000 <= ts && ts <= unix_ms(r.received_at) + 1000,
        "timestamp {ts} is not the time of the request in ms"
    );
    let expected_sign = hmac_b64(
        secret.as_bytes(),
        format!("{timestamp}\n{secret}").as_bytes(),
    );
    assert_eq!(
        r.query_param("sign").as_deref(),
        Some(expected_sign.as_str())
    );
    // Percent-encoded exactly once: the raw query holds the encoded base64, not `%25…`.
    let raw_sign = r
        .query()
        .unwrap()
        .split('&')
        .find_map(|p| p.strip_prefix("sign="));
    let once: String = url::form_urlencoded::byte_serialize(expected_sign.as_bytes()).collect();
    assert_eq!(raw_sign, Some(once.as_str()), "{}", r.target);
    assert_eq!(
        r.json(),
        json!({
            "msgtype": "markdown",
            "markdown": {
                "title": "[keywatch] Order lock expired",
                "text": format!("#### [keywatch] Order lock expired\n\nLock of order {hostile} expired.\n@13800000000 @user123"),
            },
            "at": {"atMobiles": ["13800000000"], "atUserIds": ["user123"], "isAtAll": false},
        })
    );

    // Text, unsigned: no timestamp or sign.
    let r = one_request(&text);
    assert_json_content_type(&r);
    assert_eq!(r.target, "/robot/send?access_token=tok-text");
    assert_eq!(
        r.json(),
        json!({
            "msgtype": "text",
            "text": {"content": format!("[keywatch] Order lock expired\nLock of order {hostile} expired.")},
            "at": {"atMobiles": [], "atUserIds": [], "isAtAll": true},
        })
    );
    let sent = attempt_logged(&daemon, "md", "sent");
    assert_eq!(sent["answer"], "errcode 0 ok", "{sent}");
}

#[test]
fn dingtalk_errcode_0_is_sent_130101_is_retried_and_310000_is_given_up() {
    let ok = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let throttled = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    throttled.push(dingtalk_answer(
        130101,
        "send too fast, exceed 20 times per minute",
    ));
    let rejected = HttpReceiver::with_default(dingtalk_answer(
        310000,
        "keywords not in content, more: [https://ding-doc.dingtalk.com/doc#/serverapi2/qf2nxq]",
    ));
    // `rate: 100/s`: a 130101 waits one rate period (10 ms) before the backoff, not a minute.
    let channel = |name: &str, r: &HttpReceiver| {
        format!(
            "  {name}:\n    type: dingtalk\n    url: \"{}\"\n    rate: 100/s\n",
            r.url_for("/robot/send?access_token=x")
        )
    };
    let yaml = format!(
        "channels:\n{}{}{}rules:\n  - name: lock\n    match: \"lock:{{id}}\"\n    notify: {{ to: [ok, throttled, rejected] }}\n",
        channel("ok", &ok),
        channel("throttled", &throttled),
        channel("rejected", &rejected),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("lock:1");

    // 130101 is a rate limit: tried again later, and then sent.
    let requests = throttled.wait_for(2, PATIENCE);
    assert_eq!(requests[0].body, requests[1].body);
    let retry = attempt_logged(&daemon, "throttled", "retry");
    assert!(
        retry["reason"].as_str().unwrap().contains("130101"),
        "{retry}"
    );
    attempt_logged(&daemon, "throttled", "sent");

    // 310000 will not get better: one request, a dead letter naming the errcode.
    let dead = dead_letter_logged(&daemon, "rejected");
    let reason = dead["reason"].as_str().unwrap();
    assert!(
        reason.contains("errcode 310000") && reason.contains("keywords not in content"),
        "{dead}"
    );
    let failed = attempt_logged(&daemon, "rejected", "failed");
    assert!(field_u64(&failed, "attempt") == Some(1), "{failed}");
    // errcode 0 is success: one request, logged as sent.
    attempt_logged(&daemon, "ok", "sent");
    // By now the throttled channel's retry (at least half a second after its first attempt) has
    // been sent: a retry of either would have come with it.
    assert_eq!(rejected.count(), 1, "310000 was retried");
    assert_eq!(ok.count(), 1, "errcode 0 was sent again");
    let ok_failures: Vec<Value> = daemon
        .events(common::ATTEMPTED)
        .into_iter()
        .filter(|e| field_is(e, "channel", "ok") && !field_is(e, "outcome", "sent"))
        .collect();
    assert!(ok_failures.is_empty(), "{ok_failures:?}");
}

// ---------------------------------------------------------------------------------------------
// Slack

#[test]
fn slack_body_is_text_with_key_text_escaped() {
    let slack = HttpReceiver::start();
    let yaml = format!(
        r#"
channels:
  team: {{ type: slack, url: "{}" }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [team], title: "Cache gone", message: "{{{{ key }}}} expired" }}
"#,
        slack.url_for("/services/T000/B000/XXXX")
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:<!channel>&<@U123>");
    let r = one_request(&slack);
    assert_json_content_type(&r);
    assert_eq!(r.target, "/services/T000/B000/XXXX");
    assert_eq!(
        r.json(),
        json!({"text": "*Cache gone*\ncache:&lt;!channel&gt;&amp;&lt;@U123&gt; expired"})
    );
    attempt_logged(&daemon, "team", "sent");
}

/// Two channels, one rule: each gets one bad answer, then `ok`.
#[test]
fn slack_retries_5xx_and_200_without_ok() {
    let failing = HttpReceiver::start();
    failing.push(Response::status(500).body("rollup_error"));
    let not_ok = HttpReceiver::start();
    not_ok.push(Response::ok_body("invalid_payload"));
    let yaml = format!(
        r#"
channels:
  failing: {{ type: slack, url: "{}", rate: 100/s }}
  not-ok: {{ type: slack, url: "{}", rate: 100/s }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [failing, not-ok] }}
"#,
        failing.url(),
        not_ok.url()
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    for (name, receiver, answer) in [
        ("failing", &failing, "rollup_error"),
        ("not-ok", &not_ok, "invalid_payload"),
    ] {
        let requests = receiver.wait_for(2, PATIENCE);
        assert_eq!(requests[0].body, requests[1].body, "{name}");
        let retry = attempt_logged(&daemon, name, "retry");
        assert!(
            retry["reason"].as_str().unwrap().contains(answer),
            "{retry}"
        );
        attempt_logged(&daemon, name, "sent");
        assert_eq!(receiver.count(), 2, "{name}: sent again after `ok`");
    }
}

#[test]
fn slack_429_waits_for_retry_after() {
    let slack = HttpReceiver::start();
    slack.push(
        Response::status(429)
            .header("Retry-After", "1")
            .header("Content-Type", "application/json")
            .body(r#"{"retry_after":1,"ok":false,"error":"rate_limited"}"#),
    );
    let yaml = format!(
        r#"
channels:
  team: {{ type: slack, url: "{}", rate: 100/s }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [team] }}
"#,
        slack.url()
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    let requests = slack.wait_for(2, PATIENCE);
    let waited = requests[1]
        .received_instant
        .duration_since(requests[0].received_instant);
    assert!(
        waited >= Duration::from_millis(900),
        "retried {waited:?} after a 429 with `Retry-After: 1`"
    );
    attempt_logged(&daemon, "team", "sent");
}

#[test]
fn slack_404_no_service_is_not_retried() {
    let slack = HttpReceiver::with_default(Response::status(404).body("no_service"));
    let yaml = format!(
        r#"
channels:
  team: {{ type: slack, url: "{}", rate: 100/s }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [team] }}
"#,
        slack.url()
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    let dead = dead_letter_logged(&daemon, "team");
    assert!(
        dead["reason"].as_str().unwrap().contains("404")
            && dead["reason"].as_str().unwrap().contains("no_service"),
        "{dead}"
    );
    assert_not_retried(&daemon, &slack, "404 no_service");
}

// ---------------------------------------------------------------------------------------------
// Feishu

#[test]
fn feishu_text_and_card_are_signed_in_the_body() {
    let text = HttpReceiver::with_default(feishu_answer(0, "success"));
    let card = HttpReceiver::with_default(feishu_answer(0, "success"));
    let secret = "feishu-secret-42";
    let yaml = format!(
        r#"
channels:
  text:
    type: feishu
    url: "{}"
    secret: "{secret}"
    mention: {{ user_ids: ["ou_abc"] }}
  card:
    type: feishu
    url: "{}"
    secret: "{secret}"
    msgtype: markdown
rules:
  - name: lock
    match: "lock:{{id}}"
    notify:
      to: [text, card]
      title: "Lock expired"
      message: "Lock {{{{ id }}}} expired."
"#,
        text.url_for("/open-apis/bot/v2/hook/hook-text"),
        card.url_for("/open-apis/bot/v2/hook/hook-card"),
    );
    let daemon = Daemon::start(&yaml);
    let before = SystemTime::now();
    daemon.expire(r#"lock:<at user_id="all">x</at>"#);

    let check_signature = |r: &Request| -> Value {
        assert_json_content_type(r);
        let mut body = r.json();
        let obj = body.as_object_mut().unwrap();
        let ts = obj.remove("timestamp").expect("timestamp in the body");
        let ts = ts.as_str().expect("timestamp is a string");
        let secs: i64 = ts.parse().expect("timestamp is seconds");
        assert!(
            unix_ms(before) / 1000 - 1 <= secs && secs <= unix_ms(r.received_at) / 1000 + 1,
            "timestamp {secs} is not the time of the request in seconds"
        );
        let sign = obj.remove("sign").expect("sign in the body");
        assert_eq!(sign, hmac_b64(format!("{ts}\n{secret}").as_bytes(), b""));
        body
    };

    let r = one_request(&text);
    assert_eq!(r.target, "/open-apis/bot/v2/hook/hook-text");
    assert_eq!(
        check_signature(&r),
        json!({
            "msg_type": "text",
            "content": {"text": "Lock expired\nLock <\u{200B}at user_id=\"all\">x<\u{200B}/at> expired.\n<at user_id=\"ou_abc\"></at>"},
        })
    );

    let r = one_request(&card);
    assert_eq!(r.target, "/open-apis/bot/v2/hook/hook-card");
    assert_eq!(
        check_signature(&r),
        json!({
            "msg_type": "interactive",
            "card": {
                "header": {"title": {"tag": "plain_text", "content": "Lock expired"}},
                "elements": [{"tag": "markdown", "content": "Lock <\u{200B}at user\\_id=\"all\"\\>x<\u{200B}/at\\> expired."}],
            },
        })
    );
    attempt_logged(&daemon, "text", "sent");
    attempt_logged(&daemon, "card", "sent");
}

#[test]
fn feishu_code_19021_is_given_up() {
    let feishu = HttpReceiver::with_default(feishu_answer(
        19021,
        "sign match fail or timestamp is not within one hour from current time",
    ));
    let yaml = format!(
        r#"
channels:
  lark: {{ type: feishu, url: "{}", secret: "s", rate: 100/s }}
rules:
  - name: lock
    match: "lock:{{id}}"
    notify: {{ to: [lark] }}
"#,
        feishu.url()
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("lock:1");
    let dead = dead_letter_logged(&daemon, "lark");
    assert!(dead["reason"].as_str().unwrap().contains("19021"), "{dead}");
    assert_not_retried(&daemon, &feishu, "code 19021");
}

// ---------------------------------------------------------------------------------------------
// WeCom

#[test]
fn wecom_text_mentions_by_list_and_markdown_by_userid() {
    let text = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let md = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let yaml = format!(
        r#"
channels:
  text:
    type: wecom
    url: "{}"
    mention: {{ user_ids: ["wangqing"], mobiles: ["13800001111"] }}
  md:
    type: wecom
    url: "{}"
    msgtype: markdown
    mention: {{ user_ids: ["wangqing"] }}
rules:
  - name: lock
    match: "lock:{{id}}"
    notify: {{ to: [text, md], title: "Lock expired", message: "Lock {{{{ id }}}} expired." }}
"#,
        text.url_for("/cgi-bin/webhook/send?key=k-text"),
        md.url_for("/cgi-bin/webhook/send?key=k-md"),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("lock:<@evil>");

    let r = one_request(&text);
    assert_json_content_type(&r);
    assert_eq!(r.target, "/cgi-bin/webhook/send?key=k-text");
    assert_eq!(
        r.json(),
        json!({"msgtype": "text", "text": {
            "content": "Lock expired\nLock <\u{200B}@\u{200B}evil> expired.",
            "mentioned_list": ["wangqing"],
            "mentioned_mobile_list": ["13800001111"],
        }})
    );
    let r = one_request(&md);
    assert_json_content_type(&r);
    assert_eq!(
        r.json(),
        json!({"msgtype": "markdown", "markdown": {
            "content": "**Lock expired**\nLock <\u{200B}@\u{200B}evil\\> expired. <@wangqing>",
        }})
    );
    attempt_logged(&daemon, "text", "sent");
    attempt_logged(&daemon, "md", "sent");
}

#[test]
fn wecom_markdown_over_4096_bytes_is_cut_saying_how_much() {
    let md = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let yaml = format!(
        r#"
channels:
  md:
    type: wecom
    url: "{}"
    msgtype: markdown
    mention: {{ user_ids: ["wangqing"] }}
rules:
  - name: big
    match: "big:{{rest}}"
    notify: {{ to: [md], title: "Big", message: "{message}" }}
"#,
        md.url(),
        // A key is shown up to WeCom's 512 bytes: a message repeating one is what is too long.
        message = "{{ rest }}".repeat(20),
    );
    let daemon = Daemon::start(&yaml);
    let rest = "x".repeat(500);
    daemon.expire(format!("big:{rest}"));
    let r = one_request(&md);
    let body = r.json();
    let content = body["markdown"]["content"].as_str().unwrap();
    assert!(
        content.len() <= 4096,
        "markdown content is {} bytes",
        content.len()
    );
    let full = format!("**Big**\n{}", rest.repeat(20));
    let (kept, tail) = content
        .split_once("\n… and ")
        .unwrap_or_else(|| panic!("not cut with \"… and N more bytes\": {content}"));
    assert!(full.starts_with(kept), "the kept part is not the start");
    let omitted = full.len() - kept.len();
    assert_eq!(tail, format!("{omitted} more bytes <@wangqing>"));
    attempt_logged(&daemon, "md", "sent");
}

// ---------------------------------------------------------------------------------------------
// Webhooks

#[test]
fn webhook_sends_the_event_json_alertmanager_json_or_a_custom_body() {
    let plain = HttpReceiver::with_default(Response::status(204));
    let am = HttpReceiver::with_default(Response::status(200));
    let custom = HttpReceiver::with_default(Response::status(200));
    let yaml = format!(
        r#"
channels:
  audit:
    type: webhook
    url: "{}"
    headers: {{ Authorization: "Bearer ${{AUDIT_TOKEN}}", X-Team: payments }}
  am:
    type: webhook
    url: "{}"
    format: alertmanager
  custom:
    type: webhook
    url: "{}"
    body: '{{"order": {{{{ captures.order_id | tojson }}}}, "key": {{{{ key | tojson }}}}}}'
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify:
      to: [audit, am, custom]
      title: "Order lock expired"
      message: "Lock of order {{{{ order_id }}}} expired."
"#,
        plain.url_for("/hooks/keywatch"),
        am.url_for("/am"),
        custom.url_for("/custom"),
    );
    let redis = RedisServer::with_events("Exg");
    let source = redis.addr();
    let daemon = Daemon::start_with(redis, &yaml, &[("AUDIT_TOKEN", "t0ken")]);
    let before = chrono::Utc::now();
    daemon.expire("order_lock:42");

    // format: keywatch — docs/rules.md#event-json, every field.
    let r = one_request(&plain);
    let after = chrono::Utc::now();
    assert_eq!(r.method, "POST");
    assert_eq!(r.target, "/hooks/keywatch");
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("authorization"), Some("Bearer t0ken"));
    assert_eq!(r.header("x-team"), Some("payments"));
    let e = r.json();
    let fields: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
    let mut expected_fields = [
        "version",
        "id",
        "rule",
        "event",
        "key",
        "db",
        "captures",
        "detail",
        "deadline",
        "observed_at",
        "late_ms",
        "recovered",
        "ttl_ms",
        "source",
    ];
    expected_fields.sort();
    let mut sorted = fields.clone();
    sorted.sort();
    assert_eq!(sorted, expected_fields, "{e}");
    let id = e["id"].as_str().unwrap();
    assert!(
        id.len() >= 16 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        "id {id:?}"
    );
    assert_eq!(e["version"], 1);
    assert_eq!(e["rule"], "order-lock-timeout");
    assert_eq!(e["event"], "expired");
    assert_eq!(e["key"], "order_lock:42");
    assert_eq!(e["db"], 0);
    assert_eq!(e["captures"], json!({"order_id": "42"}));
    assert_eq!(e["detail"], Value::Null, "no `detail` step");
    assert_eq!(e["recovered"], false);
    assert_eq!(e["ttl_ms"], Value::Null, "ttl_ms is only for `expiring`");
    assert_eq!(e["source"], source);
    let observed = e["observed_at"].as_str().unwrap();
    assert!(
        observed.ends_with('Z') && observed.len() == "2026-11-29T10:15:00.012Z".len(),
        "observed_at {observed:?} is not RFC 3339 UTC with milliseconds"
    );
    let observed_at = chrono::DateTime::parse_from_rfc3339(observed).unwrap();
    assert!(
        before - chrono::Duration::seconds(1) <= observed_at
            && observed_at <= after + chrono::Duration::seconds(1),
        "observed_at {observed} is not when the key expired"
    );
    // The deadline is known only when keywatch learnt it; then late_ms says how late we were.
    match e["deadline"].as_str() {
        None => {
            assert_eq!(e["deadline"], Value::Null);
            assert_eq!(e["late_ms"], Value::Null, "late_ms without a deadline");
        }
        Some(deadline) => {
            chrono::DateTime::parse_from_rfc3339(deadline).expect("deadline is RFC 3339");
            assert!(e["late_ms"].as_i64().is_some_and(|ms| ms >= 0), "{e}");
        }
    }
    assert_eq!(
        r.header("idempotency-key"),
        Some(format!("{id}:notify:audit").as_str())
    );

    // format: alertmanager — its version-4 webhook JSON.
    let r = one_request(&am);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.header("idempotency-key"),
        Some(format!("{id}:notify:am").as_str())
    );
    let m = r.json();
    assert_eq!(m["version"], "4");
    assert_eq!(m["status"], "firing");
    assert_eq!(m["receiver"], "am");
    assert_eq!(m["truncatedAlerts"], 0);
    assert_eq!(m["groupLabels"], json!({"alertname": "order-lock-timeout"}));
    assert_eq!(m["commonLabels"]["alertname"], "order-lock-timeout");
    assert!(m["groupKey"].as_str().is_some_and(|k| !k.is_empty()), "{m}");
    let alerts = m["alerts"].as_array().unwrap();
    assert_eq!(alerts.len(), 1, "{m}");
    let a = &alerts[0];
    assert_eq!(a["status"], "firing");
    assert_eq!(
        a["labels"],
        json!({
            "alertname": "order-lock-timeout",
            "event": "expired",
            "redis_key": "order_lock:42",
            "db": "0",
            "order_id": "42",
        })
    );
    assert_eq!(a["annotations"]["summary"], "Order lock expired");
    assert_eq!(a["annotations"]["description"], "Lock of order 42 expired.");
    assert_eq!(a["startsAt"], e["observed_at"]);
    assert!(
        a["fingerprint"].as_str().is_some_and(|f| !f.is_empty()),
        "{a}"
    );
    for field in ["endsAt", "generatorURL"] {
        assert!(a.get(field).is_some(), "alert without `{field}`: {a}");
    }

    // A custom body, rendered, sent as it is.
    let r = one_request(&custom);
    assert_eq!(r.target, "/custom");
    assert_eq!(r.body_str(), r#"{"order": "42", "key": "order_lock:42"}"#);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.header("idempotency-key"),
        Some(format!("{id}:notify:custom").as_str())
    );
}

#[test]
fn keys_that_are_not_utf8_or_a_megabyte_long_are_delivered() {
    let hook = HttpReceiver::with_default(Response::status(200));
    let custom = HttpReceiver::with_default(Response::status(200));
    let yaml = format!(
        r#"
channels:
  hook: {{ type: webhook, url: "{}" }}
  custom: {{ type: webhook, url: "{}", body: '{{"key": {{{{ key | tojson }}}}}}' }}
rules:
  - name: cache
    match: "cache:{{id}}:{{n}}"
    notify: {{ to: [hook, custom] }}
  - name: big
    match: "big:{{rest}}"
    notify: {{ to: [hook] }}
"#,
        hook.url(),
        custom.url()
    );
    let mut daemon = Daemon::start(&yaml);
    daemon.expire(&b"cache:\xff\xfe:1"[..]);
    let e = one_request(&hook).json();
    assert_eq!(e["rule"], "cache");
    assert_eq!(e["key"], "cache:\u{FFFD}\u{FFFD}:1");
    assert_eq!(e["captures"], json!({"id": "\u{FFFD}\u{FFFD}", "n": "1"}));
    // A custom body is text too: valid UTF-8 JSON, not the key's raw bytes.
    let r = one_request(&custom);
    assert_eq!(r.json(), json!({"key": "cache:\u{FFFD}\u{FFFD}:1"}));
    assert_eq!(r.header("content-type"), Some("application/json"));

    // A key is whole in the event JSON up to 64 KiB; beyond, it and its captures are their cut
    // views: the first bytes, then the length and a short hash
    // (docs/reliability.md#bounded-whatever-the-key).
    let rest = "k".repeat(60 << 10);
    daemon.expire(format!("big:{rest}"));
    let requests = hook.wait_for(2, PATIENCE);
    let e = requests[1].json();
    assert_eq!(e["rule"], "big");
    assert_eq!(e["key"].as_str().map(str::len), Some(4 + (60 << 10)));
    assert_eq!(e["captures"]["rest"].as_str(), Some(rest.as_str()));
    let rest = "k".repeat(1 << 20);
    daemon.expire(format!("big:{rest}"));
    let requests = hook.wait_for(3, PATIENCE);
    let e = requests[2].json();
    let key = e["key"].as_str().unwrap();
    assert!(key.len() <= 64 << 10, "{}", key.len());
    assert!(key.starts_with("big:kkk"), "{key:.20}");
    assert!(
        key.ends_with(" bytes, sha256 ") || key.contains("[1048580 bytes, sha256 "),
        "{}",
        &key[key.len() - 60..]
    );
    let capture = e["captures"]["rest"].as_str().unwrap();
    assert!(
        capture.contains("[1048576 bytes, sha256 "),
        "{}",
        &capture[capture.len() - 60..]
    );
    assert!(
        daemon.process.try_status().is_none(),
        "keywatch exited\n{}",
        daemon.process.describe_output()
    );
    daemon.stop();
}

// ---------------------------------------------------------------------------------------------
// send-test

#[test]
fn send_test_prints_the_answer_and_fails_on_an_error_code() {
    let robot = HttpReceiver::with_default(dingtalk_answer(0, "ok"));
    let rules = Rules::new(&format!(
        r#"
channels:
  oncall: {{ type: dingtalk, url: "{}", secret: "SECsendtest" }}
rules:
  - name: lock
    match: "lock:{{id}}"
    notify: {{ to: [oncall] }}
"#,
        robot.url_for("/robot/send?access_token=sendtesttoken")
    ));
    let out = rules.run(&["send-test", "oncall"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("errcode 0 ok"), "{stdout}");
    let r = one_request(&robot);
    assert_eq!(r.path(), "/robot/send");
    assert_eq!(r.json()["msgtype"], "markdown");

    robot.set_default(dingtalk_answer(310000, "sign not match, more: [xyz]"));
    let out = rules.run(&["send-test", "oncall"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("errcode 310000") && stderr.contains("sign not match"),
        "{stderr}"
    );
    for text in [&stdout, &stderr] {
        assert_no_secret("send-test output", text, &["sendtesttoken", "SECsendtest"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Secrets

#[test]
fn secrets_stay_out_of_logs_and_explain() {
    const DT_TOKEN: &str = "dt0token0c0ffee";
    const DT_SECRET: &str = "SECdt0secret0beef";
    const SLACK_TOKEN: &str = "slack0token0f00d";
    const DOWN_TOKEN: &str = "down0token0dead";
    const REDIS_PASSWORD: &str = "redis0pass0word";
    let dingtalk = HttpReceiver::with_default(Response::status(500).body("boom"));
    let slack = HttpReceiver::with_default(Response::status(500).body("rollup_error"));
    // A target that refuses connections: transport errors must not name the URL either.
    let down = HttpReceiver::start();
    let down_url = down.url_for(&format!("/services/T1/B1/{DOWN_TOKEN}"));
    down.down();
    let dt_url = dingtalk.url_for(&format!("/robot/send?access_token={DT_TOKEN}"));
    let slack_url = slack.url_for(&format!("/services/T0/B0/{SLACK_TOKEN}"));
    let yaml = r#"
channels:
  oncall: { type: dingtalk, url: "${DT_URL}", secret: "${DT_SECRET}", rate: 100/s }
  team: { type: slack, url: "${SLACK_URL}", rate: 100/s }
  gone: { type: slack, url: "${DOWN_URL}", rate: 100/s }
rules:
  - name: lock
    match: "lock:{id}"
    notify: { to: [oncall, team, gone] }
"#;
    let envs = [
        ("DT_URL", dt_url.as_str()),
        ("DT_SECRET", DT_SECRET),
        ("SLACK_URL", slack_url.as_str()),
        ("DOWN_URL", down_url.as_str()),
    ];
    let secrets = [DT_TOKEN, DT_SECRET, SLACK_TOKEN, DOWN_TOKEN, REDIS_PASSWORD];
    // The daemon gets the password in its `--redis` URL.
    let redis = RedisServer::builder()
        .notify_keyspace_events("Exg")
        .requirepass(REDIS_PASSWORD)
        .start();
    let daemon = Daemon::start_with(redis, yaml, &envs);
    daemon.expire("lock:1");
    // Two failed attempts on each: the first attempt and a retry.
    dingtalk.wait_for(2, PATIENCE);
    slack.wait_for(2, PATIENCE);
    for channel in ["oncall", "team"] {
        let retry = attempt_logged(&daemon, channel, "retry");
        assert!(
            retry["reason"].as_str().unwrap().contains("HTTP 500"),
            "{retry}"
        );
    }
    let retry = attempt_logged(&daemon, "gone", "retry");
    assert!(
        retry["reason"].as_str().unwrap().contains("cannot connect"),
        "{retry}"
    );
    let explain = daemon.rules.run(&["explain", "lock:1"], &envs);
    let explained = String::from_utf8_lossy(&explain.stdout);
    assert_eq!(explain.status.code(), Some(0), "{explained}");
    assert!(explained.contains("oncall"), "{explained}");
    assert_no_secret("explain stdout", &explained, &secrets);
    assert_no_secret(
        "explain stderr",
        &String::from_utf8_lossy(&explain.stderr),
        &secrets,
    );
    let logs = daemon.stop();
    assert_no_secret("the daemon's logs", &logs, &secrets);
}

/// Secrets by where they came from, not by what a header is called: a value from `${VAR}`,
/// `${VAR:-…}` or a `*_file`, and a URL's user info, are masked wherever they land (reload URL
/// and query, a header, the body, an exec argument, a receiver's answer, a program's output)
/// in `explain`, `check` and the daemon's logs.
#[test]
fn secrets_are_masked_by_provenance_wherever_they_land() {
    const USER_PW: &str = "literal0userinfo0pw";
    const TOKEN: &str = "query0token0abc";
    const SIG: &str = "x-signature0value";
    const BODY: &str = "body0secret0value";
    const ARG: &str = "exec0argument0secret";
    const DEFAULTED: &str = "default0secret0zz";
    const FILED: &str = "filed0hook0token";
    let reloader = HttpReceiver::with_default(
        Response::status(500).body(format!("bad token {TOKEN} and {SIG}")),
    );
    let hook = HttpReceiver::with_default(Response::status(500).body("nope"));
    let reload_url = reloader.url_for("/reload/{{ id }}").replacen(
        "http://",
        &format!("http://reloader:{USER_PW}@"),
        1,
    );
    let rules = Rules::new_with(|dir| {
        std::fs::write(dir.join("hook.url"), hook.url_for(&format!("/h/{FILED}"))).unwrap();
        format!(
            r#"
channels:
  hook: {{ type: webhook, url_file: hook.url, rate: 100/s }}
rules:
  - name: warm
    match: "cache:{{id}}"
    reload:
      url: "{reload_url}?token=${{TOKEN}}&d=${{UNSET_WITH_DEFAULT:-{DEFAULTED}}}"
      headers: {{ X-Signature: "${{SIG}}", X-Plain: "shown-as-is" }}
      body: '{{"id": {{{{ id | tojson }}}}, "auth": "${{BODY}}"}}'
    exec:
      command: ["/bin/sh", "-c", 'echo "$$0"; echo "$$0" >&2; exit 3', "${{ARG}}"]
    notify: {{ to: [hook] }}
"#
        )
    });
    let envs = [("TOKEN", TOKEN), ("SIG", SIG), ("BODY", BODY), ("ARG", ARG)];
    let secrets = [USER_PW, TOKEN, SIG, BODY, ARG, DEFAULTED, FILED];

    let explain = rules.run(&["explain", "cache:1"], &envs);
    let explained = String::from_utf8_lossy(&explain.stdout);
    assert_eq!(explain.status.code(), Some(0), "{explained}");
    assert_no_secret("explain", &explained, &secrets);
    assert_no_secret(
        "explain",
        &String::from_utf8_lossy(&explain.stderr),
        &secrets,
    );
    for shown in [
        "X-Signature: <secret>",
        "X-Plain: shown-as-is",
        "token=<secret>",
        "<secret>@127.0.0.1",
        "\"auth\": \"<secret>\"",
        "/bin/sh",
    ] {
        assert!(explained.contains(shown), "{shown:?} not in:\n{explained}");
    }
    let check = rules.run(&["check"], &envs);
    assert_no_secret("check", &String::from_utf8_lossy(&check.stdout), &secrets);
    assert_no_secret("check", &String::from_utf8_lossy(&check.stderr), &secrets);

    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        rules,
        common::Logs::Json,
        &envs,
    );
    daemon.expire("cache:1");
    reloader.wait_for(2, PATIENCE);
    hook.wait_for(2, PATIENCE);
    let got = reloader.wait_for(1, PATIENCE);
    assert_eq!(
        got[0].header("x-signature"),
        Some(SIG),
        "the real request carries the secret"
    );
    daemon.wait_for_event("exec_output", "of the exec", |_| true);
    daemon.wait_for_event(common::ATTEMPTED, "of the exec's failure", |e| {
        field_is(e, "action", "exec") && field_is(e, "outcome", "retry")
    });
    let logs = daemon.stop();
    assert!(logs.contains("<secret>"), "{logs}");
    assert_no_secret("the daemon's logs", &logs, &secrets);
}
