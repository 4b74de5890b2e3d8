//! The alertmanager channel end to end, against a real Prometheus Alertmanager: keys that
//! really expire, keywatch posting to Alertmanager's API v2, and Alertmanager's own
//! notifications arriving at a local webhook receiver (docs/rules.md#channels).

use crate::common;

use common::alertmanager::{Alertmanager, keys_of, notifications, wait_for_notification};
use common::{
    Daemon, HttpReceiver, Logs, PATIENCE, RedisServer, Response, assert_no_secret, endpoint, get,
    poll, run_keywatch, run_subscribed, wait_until,
};
use serde_json::{Value, json};
use std::time::Duration;

/// A rule on `order_lock:{order_id}` notifying the alertmanager channel `am` of `urls`.
fn rules(urls: &[String], channel_extra: &str, rule_extra: &str) -> String {
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        r#"
channels:
  am:
    type: alertmanager
    urls: [{urls}]
    labels: {{ team: payments }}
{channel_extra}
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify:
      to: [am]
      title: "Order lock expired"
      message: "Lock of order {{{{ order_id }}}} expired."
      labels: {{ severity: "{{% if order_id == '1' %}}page{{% else %}}ticket{{% endif %}}" }}
      annotations: {{ runbook_url: "https://wiki.example/locks#{{{{ order_id }}}}" }}
{rule_extra}
"#,
        urls = urls.join(", ")
    )
}

fn history(daemon: &Daemon) -> Vec<Value> {
    common::history_json(&daemon.redis.url(), &daemon.rules.path, &[])
}

#[test]
fn an_expiry_reaches_the_receiver_through_alertmanager_with_its_labels() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let yaml = rules(&[am.url()], "", "")
        + "links: { base_url: \"https://kw.example\", secret: \"0123456789abcdef0123\" }\n";
    let daemon = Daemon::start(&yaml);
    daemon.expire("order_lock:1");

    let n = wait_for_notification(&hook, "the expiry", |n| keys_of(n) == ["order_lock:1"]);
    assert_eq!(n["status"], "firing");
    assert_eq!(n["groupLabels"], json!({"alertname": "order-lock-timeout"}));
    let alert = &n["alerts"][0];
    assert_eq!(
        alert["labels"],
        json!({
            "alertname": "order-lock-timeout", "key": "order_lock:1", "db": "0",
            "event": "expired", "order_id": "1", "team": "payments", "severity": "page",
        })
    );
    let id = alert["annotations"]["keywatch_id"].as_str().unwrap();
    assert_eq!(id.len(), 32, "{alert}");
    assert_eq!(
        alert["annotations"],
        json!({
            "summary": "Order lock expired", "description": "Lock of order 1 expired.",
            "keywatch_id": id, "runbook_url": "https://wiki.example/locks#1",
        })
    );
    // `generatorURL`: the event's history on keywatch's endpoint.
    let generator = format!("https://kw.example/api/history?id={id}");
    assert_eq!(alert["generatorURL"], generator.as_str());
    let (status, body) = get(
        &endpoint(&daemon.process),
        generator.strip_prefix("https://kw.example").unwrap(),
    );
    assert_eq!(status, 200, "{body}");
    let listed: Vec<Value> = serde_json::from_str(&body).unwrap();
    assert_eq!(listed.len(), 1, "{body}");
    assert_eq!(listed[0]["id"], id);

    // What Alertmanager holds: the alert keywatch posted, ending `hold` (1h) after it started,
    // or after keywatch observed it when that was later (docs/rules.md#alertmanager): by as much
    // as the expiry was late, milliseconds here.
    let held = am.wait_for_alert("order_lock:1");
    let starts: chrono::DateTime<chrono::Utc> = held["startsAt"].as_str().unwrap().parse().unwrap();
    let ends: chrono::DateTime<chrono::Utc> = held["endsAt"].as_str().unwrap().parse().unwrap();
    let hold = ends - starts;
    assert!(
        hold >= chrono::Duration::hours(1)
            && hold < chrono::Duration::hours(1) + chrono::Duration::seconds(5),
        "{held}"
    );

    // History: one outcome per URL, sent.
    let h = history(&daemon);
    assert_eq!(h.len(), 1, "{h:#?}");
    assert_eq!(
        h[0]["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (
                a["action"].clone(),
                a["channel"].clone(),
                a["target"].clone(),
                a["outcome"].clone()
            ))
            .collect::<Vec<_>>(),
        [(json!("notify"), json!("am"), json!(0), json!("sent"))]
    );
}

