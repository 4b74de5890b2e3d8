//! What rules do: `reload`, `exec`, `cleanup` and `notify`, each attempt ending in an [`Outcome`].
//!
//! One small module per action behind one entry point, [`ActionContext::run`]; `notify` sends through
//! the channel integrations of [`crate::channel`]. Whether to retry is decided by the action or
//! integration (it knows that DingTalk's HTTP 200 with `errcode` 130101 is a rate limit), when to
//! retry by the delivery stage.

mod context;
pub use context::ActionContext;

pub mod alert;
pub(crate) mod cleanup;
pub(crate) mod exec;
pub(crate) mod followup;
pub(crate) mod mention;
pub mod notify;
pub(crate) mod preview;
pub(crate) mod refusal;
pub(crate) mod release;
pub(crate) mod reload;
pub use refusal::refused;

use crate::firing::{Action, Firing};
use crate::outcome::Outcome;

impl ActionContext {
    /// One attempt of `action` for `firing`, under the rules in force now. A firing of a key
    /// longer than [`crate::long_key::EXACT`] first waits for its share of
    /// [`crate::long_key::AT_ONCE`] bytes, then is made whole with the exact key read again
    /// from where it is kept apart: what attempts hold of long keys at once is bounded
    /// (docs/reliability.md#bounded-whatever-the-key).
    pub async fn run(&self, firing: &Firing, action: &Action) -> Outcome {
        let _turn = match firing.is_long() {
            true => self.long_keys.acquire_many(turn_of(firing)).await.ok(),
            false => None,
        };
        let a = self.refreshed();
        if firing.apart.is_none() {
            return a.run_snapshot(firing, action).await;
        }
        match a.whole(firing).await {
            Ok(whole) => a.run_snapshot(&whole, action).await,
            // Redis did not answer: the exact bytes are still kept, so the job is tried again.
            Err(Unwhole::Unread(reason)) => Outcome::Retry {
                reason,
                after: None,
            },
            Err(Unwhole::Refused(why)) => {
                tracing::error!(rule = %firing.rule, key = %crate::event::printable(&firing.key), id = %firing.id, action = action.name(), reason = %why, "A stored job is refused: its exact key cannot be read again.");
                Outcome::Failed(format!("refused: {why}"))
            }
        }
    }

    /// `firing` (stored, its exact key kept apart) made whole again: the exact key and field
    /// read from keywatch's state, checked against the hashes the firing names, and its
    /// captures taken again by the rule's pattern.
    pub async fn whole(&self, firing: &Firing) -> Result<Firing, Unwhole> {
        let Some(apart) = &firing.apart else {
            return Ok(firing.clone());
        };
        let Some(rule) = self.config.rule(&firing.rule) else {
            return Err(Unwhole::Refused(format!(
                "rule `{}` no longer exists",
                firing.rule
            )));
        };
        let Some(state) = &self.state else {
            return Err(Unwhole::Refused(
                "the exact key is kept in keywatch's state, which is not at hand".into(),
            ));
        };
        let prefix = &self.config.state.prefix;
        let read = |e: &Option<crate::firing::Exact>| {
            let sha = e.as_ref().map(|e| e.sha256.clone());
            async move {
                match sha {
                    None => Ok(None),
                    Some(sha) => crate::store::long_keys::read(state, prefix, &sha).await,
                }
            }
        };
        let key = read(&apart.key)
            .await
            .map_err(|e| Unwhole::Unread(format!("cannot read the exact key: {e}")))?;
        let field = read(&apart.field)
            .await
            .map_err(|e| Unwhole::Unread(format!("cannot read the exact field: {e}")))?;
        firing
            .whole(key, field, |k, f| rule.captures_in(k, f))
            .map_err(Unwhole::Refused)
    }

