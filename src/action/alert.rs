//! `notify` through an alertmanager channel: one alert posted to one of the channel's `urls`,
//! posted again every `resend` while it fires, and ended by the rule's `resolved`
//! (docs/rules.md#channels).
//!
//! Each URL is a job of its own in the durable queue (`Action::Alert`), so each has its own
//! retries and outcome, and one instance posts each round: the job comes back due every
//! `resend` ([`Outcome::Again`]) until the alert's end, from whichever instance takes it, and a
//! restart of keywatch loses no round. Alertmanager keeps alerts in memory only; the rounds
//! are what bring an alert back to an Alertmanager that restarted.
//!
//! The rule's `resolved` ends the alert: its job for the channel records when
//! ([`crate::store::alert_ends`]) and makes the alert's jobs due at once; each then posts the alert with
//! `endsAt` that moment, and again every `resend` for [`RESOLVED_RESEND`] (a round that crossed
//! the resolution on its way, posted as firing after it, is put right by the next one).

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::channel::alert::{Alert, Alertmanager, RESOLVED_RESEND};
use crate::channel::{Channel, http};
use crate::config::{Config, Rule};
use crate::firing::{Action, Firing};
use crate::keyspace::clock;
use crate::outcome::Outcome;
use crate::store::alert_ends;

use super::context::ActionContext;

/// When the alert of `f` starts: its deadline, or when it was observed.
pub fn starts_at(f: &Firing) -> DateTime<Utc> {
    f.deadline.unwrap_or(f.observed_at)
}

/// When the alert of `f` ends unless the rule's `resolved` ends it sooner: `hold` after it
/// started, counted from when keywatch observed it if that is later (an expiry recovered hours
/// after its deadline still fires for `hold`, rather than arriving already over).
pub fn held_until(f: &Firing, am: &Alertmanager) -> DateTime<Utc> {
    let hold = chrono::Duration::from_std(am.hold).unwrap_or(chrono::Duration::MAX);
    starts_at(f).max(f.observed_at) + hold
}

/// The alert of `f` for `ch`, ending at `ends_at`: the rule's title and message, its
/// `notify.labels` and `notify.annotations`, and `generatorURL` to the event's history when
/// the files configure `links`.
pub fn compose(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    ch: &Channel,
    am: &Alertmanager,
    ends_at: DateTime<Utc>,
) -> Result<Alert, String> {
    let msg = super::notify::compose(a, f, rule, ch)?;
    let n = rule.notify.as_ref().ok_or("the rule has no `notify`")?;
    // Labels and annotations from the firing as the channel shows it (its labels are text).
    let cut = f.cut(ch.integration.key_limit());
    let ctx = a.context_of(cut.as_ref().unwrap_or(f));
    let t = &a.config.templates;
    let render = |pairs: &[(String, crate::template::TemplateId)], field: &str| {
        pairs
            .iter()
            .map(|(k, id)| {
                t.render_text(*id, &ctx)
                    .map(|v| (k.clone(), v))
                    .map_err(|e| format!("notify.{field}.{k}: {}", e.message))
            })
            .collect::<Result<Vec<_>, String>>()
    };
    let labels = render(&n.labels, "labels")?;
    let annotations = render(&n.annotations, "annotations")?;
    let item = msg.items.first().ok_or("an empty message")?;
    let alert = Alert::of_event(
        &rule.name,
        &item.event,
        &msg.title,
        &item.text,
        starts_at(f),
        ends_at,
    )
    .with_labels(am.labels.iter().cloned())
    .with_labels(labels)
    .with_annotations(annotations);
    Ok(Alert {
        generator_url: generator_url(&a.config, &f.id),
        ..alert
    })
}

/// The event's history on keywatch's endpoint, where `links.base_url` says people reach it.
pub fn generator_url(config: &Config, firing_id: &str) -> Option<String> {
    config
        .links
        .as_ref()
        .map(|l| format!("{}/api/history?id={firing_id}", l.base_url))
}