#[test]
fn several_expiries_of_one_rule_arrive_grouped() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let daemon = Daemon::start(&rules(&[am.url()], "", ""));
    daemon.expire_all(&["order_lock:1", "order_lock:2", "order_lock:3"]);

    let n = wait_for_notification(&hook, "the three expiries", |n| keys_of(n).len() == 3);
    assert_eq!(
        keys_of(&n),
        ["order_lock:1", "order_lock:2", "order_lock:3"]
    );
    assert_eq!(n["commonLabels"]["alertname"], "order-lock-timeout");
    // One group, one notification: none came before it with fewer alerts.
    assert_eq!(notifications(&hook).len(), 1, "{:#?}", notifications(&hook));
    drop(am);
}

#[test]
fn an_alertmanager_silence_on_key_mutes_one_expiry() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    am.silence("key", "order_lock:2");
    let daemon = Daemon::start(&rules(&[am.url()], "", ""));
    daemon.expire_all(&["order_lock:1", "order_lock:2"]);

    // Both reach Alertmanager; the silenced one is held as suppressed.
    let muted = am.wait_for_alert("order_lock:2");
    let muted = poll(
        "Alertmanager marks order_lock:2 suppressed",
        PATIENCE,
        || {
            let a = am.wait_for_alert("order_lock:2");
            (a["status"]["state"] == "suppressed").then_some(a)
        },
        || format!("{muted:#}"),
    );
    assert_eq!(muted["status"]["silencedBy"].as_array().unwrap().len(), 1);
    let n = wait_for_notification(&hook, "the unsilenced expiry", |n| {
        keys_of(n).contains(&"order_lock:1".to_string())
    });
    assert_eq!(keys_of(&n), ["order_lock:1"]);
    assert!(
        notifications(&hook)
            .iter()
            .all(|n| !keys_of(n).contains(&"order_lock:2".to_string())),
        "{:#?}",
        notifications(&hook)
    );
}

#[test]
fn the_rules_resolved_produces_alertmanagers_resolved_notification() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let yaml = rules(&[am.url()], "", "    resolved: { within: 1h }\n");
    let daemon = Daemon::start(&yaml);
    daemon.expire("order_lock:1");
    wait_for_notification(&hook, "the alert firing", |n| n["status"] == "firing");

    // The lock is taken again (with a TTL: keywatch hears its `expire` event).
    let _: () = redis::cmd("SET")
        .arg("order_lock:1")
        .arg("worker-2")
        .arg("PX")
        .arg(600_000)
        .query(&mut daemon.conn())
        .unwrap();

    let n = wait_for_notification(&hook, "the alert resolved", |n| n["status"] == "resolved");
    assert_eq!(keys_of(&n), ["order_lock:1"]);
    let ended: chrono::DateTime<chrono::Utc> =
        n["alerts"][0]["endsAt"].as_str().unwrap().parse().unwrap();
    let started: chrono::DateTime<chrono::Utc> = n["alerts"][0]["startsAt"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        ended > started && ended - started < chrono::Duration::minutes(5),
        "{n:#}"
    );
    // Alertmanager no longer holds it as active.
    wait_until("Alertmanager drops the resolved alert", PATIENCE, || {
        am.alerts()
            .iter()
            .all(|a| a["labels"]["key"] != "order_lock:1")
    });
    let h = history(&daemon);
    let resolved: Vec<&Value> = h[0]["actions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["action"] == "resolved")
        .collect();
    assert_eq!(resolved.len(), 1, "{h:#?}");
    assert_eq!(resolved[0]["channel"], "am");
    assert_eq!(resolved[0]["outcome"], "sent");
}

#[test]
fn a_restarted_alertmanager_has_the_firing_alert_again_within_resend() {
    let hook = HttpReceiver::start();
    let mut am = Alertmanager::start(&hook);
    let resend = Duration::from_secs(2);
    let daemon = Daemon::start(&rules(&[am.url()], "    resend: 2s\n", ""));
    daemon.expire("order_lock:1");
    let before = am.wait_for_alert("order_lock:1");

    // Killed and started again with an empty storage folder: it holds nothing until keywatch's
    // next round posts the alert again, at most `resend` later. Five rounds' time is the bound:
    // generous for a loaded machine, yet a fraction of the default `resend` (1m) that a channel
    // ignoring its own would fall back to.
    am.restart_afresh();
    let after = am.wait_for_alert_within("order_lock:1", resend * 5);
    assert_eq!(after["startsAt"], before["startsAt"]);
    assert_eq!(after["endsAt"], before["endsAt"]);
    assert_eq!(after["labels"], before["labels"]);
}

