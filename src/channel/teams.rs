//! Microsoft Teams through a Workflows webhook (the "When a Teams webhook request is received"
//! trigger that replaced Office 365 connectors): one Adaptive Card in a `message` envelope, with
//! the title, the message, a FactSet (rule, key, db, deadline, late) and the acknowledge and
//! silence links as `Action.OpenUrl` buttons. Success is any 2xx (Workflows answer `202
//! Accepted`, the flow runs later); 429 waits for `Retry-After`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::template::{Escape, human_duration};
use crate::yaml::Secret;

use super::chat::{fit, json_headers, with_keyword};
use super::fields::Fields;
use super::http::Request;
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::Message;

pub const KIND: Kind = Kind {
    name: "teams",
    fields: &["url", "url_file"],
    // The Workflows template posts as the Flow bot, which the Teams connector lets post 25
    // times per 300 s per connection: the tightest of a Workflow's documented limits
    // (docs/rules.md#teams).
    default_rate: Some(Rate {
        burst: 25,
        per: Duration::from_secs(300),
    }),
    example_url: "https://prod-00.westeurope.logic.azure.com/workflows/ID/triggers/manual/paths/invoke?api-version=2016-06-01&sig=...",
    decode,
};

#[derive(Clone, Debug)]
pub struct Teams {
    /// The whole URL is the credential (its `sig` query parameter).
    pub url: Secret,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    Some(Arc::new(Teams { url: f.url()? }))
}

impl Integration for Teams {
    fn escape(&self) -> Escape {
        Escape::Teams
    }

    /// A card's facts show at most [`PART_LIMIT`] bytes each: the key's cut view fits one
    /// whole, its marker included.
    fn key_limit(&self) -> usize {
        512
    }

    fn target(&self) -> String {
        self.url.redacted_url()
    }

    fn links_as_buttons(&self) -> bool {
        true
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        Dispatch::Request(request(ch, self, msg))
    }
}

/// Teams refuses a message over 28 KB; the JSON body stays under it with room to spare.
pub const BODY_LIMIT: usize = 27_000;
/// The title, and each fact's value (a key may be a megabyte), before escaping.
const PART_LIMIT: usize = 1_000;

pub fn request(ch: &Channel, t: &Teams, msg: &Message) -> Request {
    Request {
        method: reqwest::Method::POST,
        url: t.url.expose().to_string(),
        headers: json_headers(),
        body: body(ch, msg),
    }
}

/// The JSON body, at most [`BODY_LIMIT`] bytes: what does not fit is cut from the message
/// text (the title, facts and buttons are bounded on their own), saying how much was left out.
pub fn body(ch: &Channel, msg: &Message) -> Vec<u8> {
    let text = paragraphs(&msg.text);
    // Everything but the text (a one-byte text, so that its TextBlock is there).
    let rest = serde_json::to_vec(&card(ch, msg, "x")).map_or(0, |b| b.len() - 1);
    let text = fit_json(&text, BODY_LIMIT.saturating_sub(rest));
    serde_json::to_vec(&card(ch, msg, &text)).unwrap_or_default()
}

/// The bytes `c` takes inside a JSON string.
fn json_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if c < ' ' => 6,
        c => c.len_utf8(),
    }
}

/// `text` cut so that it takes at most `room` bytes in a JSON string, on a character boundary,
/// saying how much was left out (JSON escaping makes quotes and controls longer there).
fn fit_json(text: &str, room: usize) -> String {
    if text.chars().map(json_len).sum::<usize>() <= room {
        return text.to_string();
    }
    let budget = room.saturating_sub(48);
    let (mut used, mut end) = (0, 0);
    for (i, c) in text.char_indices() {
        used += json_len(c);
        if used > budget {
            break;
        }
        end = i + c.len_utf8();
    }
    format!("{}\n\n… and {} more bytes", &text[..end], text.len() - end)
}

/// A TextBlock is Markdown: a single line break is no break, so each becomes a paragraph.
fn paragraphs(text: &str) -> String {
    text.replace("\r\n", "\n").replace('\n', "\n\n")
}

