//! What every action needs, in one value handed to each attempt.

use crate::config::{Config, LiveConfig};
use crate::keyspace::Keyspace;
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
    /// The turns of firings of long keys ([`crate::long_key::AT_ONCE`]), shared by every clone.
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
            long_keys: Arc::new(tokio::sync::Semaphore::new(crate::long_key::AT_ONCE)),
        }
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