/// The rounds' timers are in Redis: a keywatch killed (SIGKILL) while an alert fires leaves its
/// alert's job there, and the keywatch started after it posts it on. An Alertmanager started
/// afresh after the kill, which only the new keywatch can have posted to, has the alert again.
#[test]
fn a_restarted_keywatch_keeps_re_sending_the_firing_alert() {
    let hook = HttpReceiver::start();
    let mut am = Alertmanager::start(&hook);
    // A short lease: a job the killed instance had taken is taken over soon.
    let envs = [("KEYWATCH_LEASE", "5s")];
    let yaml = rules(&[am.url()], "    resend: 2s\n", "");
    let mut daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &envs);
    daemon.expire("order_lock:1");
    let before = am.wait_for_alert("order_lock:1");

    daemon.process.sigkill();
    daemon.process = run_subscribed(
        &daemon.redis.auth_url(),
        &daemon.rules.path,
        Logs::Json,
        &envs,
    );
    am.restart_afresh();
    let after = am.wait_for_alert("order_lock:1");
    assert_eq!(after["startsAt"], before["startsAt"]);
    assert_eq!(after["endsAt"], before["endsAt"]);
    assert_eq!(after["labels"], before["labels"]);
    // The new keywatch posted it: a round of its own, sent and to be posted again.
    let round = daemon.wait_for_event(
        common::ATTEMPTED,
        "of a round sent by the new keywatch",
        |e| e["channel"] == "am" && e["outcome"] == "sent" && e.get("again_in").is_some(),
    );
    assert_eq!(round["key"], "order_lock:1", "{round}");
    // Still the one event: history holds one firing, its one URL sent.
    let h = history(&daemon);
    assert_eq!(h.len(), 1, "{h:#?}");
}

#[test]
fn one_of_two_urls_down_changes_nothing_for_the_other() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    // Nothing listens there.
    let closed = common::ports::closed_port();
    let down = format!("http://127.0.0.1:{}", closed.port);
    let daemon = Daemon::start(&rules(&[down.clone(), am.url()], "", ""));
    daemon.expire("order_lock:1");

    let n = wait_for_notification(&hook, "the expiry", |n| keys_of(n) == ["order_lock:1"]);
    assert_eq!(n["status"], "firing");
    poll(
        "history shows each URL's own outcome",
        PATIENCE,
        || {
            let h = history(&daemon);
            let actions = h.first()?["actions"].as_array()?.clone();
            let of = |t: u32| {
                actions
                    .iter()
                    .find(|a| a["target"] == t)
                    .map(|a| a["outcome"].clone())
            };
            (of(0) == Some(json!("retrying")) && of(1) == Some(json!("sent"))).then_some(())
        },
        || format!("{:#?}", history(&daemon)),
    );
    let retrying = daemon.attempt_on("am", "retry");
    assert!(
        retrying["reason"]
            .as_str()
            .unwrap()
            .contains("cannot connect"),
        "{retrying}"
    );
}

#[test]
fn send_test_posts_a_test_alert_to_every_url_and_explain_shows_the_exact_json() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let yaml = rules(
        &[am.url()],
        "    headers: { Authorization: \"Bearer ${AM_TOKEN}\" }\n",
        "",
    );
    let daemon_rules = common::Rules::new(&yaml);
    let envs = [("AM_TOKEN", "s3cr3t-token")];
    let out = daemon_rules.run(&["send-test", "am"], &envs);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim(),
        format!("sent to am (alertmanager → {}): HTTP 200", am.url())
    );
    let test = am.wait_for_alert("keywatch:send-test");
    assert_eq!(test["labels"]["alertname"], "keywatch-send-test");
    assert_eq!(test["labels"]["team"], "payments");

    let out = daemon_rules.run(&["explain", "order_lock:7"], &envs);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("s3cr3t"), "{text}");
    assert!(
        text.contains(&format!("POST {}/api/v2/alerts", am.url())),
        "{text}"
    );
    assert!(text.contains("header Authorization: <secret>"), "{text}");
    let body = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("body: "))
        .unwrap_or_else(|| panic!("{text}"));
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        body[0]["labels"],
        json!({
            "alertname": "order-lock-timeout", "key": "order_lock:7", "db": "0",
            "event": "expired", "order_id": "7", "team": "payments", "severity": "ticket",
        })
    );
    assert_eq!(
        body[0]["annotations"]["runbook_url"],
        "https://wiki.example/locks#7"
    );
}

