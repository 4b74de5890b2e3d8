//! The keyevent subscriber of one Redis node: `expired`, `evicted` and `del` as they happen.
//!
//! It runs on a dedicated connection (a subscribed connection counts as "pubsub" for Redis's
//! output-buffer limit, so command replies must not share it), pings it every second so a dead
//! connection is noticed within seconds even when no event flows, and reconnects with backoff
//! (500 ms doubling to 30 s, reset only after a minute of health, as Vector's Redis source does).
//! Pub/sub is at-most-once: every `Down` tells downstream that events may have been lost.

use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::event::{EventKind, KeyEvent};

/// What a subscriber reports.
#[derive(Debug)]
pub enum Signal {
    Event(KeyEvent),
    /// Subscribed to every channel; events flow from now on.
    Up {
        node: String,
    },
    /// The connection ended; events published until the next `Up` are lost.
    Down {
        node: String,
        reason: String,
    },
}

/// The keyevent channels for `kinds` in `dbs`: `__keyevent@0__:expired`, …
pub fn channels(dbs: &[u32], kinds: &[EventKind]) -> Vec<String> {
    let mut out = Vec::new();
    for db in dbs {
        for k in kinds {
            if let Some(ev) = k.redis_event() {
                out.push(format!("__keyevent@{db}__:{ev}"));
            }
        }
    }
    out
}

/// `__keyevent@3__:expired` → (3, Expired).
pub fn parse_channel(channel: &str) -> Option<(u32, EventKind)> {
    let rest = channel.strip_prefix("__keyevent@")?;
    let (db, ev) = rest.split_once("__:")?;
    let kind = match ev {
        "expired" => EventKind::Expired,
        "evicted" => EventKind::Evicted,
        "del" => EventKind::Deleted,
        _ => return None,
    };
    Some((db.parse().ok()?, kind))
}

#[derive(Clone, Debug)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
    /// Connected this long without trouble, the next failure starts again from `min`.
    pub healthy_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            min: Duration::from_millis(500),
            max: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
        }
    }
}

const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(3);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Subscribes to `channels` on `client`'s node until `shutdown`, sending what happens to `tx`.
pub async fn subscribe(
    client: redis::Client,
    node: String,
    channels: Vec<String>,
    tx: mpsc::Sender<Signal>,
    backoff: Backoff,
    shutdown: CancellationToken,
) {
    let mut delay = backoff.min;
    loop {
        let started = Instant::now();
        let reason = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            r = session(&client, &node, &channels, &tx, &shutdown) => r,
        };
        let Some(reason) = reason else { return };
        tracing::warn!(%node, %reason, "Subscriber connection ended; reconnecting.");
        if tx
            .send(Signal::Down {
                node: node.clone(),
                reason,
            })
            .await
            .is_err()
        {
            return;
        }
        if started.elapsed() >= backoff.healthy_after {
            delay = backoff.min;
        }
        // Full jitter keeps several instances from reconnecting in lockstep after a restart.
        let sleep = delay.mul_f64(0.5 + fastrand::f64() * 0.5);
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(sleep) => {}
        }
        delay = (delay * 2).min(backoff.max);
    }
}

/// One connection's life. `None` when shutdown asked to stop, else why it ended.
async fn session(
    client: &redis::Client,
    node: &str,
    channels: &[String],
    tx: &mpsc::Sender<Signal>,
    shutdown: &CancellationToken,
) -> Option<String> {
    let pubsub = match tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub()).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Some(format!("cannot connect: {e}")),
        Err(_) => {
            return Some(format!(
                "cannot connect within {}s",
                CONNECT_TIMEOUT.as_secs()
            ));
        }
    };
    let (mut sink, mut stream) = pubsub.split();
    for ch in channels {
        match tokio::time::timeout(CONNECT_TIMEOUT, sink.subscribe(ch)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Some(format!("SUBSCRIBE {ch} failed: {e}")),
            Err(_) => return Some(format!("SUBSCRIBE {ch} timed out")),
        }
    }
    tracing::info!(%node, channels = channels.len(), "Subscribed to keyspace events.");
    if tx
        .send(Signal::Up {
            node: node.to_string(),
        })
        .await
        .is_err()
    {
        return None;
    }
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            msg = stream.next() => {
                let Some(msg) = msg else { return Some("connection closed by the server".into()) };
                let Some((db, kind)) = parse_channel(msg.get_channel_name()) else { continue };
                let event = KeyEvent {
                    kind,
                    db,
                    key: msg.get_payload_bytes().to_vec(),
                    observed_at: Utc::now(),
                    deadline: None,
                    ttl_ms: None,
                    recovered: false,
                    source: node.to_string(),
                };
                if tx.send(Signal::Event(event)).await.is_err() {
                    return None;
                }
            }
            _ = ping.tick() => {
                match tokio::time::timeout(PING_TIMEOUT, sink.ping::<()>()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Some(format!("PING failed: {e}")),
                    Err(_) => return Some(format!("no answer to PING within {}s", PING_TIMEOUT.as_secs())),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_round_trip() {
        let ch = channels(
            &[0, 3],
            &[EventKind::Expired, EventKind::Deleted, EventKind::Expiring],
        );
        assert_eq!(
            ch,
            [
                "__keyevent@0__:expired",
                "__keyevent@0__:del",
                "__keyevent@3__:expired",
                "__keyevent@3__:del"
            ]
        );
        assert_eq!(
            parse_channel("__keyevent@3__:del"),
            Some((3, EventKind::Deleted))
        );
        assert_eq!(
            parse_channel("__keyevent@0__:evicted"),
            Some((0, EventKind::Evicted))
        );
        assert_eq!(parse_channel("__keyevent@0__:set"), None);
        assert_eq!(parse_channel("other"), None);
    }
}