    async fn run_snapshot(&self, firing: &Firing, action: &Action) -> Outcome {
        let Some(rule) = self.config.rule(&firing.rule) else {
            return Outcome::Failed(format!("rule `{}` no longer exists", firing.rule));
        };
        if let Some(why) = refused(rule, firing) {
            tracing::error!(rule = %rule.name, key = %crate::event::printable(&firing.key), id = %firing.id, action = action.name(), reason = %why, "A stored job is refused: it is not what the rules in force say for its key.");
            return Outcome::Failed(format!("refused: {why}"));
        }
        if let Some(why) = not_the_rules(rule, action) {
            return Outcome::Skipped(why);
        }
        if matches!(action, Action::Reload | Action::Exec) && firing.is_long() {
            return Outcome::Failed(format!(
                "the key is {} bytes: `{}` takes keys of up to {} bytes (no URL or argument that long works; docs/reliability.md#bounded-whatever-the-key)",
                firing.key.len(),
                action.name(),
                crate::long_key::EXACT
            ));
        }
        match action {
            Action::Reload => match &rule.reload {
                Some(step) => reload::run(self, firing, rule, step).await,
                None => Outcome::Failed("the rule no longer has a `reload` step".into()),
            },
            Action::Exec => match &rule.exec {
                Some(step) => exec::run(self, firing, rule, step).await,
                None => Outcome::Failed("the rule no longer has an `exec` step".into()),
            },
            Action::Cleanup => match &rule.cleanup {
                Some(step) => cleanup::run(self, firing, rule, step).await,
                None => Outcome::Failed("the rule no longer has a `cleanup` step".into()),
            },
            Action::Escalate { .. } | Action::Resolved { .. } => {
                followup::run(self, firing, rule, action).await
            }
            Action::Alert { channel, target } => {
                alert::run(self, firing, rule, channel, *target).await
            }
            Action::Notify { channel } => match self.config.channel(channel) {
                Some(ch) => notify::send_one(self, firing, rule, ch).await,
                None => Outcome::Failed(format!("channel `{channel}` is no longer defined")),
            },
        }
    }
}

/// Why a stored firing of a long key could not be made whole ([`ActionContext::whole`]).
#[derive(Debug)]
pub enum Unwhole {
    /// keywatch's state did not answer: worth trying again.
    Unread(String),
    /// Its exact bytes are gone or are not what it names, or its captures are not the key's:
    /// never (docs/reliability.md#keywatchs-state-is-not-a-way-in).
    Refused(String),
}

/// The share of [`crate::long_key::AT_ONCE`] an attempt on `firing` takes, in KiB: its long
/// key's and field's length, all of it for a key longer than that.
fn turn_of(firing: &Firing) -> u32 {
    let len = match &firing.apart {
        Some(apart) => [&apart.key, &apart.field]
            .into_iter()
            .flatten()
            .map(|e| e.len)
            .sum(),
        None => firing.key.len() + firing.field.as_ref().map_or(0, Vec::len),
    };
    (len.clamp(1024, crate::long_key::AT_ONCE) / 1024) as u32
}

/// Why `action` is no longer the rule's to do (a reload took its channel from `notify.to`, or
/// the follow-up's channel from its step), if it is not: nothing to do, and done for the queue.
/// The other actions say so themselves (a rule without `reload`, an Alertmanager URL gone).
fn not_the_rules(rule: &crate::config::Rule, action: &Action) -> Option<String> {
    let mine = match action {
        Action::Notify { .. } | Action::Escalate { .. } | Action::Resolved { .. } => {
            every_action_of(rule).contains(action)
        }
        _ => true,
    };
    (!mine).then(|| {
        format!(
            "rule `{}` no longer has `{}` to channel `{}`",
            rule.name,
            action.name(),
            action.channel().unwrap_or_default()
        )
    })
}

/// The actions of a rule, in the order of docs/rules.md (detail is read before any of them).
pub fn actions_of(rule: &crate::config::Rule) -> Vec<Action> {
    let mut out = Vec::new();
    if rule.reload.is_some() {
        out.push(Action::Reload);
    }
    if rule.exec.is_some() {
        out.push(Action::Exec);
    }
    if rule.cleanup.is_some() {
        out.push(Action::Cleanup);
    }
    if let Some(n) = &rule.notify {
        for c in &n.to {
            match n.alert_targets(c) {
                Some(urls) => out.extend((0..urls).map(|target| Action::Alert {
                    channel: c.clone(),
                    target,
                })),
                None => out.push(Action::Notify { channel: c.clone() }),
            }
        }
    }
    out
}

/// [`actions_of`] and the rule's follow-ups (`escalate`, `resolved`): every action a firing of
/// `rule` may record an outcome for.
pub fn every_action_of(rule: &crate::config::Rule) -> Vec<Action> {
    let mut out = actions_of(rule);
    out.extend(followup::jobs_of(rule, 0).0.into_iter().map(|(a, _)| a));
    out
}
