//! Microsoft Teams, Telegram and PagerDuty end to end: the real binary on a real `redis-server`,
//! keys that really expire, and local HTTP receivers that check the method, path, headers and
//! exact body of each request and play the services' answers (429s included).
//!
//! Each test has its own Redis, receivers and daemon, so the tests run in parallel.

use crate::common;

use std::time::Duration;

use common::{
    Daemon, HttpReceiver, PATIENCE, Request, Response, Rules, assert_no_secret, field_is,
};
use serde_json::{Value, json};

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

/// A JSON POST to `path`, as every one of these services takes it.
fn assert_json_post(r: &Request, path: &str) {
    assert_eq!(r.method, "POST", "{}", r.summary());
    assert_eq!(r.target, path, "{}", r.summary());
    assert_eq!(
        r.header("content-type"),
        Some("application/json; charset=utf-8"),
        "{}",
        String::from_utf8_lossy(&r.raw_head)
    );
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str())
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

/// How long after the first request the second came.
fn waited(requests: &[Request]) -> Duration {
    requests[1]
        .received_instant
        .duration_since(requests[0].received_instant)
}

/// `keywatch send-test CHANNEL` on `rules`: its exit code, stdout and stderr.
fn send_test(rules: &Rules, channel: &str) -> (Option<i32>, String, String) {
    let out = rules.run(&["send-test", channel], &[]);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// ---------------------------------------------------------------------------------------------
// Microsoft Teams

#[test]
fn teams_posts_an_adaptive_card_with_escaped_facts_and_link_buttons() {
    let teams = HttpReceiver::with_default(Response::status(202));
    let yaml = format!(
        r#"
links:
  base_url: "https://kw.example"
  secret: "0123456789abcdef0123"
channels:
  ops: {{ type: teams, url: "{url}" }}
rules:
  - name: pay-lock
    match: "pay_lock:{{order_id}}"
    notify:
      to: [ops]
      title: "Payment lock {{{{ order_id }}}}"
      message: "Lock of **{{{{ order_id }}}}** expired.\nCheck the worker."
    escalate: {{ after: 1h, to: [ops] }}
"#,
        url = teams
            .url_for("/workflows/abc/triggers/manual/paths/invoke?api-version=1&sig=SIGsecret"),
    );
    let daemon = Daemon::start(&yaml);
    let hostile = "[x](http://evil) <b>@channel</b> evil.com/login /start <!channel> **b** config.yaml a\u{202E}b\u{7}c";
    daemon.expire(format!("pay_lock:{hostile}"));
    let r = one_request(&teams);
    assert_json_post(
        &r,
        "/workflows/abc/triggers/manual/paths/invoke?api-version=1&sig=SIGsecret",
    );
    let mut body = r.json();
    // Whether keywatch learnt the deadline before the key expired is a race (it expires at
    // once): a learnt one is shown as a time and a lateness, then compared as unknown.
    for fact in body["attachments"][0]["content"]["body"][2]["facts"]
        .as_array_mut()
        .unwrap()
    {
        let value = fact["value"].as_str().unwrap_or_default().to_string();
        match fact["title"].as_str() {
            Some("Deadline") if value != "unknown" => {
                assert!(
                    chrono::DateTime::parse_from_rfc3339(&value).is_ok(),
                    "{value}"
                );
                fact["value"] = json!("unknown");
            }
            Some("Late") if value != "unknown" => {
                assert!(value.ends_with('s'), "{value}");
                fact["value"] = json!("unknown");
            }
            _ => {}
        }
    }
    let card = &body["attachments"][0]["content"];
    let actions = card["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{body}");
    for (action, label) in actions.iter().zip(["Acknowledge", "Silence 1h"]) {
        assert_eq!(action["type"], "Action.OpenUrl");
        assert_eq!(action["title"], label);
        assert!(
            action["url"]
                .as_str()
                .unwrap()
                .starts_with("https://kw.example/l/"),
            "{action}"
        );
    }
    // Teams Markdown: links, bare host names, mentions and card functions broken by zero-width
    // spaces, emphasis by backslashes, invisible characters shown; a dot before no top-level
    // domain left as it is, so the key copies exactly.
    let escaped = "[x]\u{200B}(http:\u{200B}//evil) <\u{200B}b>@\u{200B}channel<\u{200B}/b> \
                   evil.\u{200B}com/login /start <\u{200B}!channel> \\*\\*b\\*\\* config.yaml a\\u202Eb\\u0007c";
    assert_eq!(
        body,
        json!({
            "type": "message",
            "attachments": [{
                "contentType": "application/vnd.microsoft.card.adaptive",
                "contentUrl": null,
                "content": {
                    "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                    "type": "AdaptiveCard",
                    "version": "1.4",
                    "msteams": {"width": "full"},
                    "body": [
                        {"type": "TextBlock", "text": format!("Payment lock {escaped}"), "weight": "Bolder", "size": "Medium", "wrap": true},
                        {"type": "TextBlock", "text": format!("Lock of **{escaped}** expired.\n\nCheck the worker."), "wrap": true},
                        {"type": "FactSet", "facts": [
                            {"title": "Rule", "value": "pay-lock"},
                            {"title": "Key", "value": format!("pay_lock:{escaped}")},
                            {"title": "DB", "value": "0"},
                            // Expired at once: normalised above when learnt.
                            {"title": "Deadline", "value": "unknown"},
                            {"title": "Late", "value": "unknown"},
                        ]},
                    ],
                    "actions": actions,
                },
            }],
        })
    );
    attempt_logged(&daemon, "ops", "sent");
}

#[test]
fn teams_429_waits_for_retry_after_and_4xx_is_a_dead_letter() {
    let teams = HttpReceiver::start();
    teams.push(Response::status(429).header("Retry-After", "1"));
    teams.push(Response::status(202));
    let broken = HttpReceiver::with_default(
        Response::status(400).body(r#"{"error":{"code":"InvalidRequestContent"}}"#),
    );
    let yaml = format!(
        r#"
channels:
  ops: {{ type: teams, url: "{}" }}
  broken: {{ type: teams, url: "{}" }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [ops, broken] }}
"#,
        teams.url_for("/invoke?sig=a"),
        broken.url_for("/invoke?sig=b"),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    let requests = teams.wait_for(2, PATIENCE);
    assert_eq!(requests[0].body, requests[1].body);
    assert!(
        waited(&requests) >= Duration::from_millis(900),
        "retried {:?} after a 429 with `Retry-After: 1`",
        waited(&requests)
    );
    attempt_logged(&daemon, "ops", "sent");
    let dead = dead_letter_logged(&daemon, "broken");
    assert!(dead.to_string().contains("InvalidRequestContent"), "{dead}");
    assert_eq!(broken.count(), 1, "a 400 was retried");
}

#[test]
fn teams_send_test_prints_the_answer_and_never_the_url() {
    let teams = HttpReceiver::with_default(Response::status(202));
    let rules = Rules::new(&format!(
        r#"
channels:
  ops: {{ type: teams, url: "{}" }}
"#,
        teams.url_for("/workflows/w1/invoke?sig=SIGsendtest")
    ));
    let (code, stdout, stderr) = send_test(&rules, "ops");
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let r = one_request(&teams);
    assert_json_post(&r, "/workflows/w1/invoke?sig=SIGsendtest");
    assert_eq!(
        r.json()["attachments"][0]["content"]["body"][0]["text"],
        "keywatch test message"
    );
    assert_eq!(
        stdout.trim(),
        format!(
            "sent to ops (teams → http://127.0.0.1:{}/<secret>): HTTP 202",
            teams.port()
        )
    );
    for text in [&stdout, &stderr] {
        assert_no_secret("send-test output", text, &["SIGsendtest", "/workflows/w1"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Telegram

const TG_TOKEN: &str = "123456789:AAEsecret-token_XYZ";

fn telegram_ok(id: i64) -> Response {
    Response::json(&json!({"ok": true, "result": {"message_id": id, "chat": {"id": -100123}}}))
}

#[test]
fn telegram_sends_escaped_html_with_link_buttons_to_send_message() {
    let tg = HttpReceiver::with_default(telegram_ok(7));
    let yaml = format!(
        r#"
links:
  base_url: "https://kw.example"
  secret: "0123456789abcdef0123"
channels:
  tg: {{ type: telegram, url: "{url}", token: "{TG_TOKEN}", chat_id: -1001234567890 }}
rules:
  - name: pay-lock
    match: "pay_lock:{{order_id}}"
    notify:
      to: [tg]
      title: "Payment lock <i>{{{{ order_id }}}}</i>"
      message: "Lock of <code>{{{{ order_id }}}}</code> expired ({{{{ key }}}})."
    escalate: {{ after: 1h, to: [tg] }}
"#,
        url = tg.url(),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire(
        "pay_lock:<b>x</b> <a href=\"http://evil\">y</a> & @channel <!channel> evil.com/login /start #tag \u{202E}\u{7}",
    );
    let r = one_request(&tg);
    assert_json_post(&r, &format!("/bot{TG_TOKEN}/sendMessage"));
    let body = r.json();
    let buttons = body["reply_markup"]["inline_keyboard"][0]
        .as_array()
        .unwrap();
    assert_eq!(buttons.len(), 2, "{body}");
    for (b, label) in buttons.iter().zip(["Acknowledge", "Silence 1h"]) {
        assert_eq!(b["text"], label);
        assert!(
            b["url"]
                .as_str()
                .unwrap()
                .starts_with("https://kw.example/l/"),
            "{b}"
        );
    }
    // Each value is a `<code>` entity, which Telegram never makes a link, mention, hashtag or
    // command of: only HTML is escaped and invisible characters shown, so it copies as it is.
    let escaped = "&lt;b&gt;x&lt;/b&gt; &lt;a href=&quot;http://evil&quot;&gt;y&lt;/a&gt; &amp; @channel \
                   &lt;!channel&gt; evil.com/login /start #tag \\u202E\\u0007";
    assert_eq!(
        body,
        json!({
            "chat_id": -1001234567890_i64,
            "text": format!(
                "<b>Payment lock <i><code>{escaped}</code></i></b>\n\
                 Lock of <code>{escaped}</code> expired (<code>pay_lock:{escaped}</code>)."
            ),
            "parse_mode": "HTML",
            "link_preview_options": {"is_disabled": true},
            "reply_markup": {"inline_keyboard": [buttons]},
        })
    );
    let sent = attempt_logged(&daemon, "tg", "sent");
    assert_no_secret("the log", &daemon.stderr(), &[TG_TOKEN, "AAEsecret"]);
    assert!(sent.to_string().contains("message_id 7"), "{sent}");
}

#[test]
fn telegram_429_obeys_retry_after_and_a_400_is_a_dead_letter() {
    let tg = HttpReceiver::start();
    tg.push(
        Response::status(429)
            .header("Content-Type", "application/json")
            .body(r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 2","parameters":{"retry_after":2}}"#),
    );
    tg.push(telegram_ok(8));
    let gone = HttpReceiver::with_default(
        Response::status(400)
            .header("Content-Type", "application/json")
            .body(r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#),
    );
    let yaml = format!(
        r#"
channels:
  tg: {{ type: telegram, url: "{}", token: "{TG_TOKEN}", chat_id: "@keywatch_alerts" }}
  gone: {{ type: telegram, url: "{}", token: "{TG_TOKEN}", chat_id: -42 }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [tg, gone], title: "Cache gone", message: "{{{{ key }}}}" }}
"#,
        tg.url(),
        gone.url(),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    let requests = tg.wait_for(2, PATIENCE);
    assert_eq!(requests[0].body, requests[1].body);
    assert_eq!(requests[0].json()["chat_id"], "@keywatch_alerts");
    assert!(
        waited(&requests) >= Duration::from_millis(1_900),
        "retried {:?} after `retry_after: 2`",
        waited(&requests)
    );
    let retry = attempt_logged(&daemon, "tg", "retry");
    assert!(retry.to_string().contains("retry after 2"), "{retry}");
    attempt_logged(&daemon, "tg", "sent");
    let dead = dead_letter_logged(&daemon, "gone");
    assert!(dead.to_string().contains("chat not found"), "{dead}");
    assert_eq!(gone.count(), 1, "a 400 was retried");
    assert_no_secret("the log", &daemon.stderr(), &[TG_TOKEN, "AAEsecret"]);
}

#[test]
fn telegram_token_stays_out_of_send_test_explain_and_errors() {
    let tg = HttpReceiver::with_default(telegram_ok(9));
    let rules = Rules::new(&format!(
        r#"
channels:
  tg: {{ type: telegram, url: "{}/", token: "{TG_TOKEN}", chat_id: -100123 }}
rules:
  - name: lock
    match: "lock:{{id}}"
    notify: {{ to: [tg] }}
"#,
        tg.url()
    ));
    // The test message names the host it was sent from: a known one here.
    let out = rules.run(&["send-test", "tg"], &[("HOSTNAME", "kw-host-1")]);
    let (code, stdout, stderr) = (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout.trim(),
        format!(
            "sent to tg (telegram → {}/bot<secret>/sendMessage, chat -100123): ok, message_id 9",
            tg.url()
        )
    );
    let r = one_request(&tg);
    assert_json_post(&r, &format!("/bot{TG_TOKEN}/sendMessage"));
    // It also says when it was sent, which the test cannot know: that part must be a time as
    // the event JSON writes it, and everything around it is exact.
    let body = r.json();
    let text = body["text"].as_str().unwrap_or_default();
    let at = text
        .strip_prefix("<b>keywatch test message</b>\nThis is a test message from keywatch send-test on kw-host-1 at ")
        .and_then(|rest| rest.strip_suffix('.'))
        .unwrap_or_else(|| panic!("{text:?}"));
    rfc3339_ms(&json!(at));
    assert_eq!(
        body,
        json!({
            "chat_id": -100123,
            "text": format!("<b>keywatch test message</b>\nThis is a test message from keywatch send-test on kw-host-1 at {at}."),
            "parse_mode": "HTML",
            "link_preview_options": {"is_disabled": true},
        })
    );

    tg.set_default(
        Response::status(401)
            .header("Content-Type", "application/json")
            .body(r#"{"ok":false,"error_code":401,"description":"Unauthorized"}"#),
    );
    let (code, stdout, stderr) = send_test(&rules, "tg");
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("HTTP 401: Unauthorized"), "{stderr}");
    let explain = rules.run(&["explain", "lock:1"], &[]);
    let explained = String::from_utf8_lossy(&explain.stdout).into_owned();
    assert!(explained.contains("bot<secret>/sendMessage"), "{explained}");
    for text in [&stdout, &stderr, &explained] {
        assert_no_secret("send-test and explain", text, &[TG_TOKEN, "AAEsecret"]);
    }
    // A connection refused names no URL either.
    let closed = common::ports::closed_port();
    let down = Rules::new(&format!(
        r#"
channels:
  tg: {{ type: telegram, url: "http://127.0.0.1:{}", token: "{TG_TOKEN}", chat_id: -100123 }}
"#,
        closed.port
    ));
    let (code, stdout, stderr) = send_test(&down, "tg");
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert_no_secret("a transport error", &stderr, &[TG_TOKEN, "AAEsecret"]);
}

#[test]
fn telegram_check_locates_a_bad_token_and_chat_id() {
    let rules = Rules::new(
        r#"
channels:
  tg:
    type: telegram
    token: "not a token/AAEsecret"
    chat_id: "somebody"
"#,
    );
    let out = rules.run(&["check"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rules.yaml:5:12: channel `tg` `token` does not look like a bot token"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rules.yaml:6:14: channel `tg` `chat_id` must be a chat id (e.g. `-1001234567890`) or a channel's `@username`, found `somebody`"),
        "{stderr}"
    );
    assert_no_secret("check", &stderr, &["AAEsecret"]);
}

// ---------------------------------------------------------------------------------------------
// PagerDuty

const PD_KEY: &str = "R0UTINGkey0123456789abcdefABCDEF";

fn pagerduty_ok(dedup_key: &str) -> Response {
    Response::status(202)
        .header("Content-Type", "application/json")
        .body(
            json!({"status": "success", "message": "Event processed", "dedup_key": dedup_key})
                .to_string(),
        )
}

/// The event JSON (docs/rules.md#event-json) of an expiry of `key` under `rule` on `daemon`'s Redis, with what
/// the test knows: everything but the instants, which are checked for what they must be and
/// taken from `sent`, and the id, computed from them. Whether keywatch learnt the deadline
/// before the key expired is a race (it expires at once): the event is stamped with the
/// deadline where it was learnt, else with when it was observed. Also returns that instant.
fn known_event(
    sent: &Value,
    daemon: &Daemon,
    rule: &str,
    key: &[u8],
    captures: Value,
) -> (Value, chrono::DateTime<chrono::Utc>) {
    let observed_at = rfc3339_ms(&sent["observed_at"]);
    let (deadline, instant) = match sent["deadline"].as_str() {
        Some(_) => {
            let deadline = rfc3339_ms(&sent["deadline"]);
            let late = (observed_at - deadline).num_milliseconds();
            assert!(late >= 0, "observed before its deadline: {sent}");
            // `late_ms` is counted from the instants themselves, which the text shows to the
            // millisecond: a difference of one is rounding, anything more a wrong lateness.
            let late_ms = sent["late_ms"].as_i64().unwrap_or(-1);
            assert!(
                (late_ms - late).abs() <= 1,
                "late_ms {late_ms}, instants say {late}"
            );
            (json!(deadline_text(deadline)), deadline)
        }
        None => (Value::Null, observed_at),
    };
    let expected = json!({
        "version": 1, "id": event_id(rule, "expired", 0, key, instant), "rule": rule,
        "event": "expired", "key": String::from_utf8_lossy(key), "db": 0, "captures": captures,
        "detail": null, "deadline": deadline, "observed_at": deadline_text(observed_at),
        "late_ms": if deadline.is_null() { Value::Null } else { sent["late_ms"].clone() },
        "recovered": false, "ttl_ms": null,
        "source": format!("127.0.0.1:{}", daemon.redis.port()),
    });
    (expected, instant)
}

/// An RFC 3339 time of the event JSON (millisecond precision, `Z`), which must be one.
fn rfc3339_ms(v: &Value) -> chrono::DateTime<chrono::Utc> {
    let text = v.as_str().unwrap_or_else(|| panic!("not a time: {v}"));
    let t = chrono::DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .with_timezone(&chrono::Utc);
    assert_eq!(
        deadline_text(t),
        text,
        "not written to the millisecond in UTC"
    );
    t
}

/// A time as the event JSON writes it (docs/rules.md#event-json: `2026-11-29T10:15:00.000Z`).
fn deadline_text(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The event id docs/rules.md#event-json says is the same on every instance: computed here on its own from
/// what identifies the event (rule, event, db, key, and its deadline or else when it was
/// observed; docs/how-it-works.md), in the exact form `firing::event_id` hashes it.
fn event_id(
    rule: &str,
    event: &str,
    db: u32,
    key: &[u8],
    instant: chrono::DateTime<chrono::Utc>,
) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(rule.as_bytes());
    h.update([0]);
    h.update(event.as_bytes());
    h.update([0]);
    h.update(db.to_be_bytes());
    h.update((key.len() as u64).to_be_bytes());
    h.update(key);
    h.update(instant.timestamp_millis().to_be_bytes());
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn pagerduty_triggers_then_resolves_with_the_same_dedup_key() {
    let pd = HttpReceiver::with_default(pagerduty_ok("x"));
    // `resolved.to` tells people elsewhere; the incident is resolved because `notify.to` paged
    // (docs/rules.md#pagerduty: a rule's `resolved` sends `event_action: resolve`), not because it is listed.
    let ops = HttpReceiver::with_default(Response::status(200));
    // The first trigger meets a 429, then PagerDuty's own answer.
    pd.push(Response::status(429).header("Retry-After", "1"));
    let yaml = format!(
        r#"
channels:
  pager:
    type: pagerduty
    url: "{url}"
    routing_key: "{PD_KEY}"
    severity: "{{{{ 'warning' if recovered else 'critical' }}}}"
  ops: {{ type: webhook, url: "{ops}" }}
rules:
  - name: pay-lock
    match: "pay_lock:{{order_id}}"
    notify:
      to: [pager]
      title: "Payment lock {{{{ order_id }}}} expired"
      message: "Check the payment worker."
    resolved:
      within: 1h
      to: [ops]
      message: "Re-acquired after {{{{ gap }}}}."
"#,
        url = pd.url_for("/v2/enqueue"),
        ops = ops.url_for("/hooks/ops"),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("pay_lock:42");
    let triggers = pd.wait_for(2, PATIENCE);
    assert_eq!(
        triggers[0].body, triggers[1].body,
        "the retry is the same event"
    );
    assert!(
        waited(&triggers) >= Duration::from_millis(900),
        "retried {:?} after a 429 with `Retry-After: 1`",
        waited(&triggers)
    );
    let trigger = &triggers[1];
    assert_json_post(trigger, "/v2/enqueue");
    let t = trigger.json();
    let (expected_details, instant) = known_event(
        &t["payload"]["custom_details"],
        &daemon,
        "pay-lock",
        b"pay_lock:42",
        json!({"order_id": "42"}),
    );
    let id = expected_details["id"].as_str().unwrap().to_string();
    let source = format!("127.0.0.1:{}", daemon.redis.port());
    assert_eq!(
        t,
        json!({
            "routing_key": PD_KEY,
            "event_action": "trigger",
            "dedup_key": id,
            "client": "keywatch",
            "payload": {
                "summary": "Payment lock 42 expired: Check the payment worker.",
                "source": source,
                "severity": "critical",
                "timestamp": deadline_text(instant),
                "group": "pay-lock",
                "class": "expired",
                "custom_details": expected_details.clone(),
            },
        })
    );
    attempt_logged(&daemon, "pager", "sent");

    // The lock is taken again: the rule's `resolved` tells `ops` and resolves the same incident.
    common::set_px(&mut daemon.conn(), "pay_lock:42", 60_000);
    let notice = one_request(&ops);
    assert_eq!(
        (notice.method.as_str(), notice.target.as_str()),
        ("POST", "/hooks/ops")
    );
    assert_eq!(notice.header("content-type"), Some("application/json"));
    assert_eq!(
        notice.header("idempotency-key"),
        Some(format!("{id}:resolved:ops").as_str())
    );
    let mut resolved_event = expected_details.clone();
    resolved_event["followup"] = json!("resolved");
    assert_eq!(notice.json(), resolved_event);
    let all = pd.wait_for(3, PATIENCE);
    assert_eq!(
        all.len(),
        3,
        "one resolve, and nothing else, after the trigger"
    );
    let resolve = &all[2];
    assert_json_post(resolve, "/v2/enqueue");
    assert_eq!(
        resolve.json(),
        json!({"routing_key": PD_KEY, "event_action": "resolve", "dedup_key": id})
    );
    // The resolve's log line names its channel, as a notification's does.
    daemon.wait_for_event(common::ATTEMPTED, "of the resolve judged sent", |e| {
        field_is(e, "action", "resolved")
            && field_is(e, "channel", "pager")
            && field_is(e, "outcome", "sent")
            && field_is(e, "answer", "202 success: Event processed")
    });
    assert_no_secret("the log", &daemon.stderr(), &[PD_KEY]);
}

#[test]
fn pagerduty_400_is_a_dead_letter_with_its_errors_and_5xx_is_retried() {
    let pd = HttpReceiver::start();
    pd.push(Response::status(503).body("Service Unavailable"));
    pd.push(
        Response::status(400)
            .header("Content-Type", "application/json")
            .body(r#"{"status":"invalid event","message":"Event object is invalid","errors":["'payload.summary' is missing or blank"]}"#),
    );
    let yaml = format!(
        r#"
channels:
  pager: {{ type: pagerduty, url: "{}", routing_key: "{PD_KEY}" }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [pager] }}
"#,
        pd.url_for("/v2/enqueue"),
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("cache:1");
    let requests = pd.wait_for(2, PATIENCE);
    assert_eq!(requests[0].body, requests[1].body);
    assert_eq!(requests[0].json()["payload"]["severity"], "error");
    attempt_logged(&daemon, "pager", "retry");
    let dead = dead_letter_logged(&daemon, "pager");
    assert!(
        dead.to_string()
            .contains("HTTP 400: Event object is invalid: 'payload.summary' is missing or blank"),
        "{dead}"
    );
    common::wait_until("no job waits in the queue", PATIENCE, || {
        redis::cmd("ZCARD")
            .arg("keywatch:queue")
            .query::<i64>(&mut daemon.conn())
            .unwrap()
            == 0
    });
    assert_eq!(pd.count(), 2, "the 400 was retried");
}

/// A hostile key is data in `custom_details` (JSON: exact, and no field added or changed) and
/// chat text in `summary`, which reaches people by push, SMS and chat apps: no link, mention,
/// line or reordering of its own there (docs/rules.md#pagerduty).
#[test]
fn pagerduty_a_hostile_key_cannot_inject_into_the_event() {
    let pd = HttpReceiver::with_default(pagerduty_ok("x"));
    let yaml = format!(
        r#"
channels:
  pager: {{ type: pagerduty, url: "{}", routing_key: "{PD_KEY}", severity: warning }}
rules:
  - name: cache-gone
    match: "cache:{{name}}"
    notify: {{ to: [pager], title: "Cache {{{{ name }}}} gone", message: "{{{{ key }}}} expired." }}
"#,
        pd.url_for("/v2/enqueue"),
    );
    let daemon = Daemon::start(&yaml);
    let name = "k\"}, \"event_action\": \"resolve\", \"x\": \"\n</x> evil.com/login http://x @all <!channel> /start a\u{202E}b\u{7}c";
    let key = format!("cache:{name}");
    daemon.expire(&key);
    let r = one_request(&pd);
    assert_json_post(&r, "/v2/enqueue");
    let t = r.json();
    let (details, instant) = known_event(
        &t["payload"]["custom_details"],
        &daemon,
        "cache-gone",
        key.as_bytes(),
        json!({ "name": name }),
    );
    let shown = "k\"}, \"event_action\": \"resolve\", \"x\": \"\\n<\u{200B}/x> evil.\u{200B}com/login \
                 http:\u{200B}//x @\u{200B}all <\u{200B}!channel> /start a\\u202Eb\\u0007c";
    assert_eq!(
        t,
        json!({
            "routing_key": PD_KEY,
            "event_action": "trigger",
            "dedup_key": details["id"],
            "client": "keywatch",
            "payload": {
                "summary": format!("Cache {shown} gone: cache:{shown} expired."),
                "source": details["source"],
                "severity": "warning",
                "timestamp": deadline_text(instant),
                "group": "cache-gone",
                "class": "expired",
                "custom_details": details,
            },
        })
    );
}

#[test]
fn pagerduty_send_test_check_and_explain() {
    let pd = HttpReceiver::with_default(pagerduty_ok("send-test"));
    let rules = Rules::new(&format!(
        r#"
channels:
  pager: {{ type: pagerduty, url: "{}", routing_key: "{PD_KEY}", severity: warning }}
rules:
  - name: lock
    match: "lock:{{id}}"
    notify: {{ to: [pager] }}
"#,
        pd.url_for("/v2/enqueue")
    ));
    let (code, stdout, stderr) = send_test(&rules, "pager");
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout.trim(),
        format!(
            "sent to pager (pagerduty → {} (routing key <secret>)): 202 success: Event processed",
            pd.url_for("/v2/enqueue")
        )
    );
    let r = one_request(&pd);
    assert_eq!(r.json()["payload"]["severity"], "warning");
    let explain = rules.run(&["explain", "lock:1"], &[]);
    let explained = String::from_utf8_lossy(&explain.stdout).into_owned();
    assert!(explained.contains("(routing key <secret>)"), "{explained}");
    for text in [&stdout, &stderr, &explained] {
        assert_no_secret("send-test and explain", text, &[PD_KEY]);
    }

    let bad = Rules::new(
        r#"
channels:
  pager: { type: pagerduty, routing_key: "shortSECRET", severity: high }
rules:
  - name: lock
    match: "lock:{id}"
    notify: { to: [pager], group: { window: 30s } }
"#,
    );
    let out = bad.run(&["check"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for expected in [
        "rules.yaml:3:42: channel `pager` `routing_key` must be the 32-character integration key of an Events API v2 integration (found 11 characters)",
        "rules.yaml:3:67: channel `pager` `severity` must be one of critical, error, warning, info or a template, found `high`",
        "takes no digests",
    ] {
        assert!(stderr.contains(expected), "{expected}\n{stderr}");
    }
    assert_no_secret("check", &stderr, &["shortSECRET"]);
}
