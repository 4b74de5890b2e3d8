//! PagerDuty's Events API v2: an alert is a `trigger` whose `dedup_key` is the event id, and the
//! rule's `resolved` notice is a `resolve` with that same key, so the incident a key's expiry
//! opened is closed when the key exists again. `summary` is the title and message (at most
//! 1,024 characters), `source` the watched Redis, `custom_details` the event JSON; `severity`
//! is the channel's (a template). Success is `202` with `"status": "success"`; 429 and 5xx are
//! retried, a 400 is given up with PagerDuty's `errors`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::outcome::Outcome;
use crate::template::{Escape, hidden_chars_shown};
use crate::yaml::{Secret, mask_user_info};

use super::chat::json_headers;
use super::fields::{Fields, check_http_url};
use super::http::{self, Answer, Request};
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::{FollowupKind, Message};

pub const KIND: Kind = Kind {
    name: "pagerduty",
    fields: &["routing_key", "routing_key_file", "severity", "url"],
    // PagerDuty's Events API v2 takes about 120 events a minute per integration key
    // (docs/rules.md#pagerduty).
    default_rate: Some(Rate {
        burst: 120,
        per: Duration::from_secs(60),
    }),
    example_url: DEFAULT_URL,
    decode,
};

/// The Events API v2 endpoint when the rule files name none.
pub const DEFAULT_URL: &str = "https://events.pagerduty.com/v2/enqueue";

/// The severities PagerDuty accepts.
pub const SEVERITIES: [&str; 4] = ["critical", "error", "warning", "info"];

/// The severity when the channel gives none, or its template renders something PagerDuty
/// would refuse: Alertmanager's default, and high urgency under PagerDuty's dynamic
/// notifications, so a typo in a template still pages (docs/rules.md#pagerduty).
pub const FALLBACK_SEVERITY: &str = "error";

/// The template field of this channel (rendered per message: [`Message::channel_field`]).
pub const SEVERITY_FIELD: &str = "severity";

#[derive(Clone, Debug)]
pub struct PagerDuty {
    pub url: String,
    pub routing_key: Secret,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let what = f.what.clone();
    let key = match f.d.inline_or_file(&mut f.m, "routing_key", &what, f.base) {
        None => {
            f.d.error(
                &f.m.loc,
                format!("{what} is missing the field `routing_key` (or `routing_key_file`): the integration key of an Events API v2 integration"),
            );
            None
        }
        Some(t) => {
            // Secret even when written in the file itself, not only from `${VAR}`.
            f.d.add_secret(&t.value);
            let looks_right =
                t.value.len() == 32 && t.value.bytes().all(|b| b.is_ascii_alphanumeric());
            if !t.unresolved && !looks_right {
                // Never quoted: it is the credential.
                f.d.error(
                    &t.loc,
                    format!("{what} `routing_key` must be the 32-character integration key of an Events API v2 integration (found {} characters)", t.value.chars().count()),
                );
            }
            Some(Secret::new(t.value))
        }
    };
    if let Some(t) = f.text(SEVERITY_FIELD) {
        let templated = t.value.contains("{{") || t.value.contains("{%");
        if !templated && !SEVERITIES.contains(&t.value.as_str()) {
            f.d.error(
                &t.loc,
                format!(
                    "{what} `severity` must be one of {} or a template, found `{}`",
                    SEVERITIES.join(", "),
                    t.value
                ),
            );
        }
        f.templates.push((SEVERITY_FIELD, t));
    }
    let url = match f.text("url") {
        Some(t) => {
            if !t.unresolved {
                check_http_url(f.d, &t.value, &t.loc, &format!("{what} `url`"), DEFAULT_URL);
            }
            t.value
        }
        None => DEFAULT_URL.to_string(),
    };
    Some(Arc::new(PagerDuty {
        url,
        routing_key: key?,
    }))
}

impl Integration for PagerDuty {
    /// PagerDuty shows text as it is, but it reaches people by push, SMS and chat apps: key
    /// text is kept from mentioning, linking or breaking lines as in any chat text.
    fn escape(&self) -> Escape {
        Escape::Text
    }

