//! How one attempt of an action went: the vocabulary shared by the integrations that judge an
//! answer, the actions that run, and the delivery stage that decides when to try again.

use std::time::Duration;

/// How a [`Outcome::Skipped`] reads in logs, history and dead letters: `cancelled: ` and why.
const CANCELLED: &str = "cancelled: ";

/// How much of an outcome's text is kept for people (logs, history, dead letters, the status
/// page): an answer's first few hundred bytes and the words around them. Cut only after secrets
/// are masked ([`crate::yaml::Secrets::mask_bounded`]).
pub const SHOWN: usize = 400;

/// How one attempt went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done; the text says what the target answered (for logs and `send-test`).
    Sent(String),
    /// Nothing to do, and done for the queue (a follow-up whose alert was handled, an alert whose
    /// channel the rules no longer have): `skipped` in history, not counted as escalated or
    /// resolved. The text says why.
    Skipped(String),
    /// Worth trying again, after `after` when the target said so (`Retry-After`).
    Retry {
        reason: String,
        after: Option<Duration>,
    },
    /// Will never work as configured (bad signature, unknown webhook): dead-letter it now.
    Failed(String),
    /// Done for now, and due again after `after`: an alert handed to Alertmanager, posted again
    /// while it fires. The same job comes back from the queue (on whichever instance takes it),
    /// its attempts counted from one again.
    Again { answer: String, after: Duration },
    /// Not done: what it would have done, rendered (`keywatch run --shadow`, which acts on
    /// nothing; docs/operations.md#rolling-out-beside-existing-code).
    Shadow(String),
}

impl Outcome {
    /// The same outcome with its text passed through `f` (masking secrets before it is
    /// logged, stored in history or shown).
    pub fn map_text(self, f: impl Fn(&str) -> String) -> Outcome {
        match self {
            Outcome::Sent(s) => Outcome::Sent(f(&s)),
            Outcome::Skipped(s) => Outcome::Skipped(f(&s)),
            Outcome::Retry { reason, after } => Outcome::Retry {
                reason: f(&reason),
                after,
            },
            Outcome::Failed(s) => Outcome::Failed(f(&s)),
            Outcome::Again { answer, after } => Outcome::Again {
                answer: f(&answer),
                after,
            },
            Outcome::Shadow(s) => Outcome::Shadow(f(&s)),
        }
    }

    /// The text people see: what the target answered, or why the attempt was skipped, retried
    /// or failed.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Outcome::Sent(s) | Outcome::Failed(s) | Outcome::Shadow(s) => s.into(),
            Outcome::Skipped(why) => format!("{CANCELLED}{why}").into(),
            Outcome::Retry { reason, .. } => reason.into(),
            Outcome::Again { answer, .. } => answer.into(),
        }
    }

    /// The `outcome` label of `keywatch_actions_total`.
    pub fn label(&self) -> &'static str {
        match self {
            // As before skips had a variant of their own: the metric's labels are a contract.
            Outcome::Sent(_) | Outcome::Skipped(_) | Outcome::Again { .. } => "sent",
            Outcome::Retry { .. } => "retry",
            Outcome::Failed(_) => "failed",
            Outcome::Shadow(_) => "shadow",
        }
    }
}
