//! What every channel is to the rest of keywatch: the settings all channels share, and its
//! integration behind one small trait.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::outcome::Outcome;
use crate::template::{Escape, TemplateId};
use crate::yaml::diagnostic::Loc;

use super::fields::Fields;
use super::http::{self, Answer, Request};
use super::message::Message;

/// One `type` of channel: what the rule files may say about it and how that is decoded.
pub struct Kind {
    /// The `type` value that selects it.
    pub name: &'static str,
    /// Its fields beyond the ones every channel takes (`type`, `rate`, `timeout`,
    /// `concurrency`, `keyword`);
    /// also used to explain a field written on a channel of another type.
    pub fields: &'static [&'static str],
    /// The `rate` it gets when none is written (docs/rules.md): what the service tolerates per robot.
    pub default_rate: Option<Rate>,
    /// A URL of the right shape, for the error that rejects a malformed one.
    pub example_url: &'static str,
    /// Reads the fields into the integration; `None` after reporting what was wrong.
    pub decode: fn(&mut Fields<'_, '_>) -> Option<Arc<dyn Integration>>,
}

/// One chat service or webhook, with its settings as the rule files gave them.
pub trait Integration: fmt::Debug + Send + Sync {
    /// How values are escaped in this channel's messages.
    fn escape(&self) -> Escape;

    /// Where messages go, as `explain` and `send-test` may show it (no token).
    fn target(&self) -> String;

    /// What sending `msg` at `now` takes (signatures depend on the time): the request to send,
    /// an exchange over the integration's own protocol, or, for a channel that needs none, the
    /// message handled here and now.
    fn dispatch(&self, ch: &Channel, msg: &Message, now: DateTime<Utc>) -> Dispatch;

    /// The most bytes of a key (and of each capture and a field) its messages show: a longer
    /// one is shown by its cut view, its first bytes then its length and a short hash
    /// ([`crate::long_key::view`]), so that a message stays within the service's limit whatever
    /// the key (docs/reliability.md#bounded-whatever-the-key). The default leaves room for a
    /// title, a message and the links within the tightest chat limits.
    fn key_limit(&self) -> usize {
        DEFAULT_KEY_LIMIT
    }

    /// Whether its messages can mention people by mobile number (a rule's `mention.mobiles`).
    fn mentions_mobiles(&self) -> bool {
        false
    }

    /// Whether its messages carry the acknowledge and silence links as buttons
    /// ([`Message::links`]) rather than at the end of the text.
    fn links_as_buttons(&self) -> bool {
        false
    }

    /// Whether it takes digests (a rule's `group`, a merged backlog); one that does not gets
    /// each event on its own and `check` refuses `group` on it.
    fn takes_digests(&self) -> bool {
        true
    }

    /// What the answer to a request means: sent, worth retrying, or never going to work.
    fn judge(&self, _ch: &Channel, answer: &Answer) -> Outcome {
        http::judge_status(answer)
    }

    /// Whether the alerts sent through this channel stay open at the receiver until they are
    /// closed (Alertmanager, PagerDuty). A rule's `resolved` then reaches this channel from
    /// `notify.to` (and `escalate.to`) whether or not `resolved.to` lists it, and its resolved
    /// notice ([`Message::followup`]) closes the alert instead of telling people
    /// (README.md#follow-ups, docs/rules.md#pagerduty).
    fn closes_on_resolved(&self) -> bool {
        false
    }

    /// The channel as an Alertmanager, whose alerts are jobs of their own (one per URL,
    /// posted again while they fire: `action::alert`); `None` for every other integration.
    fn alertmanager(&self) -> Option<&super::alert::Alertmanager> {
        None
    }
}

/// What delivering one message takes.
pub enum Dispatch {
    /// An HTTP request, whose answer the integration then judges.
    Request(Request),
    /// An exchange over another protocol (SMTP), run and judged by the integration itself.
    Exchange(Exchange),
    /// Nothing to send: the message was handled in-process (the log).
    Done(Outcome),
}

/// A send over an integration's own protocol: it owns everything it needs and resolves to the
/// outcome, bounded by the channel's `timeout`.
pub type Exchange = futures_util::future::BoxFuture<'static, Outcome>;

/// [`Integration::key_limit`] unless an integration says otherwise.
pub const DEFAULT_KEY_LIMIT: usize = 1_024;

/// Requests in flight at once per channel, and per `reload` or `exec` rule, when the rule files
/// do not say (docs/rules.md).
pub const DEFAULT_CONCURRENCY: usize = 16;

/// The most `concurrency` may say: each request in flight holds a connection (or a process).
pub const MAX_CONCURRENCY: u64 = 10_000;

/// A token bucket: up to `burst` at once, refilled evenly over `per`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub burst: u32,
    pub per: Duration,
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.burst, humantime::format_duration(self.per))
    }
}

/// A channel of the rule files.
#[derive(Clone, Debug)]
pub struct Channel {
    pub name: String,
    pub loc: Loc,
    /// The `type` it was declared with.
    pub kind: &'static Kind,
    pub integration: Arc<dyn Integration>,
    /// `None`: no limit (webhooks and the log).
    pub rate: Option<Rate>,
    pub timeout: Duration,
    /// Requests to this channel in flight at once on one instance; a storm's other notifications
    /// wait in the queue (docs/reliability.md#guarantees: bounded connections under any storm).
    pub concurrency: usize,
    /// Put in every message, for robots with keyword security.
    pub keyword: Option<String>,
    /// A custom body template instead of the integration's own payload (webhooks only),
    /// compiled with the rules' templates after decoding.
    pub body: Option<TemplateId>,
    /// Fields of the integration that are templates (PagerDuty's `severity`), by field name,
    /// rendered per message into [`Message::channel_fields`].
    pub templates: Vec<(&'static str, TemplateId)>,
    /// `quiet`: the quiet hours during which its messages are held, and how they are released
    /// (docs/rules.md#quiet-hours).
    pub quiet: Option<crate::quiet_hours::Quiet>,
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
impl Channel {
    /// A channel as the rule files would give it with only `type` written (its defaults), for
    /// the integrations' unit tests.
    pub fn for_test(name: &str, kind: &'static Kind, integration: Arc<dyn Integration>) -> Channel {
        Channel {
            name: name.into(),
            loc: Loc::new(&Arc::from(std::path::Path::new("rules.yaml")), 1, 1),
            kind,
            integration,
            rate: kind.default_rate,
            timeout: Duration::from_secs(10),
            concurrency: DEFAULT_CONCURRENCY,
            keyword: None,
            body: None,
            templates: Vec::new(),
            quiet: None,
        }
    }
}

impl Channel {
    /// How values are escaped in this channel's messages.
    pub fn escape(&self) -> Escape {
        self.integration.escape()
    }
}
