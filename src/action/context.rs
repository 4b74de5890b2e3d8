//! What every action needs, in one value handed to each attempt.

use crate::config::{Config, LiveConfig};
use crate::firing::Firing;
use crate::keyspace::Keyspace;
use crate::template::Context;
use chrono::{DateTime, Utc};
use std::sync::Arc;

/// What every action needs: the rules, an HTTP client, and the watched Redis.
#[derive(Clone)]
pub struct ActionContext {
    /// One snapshot of the rules: a rule, its channel and the templates they point at must come
    /// from the same reload, so an attempt works on [`ActionContext::refreshed`] throughout.
    pub config: Arc<Config>,
    pub live: LiveConfig,
    pub http: reqwest::Client,
    pub keyspace: Keyspace,
    /// keywatch's state, where follow-ups read acknowledgements; `None` in tests without it.
    pub state: Option<crate::keyspace::Conn>,
    /// The moment actions render at: `None` is the real clock; `keywatch test` sets the
    /// moment each rendered action would happen (docs/rules.md#testing-rules).
    at: Option<DateTime<Utc>>,
    /// The bytes of long keys attempts may hold at once, in KiB ([`crate::long_key::AT_ONCE`]),
    /// shared by every clone.
    pub long_keys: Arc<tokio::sync::Semaphore>,
}

impl ActionContext {
    pub fn new(live: LiveConfig, http: reqwest::Client, keyspace: Keyspace) -> ActionContext {
        ActionContext {
            config: live.current(),
            live,
            http,
            keyspace,
            state: None,
            at: None,
            long_keys: Arc::new(tokio::sync::Semaphore::new(crate::long_key::AT_ONCE / 1024)),
        }
    }

    /// These actions rendering at `at` instead of now: templates read it as `now`, and a
    /// follow-up's `gap` runs to it. For `keywatch test`, which renders what would happen later.
    pub fn at(mut self, at: DateTime<Utc>) -> ActionContext {
        self.at = Some(at);
        self
    }

    /// Now, in Redis's clock (or the moment set with [`ActionContext::at`]).
    pub fn now(&self) -> DateTime<Utc> {
        self.at.unwrap_or_else(crate::keyspace::clock::now)
    }

    /// The template context of `firing` for these actions.
    pub fn context_of(&self, firing: &Firing) -> Context {
        match self.at {
            None => firing.context(),
            Some(at) => firing.context().at(at),
        }
    }

    /// Actions under the rules of `yaml` (which must load as `mode` loads them), with a watched
    /// Redis that is named but never reached: for unit tests that render.
    #[cfg(test)]
    pub(crate) fn of_yaml(yaml: &str, mode: crate::config::Mode) -> ActionContext {
        let config = crate::config::of_yaml(yaml, mode);
        let keyspace = Keyspace::new(
            crate::yaml::Secret::new("redis://127.0.0.1:1"),
            config.redis.clone(),
        )
        .expect("a plain URL");
        ActionContext::new(
            LiveConfig::fixed(config),
            crate::channel::http::client(),
            keyspace,
        )
    }

    /// These actions with keywatch's state at hand (follow-ups read acknowledgements there).
    pub fn with_state(mut self, state: crate::keyspace::Conn) -> ActionContext {
        self.state = Some(state);
        self
    }

    /// These actions with the rules in force now; take it once per attempt or digest.
    pub fn refreshed(&self) -> ActionContext {
        ActionContext {
            config: self.live.current(),
            ..self.clone()
        }
    }
}
