//! One event, one firing, however many instances saw it.
//!
//! Every instance subscribed to the same Redis receives every keyevent. Before an event fires,
//! its instance claims it with `SET NX PX` on a key derived from the database, event, key and
//! deadline (when known — the ledger gives every instance the same one); only the instance whose
//! claim succeeds goes on. Without a known deadline the claim covers a short window, so the same
//! key deleted twice within it (5 s) counts once.

use std::time::Duration;

use crate::keyspace::Conn;
use sha2::{Digest, Sha256};

use crate::event::KeyEvent;

/// Long enough for every instance's copy of one event (and a recovery racing it) to arrive.
const WITH_DEADLINE: Duration = Duration::from_secs(600);
/// Without a deadline the claim can only tell copies apart from repeats by time.
const WITHOUT_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct Claims {
    conn: Conn,
    prefix: String,
}

impl Claims {
    pub fn new(conn: Conn, prefix: &str) -> Claims {
        Claims {
            conn,
            prefix: prefix.to_string(),
        }
    }

    fn key(&self, e: &KeyEvent) -> String {
        let mut h = Sha256::new();
        h.update(e.db.to_be_bytes());
        h.update(e.kind.as_str().as_bytes());
        h.update([0]);
        h.update((e.key.len() as u64).to_be_bytes());
        h.update(&e.key);
        if let Some(d) = e.deadline {
            h.update(d.timestamp_millis().to_be_bytes());
        }
        let digest = h.finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}claim:{hex}", self.prefix)
    }

    /// Claims each event; `true` where this instance won. On a Redis error every event counts
    /// as claimed: a duplicate is better than a loss.
    pub async fn claim(&self, events: &[&KeyEvent], instance: &str) -> Vec<bool> {
        if events.is_empty() {
            return Vec::new();
        }
        let mut pipe = redis::pipe();
        for e in events {
            let ttl = if e.deadline.is_some() {
                WITH_DEADLINE
            } else {
                WITHOUT_DEADLINE
            };
            pipe.cmd("SET")
                .arg(self.key(e))
                .arg(instance)
                .arg("NX")
                .arg("PX")
                .arg(ttl.as_millis() as u64);
        }
        match pipe
            .query_async::<Vec<Option<String>>>(&mut self.conn.clone())
            .await
        {
            Ok(v) => v.into_iter().map(|r| r.is_some()).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot claim events in Redis; handling them here (other instances may too).");
                vec![true; events.len()]
            }
        }
    }
}
