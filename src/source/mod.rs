//! Where events come from, each reporting [`Signal`]s on a channel it is given: Redis keyspace
//! notifications ([`notifications`]), checked against what the rules need ([`flags`]); the
//! deadline ledger that makes expiries punctual and recovers missed ones ([`ledger`]); the
//! scanner that warns before deadlines ([`scanner`]); flushes and swaps, which publish no
//! keyevent ([`flushes`]); on a Redis Cluster, a subscriber per
//! master that follows failovers and reshards ([`cluster`]); and with Sentinel, a subscriber
//! that follows the master ([`sentinel`]).

pub(crate) mod cluster;
pub(crate) mod fields;
pub(crate) mod flags;
pub mod flushes;
pub mod ledger;

pub mod notifications;
pub mod places;
pub mod scanner;
pub(crate) mod sentinel;

use crate::event::KeyEvent;
use ledger::Note;

/// What a keyevent says about a hash, for the field ledger (`source::fields`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    /// `hpersist`, `hdel`, `hexpired`, `del`: fields may be gone; look at the known ones.
    Check,
    /// `hexpire`: some field got a deadline; walk the hash.
    Learn,
}

/// What every source reports: the one type that flows from the sources to the engine.
#[derive(Debug)]
pub enum Signal {
    Event(KeyEvent),
    /// A keyevent that changes a key's deadline (`expire`, `persist`, `rename_*`), for the ledger.
    Deadline {
        db: u32,
        key: Vec<u8>,
        note: Note,
    },
    /// A keyevent about a hash's fields, for the field ledger (`source::fields`).
    Hash {
        db: u32,
        /// Shared by every signal naming the same long hash ([`crate::long_key::shared`]).
        key: bytes::Bytes,
        change: Change,
    },
    /// An `expiring` event from the scanner ([`crate::source::scanner`]), for the rules it
    /// names only: each rule has its own `warn_before`, and this instance claimed each warning.
    Warn {
        event: KeyEvent,
        rules: Vec<String>,
    },
    /// A message on keywatch's marker channel (see [`crate::source::ledger`]), heard on `node`.
    Marker {
        node: String,
        payload: Vec<u8>,
    },
    /// Subscribed to every channel; events flow from now on.
    Up {
        node: String,
    },
    /// The connection ended; events published until the next `Up` are lost.
    Down {
        node: String,
        reason: String,
    },
    /// The node answered `ROLE` as something other than a master (a replica, say): it is not
    /// watched, and readiness stays false, until it is one again. `reason` says what to do.
    NotMaster {
        node: String,
        reason: String,
    },
    /// The node is no longer watched: a cluster node that stopped being a master
    /// ([`crate::source::cluster`]).
    Gone {
        node: String,
    },
    /// Keys may have left databases of `node` from `since_ms` on (Redis's clock) without a
    /// keyevent: a `FLUSHDB` or `FLUSHALL`, or a `SWAPDB` when `swapped` ([`flushes`]).
    Emptied {
        node: String,
        swapped: bool,
        since_ms: i64,
    },
}
