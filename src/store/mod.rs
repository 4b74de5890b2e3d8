//! What keywatch keeps in Redis: one file per structure, each with its key names, its leases,
//! its Lua (in `.lua` files beside it) and the Redis commands it sends
//! ([`crate::keyspace::commands`]). Every instance shares these structures, so they are the
//! contract between instances and between versions: the stages decide what to store and when,
//! this module how it is laid out. The structures and their keys are listed in
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.
//!
//! The stages import the store; the store imports none of them (`tests/layout.rs`).

pub(crate) mod alert_ends;
pub(crate) mod dead;
pub(crate) mod fields;
pub(crate) mod followups;
pub(crate) mod handled;
pub(crate) mod held;
pub(crate) mod history;
pub mod intake;
pub mod ledger;
pub(crate) mod links;
pub(crate) mod long_keys;
pub(crate) mod notices;
pub(crate) mod queue;
pub(crate) mod rate;
pub mod scanner;
pub(crate) mod silences;

use std::sync::OnceLock;
use std::time::Duration;

/// How long a taken job or intake record is its taker's before another instance may take it
/// over: 15 s, or `KEYWATCH_LEASE` (a duration such as `2s`) for drills and tests (see
/// `docs/development.md#drills-killing-keywatch-at-an-exact-step-and-a-host-clock-that-is-off`).
/// Read once.
pub fn lease() -> Duration {
    static LEASE: OnceLock<Duration> = OnceLock::new();
    *LEASE.get_or_init(|| lease_from(std::env::var("KEYWATCH_LEASE").ok().as_deref()))
}

/// How often a taker renews the leases of what it holds: a third of the lease, so two renewals
/// may fail before another instance takes over.
pub fn renew_every() -> Duration {
    lease() / 3
}

/// The lease in milliseconds, as the scripts take it.
pub fn lease_ms() -> i64 {
    lease().as_millis() as i64
}

/// When a lease taken at `now_ms` ends, as the queue scores it: half a millisecond past the
/// whole millisecond, where a due time is always a whole one. So a take tells a job whose lease
/// ran out (its taker died, or stalled past its renewals) from one that came due, and counts
/// the first kind (`queue::takeovers`).
pub fn lease_end(now_ms: i64) -> f64 {
    (now_ms + lease_ms()) as f64 + 0.5
}

/// Without `KEYWATCH_LEASE`.
const DEFAULT_LEASE: Duration = Duration::from_secs(15);

fn lease_from(var: Option<&str>) -> Duration {
    match var.map(str::trim).filter(|v| !v.is_empty()) {
        None => DEFAULT_LEASE,
        Some(v) => match humantime::parse_duration(v) {
            Ok(d) if !d.is_zero() => d,
            _ => {
                tracing::warn!(
                    value = v,
                    "KEYWATCH_LEASE is not a duration such as `2s`; the lease stays 15 s."
                );
                DEFAULT_LEASE
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_is_15_s_unless_the_environment_says_otherwise() {
        assert_eq!(lease_from(None), Duration::from_secs(15));
        assert_eq!(lease_from(Some("")), Duration::from_secs(15));
        assert_eq!(lease_from(Some("2s")), Duration::from_secs(2));
        assert_eq!(lease_from(Some("1500ms")), Duration::from_millis(1500));
        assert_eq!(lease_from(Some("soon")), Duration::from_secs(15));
        assert_eq!(lease_from(Some("0s")), Duration::from_secs(15));
    }
}
