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
    let target = ch.integration.target();
    // A target's answer may quote what it was sent (a token in the URL, a signed header).
    let outcome = channel::send(&http::client(), ch, &msg)
        .await
        .map_text(|t| config.secrets.mask(t));
    match outcome {
        Outcome::Sent(answer) => Ok(format!(
            "sent to {channel} ({} → {target}): {answer}",
            ch.kind.name
        )),
        Outcome::Retry { reason, .. } => Err(format!(
            "not sent to {channel} ({} → {target}): {reason} (keywatch would retry this)",
            ch.kind.name
        )),
        Outcome::Failed(reason) => Err(format!(
            "not sent to {channel} ({} → {target}): {reason} (keywatch would not retry this: fix the channel)",
            ch.kind.name
        )),
    }
}
