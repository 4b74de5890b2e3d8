//! `keywatch send-test CHANNEL`: one test message through one channel, showing the target's
//! answer (DingTalk's errcode and errmsg, Slack's body, …), so a wrong secret or keyword is
//! found before the first real alert.

use chrono::Utc;

use crate::channel::{self, Item, Message, http};
use crate::config::Config;
use crate::firing::rfc3339;
use crate::outcome::Outcome;

pub async fn run(config: &Config, channel: &str) -> Result<String, String> {
    let Some(ch) = config.channel(channel) else {
        let names: Vec<&str> = config.channels.iter().map(|c| c.name.as_str()).collect();
        return Err(format!(
            "no channel `{channel}` in the rules (channels: {})",
            names.join(", ")
        ));
    };
    let now = Utc::now();
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "this host".into());
    let text = format!(
        "This is a test message from keywatch send-test on {host} at {}.",
        rfc3339(now)
    );
    let event = serde_json::json!({
        "version": 1, "id": "send-test", "rule": "send-test", "event": "expired", "key": "keywatch:send-test",
        "db": 0, "captures": {}, "detail": null, "deadline": null, "observed_at": rfc3339(now),
        "late_ms": null, "recovered": false, "ttl_ms": null, "source": "send-test",
    });
    let msg = Message {
        rule: "send-test".into(),
        event: "expired".into(),
        title: "keywatch test message".into(),
        text: text.clone(),
        items: vec![Item { event, text }],
        count: 1,
        digest: false,
        idempotency_key: format!("send-test:{}", now.timestamp_millis()),
        custom_body: None,
        mention: Default::default(),
        links: Vec::new(),
        // The channel's own templates (PagerDuty's `severity`) as for any expiry.
        channel_fields: crate::action::notify::channel_fields(
            &config.templates,
            ch,
            &crate::template::Context::sample("send-test", crate::event::EventKind::Expired, &[]),
        )?,
        followup: None,
    };
    if let Some(am) = ch.integration.alertmanager() {
        return alertmanager(config, ch, am, &msg).await;
    }
    let target = ch.integration.target();
    // A target's answer may quote what it was sent (a token in the URL, a signed header).
    let outcome = channel::send(&http::client(), ch, &msg)
        .await
        .map_text(|t| config.secrets.mask_bounded(t, crate::outcome::SHOWN));
    say(channel, ch.kind.name, &target, outcome)
}

fn say(channel: &str, kind: &str, target: &str, outcome: Outcome) -> Result<String, String> {
    match outcome {
        Outcome::Sent(answer) | Outcome::Again { answer, .. } => {
            Ok(format!("sent to {channel} ({} → {target}): {answer}", kind))
        }
        // A channel's send never skips; a skip is the follow-ups' and the alerts' own word, a
        // shadow a delivery's.
        Outcome::Skipped(why) | Outcome::Shadow(why) => Ok(format!(
            "nothing sent to {channel} ({} → {target}): {why}",
            kind
        )),
        Outcome::Retry { reason, .. } => Err(format!(
            "not sent to {channel} ({} → {target}): {reason} (keywatch would retry this)",
            kind
        )),
        Outcome::Failed(reason) => Err(format!(
            "not sent to {channel} ({} → {target}): {reason} (keywatch would not retry this: fix the channel)",
            kind
        )),
    }
}

/// A test alert (`alertname="keywatch-send-test"`, firing for 5 minutes) posted to each URL of
/// an alertmanager channel, each answer on its own line; an error when any URL did not take it.
async fn alertmanager(
    config: &Config,
    ch: &channel::Channel,
    am: &channel::alert::Alertmanager,
    msg: &Message,
) -> Result<String, String> {
    let alert = channel::alert::test_alert(am, msg, Utc::now());
    let client = http::client();
    let mut lines = Vec::new();
    let mut failed = false;
    for target in 0..am.urls.len() {
        let Some(req) = am.request(target, &alert) else {
            continue;
        };
        let outcome = match http::send(&client, &req, ch.timeout).await {
            Ok(answer) => ch.integration.judge(ch, &answer),
            Err(o) => o,
        }
        .map_text(|t| config.secrets.mask_bounded(t, crate::outcome::SHOWN));
        let said = say(&ch.name, ch.kind.name, &am.shown_url(target), outcome);
        failed |= said.is_err();
        lines.push(said.unwrap_or_else(|e| e));
    }
    let out = lines.join("\n");
    if failed { Err(out) } else { Ok(out) }
}