    /// Of a 512 KB event: the key (and each capture) in `custom_details` up to 16 KiB, which
    /// even escaped six times over (control characters) leaves room.
    fn key_limit(&self) -> usize {
        16 * 1024
    }

    fn target(&self) -> String {
        format!("{} (routing key <secret>)", mask_user_info(&self.url))
    }

    fn links_as_buttons(&self) -> bool {
        true
    }

    fn takes_digests(&self) -> bool {
        false
    }

    /// An incident stays open until it is resolved: the rule's `resolved` resolves it whether
    /// or not `resolved.to` names this channel (docs/rules.md#pagerduty).
    fn closes_on_resolved(&self) -> bool {
        true
    }

    fn dispatch(&self, _ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        match body(self, msg) {
            Ok(body) => Dispatch::Request(Request {
                method: reqwest::Method::POST,
                url: self.url.clone(),
                headers: json_headers(),
                body: serde_json::to_vec(&body).unwrap_or_default(),
            }),
            Err(why) => Dispatch::Done(Outcome::Failed(why)),
        }
    }

    fn judge(&self, _ch: &Channel, a: &Answer) -> Outcome {
        let j = a.json();
        let field = |name: &str| j.as_ref().and_then(|j| j.get(name));
        let s = a.status.as_u16();
        match s {
            202 if field("status").and_then(Value::as_str) == Some("success") => {
                let message = field("message").and_then(Value::as_str).unwrap_or("");
                Outcome::Sent(format!("202 success: {message}"))
            }
            200..=299 => Outcome::Retry {
                reason: format!("HTTP {s} without \"status\": \"success\": {}", a.body_text()),
                after: None,
            },
            400 => {
                let message = field("message").and_then(Value::as_str).unwrap_or("");
                let errors: Vec<&str> = field("errors")
                    .and_then(Value::as_array)
                    .map(|e| e.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                Outcome::Failed(if errors.is_empty() && message.is_empty() {
                    format!("HTTP 400: {}", a.body_text())
                } else {
                    format!("HTTP 400: {message}: {}", errors.join("; "))
                })
            }
            // PagerDuty asks for 429s to be retried some 30 s apart when it does not say.
            429 => Outcome::Retry {
                reason: format!("HTTP 429 rate limited: {}", a.body_text()),
                after: Some(http::retry_after(&a.headers).unwrap_or(Duration::from_secs(30))),
            },
            _ => http::judge_status(a),
        }
    }
}

/// PagerDuty's bound on `payload.summary`, in characters.
pub const SUMMARY_LIMIT: usize = 1_024;
/// PagerDuty refuses an event over 512 KB; `custom_details` gives way first.
pub const BODY_LIMIT: usize = 500_000;
/// What stays of the key and each capture in `custom_details` when the event is too big.
const VALUE_LIMIT: usize = 1_024;

/// The event of `msg`: a `resolve` for a resolved notice, a `trigger` otherwise.
pub fn body(p: &PagerDuty, msg: &Message) -> Result<Value, String> {
    let [item] = msg.items.as_slice() else {
        return Err(format!(
            "a PagerDuty alert is one event, and this message holds {} (`group` is refused on pagerduty channels)",
            msg.count
        ));
    };
    let event = &item.event;
    if let Some(f) = &msg.followup
        && f.kind == FollowupKind::Resolved
    {
        return Ok(json!({
            "routing_key": p.routing_key.expose(),
            "event_action": "resolve",
            "dedup_key": f.alert_id,
        }));
    }
    // An escalation triggers under the alert's own key: one incident per event, which the
    // resolved notice closes whichever of the two opened it.
    let dedup_key = match &msg.followup {
        Some(f) => f.alert_id.clone(),
        None => event["id"].as_str().unwrap_or_default().to_string(),
    };
    let rendered = msg.channel_field(SEVERITY_FIELD);
    let severity = severity(rendered);
    let mut details = event.clone();
    if let Some(r) = rendered
        && r.trim().to_ascii_lowercase() != severity
    {
        // Kept where the incident shows it, so the template can be fixed.
        details["keywatch_invalid_severity"] = json!(r);
    }
    let mut out = json!({
        "routing_key": p.routing_key.expose(),
        "event_action": "trigger",
        "dedup_key": dedup_key,
        "client": "keywatch",
        "payload": {
            "summary": summary(&msg.title, &item.text),
            "source": event["source"],
            "severity": severity,
            "timestamp": if event["deadline"].is_string() { &event["deadline"] } else { &event["observed_at"] },
            "group": msg.rule,
            "class": event["event"],
            "custom_details": details,
        },
    });
    if !msg.links.is_empty() {
        out["links"] = msg
            .links
            .iter()
            .map(|(label, url)| json!({"href": url, "text": label}))
            .collect();
    }
    if serde_json::to_vec(&out).map_or(0, |b| b.len()) > BODY_LIMIT {
        out["payload"]["custom_details"] = shrunk(&out["payload"]["custom_details"]);
    }
    Ok(out)
}

/// A rendered severity as PagerDuty takes it (case and spaces forgiven), or
/// [`FALLBACK_SEVERITY`].
pub fn severity(rendered: Option<&str>) -> &'static str {
    let Some(r) = rendered else {
        return FALLBACK_SEVERITY;
    };
    let r = r.trim().to_ascii_lowercase();
    SEVERITIES
        .into_iter()
        .find(|s| *s == r)
        .unwrap_or(FALLBACK_SEVERITY)
}

