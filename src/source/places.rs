//! Where an event lies in a node's stream of keyevents, the same for every instance that hears
//! it: how events without a deadline are told apart (docs/how-it-works.md#events-without-a-deadline).
//!
//! A `del`, an `evicted`, an `expired` the ledger did not know carry nothing Redis keeps that
//! would name them: two instances that hear one `del` must claim it under one name, and a key
//! deleted again must get another. Pub/sub keeps order, and every subscriber of a node reads the
//! same messages in the same order. So subscribers publish *marks* (a message on keywatch's
//! marker channel, `place:` and a random nonce): an event's place is the last mark before it
//! and how many events of the same kind, database and key came since that mark, itself
//! included. Every instance that heard the mark counts the same, however late it reads the
//! stream, whichever other channels it listens to.
//!
//! A subscriber publishes a mark once subscribed (and is up only once it hears a mark), after
//! it changed its channels, and when [`MARK_AFTER`] events were placed under one mark, which
//! bounds what it counts. Until a session heard its first mark, and for events of a channel
//! subscribed since the last mark, an event has no place: it is claimed for a few seconds by
//! name, as before.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::event::{EventKind, KeyEvent, Place};

/// What starts a mark's payload: other messages on the marker channel (the ledger's markers,
/// notices) are not marks.
const MARK: &[u8] = b"place:";

/// Events placed under one mark before the subscriber asks for the next: the counts are what
/// it keeps meanwhile, and a claim hash holds about as many fields.
pub const MARK_AFTER: u32 = 4096;

/// A mark's payload: unique, so that no two marks are taken for one.
pub fn mark_payload(node: &str) -> String {
    format!("place:{node}:{:016x}", fastrand::u64(..))
}

/// Events placed under one mark at most: past that without a mark heard (marks cannot be
/// published), events go unplaced until the next one, so the counts stay bounded.
const PLACED_AT_MOST: u32 = 4 * MARK_AFTER;

/// One session's count of events since the last mark.
#[derive(Debug, Default)]
pub struct Places {
    mark: Option<Arc<str>>,
    counts: HashMap<(EventKind, u32, u64), u32>,
    placed: u32,
    /// Channels subscribed since the last mark: their events before the next one have no place
    /// (what came on them since the mark was not counted here).
    fresh: Vec<String>,
    /// How many events were placed when a mark was last asked for, if one was since the last
    /// mark heard: asked again only [`MARK_AFTER`] events later (a publish that failed).
    asked_at: Option<u32>,
}

impl Places {
    /// A message on the marker channel: a mark starts counting anew. Returns whether it was one.
    pub fn heard(&mut self, payload: &[u8]) -> bool {
        if !payload.starts_with(MARK) {
            return false;
        }
        let digest = Sha256::digest(payload);
        self.mark = Some(hex::encode(&digest[..8]).into());
        self.counts.clear();
        self.placed = 0;
        self.fresh.clear();
        self.asked_at = None;
        true
    }

    /// `channels` were just subscribed: their events are not placed until the next mark.
    pub fn subscribed(&mut self, channels: impl IntoIterator<Item = String>) {
        self.fresh.extend(channels);
    }

    /// Places `event`, read on `channel`; for the kinds that may come without a deadline only.
    pub fn place(&mut self, channel: &str, event: &mut KeyEvent) {
        if !matches!(
            event.kind,
            EventKind::Expired | EventKind::Evicted | EventKind::Deleted
        ) {
            return;
        }
        if self.placed >= PLACED_AT_MOST {
            self.mark = None;
            self.counts.clear();
        }
        let Some(mark) = &self.mark else { return };
        if self.fresh.iter().any(|c| c == channel) {
            return;
        }
        // By a hash of the key, not the key: a long key is not kept for as long as the mark
        // lasts. Two keys of one hash share a count, alike on every instance.
        let hash = crate::store::ledger::far_hash(&event.key);
        let n = self.counts.entry((event.kind, event.db, hash)).or_default();
        *n += 1;
        self.placed += 1;
        event.place = Some(Place {
            mark: mark.clone(),
            n: *n,
        });
    }

