//! keywatch's internal events: what happened inside keywatch that operators, dashboards and
//! tests read, each one a type whose `emit` logs it and counts it in one call (Vector's
//! `emit!`, `src/internal_events/`).
//!
//! Every log line of an internal event carries the field `internal_event` with the event's
//! name (`NAME`, stable: docs/operations.md#internal-events lists them), beside its own fields.
//! Tests and log pipelines match that name and the fields, never the wording of the sentence,
//! which may change. An internal event is not a keyspace event (docs/how-it-works.md#glossary):
//! the name says where it comes from.

use std::fmt::Display;
use std::net::SocketAddr;

use crate::metrics::Metrics;
use crate::outcome::Outcome;

/// The HTTP endpoint accepts connections at `addr` (the port the OS chose for `:0` included).
pub struct Listening {
    pub addr: SocketAddr,
}

impl Listening {
    pub const NAME: &'static str = "listening";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, addr = %self.addr, "HTTP endpoint listening (/, /metrics, /healthz, /readyz, /-/reload).");
    }
}

/// A subscriber's connection to `node` is subscribed to the keyevent channels the rules need:
/// events flow from now on.
pub struct Subscribed<'a> {
    pub node: &'a str,
    pub channels: usize,
}

impl Subscribed<'_> {
    pub const NAME: &'static str = "subscribed";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, node = %self.node, channels = self.channels, "Subscribed to keyspace events.");
    }
}

/// A subscriber's connection to `node` ended: what Redis publishes until the next
/// [`Subscribed`] is recovered from the ledger, not heard.
pub struct SubscriptionLost<'a> {
    pub node: &'a str,
    pub reason: &'a str,
}

impl SubscriptionLost<'_> {
    pub const NAME: &'static str = "subscription_lost";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, node = %self.node, reason = %self.reason, "Subscriber connection ended; reconnecting.");
    }
}

/// Readiness changed (`/readyz`): `ready`, or not and why.
pub struct Readiness<'a> {
    pub ready: bool,
    /// The watched nodes not subscribed, space-separated (when not ready).
    pub nodes_down: &'a str,
    /// The other reasons, `; `-separated (when not ready).
    pub reasons: &'a str,
}

impl Readiness<'_> {
    pub const NAME: &'static str = "readiness";

    pub fn emit(self) {
        if self.ready {
            tracing::info!(
                internal_event = Self::NAME,
                ready = true,
                "keywatch is ready."
            );
        } else {
            tracing::warn!(internal_event = Self::NAME, ready = false, nodes_not_subscribed = %self.nodes_down, reasons = %self.reasons, "keywatch is not ready.");
        }
    }
}

/// What one attempt of an action (or a digest) is named by in its internal event.
pub struct Attempted<'a> {
    pub rule: &'a str,
    /// The key as shown to people, or how many keys a digest stands for.
    pub key: &'a str,
    pub action: &'static str,
    /// The channel, for any action that has one (a follow-up's included); `""` otherwise.
    pub channel: &'a str,
    /// Which attempt this was (from 1).
    pub attempt: u32,
    pub outcome: &'a Outcome,
    pub seconds: f64,
}

impl Attempted<'_> {
    pub const NAME: &'static str = "attempted";

    /// Logs the attempt (secrets already masked in its text) and counts it in
    /// `keywatch_actions_total{rule,action,outcome}` and `keywatch_action_seconds`.
    pub fn emit(self, metrics: &Metrics) {
        let Attempted {
            rule,
            key,
            action,
            channel,
            attempt,
            outcome,
            seconds,
        } = self;
        metrics.action(rule, action, outcome.label(), seconds);
        let label = outcome.label();
        let name = Self::NAME;
        match outcome {
            Outcome::Sent(_) | Outcome::Skipped(_) => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, answer = %outcome.text(), "Action done.")
            }
            Outcome::Shadow(rendered) => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %rendered, "Shadow: the action was rendered, not done.")
            }
            Outcome::Again { answer, after } => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %answer, again_in = %humantime::format_duration(*after), "Action done; it runs again later.")
            }
            Outcome::Retry { reason, .. } => {
                tracing::warn!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %reason, "Action failed; will retry.")
            }
            Outcome::Failed(reason) => {
                tracing::error!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %reason, "Action failed for good.")
            }
        }
    }
}

/// An action given up for good: kept as a dead letter (`keywatch dead list`).
pub struct DeadLettered<'a> {
    pub rule: &'a str,
    pub key: &'a str,
    pub action: &'a str,
    pub channel: &'a str,
    /// The event id (or a digest's).
    pub id: &'a str,
    pub reason: &'a str,
}

impl DeadLettered<'_> {
    pub const NAME: &'static str = "dead_lettered";

    /// Logs the dead letter and counts it in `keywatch_dead_letters_total`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.dead_letters.inc();
        let DeadLettered {
            rule,
            key,
            action,
            channel,
            id,
            reason,
        } = self;
        tracing::error!(internal_event = Self::NAME, %rule, %key, action, channel, %id, %reason, "Dead letter: the action will not be retried.");
    }
}

/// Redis did not take a write (or answer a read) of keywatch's state. What it was about stays
/// where it is in Redis (an event's intake record, a job's lease) and is tried again: the
/// event names the `operation` (docs/operations.md#internal-events lists them) and what
/// happens next.
pub struct StateError<'a> {
    pub operation: &'static str,
    pub error: &'a dyn Display,
    /// How many jobs, events or windows it was about.
    pub items: usize,
    /// What happens next, as a sentence.
    pub then: &'static str,
}

impl StateError<'_> {
    pub const NAME: &'static str = "state_error";

    /// Logs it and counts it in `keywatch_state_errors_total{operation}`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.state_error(self.operation);
        let StateError {
            operation,
            error,
            items,
            then,
        } = self;
        tracing::warn!(internal_event = Self::NAME, operation, error = %error, items, "Redis did not take keywatch's state: {then}");
    }
}

/// A message to a channel in its quiet hours is held until they end (docs/rules.md#quiet-hours).
pub struct HeldMessage<'a> {
    pub rule: &'a str,
    /// The key as shown to people, or how many keys a digest stands for.
    pub key: &'a str,
    pub channel: &'a str,
    /// The channel's window.
    pub window: &'a str,
    pub until: chrono::DateTime<chrono::Utc>,
    /// How many messages (a window's digest holds each of its notifications).
    pub messages: usize,
}

impl HeldMessage<'_> {
    pub const NAME: &'static str = "held";

    pub fn emit(self) {
        let HeldMessage {
            rule,
            key,
            channel,
            window,
            until,
            messages,
        } = self;
        tracing::info!(internal_event = Self::NAME, %rule, %key, %channel, %window, until = %crate::firing::rfc3339(until), messages, "Held by quiet hours.");
    }
}
