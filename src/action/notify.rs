//! `notify`: a message composed from a rule's templates, escaped for its channel, sent through
//! the channel's integration, and judged by that integration's idea of success.

use std::sync::Arc;

use crate::channel::message::digest_key;
use crate::channel::{self, Channel, Item, Message};
use crate::config::Rule;
use crate::firing::{Action, Firing};
use crate::outcome::Outcome;

use super::context::ActionContext;

/// The message of one firing for one channel, made from the firing as the channel shows it: a
/// key (or capture, or field) longer than the channel's [`crate::channel::Integration::key_limit`]
/// by its cut view (docs/reliability.md#bounded-whatever-the-key).
pub fn compose(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    ch: &Channel,
) -> Result<Message, String> {
    let n = rule.notify.as_ref().ok_or("the rule has no `notify`")?;
    let escape = ch.escape();
    let t = &a.config.templates;
    let links = links_of(a, f, rule);
    let cut = f.cut(ch.integration.key_limit());
    let f = cut.as_ref().unwrap_or(f);
    let ctx = a.context_of(f);
    let title = match n.title.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.title: {}", e.message))?,
        None => rule.name.clone(),
    };
    let text = match n.message.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.message: {}", e.message))?,
        None => String::new(),
    };
    let custom_body = match ch.body {
        Some(id) => Some(
            t.render_text(id, &ctx)
                .map_err(|e| format!("channel body: {}", e.message))?
                .into_bytes(),
        ),
        None => None,
    };
    Ok(Message {
        rule: rule.name.clone(),
        event: f.kind.as_str().to_string(),
        items: vec![Item {
            event: f.to_json(),
            text: text.clone(),
        }],
        title,
        text,
        count: 1,
        digest: false,
        idempotency_key: Action::Notify {
            channel: ch.name.clone(),
        }
        .idempotency_key(&f.id),
        custom_body,
        mention: super::mention::render(t, &n.mention, &rule.name, &ctx),
        links,
        channel_fields: channel_fields(t, ch, &ctx)?,
        followup: None,
    })
}

/// One digest message for `firings` (all of one rule, for one channel): the title rendered with
/// `count` and `events`, then one line per event up to `max_items`, then "… and N more".
pub fn compose_digest(
    a: &ActionContext,
    firings: &[Arc<Firing>],
    rule: &Rule,
    ch: &Channel,
    max_items: usize,
) -> Result<Message, String> {
    let n = rule.notify.as_ref().ok_or("the rule has no `notify`")?;
    // Only what the rules in force say for each key (docs/reliability.md#keywatchs-state-is-not-a-way-in):
    // a notification refused is left out of the digest, said in the log, and the others go.
    let firings: Vec<&Arc<Firing>> = firings
        .iter()
        .filter(|f| match super::refusal::refused(rule, f) {
            None => true,
            Some(why) => {
                tracing::error!(rule = %rule.name, channel = %ch.name, key = %crate::event::printable(&f.key), id = %f.id, reason = %why, "A stored notification is refused: it is not what the rules in force say for its key; left out of the digest.");
                false
            }
        })
        .collect();
    // Listed in the order they were observed: a window hands its notifications over by member
    // name, and a digest cut at `max_items` lists the oldest. Stable: those observed at the same
    // moment keep the order they came in (a channel's backlog, its arrival order).
    let mut firings: Vec<&Arc<Firing>> = firings;
    firings.sort_by_key(|f| f.observed_at);
    let first = *firings.first().ok_or("an empty digest")?;
    let escape = ch.escape();
    let t = &a.config.templates;
    let mut items = Vec::new();
    let mut mention = crate::channel::chat::Mention::default();
    let limit = ch.integration.key_limit();
    let cut: Vec<Option<Firing>> = firings
        .iter()
        .take(max_items)
        .map(|f| f.cut(limit))
        .collect();
    let shown = firings
        .iter()
        .zip(&cut)
        .map(|(f, c)| c.as_ref().unwrap_or(f.as_ref()));
    for f in shown {
        mention = mention.merged(&super::mention::render(
            t,
            &n.mention,
            &rule.name,
            &a.context_of(f),
        ));
        let text = match n.message.get(escape) {
            Some(id) => t
                .render_text(id, &a.context_of(f))
                .map_err(|e| format!("notify.message: {}", e.message))?,
            None => String::new(),
        };
        items.push(Item {
            event: f.to_json(),
            text,
        });
    }
    let events: Vec<serde_json::Value> = items.iter().map(|i| i.event.clone()).collect();
    let first_cut = first.cut(limit);
    let ctx = a
        .context_of(first_cut.as_ref().unwrap_or(first))
        .with_digest(firings.len(), events);
    let title = match n.title.get(escape) {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| format!("notify.title: {}", e.message))?,
        None => rule.name.clone(),
    };
    let mut text = String::new();
    if firings.len() > 1 {
        text.push_str(&format!(
            "{} {} events:\n",
            firings.len(),
            first.kind.as_str()
        ));
    }
    for i in &items {
        text.push_str(&format!("- {}\n", i.text));
    }
    let omitted = firings.len().saturating_sub(items.len());
    if omitted > 0 {
        text.push_str(&format!("… and {omitted} more\n"));
    }
    Ok(Message {
        rule: rule.name.clone(),
        event: first.kind.as_str().to_string(),
        title,
        text: text.trim_end().to_string(),
        items,
        count: firings.len(),
        digest: true,
        idempotency_key: digest_key(&first.id, &ch.name, firings.len()),
        custom_body: None,
        mention,
        links: Vec::new(),
        channel_fields: channel_fields(t, ch, &ctx)?,
        followup: None,
    })
}

