//! The attempt stage: one attempt of a job or a digest through its integration, its answer
//! masked, and what it comes to under the retry policy — sent, failed for good, or retried at a
//! given time (docs/reliability.md#guarantees).

use std::time::Instant;

use crate::action::ActionContext;
use crate::channel;
use crate::firing::Action;
use crate::internal_events::Attempted;
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::store::queue::now_ms;

use super::retry::{Next, RetryPolicy};
use super::work::Work;

/// What an attempt came to.
pub(super) struct Tried {
    /// `Retry` only while the retry window is open: past it, the last failure is `Failed`.
    pub(super) outcome: Outcome,
    /// With a `Retry`: when to attempt again (unix ms).
    pub(super) retry_at: Option<i64>,
    /// When the job first failed (unix ms), for the retry window; `None` while it never has.
    pub(super) failing_since: Option<i64>,
}

pub(super) struct Attempt {
    pub(super) actions: ActionContext,
    pub(super) policy: RetryPolicy,
    pub(super) metrics: std::sync::Arc<Metrics>,
}

impl Attempt {
    /// Attempts `work` once; `n` attempts came before it, failing since `failing_since`. Emits
    /// [`Attempted`] (logged and counted): a failure past the retry window is the last attempt,
    /// counted and logged as failed (the dead letter follows), not as a retry.
    pub(super) async fn run(&self, work: &Work, n: u32, failing_since: Option<i64>) -> Tried {
        let started = Instant::now();
        let outcome = if self.actions.live.current().state.is_shadow() {
            self.shadow(work)
        } else {
            self.real(work).await
        };
        // The one place every attempt's text passes before it is logged, counted, kept in
        // history or dead-lettered: an error may quote a rendered URL, argument or answer with a
        // secret. Masked before it is cut, so a cut never leaves the start of a secret; control
        // and bidi characters of an answer written out, so it cannot forge a log line or repaint
        // a terminal.
        let secrets = &self.actions.live.current().secrets;
        let outcome = outcome.map_text(|t| {
            crate::event::printable(secrets.mask_bounded(t, crate::outcome::SHOWN).as_bytes())
                .into_owned()
        });
        let mut tried = Tried {
            outcome,
            retry_at: None,
            failing_since,
        };
        if let Outcome::Retry { reason, after } = &tried.outcome {
            let now = now_ms();
            let since = *tried.failing_since.get_or_insert(now);
            match self.policy.after_failure(n + 1, since, now, *after) {
                Next::RetryAt(at) => tried.retry_at = Some(at),
                Next::GiveUp => {
                    tried.outcome = Outcome::Failed(format!(
                        "gave up: failing for longer than the retry window; last: {reason}"
                    ))
                }
            }
        }
        if let (Outcome::Sent(_), Work::Job { action, .. }) = (&tried.outcome, work) {
            match action {
                Action::Escalate { .. } => self.metrics.escalated_for(work.rule()),
                Action::Resolved { .. } => self.metrics.resolved_for(work.rule()),
                _ => {}
            }
        }
        Attempted {
            rule: work.rule(),
            key: &work.subject_shown(),
            action: work.action_name(),
            channel: work.channel().unwrap_or(""),
            attempt: n + 1,
            outcome: &tried.outcome,
            seconds: started.elapsed().as_secs_f64(),
        }
        .emit(&self.metrics);
        tried
    }

    /// The attempt itself: the integration's request, the command, the cleanup.
    async fn real(&self, work: &Work) -> Outcome {
        match work {
            Work::Job {
                firing,
                action,
                released: None,
            } => self.actions.run(firing, action).await,
            Work::Job {
                firing,
                action,
                released: Some(released),
            } => {
                let job = crate::firing::Job::first(firing.clone(), action.clone());
                crate::action::release::Release::send_released(&self.actions, &job, released).await
            }
            Work::Digest {
                channel, message, ..
            } => match self.actions.refreshed().config.channel(channel) {
                Some(ch) => channel::send(&self.actions.http, ch, message).await,
                None => Outcome::Failed(format!("channel `{channel}` is no longer defined")),
            },
        }
    }

    /// What a shadow (`run --shadow`) does instead: renders the action with the code that does
    /// it (`action::preview`) and does nothing. A resolved notice needs the key back, which a
    /// shadow does not look for.
    fn shadow(&self, work: &Work) -> Outcome {
        match work {
            Work::Digest {
                channel, message, ..
            } => Outcome::Shadow(format!(
                "notify {channel}: {}\n{}",
                message.title, message.text
            )),
            Work::Job { firing, action, .. } => {
                let a = self.actions.refreshed();
                let Some(rule) = a.config.rule(&firing.rule) else {
                    return Outcome::Failed(format!("rule `{}` no longer exists", firing.rule));
                };
                if matches!(action, Action::Resolved { .. }) {
                    return Outcome::Skipped(
                        "a shadow does not look whether the key exists again".into(),
                    );
                }
                match crate::action::preview::preview(&a, firing, rule, action) {
                    Ok(p) => Outcome::Shadow(p.describe()),
                    Err(why) => Outcome::Failed(why),
                }
            }
        }
    }
}