    /// Whether to ask for a mark now (noted as asked): enough events were placed under this one,
    /// or channels were subscribed since, and none was asked for in the last [`MARK_AFTER`]
    /// events.
    pub fn ask(&mut self) -> bool {
        let due = self.placed >= MARK_AFTER || !self.fresh.is_empty();
        let again = self
            .asked_at
            .is_none_or(|at| self.placed >= at + MARK_AFTER);
        if due && again {
            self.asked_at = Some(self.placed);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind, key: &str) -> KeyEvent {
        KeyEvent {
            kind,
            db: 0,
            key: bytes::Bytes::copy_from_slice(key.as_bytes()),
            field: None,
            observed_at: chrono::Utc::now(),
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: "n".into(),
            place: None,
        }
    }

    fn placed(p: &mut Places, channel: &str, kind: EventKind, key: &str) -> Option<String> {
        let mut e = event(kind, key);
        p.place(channel, &mut e);
        e.place.map(|p| p.to_string())
    }

    #[test]
    fn events_are_numbered_per_key_since_the_last_mark() {
        let mut p = Places::default();
        let del = "__keyevent@0__:del";
        assert_eq!(placed(&mut p, del, EventKind::Deleted, "a"), None);
        assert!(!p.heard(b"keywatch-1:0:7"), "a ledger marker is no mark");
        assert!(p.heard(b"place:n:1"));
        let a1 = placed(&mut p, del, EventKind::Deleted, "a").unwrap();
        let b1 = placed(&mut p, del, EventKind::Deleted, "b").unwrap();
        let a2 = placed(&mut p, del, EventKind::Deleted, "a").unwrap();
        assert!(a1.ends_with(":1") && b1.ends_with(":1") && a2.ends_with(":2"));
        assert_eq!(a1.split(':').next(), a2.split(':').next());
        // Another kind of the same key counts apart.
        let e1 = placed(&mut p, "__keyevent@0__:expired", EventKind::Expired, "a").unwrap();
        assert!(e1.ends_with(":1"));
        // A later instance that heard only the second mark agrees with this one from there.
        assert!(p.heard(b"place:n:2"));
        let mut late = Places::default();
        assert!(late.heard(b"place:n:2"));
        assert_eq!(
            placed(&mut p, del, EventKind::Deleted, "a"),
            placed(&mut late, del, EventKind::Deleted, "a")
        );
        assert_ne!(placed(&mut p, del, EventKind::Deleted, "a"), Some(a2));
    }

    #[test]
    fn a_channel_subscribed_since_the_mark_waits_for_the_next() {
        let mut p = Places::default();
        assert!(p.heard(b"place:n:1"));
        assert!(!p.ask());
        p.subscribed(["__keyevent@0__:evicted".to_string()]);
        assert!(p.ask(), "a new channel asks for a mark");
        assert!(!p.ask(), "once");
        assert_eq!(
            placed(&mut p, "__keyevent@0__:evicted", EventKind::Evicted, "a"),
            None
        );
        assert!(placed(&mut p, "__keyevent@0__:del", EventKind::Deleted, "a").is_some());
        assert!(p.heard(b"place:n:2"));
        assert!(placed(&mut p, "__keyevent@0__:evicted", EventKind::Evicted, "a").is_some());
    }

    #[test]
    fn a_mark_is_asked_for_after_many_events() {
        let mut p = Places::default();
        assert!(p.heard(b"place:n:1"));
        for i in 0..MARK_AFTER {
            assert!(!p.ask());
            placed(&mut p, "c", EventKind::Deleted, &i.to_string());
        }
        assert!(p.ask());
        for i in 0..MARK_AFTER {
            assert!(!p.ask(), "not again until {MARK_AFTER} more");
            placed(&mut p, "c", EventKind::Deleted, &i.to_string());
        }
        assert!(p.ask(), "again: the publish may have failed");
        // No mark ever heard: past a bound, events go unplaced and nothing more is counted.
        for i in 0..2 * MARK_AFTER {
            placed(&mut p, "c", EventKind::Deleted, &i.to_string());
        }
        assert_eq!(placed(&mut p, "c", EventKind::Deleted, "x"), None);
        assert!(p.counts.is_empty());
    }
}
