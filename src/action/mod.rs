//! What rules do: `reload`, `exec`, `cleanup` and `notify`, each attempt ending in an [`Outcome`].
//!
//! One small module per action behind one entry point, [`ActionContext::run`]; `notify` sends through
//! the channel integrations of [`crate::channel`]. Whether to retry is decided by the action or
//! integration (it knows that DingTalk's HTTP 200 with `errcode` 130101 is a rate limit), when to
//! retry by the delivery stage.

mod context;
pub use context::ActionContext;

pub mod alert;
pub mod cleanup;
pub mod exec;
pub mod followup;
pub mod mention;
pub mod notify;
pub mod reload;

use crate::firing::{Action, Firing};
use crate::outcome::Outcome;

impl ActionContext {
    /// One attempt of `action` for `firing`, under the rules in force now. A firing of a key
    /// longer than [`crate::long_key::EXACT`] waits for one of [`crate::long_key::AT_ONCE`]
    /// turns: what its attempt holds besides the key is bounded, and so is how many hold it
    /// at once (docs/reliability.md#bounded-whatever-the-key).
    pub async fn run(&self, firing: &Firing, action: &Action) -> Outcome {
        let _turn = match crate::long_key::is_long(&firing.key) {
            true => self.long_keys.acquire().await.ok(),
            false => None,
        };
        self.refreshed().run_snapshot(firing, action).await
    }

    async fn run_snapshot(&self, firing: &Firing, action: &Action) -> Outcome {
        let Some(rule) = self.config.rule(&firing.rule) else {
            return Outcome::Failed(format!("rule `{}` no longer exists", firing.rule));
        };
        if matches!(action, Action::Reload | Action::Exec) && crate::long_key::is_long(&firing.key)
        {
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