fn card(ch: &Channel, msg: &Message, text: &str) -> Value {
    let title = fit(&with_keyword(ch, &msg.title), PART_LIMIT);
    let mut body = vec![json!({
        "type": "TextBlock", "text": title, "weight": "Bolder", "size": "Medium", "wrap": true,
    })];
    if !text.is_empty() {
        body.push(json!({"type": "TextBlock", "text": text, "wrap": true}));
    }
    body.push(json!({"type": "FactSet", "facts": facts(msg)}));
    let mut content = json!({
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "type": "AdaptiveCard",
        // Teams renders Adaptive Cards up to 1.5; 1.4 is what Workflows render everywhere.
        "version": "1.4",
        "msteams": {"width": "full"},
        "body": body,
    });
    if !msg.links.is_empty() {
        content["actions"] = msg
            .links
            .iter()
            .map(|(label, url)| json!({"type": "Action.OpenUrl", "title": label, "url": url}))
            .collect();
    }
    json!({
        "type": "message",
        "attachments": [{
            "contentType": "application/vnd.microsoft.card.adaptive",
            "contentUrl": null,
            "content": content,
        }],
    })
}

/// Rule, key, db, deadline and late of the event (a digest: rule, event and how many); the
/// card writes these itself, so key text is escaped here as a template value would be.
fn facts(msg: &Message) -> Vec<Value> {
    let esc = |s: &str| Escape::Teams.escape_value(&fit(s, PART_LIMIT));
    let fact = |title: &str, value: String| json!({"title": title, "value": value});
    let mut out = vec![fact("Rule", esc(&msg.rule))];
    match msg.items.as_slice() {
        [item] if !msg.digest => {
            let e = &item.event;
            let text = |v: &Value| v.as_str().map(esc);
            out.push(fact("Key", text(&e["key"]).unwrap_or_default()));
            if let Some(field) = text(&e["field"]) {
                out.push(fact("Field", field));
            }
            out.push(fact("DB", e["db"].to_string()));
            out.push(fact(
                "Deadline",
                text(&e["deadline"]).unwrap_or_else(|| "unknown".into()),
            ));
            out.push(fact(
                "Late",
                e["late_ms"]
                    .as_i64()
                    .map_or_else(|| "unknown".into(), human_duration),
            ));
        }
        _ => {
            out.push(fact("Event", esc(&msg.event)));
            out.push(fact("Events", msg.count.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Item;

    fn channel() -> Channel {
        Channel::for_test("ops", &KIND, Arc::new(Teams {
                url: Secret::new("https://example.logic.azure.com/workflows/1?sig=SIG"),
            }))
    }

    fn message(key: &str, text: &str) -> Message {
        let event = json!({
            "version": 1, "id": "e1", "rule": "order-lock", "event": "expired", "key": key,
            "db": 0, "captures": {}, "detail": null, "deadline": "2026-11-29T10:15:00.000Z",
            "observed_at": "2026-11-29T10:15:00.012Z", "late_ms": 12, "recovered": false,
            "ttl_ms": null, "source": "127.0.0.1:6379",
        });
        Message {
            rule: "order-lock".into(),
            event: "expired".into(),
            title: "Order lock expired".into(),
            text: text.into(),
            items: vec![Item {
                event,
                text: text.into(),
            }],
            count: 1,
            digest: false,
            idempotency_key: "e1:notify:ops".into(),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    #[test]
    fn the_card_is_exactly_the_workflows_envelope() {
        let mut msg = message("order_lock:42", "Lock of 42 expired.\nCheck the worker.");
        msg.links = vec![
            ("Acknowledge".into(), "https://kw/l/a".into()),
            ("Silence 1h".into(), "https://kw/l/s".into()),
        ];
        let req = request(&channel(), &Teams { url: Secret::new("https://h/w?sig=S") }, &msg);
        assert_eq!(req.method, reqwest::Method::POST);
        assert_eq!(req.url, "https://h/w?sig=S");
        assert_eq!(
            req.headers,
            vec![(
                "Content-Type".to_string(),
                "application/json; charset=utf-8".to_string()
            )]
        );
        assert_eq!(
            String::from_utf8(req.body).unwrap(),
            concat!(
                r#"{"attachments":[{"content":{"$schema":"http://adaptivecards.io/schemas/adaptive-card.json","#,
                r#""actions":[{"title":"Acknowledge","type":"Action.OpenUrl","url":"https://kw/l/a"},"#,
                r#"{"title":"Silence 1h","type":"Action.OpenUrl","url":"https://kw/l/s"}],"#,
                r#""body":[{"size":"Medium","text":"Order lock expired","type":"TextBlock","weight":"Bolder","wrap":true},"#,
                r#"{"text":"Lock of 42 expired.\n\nCheck the worker.","type":"TextBlock","wrap":true},"#,
                r#"{"facts":[{"title":"Rule","value":"order-lock"},{"title":"Key","value":"order_lock:42"},"#,
                r#"{"title":"DB","value":"0"},{"title":"Deadline","value":"2026-11-29T10:15:00.000Z"},"#,
                r#"{"title":"Late","value":"12ms"}],"type":"FactSet"}],"#,
                r#""msteams":{"width":"full"},"type":"AdaptiveCard","version":"1.4"},"#,
                r#""contentType":"application/vnd.microsoft.card.adaptive","contentUrl":null}],"type":"message"}"#
            )
        );
    }

    /// Fact values are Teams Markdown too (docs/rules.md#teams): a key in them can no more
    /// format, link or mention than in the text, and a plain key shows exactly.
    #[test]
    fn a_hostile_key_in_the_facts_cannot_format_link_or_mention() {
        for (key, shown) in [
            ("order_lock:42", "order_lock:42"),
            ("evil.com/login", "evil.\u{200B}com/login"),
            ("http://x", "http:\u{200B}//x"),
            ("[x](http://evil)", "[x]\u{200B}(http:\u{200B}//evil)"),
            ("<a href=x>", "<\u{200B}a href=x>"),
            ("@all <!channel>", "@\u{200B}all <\u{200B}!channel>"),
            ("**b** _i_", "\\*\\*b\\*\\* \\_i\\_"),
            ("/start", "/start"),
            ("{{DATE(2017-02-14T06:08:39Z)}}", "{\u{200B}{DATE(2017-02-14T06:08:39Z)}}"),
            ("a\u{202E}b\u{1b}[31m\nline", "a\\u202Eb\\u001B[31m\\nline"),
        ] {
            let msg = message(key, "");
            let body: Value = serde_json::from_slice(&body(&channel(), &msg)).unwrap();
            let facts = &body["attachments"][0]["content"]["body"][1]["facts"];
            assert_eq!(facts[1], json!({"title": "Key", "value": shown}), "{key:?}");
        }
    }

    #[test]
    fn a_digest_has_its_count_as_facts() {
        let mut msg = message("k", "- a\n- b");
        msg.digest = true;
        msg.count = 5;
        let body: Value = serde_json::from_slice(&body(&channel(), &msg)).unwrap();
        assert_eq!(
            body["attachments"][0]["content"]["body"][2]["facts"],
            json!([
                {"title": "Rule", "value": "order-lock"},
                {"title": "Event", "value": "expired"},
                {"title": "Events", "value": "5"},
            ])
        );
        assert!(body["attachments"][0]["content"].get("actions").is_none());
    }

    #[test]
    fn every_part_is_bounded_and_the_body_stays_under_28_kb() {
        // A megabyte key, a long title, and a message of quotes (each doubles in JSON).
        let mut msg = message(&"k".repeat(1 << 20), &"\"".repeat(100_000));
        msg.title = "T".repeat(5_000);
        let out = body(&channel(), &msg);
        assert!(out.len() <= BODY_LIMIT, "{}", out.len());
        assert!(out.len() > BODY_LIMIT - 1_000, "{}", out.len());
        let v: Value = serde_json::from_slice(&out).unwrap();
        let blocks = &v["attachments"][0]["content"]["body"];
        for part in [
            blocks[0]["text"].as_str().unwrap(),
            blocks[1]["text"].as_str().unwrap(),
            blocks[2]["facts"][1]["value"].as_str().unwrap(),
        ] {
            assert!(part.contains("more bytes"), "{}", &part[part.len() - 40..]);
        }
        assert!(blocks[2]["facts"][1]["value"].as_str().unwrap().len() <= PART_LIMIT);
    }
}
