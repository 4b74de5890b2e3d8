//! Following a Redis Cluster: one keyevent subscriber per master, kept in step with failovers,
//! nodes added or removed, and slots moved.
//!
//! Keyspace events are published only on the master that owns the key, so a subscriber per
//! master is the only way to hear them all. The masters are read again every
//! [`REDISCOVER_EVERY`], and at once when a subscriber loses its node (the engine calls
//! [`Keyspace::suspect`]): a replica promoted by a failover gets a subscriber within seconds.
//! Expiries published in between are lost to pub/sub; the ledger recovers those of keys with
//! known deadlines.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::source::Signal;
use crate::source::notifications::Watcher;

/// How often the masters are read again when nothing went wrong.
pub const REDISCOVER_EVERY: Duration = Duration::from_secs(5);
/// After a subscriber lost its node, the cluster needs a moment to promote a replica.
const AFTER_SUSPECT: Duration = Duration::from_millis(500);

/// Subscribes to `channels` on every master until `shutdown`, each subscriber following the
/// channels' changes (a reload) on its own connection; what the subscribers hear goes to `tx`,
/// plus [`Signal::Gone`] for a node that stopped being a master. `watching` is told of each
/// master before its subscriber starts, so that readiness waits for it.
pub async fn follow(
    keyspace: Keyspace,
    channels: watch::Receiver<Vec<String>>,
    tx: mpsc::Sender<Signal>,
    watching: impl Fn(&str),
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let mut watched: BTreeMap<String, Watcher> = BTreeMap::new();
    let mut tick = tokio::time::interval(REDISCOVER_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The first discovery ran at start-up (`command::run::run`); begin with its answer.
    let mut masters = Some(keyspace.masters());
    loop {
        let current = match masters.take() {
            Some(m) => Ok(m),
            None => keyspace.discover().await,
        };
        match current {
            Ok(masters) if !masters.is_empty() => {
                for m in &masters {
                    if watched.contains_key(&m.addr) {
                        continue;
                    }
                    let client = match keyspace.client_for(&m.addr) {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::error!(node = %m.addr, error = %e, "Cannot make a client for a cluster master.");
                            continue;
                        }
                    };
                    tracing::info!(node = %m.addr, id = %m.id, "Cluster: watching a master.");
                    watching(&m.addr);
                    // Also with no channel at all (only `expiring` rules): a reload may add some.
                    metrics.subscriber(&m.addr, false);
                    let w = Watcher::spawn(
                        client,
                        &m.addr,
                        channels.clone(),
                        tx.clone(),
                        metrics.clone(),
                        &shutdown,
                    );
                    watched.insert(m.addr.clone(), w);
                }
                let gone: Vec<String> = watched
                    .keys()
                    .filter(|a| !masters.iter().any(|m| &m.addr == *a))
                    .cloned()
                    .collect();
                for node in gone {
                    if let Some(w) = watched.remove(&node) {
                        w.end().await;
                    }
                    tracing::info!(%node, "Cluster: no longer a master serving slots; stopped watching it.");
                    if tx.send(Signal::Gone { node }).await.is_err() {
                        return;
                    }
                }
            }
            Ok(_) => tracing::warn!("Cluster: no master serves slots; keeping the subscribers."),
            Err(e) => {
                tracing::warn!(error = %e, "Cluster: cannot read the masters; keeping the subscribers.")
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
            _ = keyspace.suspected() => {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(AFTER_SUSPECT) => {}
                }
            }
        }
    }
    for (_, w) in watched {
        w.end().await;
    }
}
