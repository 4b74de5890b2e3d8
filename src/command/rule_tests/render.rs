//! A test's events through the rules, to the actions they render, in the order they would
//! happen: each event's actions when it happens (reload → exec → cleanup → notify, rule by
//! rule), a digest when its window ends, an escalation `after` its alert.
//!
//! The decisions are keywatch's own: matching ([`Config::rules_for_event`]), silences,
//! `recover` ([`crate::engine::stage`]), the actions of a rule ([`crate::action::actions_of`]),
//! follow-ups ([`crate::action::followup`]) and every action's rendering
//! ([`crate::action::preview`]). Nothing is sent, run or read.
//!
//! Where a notification goes out is decided in one place, [`Schedule::notification`]: now, or
//! when its digest window ends; then, in [`Schedule::finish`], whether its channel's quiet
//! hours hold it at that moment, and until when ([`Config::hold`], what delivery asks).

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::action::preview::{Preview, preview, preview_digest};
use crate::action::{ActionContext, actions_of, followup};
use crate::config::{Config, Rule};
use crate::event::{EventKind, KeyEvent};
use crate::firing::{Action, Detail, Firing};

use super::file::{DetailGiven, Event, Test};

/// One action the events render.
#[derive(Clone, Debug)]
pub struct Rendered {
    pub rule: String,
    /// When it would happen.
    pub at: DateTime<Utc>,
    /// `notify`, `escalate`, `reload`, `exec` or `cleanup`.
    pub action: &'static str,
    pub channel: Option<String>,
    /// What it renders, or why it would fail for good.
    pub preview: Result<Preview, String>,
    /// Held by its channel's quiet hours until then, and released with what else they held.
    pub held_until: Option<DateTime<Utc>>,
}

/// The actions `test`'s events render under `config`, at `now`, in the order they would happen.
pub fn render(
    config: &Arc<Config>,
    actions: &ActionContext,
    now: DateTime<Utc>,
    test: &Test,
) -> Vec<Rendered> {
    let mut schedule = Schedule::default();
    for event in &test.events {
        fire(config, actions, now, event, &mut schedule);
    }
    schedule.finish(config, actions)
}

