//! Redis's clock, as keywatch reads it.
//!
//! Deadlines come from the watched Redis (`PEXPIRETIME`), and leases, due times and digest
//! windows are shared by every instance through Redis. Compared against each host's own clock,
//! an instance whose clock runs 15 s fast takes jobs still leased to another (a duplicate) and
//! pokes keys Redis does not yet consider due (a spin). So every instance compares against one
//! clock, the watched Redis's: it learns the offset between `TIME` and its own clock (half a
//! round trip of error) and adds it to every reading.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

/// Redis's clock minus the host's, in µs, as last learnt. Kept in µs: cut to whole
/// milliseconds on both sides before halving the round trip, the reading was up to a
/// millisecond off, and an expiry came out observed before its deadline.
static OFFSET_US: AtomicI64 = AtomicI64::new(0);

/// How often the offset is learnt again: host clocks drift, and NTP steps them.
const RELEARN_EVERY: Duration = Duration::from_secs(30);

/// An offset beyond this is worth a warning: something on this host or Redis's is off.
const WORTH_A_WARNING_MS: i64 = 1000;

/// Now, in Redis's clock (unix ms).
pub fn now_ms() -> i64 {
    // Whole milliseconds as Redis counts them (`mstime`): the µs floored.
    now_us().div_euclid(1000)
}

/// Now, in Redis's clock.
pub fn now() -> DateTime<Utc> {
    DateTime::from_timestamp_millis(now_ms()).unwrap_or_else(Utc::now)
}

/// Now, in Redis's clock (unix µs, to the host clock's precision): when to wake for a deadline.
pub fn now_us() -> i64 {
    host_us().saturating_add(OFFSET_US.load(Ordering::Relaxed))
}

fn host_us() -> i64 {
    Utc::now().timestamp_micros()
}

/// Reads `TIME` once and sets the offset from it; returns the offset in ms (rounded).
pub async fn learn(conn: &mut impl redis::aio::ConnectionLike) -> redis::RedisResult<i64> {
    let before = host_us();
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    let after = host_us();
    let offset = secs * 1_000_000 + micros - before.midpoint(after);
    OFFSET_US.store(offset, Ordering::Relaxed);
    Ok((offset as f64 / 1000.0).round() as i64)
}

/// Learns the offset now and every [`RELEARN_EVERY`] until `stop`; says so when it is large.
pub async fn follow(mut conn: crate::keyspace::Conn, stop: CancellationToken) {
    let mut warned = false;
    loop {
        match learn(&mut conn).await {
            Ok(offset) if offset.abs() > WORTH_A_WARNING_MS && !warned => {
                warned = true;
                crate::internal_events::ClockOffset { offset_ms: offset }.emit();
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "Cannot read Redis's clock; keeping the last offset.")
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RELEARN_EVERY) => {}
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands reading Redis's clock send ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "time", "Redis's clock for deadlines and leases"),
    ]
}
