//! The rules a running keywatch obeys right now.
//!
//! A reload swaps the whole [`Config`] at once: every reader takes one snapshot (an `Arc`) per
//! unit of work — a batch of events, one delivery attempt, one scanner run — so a unit never sees
//! half of the old rules and half of the new. Readers that must act on a change (the subscriber
//! follows the channels, the scanner its schedule) wait on [`LiveConfig::changed`].

use std::sync::Arc;

use tokio::sync::watch;

use super::model::Config;

#[derive(Clone)]
pub struct LiveConfig {
    rx: watch::Receiver<Arc<Config>>,
}

/// The one writer: only a successful reload publishes.
pub struct ConfigPublisher {
    tx: watch::Sender<Arc<Config>>,
}

impl LiveConfig {
    /// A live config and its publisher, starting from `config`.
    pub fn new(config: Config) -> (LiveConfig, ConfigPublisher) {
        let (tx, rx) = watch::channel(Arc::new(config));
        (LiveConfig { rx }, ConfigPublisher { tx })
    }

    /// Rules that never change (one-shot commands, examples, tests).
    pub fn fixed(config: Config) -> LiveConfig {
        LiveConfig::new(config).0
    }

    /// The rules in force now. Take it once per unit of work.
    pub fn current(&self) -> Arc<Config> {
        self.rx.borrow().clone()
    }

    /// Waits until a reload has published new rules since this handle last looked, and returns
    /// them; `None` once the publisher is gone (keywatch is stopping).
    pub async fn changed(&mut self) -> Option<Arc<Config>> {
        self.rx.changed().await.ok()?;
        Some(self.rx.borrow_and_update().clone())
    }
}

impl ConfigPublisher {
    pub fn publish(&self, config: Config) -> Arc<Config> {
        let config = Arc::new(config);
        self.tx.send_replace(config.clone());
        config
    }

    pub fn current(&self) -> Arc<Config> {
        self.tx.borrow().clone()
    }
}