/// `title: message` on one line, at most [`SUMMARY_LIMIT`] characters, the cut said. Control
/// and bidi characters (which chat text escaping leaves) are shown as `\u202E`: a summary
/// reaches phones and chat apps, where they would reorder or hide what it says.
pub fn summary(title: &str, text: &str) -> String {
    let text = text.split('\n').map(str::trim_end).collect::<Vec<_>>().join(" ");
    let whole = if text.trim().is_empty() {
        title.to_string()
    } else {
        format!("{title}: {text}")
    };
    let whole = hidden_chars_shown(&whole);
    let total = whole.chars().count();
    if total <= SUMMARY_LIMIT {
        return whole;
    }
    // Room for "… (1234567 more characters)".
    let keep = SUMMARY_LIMIT - 30;
    let head: String = whole.chars().take(keep).collect();
    format!("{head}… ({} more characters)", total - keep)
}

/// The event JSON without what makes it too big for PagerDuty: the key and captures cut, the
/// detail left out (it stays in `keywatch history`).
fn shrunk(event: &Value) -> Value {
    let cut = |v: &Value| match v.as_str() {
        Some(s) => json!(super::chat::fit(s, VALUE_LIMIT)),
        None => v.clone(),
    };
    let mut out = event.clone();
    out["key"] = cut(&event["key"]);
    if let Some(c) = event["captures"].as_object() {
        out["captures"] = c.iter().map(|(k, v)| (k.clone(), cut(v))).collect();
    }
    if !event["detail"].is_null() {
        out["detail"] = json!("(left out: the event was over PagerDuty's 512 KB)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Item;
    use crate::channel::message::Followup;
    use reqwest::StatusCode;
    use reqwest::header::HeaderMap;

    const KEY: &str = "R0UTINGKEY0123456789abcdefABCDEF";

    fn pd() -> PagerDuty {
        PagerDuty {
            url: "http://127.0.0.1:9/v2/enqueue".into(),
            routing_key: Secret::new(KEY),
        }
    }

    fn channel() -> Channel {
        Channel::for_test("pager", &KIND, Arc::new(pd()))
    }

    fn event() -> Value {
        json!({
            "version": 1, "id": "e1", "rule": "order-lock", "event": "expired", "key": "order_lock:42",
            "db": 0, "captures": {"id": "42"}, "detail": null, "deadline": "2026-11-29T10:15:00.000Z",
            "observed_at": "2026-11-29T10:15:00.012Z", "late_ms": 12, "recovered": false,
            "ttl_ms": null, "source": "127.0.0.1:6379",
        })
    }

    fn message(severity: Option<&str>) -> Message {
        Message {
            rule: "order-lock".into(),
            event: "expired".into(),
            title: "Order lock expired".into(),
            text: "Lock of 42 expired.".into(),
            items: vec![Item {
                event: event(),
                text: "Lock of 42 expired.".into(),
            }],
            count: 1,
            digest: false,
            idempotency_key: "e1:notify:pager".into(),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: severity
                .map(|s| vec![(SEVERITY_FIELD, s.to_string())])
                .unwrap_or_default(),
            followup: None,
        }
    }

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: HeaderMap::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_trigger_is_exactly_the_events_api_v2_event() {
        let mut msg = message(Some("critical"));
        msg.links = vec![("Acknowledge".into(), "https://kw/l/a".into())];
        let Dispatch::Request(req) = pd().dispatch(&channel(), &msg, Utc::now()) else {
            panic!("no request")
        };
        assert_eq!(req.method, reqwest::Method::POST);
        assert_eq!(req.url, "http://127.0.0.1:9/v2/enqueue");
        assert_eq!(
            String::from_utf8(req.body).unwrap(),
            concat!(
                r#"{"client":"keywatch","dedup_key":"e1","event_action":"trigger","#,
                r#""links":[{"href":"https://kw/l/a","text":"Acknowledge"}],"#,
                r#""payload":{"class":"expired","custom_details":{"captures":{"id":"42"},"db":0,"#,
                r#""deadline":"2026-11-29T10:15:00.000Z","detail":null,"event":"expired","id":"e1","#,
                r#""key":"order_lock:42","late_ms":12,"observed_at":"2026-11-29T10:15:00.012Z","#,
                r#""recovered":false,"rule":"order-lock","source":"127.0.0.1:6379","ttl_ms":null,"version":1},"#,
                r#""group":"order-lock","severity":"critical","source":"127.0.0.1:6379","#,
                r#""summary":"Order lock expired: Lock of 42 expired.","timestamp":"2026-11-29T10:15:00.000Z"},"#,
                r#""routing_key":"R0UTINGKEY0123456789abcdefABCDEF"}"#
            )
        );
    }

    #[test]
    fn a_resolved_notice_resolves_the_alert_s_key_and_an_escalation_triggers_it() {
        let mut msg = message(None);
        msg.followup = Some(Followup {
            kind: FollowupKind::Resolved,
            alert_id: "e1".into(),
        });
        assert_eq!(
            body(&pd(), &msg).unwrap(),
            json!({"routing_key": KEY, "event_action": "resolve", "dedup_key": "e1"})
        );
        msg.followup = Some(Followup {
            kind: FollowupKind::Escalation,
            alert_id: "e1".into(),
        });
        let b = body(&pd(), &msg).unwrap();
        assert_eq!(b["event_action"], "trigger");
        assert_eq!(b["dedup_key"], "e1");
    }

    #[test]
    fn a_severity_pagerduty_would_refuse_pages_as_error_and_says_so() {
        assert_eq!(severity(Some(" Warning\n")), "warning");
        assert_eq!(severity(None), FALLBACK_SEVERITY);
        let b = body(&pd(), &message(Some("high"))).unwrap();
        assert_eq!(b["payload"]["severity"], "error");
        assert_eq!(b["payload"]["custom_details"]["keywatch_invalid_severity"], "high");
        let b = body(&pd(), &message(Some("info"))).unwrap();
        assert!(b["payload"]["custom_details"].get("keywatch_invalid_severity").is_none());
    }

    #[test]
    fn the_summary_is_one_line_of_at_most_1024_characters() {
        assert_eq!(summary("T", "a\nb  \nc"), "T: a b c");
        assert_eq!(summary("T", ""), "T");
        let s = summary("T", &"é".repeat(5_000));
        assert_eq!(s.chars().count(), SUMMARY_LIMIT - 30 + "… (4009 more characters)".chars().count());
        assert!(s.ends_with("é… (4009 more characters)"), "{s}");
    }

    /// The key is data in `custom_details` (exact: JSON escapes it) and chat text in `summary`
    /// (escaped as the rule's templates escape it, with what stays invisible shown).
    #[test]
    fn a_hostile_key_stays_data_in_custom_details_and_text_in_the_summary() {
        let key = "k\"}, \"event_action\": \"resolve\"\n</x> evil.com/login http://x @all <!channel> /start a\u{202E}b\u{7}c";
        let mut msg = message(None);
        msg.items[0].event["key"] = json!(key);
        let shown = Escape::Text.escape_value(key);
        msg.title = format!("Lock {shown}");
        msg.items[0].text = format!("Key {shown} expired.");
        let b = body(&pd(), &msg).unwrap();
        assert_eq!(b["event_action"], "trigger");
        assert_eq!(b["dedup_key"], "e1");
        let mut want = event();
        want["key"] = json!(key);
        assert_eq!(b["payload"]["custom_details"], want);
        let shown = "k\"}, \"event_action\": \"resolve\"\\n<\u{200B}/x> evil.\u{200B}com/login \
                     http:\u{200B}//x @\u{200B}all <\u{200B}!channel> /start a\\u202Eb\\u0007c";
        assert_eq!(
            b["payload"]["summary"],
            format!("Lock {shown}: Key {shown} expired.")
        );
    }

    #[test]
    fn a_megabyte_key_still_makes_an_event_pagerduty_takes() {
        let mut msg = message(None);
        msg.items[0].event["key"] = json!("k".repeat(1 << 20));
        msg.items[0].event["detail"] = json!({"blob": "x".repeat(600_000)});
        let b = body(&pd(), &msg).unwrap();
        let len = serde_json::to_vec(&b).unwrap().len();
        assert!(len < BODY_LIMIT, "{len}");
        let key = b["payload"]["custom_details"]["key"].as_str().unwrap();
        assert!(key.len() <= VALUE_LIMIT && key.ends_with("more bytes"), "{key}");
    }

    #[test]
    fn a_digest_is_never_sent() {
        let mut msg = message(None);
        msg.items.push(msg.items[0].clone());
        msg.count = 2;
        msg.digest = true;
        assert!(matches!(
            pd().dispatch(&channel(), &msg, Utc::now()),
            Dispatch::Done(Outcome::Failed(m)) if m.contains("`group` is refused")
        ));
    }

    #[test]
    fn answers_mean_what_the_events_api_says() {
        let ch = channel();
        let p = pd();
        assert!(matches!(
            p.judge(&ch, &answer(202, r#"{"status":"success","message":"Event processed","dedup_key":"e1"}"#)),
            Outcome::Sent(m) if m == "202 success: Event processed"
        ));
        assert!(matches!(
            p.judge(&ch, &answer(200, r#"{}"#)),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            p.judge(&ch, &answer(400, r#"{"status":"invalid event","message":"Event object is invalid","errors":["Length of 'routing_key' is incorrect (should be 32 characters)"]}"#)),
            Outcome::Failed(m) if m == "HTTP 400: Event object is invalid: Length of 'routing_key' is incorrect (should be 32 characters)"
        ));
        assert!(matches!(
            p.judge(&ch, &answer(429, "")),
            Outcome::Retry { after: Some(d), .. } if d == Duration::from_secs(30)
        ));
        assert!(matches!(
            p.judge(&ch, &answer(503, "busy")),
            Outcome::Retry { .. }
        ));
    }

    #[test]
    fn the_target_never_shows_the_routing_key() {
        assert_eq!(
            pd().target(),
            "http://127.0.0.1:9/v2/enqueue (routing key <secret>)"
        );
        assert!(!format!("{:?}", pd()).contains(KEY));
    }
}