#[test]
fn check_refuses_group_and_bad_label_names_on_alertmanager_channels_with_their_places() {
    let yaml = r#"channels:
  am:
    type: alertmanager
    urls: ["http://127.0.0.1:9093"]
    labels: { "1bad": x }
rules:
  - name: r
    match: "a:{id}"
    notify:
      to: [am]
      group: { window: 30s }
      labels: { "a-b": "{{ id }}" }
      anotations: { x: y }
"#;
    let rules = common::Rules::new(yaml);
    let out = rules.run(&["check"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let file = rules.path.display().to_string();
    for expected in [
        format!("{file}:5:15: channel `am` `labels`: `1bad` is not a valid Prometheus label name"),
        format!(
            "{file}:11:7: rule `r` `notify.group`: channel `am` is an alertmanager channel, and Alertmanager groups alerts itself"
        ),
        format!(
            "{file}:12:17: rule `r` `notify.labels`: `a-b` is not a valid Prometheus label name"
        ),
        format!("{file}:13:7: unknown field `anotations` in rule `r` `notify`"),
    ] {
        assert!(err.contains(&expected), "missing {expected:?} in:\n{err}");
    }
    assert!(err.contains("did you mean `annotations`?"), "{err}");
}

/// What people see of a channel whose Alertmanager sits behind a proxy that quotes the
/// credentials it refused: a bearer token written in the file itself and the user info of a URL
/// are masked in `send-test`, `explain`, the log and history, as values from `${…}` are.
#[test]
fn inline_header_tokens_and_url_user_info_never_show() {
    use base64::Engine;
    const TOKEN: &str = "inl1ne-bearer-t0ken";
    const PASSWORD: &str = "us3r-pa55word";
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("kwuser:{PASSWORD}"));
    let secrets = [TOKEN, PASSWORD, basic.as_str()];
    let proxy = HttpReceiver::start();
    proxy.set_handler(|r| {
        let said = format!(
            "refused Authorization: {}",
            r.header("authorization").unwrap_or("none")
        );
        Some(
            Response::status(400)
                .header("Content-Type", "application/json")
                .body(json!({"code": 400, "message": said}).to_string()),
        )
    });
    let port = proxy.port();
    let yaml = format!(
        r#"
channels:
  bearer:
    type: alertmanager
    urls: ["http://127.0.0.1:{port}"]
    headers: {{ Authorization: "Bearer {TOKEN}" }}
  userinfo:
    type: alertmanager
    urls: ["http://kwuser:{PASSWORD}@127.0.0.1:{port}"]
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify: {{ to: [bearer, userinfo] }}
"#
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire("order_lock:1");
    // Both refused (a 400 is given up): each answer quoted the credentials it was sent.
    for channel in ["bearer", "userinfo"] {
        let dead = daemon.dead_letter_on(channel);
        let reason = dead["reason"].as_str().unwrap_or_default();
        assert!(
            reason.starts_with("HTTP 400: refused Authorization: ") && reason.contains("<secret>"),
            "{dead}"
        );
    }
    let sent: Vec<String> = proxy
        .requests()
        .iter()
        .filter_map(|r| r.header("authorization").map(str::to_string))
        .collect();
    assert!(sent.contains(&format!("Bearer {TOKEN}")), "{sent:?}");
    assert!(sent.contains(&format!("Basic {basic}")), "{sent:?}");
    assert_no_secret("the log", &daemon.stderr(), &secrets);

    let url = daemon.redis.url();
    let rules = daemon.rules.path.to_string_lossy().into_owned();
    for args in [
        vec!["history", "--json", "--redis", &url, "-r", &rules],
        vec!["history", "--redis", &url, "-r", &rules],
    ] {
        let out = run_keywatch(&args, &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("refused Authorization"), "{args:?}: {text}");
        assert_no_secret(&format!("{args:?}"), &text, &secrets);
    }
    for args in [
        vec!["send-test", "bearer"],
        vec!["send-test", "userinfo"],
        vec!["explain", "order_lock:7"],
    ] {
        let out = daemon.rules.run(&args, &[]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_no_secret(&format!("{args:?}"), &text, &secrets);
    }
}

/// Alertmanager hands annotations to Slack, Telegram, email and chat receivers as they are, so a
/// key's text in `summary`, `description` and `notify.annotations` is escaped as chat text: no
/// mention (`<!channel>`, `@all`), no tag, no bare link, no invisible reordering. Labels stay the
/// exact key text: a silence or a route on `key` must match the real key.
#[test]
fn a_hostile_key_is_exact_in_labels_and_escaped_in_annotations() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let yaml = format!(
        r#"
channels:
  am:
    type: alertmanager
    urls: ["{}"]
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify:
      to: [am]
      title: "Lock {{{{ order_id }}}}"
      message: "Lock of order {{{{ order_id }}}} expired.\nCheck the worker."
      labels: {{ shard: "{{{{ order_id }}}}" }}
      annotations: {{ runbook_url: "https://wiki.example/locks#{{{{ order_id }}}}" }}
"#,
        am.url()
    );
    let daemon = Daemon::start(&yaml);
    let hostile = "<!channel> @all <b>x</b> http://evil \u{202E}gpj.exe\x1b[2J\n# forged";
    let key = format!("order_lock:{hostile}");
    daemon.expire(key.as_str());

    let alert = am.wait_for_alert(&key);
    assert_eq!(alert["labels"]["key"], key.as_str(), "{alert:#}");
    assert_eq!(alert["labels"]["order_id"], hostile, "{alert:#}");
    assert_eq!(alert["labels"]["shard"], hostile, "{alert:#}");
    let escaped = "<\u{200B}!channel> @\u{200B}all <\u{200B}b>x<\u{200B}/b> http:\u{200B}//evil \\u202Egpj.exe\\u001B[2J\\n# forged";
    let annotations = &alert["annotations"];
    assert_eq!(
        annotations["summary"],
        format!("Lock {escaped}"),
        "{alert:#}"
    );
    assert_eq!(
        annotations["description"],
        format!("Lock of order {escaped} expired.\nCheck the worker."),
        "{alert:#}"
    );
    assert_eq!(
        annotations["runbook_url"],
        format!("https://wiki.example/locks#{escaped}"),
        "{alert:#}"
    );
}

/// The attempts of an alertmanager channel count in `/metrics` and history as any channel's:
/// each round is an attempt sent, a URL that is down retries. An alert's job between rounds is
/// queued (`keywatch_queue_pending`) but not due (`keywatch_queue_due`): it is no backlog
/// (docs/operations.md#metrics).
#[test]
fn rounds_and_retries_count_in_metrics_and_an_alert_between_rounds_is_not_due() {
    let hook = HttpReceiver::start();
    let am = Alertmanager::start(&hook);
    let closed = common::ports::closed_port();
    let down = format!("http://127.0.0.1:{}", closed.port);
    let daemon = Daemon::start(&rules(&[am.url(), down], "    resend: 1s\n", ""));
    daemon.expire("order_lock:1");
    am.wait_for_alert("order_lock:1");
    let addr = endpoint(&daemon.process);
    let sent =
        "keywatch_actions_total{rule=\"order-lock-timeout\",action=\"notify\",outcome=\"sent\"}";
    let retried =
        "keywatch_actions_total{rule=\"order-lock-timeout\",action=\"notify\",outcome=\"retry\"}";
    // Two rounds posted to the Alertmanager that is up, one retry of the one that is down.
    wait_until("two rounds sent and a retry counted", PATIENCE, || {
        let (_, body) = get(&addr, "/metrics");
        common::metric(&body, sent) >= 2.0 && common::metric(&body, retried) >= 1.0
    });
    let h = history(&daemon);
    let actions = h[0]["actions"].as_array().unwrap();
    let of = |t: u32| actions.iter().find(|a| a["target"] == t).unwrap();
    assert_eq!(of(0)["outcome"], "sent", "{h:#?}");
    assert_eq!(of(1)["outcome"], "retrying", "{h:#?}");

    // Stop the down URL's retries from being due now and then: a channel of one URL.
    drop(daemon);
    let daemon = Daemon::start(&rules(&[am.url()], "    resend: 10m\n", ""));
    daemon.expire("order_lock:2");
    am.wait_for_alert("order_lock:2");
    let addr = endpoint(&daemon.process);
    // The gauges are read at each scrape: wait for the job to be seen between rounds.
    let due = poll(
        "the queue gauges show the alert's job waiting for its next round",
        PATIENCE,
        || {
            let (_, body) = get(&addr, "/metrics");
            (common::metric(&body, "keywatch_queue_pending ") == 1.0)
                .then(|| {
                    body.lines()
                        .find(|l| l.starts_with("keywatch_queue_due "))
                        .map(str::to_string)
                })
                .flatten()
        },
        || get(&addr, "/metrics").1,
    );
    assert_eq!(due, "keywatch_queue_due 0");
}