/// The channel's own templates ([`Channel::templates`]) rendered in `ctx`, as plain values.
pub fn channel_fields(
    t: &crate::template::TemplateSet,
    ch: &Channel,
    ctx: &crate::template::Context,
) -> Result<Vec<(&'static str, String)>, String> {
    ch.templates
        .iter()
        .map(|(field, id)| {
            t.render_text(*id, ctx)
                .map(|v| (*field, v))
                .map_err(|e| format!("channel `{field}`: {}", e.message))
        })
        .collect()
}

pub async fn send_one(a: &ActionContext, f: &Firing, rule: &Rule, ch: &Channel) -> Outcome {
    match compose(a, f, rule, ch) {
        Ok(msg) => channel::send(&a.http, ch, &msg).await,
        Err(e) => Outcome::Failed(e),
    }
}

/// The acknowledge and silence links of a rule with `escalate` when the files configure
/// `links` (docs/rules.md): channels show them as buttons, or after the message's text in their
/// link syntax ([`crate::channel::chat::links_suffix`]). `f` with its exact key, which the
/// links name by its hash.
pub fn links_of(a: &ActionContext, f: &Firing, rule: &Rule) -> Vec<(String, String)> {
    match (&a.config.links, &rule.escalate) {
        (Some(links), Some(step)) => crate::links::for_firing(links, f, step.wait),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn firing(key: &str, observed_at: &str) -> Arc<Firing> {
        Arc::new(crate::firing::expiry("burst", key, observed_at))
    }

    /// A recovered expiry cannot be told from a delete made while nobody listened: the
    /// default message says so rather than claiming an expiry (docs/rules.md#recover-expiries-found-afterwards).
    #[test]
    fn the_default_message_says_a_recovered_expiry_may_have_been_a_delete() {
        let a = ActionContext::of_yaml(
            r#"
channels:
  log: { type: log }
rules:
  - name: lock
    match: 'lock:*'
    notify: { to: [log] }
"#,
            crate::config::Mode::Check,
        );
        let rule = a.config.rule("lock").unwrap();
        let ch = a.config.channel("log").unwrap();
        let heard = crate::firing::expiry("lock", "lock:7", "2026-01-01T00:00:01Z");
        assert_eq!(
            compose(&a, &heard, rule, ch).unwrap().text,
            "lock: lock:7 expired"
        );
        let mut found = heard.clone();
        found.recovered = true;
        assert_eq!(
            compose(&a, &found, rule, ch).unwrap().text,
            "lock: lock:7 found gone after keywatch was down: expired, or deleted while nobody listened"
        );
    }

    /// A window hands its notifications over by member name; the digest lists the oldest
    /// first, and cuts the newest.
    #[test]
    fn a_digest_lists_its_events_in_the_order_they_were_observed() {
        let a = ActionContext::of_yaml(
            r#"
channels:
  log: { type: log }
rules:
  - name: burst
    match: 'burst:*'
    notify: { to: [log], group: { window: 1s, max_items: 2 }, message: "{{ key }}" }
"#,
            crate::config::Mode::Check,
        );
        let firings = [
            firing("burst:c", "2026-01-01T00:00:03Z"),
            firing("burst:a", "2026-01-01T00:00:01Z"),
            // Written into a window by hand: its key is none the rule matches, so it is left
            // out (docs/reliability.md#keywatchs-state-is-not-a-way-in).
            firing("forged:x", "2026-01-01T00:00:00Z"),
            firing("burst:b", "2026-01-01T00:00:02Z"),
        ];
        let rule = a.config.rule("burst").unwrap();
        let ch = a.config.channel("log").unwrap();
        let m = compose_digest(&a, &firings, rule, ch, 2).unwrap();
        let keys: Vec<&str> = m
            .items
            .iter()
            .map(|i| i.event["key"].as_str().unwrap())
            .collect();
        assert_eq!(keys, ["burst:a", "burst:b"]);
        assert_eq!(
            m.text,
            "3 expired events:\n- burst:a\n- burst:b\n… and 1 more"
        );
        assert_eq!(m.count, 3);
    }
}