/// One round of the alert job for `urls[target]` of `channel`.
pub async fn run(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    channel: &str,
    target: u32,
) -> Outcome {
    let Some(ch) = a.config.channel(channel) else {
        return Outcome::Failed(format!("channel `{channel}` is no longer defined"));
    };
    let Some(am) = ch.integration.alertmanager() else {
        return Outcome::Failed(format!(
            "channel `{channel}` is no longer an alertmanager channel"
        ));
    };
    let target = target as usize;
    if target >= am.urls.len() {
        return Outcome::Skipped(format!(
            "channel `{channel}` no longer has a URL #{target} in `urls`"
        ));
    }
    if rule
        .notify
        .as_ref()
        .is_none_or(|n| !n.to.iter().any(|c| c == channel))
    {
        return Outcome::Skipped(format!("the rule no longer notifies `{channel}`"));
    }
    let ended = match ended_at(a, f, channel).await {
        Ok(e) => e,
        Err(reason) => {
            return Outcome::Retry {
                reason,
                after: None,
            };
        }
    };
    let now = clock::now();
    let held = held_until(f, am);
    let ends_at = ended.map_or(held, |e| e.min(held));
    // Past the last round this alert would have: a round that could not be posted in time.
    let last = match ended {
        Some(e) => e + chrono::Duration::from_std(RESOLVED_RESEND).unwrap_or_default(),
        None => held,
    };
    if now >= last {
        return Outcome::Failed(format!(
            "gave up: the alert {} before {} took it",
            if ended.is_some() {
                "was resolved and its resolution's rounds ended"
            } else {
                "ended (`hold`)"
            },
            am.shown_url(target)
        ));
    }
    let alert = match compose(a, f, rule, ch, am, ends_at) {
        Ok(alert) => alert,
        Err(e) => return Outcome::Failed(e),
    };
    let Some(req) = am.request(target, &alert) else {
        return Outcome::Failed("no such URL".into());
    };
    let outcome = match http::send(&a.http, &req, ch.timeout).await {
        Ok(answer) => ch.integration.judge(ch, &answer),
        Err(o) => o,
    };
    match outcome {
        Outcome::Sent(answer) => next_round(answer, now, last, am.resend),
        other => other,
    }
}

/// After a round posted at `now`: again after `resend` while that is before `last`.
fn next_round(
    answer: String,
    now: DateTime<Utc>,
    last: DateTime<Utc>,
    resend: Duration,
) -> Outcome {
    // A round due too close to the last moment could run after it (the queue is read every
    // 200 ms) and be taken for one that failed to post in time.
    let margin = chrono::Duration::seconds(10);
    let next = now + chrono::Duration::from_std(resend).unwrap_or(chrono::Duration::MAX);
    if next + margin < last {
        Outcome::Again {
            answer,
            after: resend,
        }
    } else {
        Outcome::Sent(answer)
    }
}

/// When the rule's `resolved` ended the alert, if it did.
async fn ended_at(
    a: &ActionContext,
    f: &Firing,
    channel: &str,
) -> Result<Option<DateTime<Utc>>, String> {
    let Some(state) = &a.state else {
        return Ok(None);
    };
    let ms = alert_ends::ended_at(state, &a.config.state.prefix, &f.id, channel)
        .await
        .map_err(|e| format!("cannot read whether the alert was resolved: {e}"))?;
    Ok(ms.and_then(DateTime::from_timestamp_millis))
}

/// The rule's `resolved` for the alertmanager channel `ch`: the alert of `f` ends now. The
/// moment is recorded (the first one stays: a resolved notice retried later does not move it)
/// and the alert's jobs, one per URL, become due at once to post it.
pub async fn end(a: &ActionContext, f: &Firing, ch: &Channel, am: &Alertmanager) -> Outcome {
    let Some(state) = &a.state else {
        return Outcome::Failed(
            "ending an Alertmanager alert needs keywatch's state in Redis".into(),
        );
    };
    let now = clock::now_ms();
    let keep = am.hold + RESOLVED_RESEND + Duration::from_secs(3600);
    let ids: Vec<String> = (0..am.urls.len())
        .map(|t| {
            Action::Alert {
                channel: ch.name.clone(),
                target: u32::try_from(t).unwrap_or(u32::MAX),
            }
            .idempotency_key(&f.id)
        })
        .collect();
    let prefix = &a.config.state.prefix;
    match alert_ends::end(state, prefix, &f.id, &ch.name, now, keep, &ids).await {
        Ok(()) => Outcome::Sent(format!(
            "the alert ends now: its {} Alertmanager URL(s) are sent `endsAt` now",
            ids.len()
        )),
        Err(e) => Outcome::Retry {
            reason: format!("cannot record the alert's end: {e}"),
            after: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn rounds_come_every_resend_until_the_last_one() {
        let resend = Duration::from_secs(60);
        let last = t("2026-11-29T11:00:00Z");
        assert_eq!(
            next_round("HTTP 200".into(), t("2026-11-29T10:58:49Z"), last, resend),
            Outcome::Again {
                answer: "HTTP 200".into(),
                after: resend
            }
        );
        assert_eq!(
            next_round("HTTP 200".into(), t("2026-11-29T10:58:50Z"), last, resend),
            Outcome::Sent("HTTP 200".into())
        );
    }
}
