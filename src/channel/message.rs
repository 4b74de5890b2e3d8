//! A message as every channel receives it: rendered and escaped for that channel already, and
//! the helpers every integration uses to keep each part of it within its service's limits.
//!
//! # Size limits
//!
//! Key text is unbounded (a key may be 512 MB), and a service refuses a message over its limit
//! (DingTalk's 20,000-byte body: errcode 460101), which no retry mends. So every part an
//! integration builds from a message is bounded: a title or a field with [`bounded`] (cut on a
//! char boundary and marked with [`CUT`]), the body text with `chat::fit`, and the whole request
//! body with [`fit_body`], which measures the body as sent (JSON escaping makes text longer)
//! and shrinks the longest part until it fits. A new integration does the same with its
//! service's limits (docs/how-it-works.md#message-size).

use std::borrow::Cow;

/// Marks where a part of a message was cut.
pub const CUT: &str = "…";

/// The most a title (a DingTalk markdown title, a Feishu card header, an annotation) takes:
/// more than any screen shows in one line, little against any service's limit.
pub const TITLE_LIMIT: usize = 1_024;

/// `text` within `limit` bytes: as it is when it fits, else cut on a char boundary with [`CUT`]
/// at the end.
pub fn bounded(text: &str, limit: usize) -> Cow<'_, str> {
    if text.len() <= limit {
        return Cow::Borrowed(text);
    }
    let mut end = limit.saturating_sub(CUT.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{CUT}", &text[..end]))
}

/// The outcome of a message that cannot be made to fit `service`'s limit: failed for good (a
/// dead letter, counted and logged), since the service would refuse it on every attempt.
pub fn too_big(service: &str, size: usize, limit: usize) -> crate::outcome::Outcome {
    crate::outcome::Outcome::Failed(format!(
        "the message is {size} bytes even with its text cut down, and {service} refuses more than {limit}: what the channel adds (mentions, keyword) is too long"
    ))
}

/// A request body within `limit` bytes: `build` makes it from `parts` (a title, a text…),
/// and while it is too long the longest part is cut by the excess (a part's bytes only ever
/// grow once escaped, so cutting a part by N bytes shortens the body by at least N). `Err`
/// with the smallest body's size when even parts cut to a few bytes do not fit (what the
/// integration adds around them is too big): the caller fails the message for good, saying
/// so, instead of sending what the service would refuse.
pub fn fit_body(
    limit: usize,
    mut parts: Vec<String>,
    build: impl Fn(&[String]) -> Vec<u8>,
) -> Result<Vec<u8>, usize> {
    /// A part is never cut below this: past it the body is not the parts' fault.
    const SMALLEST: usize = 16;
    loop {
        let body = build(&parts);
        if body.len() <= limit {
            return Ok(body);
        }
        let excess = body.len() - limit;
        let Some(longest) = parts
            .iter_mut()
            .filter(|p| p.len() > SMALLEST)
            .max_by_key(|p| p.len())
        else {
            return Err(body.len());
        };
        let keep = longest
            .len()
            .saturating_sub(excess + CUT.len())
            .max(SMALLEST);
        *longest = bounded(longest, keep).into_owned();
    }
}

/// One event of a message (a digest has several).
#[derive(Clone, Debug)]
pub struct Item {
    /// The event JSON of docs/rules.md#event-json.
    pub event: serde_json::Value,
    /// Its rendered `notify.message`, escaped for the channel.
    pub text: String,
}