/// The event as a source would report it: an expiry heard at its deadline, or found at `now`
/// when it is `recovered`; a warning `ttl` (the rule's `warn_before`) before its deadline.
fn key_event(config: &Config, now: DateTime<Utc>, e: &Event, source: &str) -> KeyEvent {
    let at = e.at.unwrap_or(now);
    let observed_at = match e.recovered {
        true => now.max(at),
        false => at,
    };
    let ttl_ms = (e.kind == EventKind::Expiring).then(|| {
        let ttl = e.ttl.or_else(|| {
            // The longest `warn_before` of the rules the key may warn for: one key, one event.
            let mut idx = Vec::new();
            config.matching_rules(&e.key, &mut idx);
            idx.iter()
                .filter_map(|&i| config.rules[i].warn_before)
                .max()
        });
        ttl.map_or(0, |t| i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
    });
    let deadline = match e.kind {
        EventKind::Expired | EventKind::Hexpired => Some(at),
        EventKind::Expiring => ttl_ms.map(|ms| at + chrono::Duration::milliseconds(ms)),
        // Heard when they happen; their deadline is not what they are about.
        EventKind::Evicted | EventKind::Deleted => None,
    };
    KeyEvent {
        kind: e.kind,
        db: e.db,
        key: e.key.clone().into(),
        field: e.field.clone(),
        observed_at,
        deadline,
        ttl_ms,
        recovered: e.recovered,
        source: source.to_string(),
        place: None,
    }
}

fn fire(
    config: &Arc<Config>,
    actions: &ActionContext,
    now: DateTime<Utc>,
    event: &Event,
    schedule: &mut Schedule,
) {
    let e = key_event(config, now, event, &actions.keyspace.node());
    for (i, captures) in config.rules_for_event(&e) {
        let rule = &config.rules[i];
        if event.silenced || crate::engine::recovery_skipped(rule, &e).is_some() {
            continue;
        }
        let detail = match (&rule.detail, &event.detail) {
            (None, _) => None,
            (Some(_), Some(DetailGiven::Text(t))) => Some(Detail::read(t.as_bytes())),
            (Some(_), Some(DetailGiven::Json(v))) => Some(Detail::from(v.clone())),
            (Some(_), None) => match crate::engine::skipped_without_detail(rule, &e) {
                Some(_) => continue,
                None => Some(serde_json::Value::Null.into()),
            },
        };
        let firing = Arc::new(Firing::new(
            &rule.name,
            &e,
            rule.capture_names(),
            captures,
            detail,
        ));
        for action in actions_of(rule) {
            match &action {
                // An alert is posted alike to each Alertmanager of `urls`: one expectation.
                Action::Alert { target, .. } if *target > 0 => {}
                Action::Notify { channel } | Action::Alert { channel, .. } => {
                    schedule.notification(config, rule, channel, &firing, action.clone());
                }
                _ => schedule.now(rule, &firing, action),
            }
        }
        if followup::follows(e.kind) {
            let (jobs, _) = followup::jobs_of(rule, e.observed_at.timestamp_millis());
            for (action, due) in jobs {
                // A resolved notice needs the key to exist again, which no test event says.
                if !matches!(action, Action::Escalate { .. }) {
                    continue;
                }
                let at = DateTime::from_timestamp_millis(due).unwrap_or(e.observed_at);
                schedule.later(rule, &firing, action, at);
            }
        }
    }
}

/// What the events render, gathered before it is rendered: actions at a moment, and open
/// digest windows.
#[derive(Default)]
struct Schedule {
    /// (when, firing, action), in the order the events made them.
    due: Vec<(DateTime<Utc>, String, Arc<Firing>, Action)>,
    windows: Vec<Window>,
}

/// A digest window of one rule and channel: opened by its first notification, it takes every
/// one until it ends, and its digest goes out then.
struct Window {
    rule: String,
    channel: String,
    ends: DateTime<Utc>,
    firings: Vec<Arc<Firing>>,
}

impl Schedule {
    fn now(&mut self, rule: &Rule, firing: &Arc<Firing>, action: Action) {
        self.later(rule, firing, action, firing.observed_at);
    }

    fn later(&mut self, rule: &Rule, firing: &Arc<Firing>, action: Action, at: DateTime<Utc>) {
        self.due
            .push((at, rule.name.clone(), firing.clone(), action));
    }

    /// A notification of `firing` to `channel`: now, or in its digest window when the rule
    /// groups and the channel takes digests.
    fn notification(
        &mut self,
        config: &Config,
        rule: &Rule,
        channel: &str,
        firing: &Arc<Firing>,
        action: Action,
    ) {
        let group = rule.notify.as_ref().and_then(|n| n.group);
        let digests = config
            .channel(channel)
            .is_some_and(|ch| ch.integration.takes_digests());
        let (Some(group), true) = (group, digests) else {
            return self.now(rule, firing, action);
        };
        let at = firing.observed_at;
        let open = self
            .windows
            .iter_mut()
            .find(|w| w.rule == rule.name && w.channel == channel && at < w.ends);
        match open {
            Some(w) => w.firings.push(firing.clone()),
            None => self.windows.push(Window {
                rule: rule.name.clone(),
                channel: channel.to_string(),
                ends: at + chrono::Duration::from_std(group.window).unwrap_or_default(),
                firings: vec![firing.clone()],
            }),
        }
    }

    /// Everything rendered, in the order it would happen (what happens at the same moment in
    /// the order the events made it).
    fn finish(self, config: &Config, actions: &ActionContext) -> Vec<Rendered> {
        let mut out: Vec<Rendered> = self
            .due
            .into_iter()
            .map(|(at, rule, firing, action)| {
                let preview = match config.rule(&rule) {
                    Some(r) => preview(&actions.clone().at(at), &firing, r, &action),
                    None => Err(format!("rule `{rule}` is not defined")),
                };
                let held_until = config.hold(&rule, &action, at).map(|h| h.until);
                Rendered {
                    held_until,
                    rule,
                    at,
                    action: match action {
                        Action::Alert { .. } => "notify",
                        ref a => a.name(),
                    },
                    channel: action.channel().map(str::to_string),
                    preview,
                }
            })
            .collect();
        for w in self.windows {
            let preview = match config.rule(&w.rule) {
                Some(r) => preview_digest(&actions.clone().at(w.ends), &w.firings, r, &w.channel),
                None => Err(format!("rule `{}` is not defined", w.rule)),
            };
            let notify = Action::Notify {
                channel: w.channel.clone(),
            };
            out.push(Rendered {
                held_until: config.hold(&w.rule, &notify, w.ends).map(|h| h.until),
                rule: w.rule,
                at: w.ends,
                action: "notify",
                channel: Some(w.channel),
                preview,
            });
        }
        // Stable: the same moment keeps the order the events made.
        out.sort_by_key(|r| r.at);
        out
    }
}