/// What a channel sends: already rendered and escaped for that channel.
#[derive(Clone, Debug)]
pub struct Message {
    pub rule: String,
    pub event: String,
    pub title: String,
    /// The body: one event's message, or a digest's lines.
    pub text: String,
    pub items: Vec<Item>,
    /// Events the message stands for (more than `items` when a digest was cut).
    pub count: usize,
    pub digest: bool,
    pub idempotency_key: String,
    /// A webhook's custom `body`, rendered.
    pub custom_body: Option<Vec<u8>>,
    /// Who the rule mentions (`notify.mention`, rendered and checked), on top of the channel's.
    pub mention: Mention,
    /// The acknowledge and silence links (label, URL) of a rule with `escalate` when the files
    /// configure `links`: chat formats with link syntax have them at the end of `text` too,
    /// channels with buttons ([`super::Integration::links_as_buttons`]) only here.
    pub links: Vec<(String, String)>,
    /// The values of the channel's own templates ([`super::Channel::templates`]), rendered for
    /// this message, by field name.
    pub channel_fields: Vec<(&'static str, String)>,
    /// Set on an escalation or a resolved notice: what kind, and which alert it follows (a
    /// PagerDuty `resolve` needs that alert's id as its `dedup_key`; a channel that keeps alerts
    /// open, [`super::Integration::closes_on_resolved`], closes the alert on a resolved one).
    pub followup: Option<Followup>,
}

/// Which follow-up of an alert a message is (docs/rules.md#event-json's `"followup"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FollowupKind {
    /// `escalate`: the alert was not handled in time.
    Escalation,
    /// `resolved`: the key exists again.
    Resolved,
}

impl FollowupKind {
    /// The value of `"followup"` in the event JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            FollowupKind::Escalation => "escalation",
            FollowupKind::Resolved => "resolved",
        }
    }
}

/// What a follow-up message follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Followup {
    pub kind: FollowupKind,
    /// The id of the alert's event (docs/rules.md#event-json), the same in the alert and its follow-ups.
    pub alert_id: String,
}

impl Message {
    /// Stands in for a digest that could not be composed (its rule or channel is gone), so its
    /// dead letter still says how many events it held, under the key it would have had.
    pub fn uncomposed_digest(rule: &str, first_id: &str, channel: &str, count: usize) -> Message {
        Message {
            rule: rule.to_string(),
            event: String::new(),
            title: String::new(),
            text: String::new(),
            items: Vec::new(),
            count,
            digest: true,
            idempotency_key: digest_key(first_id, channel, count),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    /// The rendered value of the channel's template `field`, if it has one.
    pub fn channel_field(&self, field: &str) -> Option<&str> {
        self.channel_fields
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, v)| v.as_str())
    }

    pub fn omitted(&self) -> usize {
        self.count.saturating_sub(self.items.len())
    }
}

/// The `Idempotency-Key` of a digest: the same firings for the same channel give the same key,
/// so a retried digest is recognisably the same message.
pub fn digest_key(first_id: &str, channel: &str, count: usize) -> String {
    format!("{first_id}:digest:{channel}:{count}")
}

/// Who a robot's messages mention.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mention {
    pub mobiles: Vec<String>,
    pub user_ids: Vec<String>,
    pub all: bool,
}

impl Mention {
    pub fn is_empty(&self) -> bool {
        self.mobiles.is_empty() && self.user_ids.is_empty() && !self.all
    }

    /// The channel's mentions and a rule's (`notify.mention`) together, each person once, the
    /// channel's first.
    pub fn merged(&self, rule: &Mention) -> Mention {
        let union = |a: &[String], b: &[String]| {
            let mut out = a.to_vec();
            for x in b {
                if !out.contains(x) {
                    out.push(x.clone());
                }
            }
            out
        };
        Mention {
            mobiles: union(&self.mobiles, &rule.mobiles),
            user_ids: union(&self.user_ids, &rule.user_ids),
            all: self.all || rule.all,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_cuts_on_a_char_boundary_and_marks_the_cut() {
        assert_eq!(bounded("short", 10), "short");
        let cut = bounded("ééééé", 8);
        assert!(cut.len() <= 8 && cut.ends_with(CUT), "{cut}");
        assert_eq!(cut, "éé…");
    }

    #[test]
    fn fit_body_measures_the_body_as_sent() {
        // JSON doubles every backslash: 30,000 of them are 60,000 bytes once escaped.
        let parts = vec!["t".repeat(5_000), "\\".repeat(15_000)];
        let build = |p: &[String]| {
            serde_json::to_vec(&serde_json::json!({"title": p[0], "text": p[1]})).unwrap()
        };
        let body = fit_body(20_000, parts, build).unwrap();
        assert!(body.len() <= 20_000, "{}", body.len());
        let j: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(j["text"].as_str().unwrap().ends_with(CUT));
        // What is around the parts alone is too big: refused, not sent.
        let build = |_: &[String]| vec![b'x'; 30_000];
        assert_eq!(fit_body(20_000, vec!["a".repeat(100)], build), Err(30_000));
    }
}
