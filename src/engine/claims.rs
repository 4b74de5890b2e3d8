//! One event, one firing, however many instances saw it.
//!
//! Every instance subscribed to the same Redis receives every keyevent. Before an event fires,
//! its instance claims it on a name derived from the database, event, key and deadline (when
//! known — the ledger gives every instance the same one); only the instance whose claim
//! succeeds goes on.
//!
//! An event with a known deadline is claimed as a field of a hash shared by every deadline in
//! the same minute (`HSETNX`, one script per batch), which Redis drops ten minutes after that
//! minute ends. Each minute's claims are spread over [`SHARDS`] hashes by their name, so that
//! dropping the hashes of a storm's minute (a delete blocks Redis for as long as it takes,
//! unless `lazyfree-lazy-expire` is on) stays short. A key of its own per claim (`SET NX PX`)
//! would make Redis publish an `expire` event for every claim to every subscriber — in a mass
//! expiry as many again as the expiries themselves, all of it work for a Redis that is busy
//! expiring. Without a known deadline the claim can only tell copies apart from repeats by time:
//! a key of its own that lives 5 s, so the same key deleted twice within it counts once.

use std::time::Duration;

use crate::keyspace::Conn;
use sha2::{Digest, Sha256};

use crate::event::KeyEvent;

/// Long enough for every instance's copy of one event (and a recovery racing it) to arrive.
const WITH_DEADLINE: Duration = Duration::from_secs(600);
/// Without a deadline the claim can only tell copies apart from repeats by time.
const WITHOUT_DEADLINE: Duration = Duration::from_secs(5);
/// Deadlines whose claims share one hash.
const BUCKET_MS: i64 = 60_000;
/// Hashes per minute of deadlines: a million expiries in one minute make sixteen hashes of
/// about 62,500 fields each.
const SHARDS: usize = 16;

/// Claims events with deadlines: `HSETNX` per event, and each hash kept until
/// `ARGV[2i + 1]` (set only when that is later than what it has: one `expire` event per bucket
/// and minute, not per claim). Returns 1 where this instance won.
const CLAIM_DEADLINES: &str = r"
local out = {}
local kept = {}
for i = 1, #KEYS do
  local k = KEYS[i]
  out[i] = redis.call('HSETNX', k, ARGV[2 * i], ARGV[1])
  if not kept[k] then
    kept[k] = true
    local until_ms = tonumber(ARGV[2 * i + 1])
    if redis.call('PEXPIRETIME', k) < until_ms then
      redis.call('PEXPIREAT', k, until_ms)
    end
  end
end
return out
";

/// The hash holding the claim `id` of a deadline in `deadline_ms`'s minute, and until when it
/// is kept: ten minutes after that minute ends, or after the minute after `now_ms` for a
/// deadline long past (a recovery), rounded to minutes so that it rarely moves.
fn bucket(prefix: &str, id: &str, deadline_ms: i64, now_ms: i64) -> (String, i64) {
    let b = deadline_ms.div_euclid(BUCKET_MS);
    let now_b = now_ms.div_euclid(BUCKET_MS);
    let until = (b.max(now_b) + 1) * BUCKET_MS + WITH_DEADLINE.as_millis() as i64;
    // The id is hex: its first digit picks one of 16 shards.
    let shard = usize::from_str_radix(&id[..1], 16).unwrap_or(0) % SHARDS;
    (format!("{prefix}claims:{b}:{shard:x}"), until)
}

#[derive(Clone)]
pub struct Claims {
    conn: Conn,
    prefix: String,
    script: std::sync::Arc<redis::Script>,
}

impl Claims {
    pub fn new(conn: Conn, prefix: &str) -> Claims {
        Claims {
            conn,
            prefix: prefix.to_string(),
            script: std::sync::Arc::new(redis::Script::new(CLAIM_DEADLINES)),
        }
    }

    /// The event's name in claims: 128 bits of SHA-256, so that huge keys make small claims.
    fn id(e: &KeyEvent) -> String {
        let mut h = Sha256::new();
        h.update(e.db.to_be_bytes());
        h.update(e.kind.as_str().as_bytes());
        h.update([0]);
        h.update((e.key.len() as u64).to_be_bytes());
        h.update(&e.key);
        if let Some(d) = e.deadline {
            h.update(d.timestamp_millis().to_be_bytes());
        }
        hex::encode(&h.finalize()[..16])
    }

    fn key(&self, e: &KeyEvent) -> String {
        format!("{}claim:{}", self.prefix, Self::id(e))
    }

    /// Claims each event; `true` where this instance won. On a Redis error every event counts
    /// as claimed: a duplicate is better than a loss.
    pub async fn claim(&self, events: &[&KeyEvent], instance: &str) -> Vec<bool> {
        let mut timed = Vec::new();
        let mut untimed = Vec::new();
        for (i, e) in events.iter().enumerate() {
            match e.deadline {
                Some(d) => timed.push((i, d.timestamp_millis())),
                None => untimed.push(i),
            }
        }
        let (a, b) = tokio::join!(
            self.claim_deadlines(events, &timed, instance),
            self.claim_for_a_while(events, &untimed, instance)
        );
        let mut won = vec![true; events.len()];
        let timed = timed.into_iter().map(|(i, _)| i).collect();
        for (which, result) in [(timed, a), (untimed, b)] {
            match result {
                Ok(w) => which.into_iter().zip(w).for_each(|(i, w)| won[i] = w),
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot claim events in Redis; handling them here (other instances may too).")
                }
            }
        }
        won
    }

    /// Claims `(index, deadline ms)` of `events` in the hashes of their deadlines' minutes.
    async fn claim_deadlines(
        &self,
        events: &[&KeyEvent],
        which: &[(usize, i64)],
        me: &str,
    ) -> redis::RedisResult<Vec<bool>> {
        if which.is_empty() {
            return Ok(Vec::new());
        }
        let now = chrono::Utc::now().timestamp_millis();
        let mut inv = self.script.prepare_invoke();
        inv.arg(me);
        for &(i, deadline) in which {
            let id = Self::id(events[i]);
            let (key, until) = bucket(&self.prefix, &id, deadline, now);
            inv.key(key).arg(id).arg(until);
        }
        let won: Vec<i64> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(won.into_iter().map(|r| r == 1).collect())
    }

    /// Claims `which` of `events` for [`WITHOUT_DEADLINE`], a key each.
    async fn claim_for_a_while(
        &self,
        events: &[&KeyEvent],
        which: &[usize],
        me: &str,
    ) -> redis::RedisResult<Vec<bool>> {
        if which.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for &i in which {
            pipe.cmd("SET")
                .arg(self.key(events[i]))
                .arg(me)
                .arg("NX")
                .arg("PX")
                .arg(WITHOUT_DEADLINE.as_millis() as u64);
        }
        let won: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(won.into_iter().map(|r| r.is_some()).collect())
    }
}

crate::keyspace::commands::declare! {
    /// The commands claims send, their script's included ([`crate::keyspace::commands`]).
    const WHY = "claims: one firing per event";
    const SCRIPT = "claims: one firing per event (script)";
    [
        Use::new(Conn::State, "set", WHY)
            .on(Keys::State("claim:*"), Access::Write)
            .args("{key} 1 NX PX 1000"),
        Use::new(Conn::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Conn::State, "evalsha", WHY)
            .on(Keys::State("claims:*:*"), Access::ReadWrite)
            .args("{sha} 1 {key} 1 id 1000"),
        Use::new(Conn::State, "hsetnx", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Write)
            .args("{key} id 1"),
        Use::new(Conn::State, "pexpiretime", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Read)
            .args("{key}"),
        Use::new(Conn::State, "pexpireat", SCRIPT)
            .on(Keys::State("claims:*:*"), Access::Write)
            .args("{key} 1000"),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minute_of_deadlines_shares_a_hash_kept_ten_minutes_past_it() {
        let (k, until) = bucket("p:", "a1", 120_000, 100_000);
        assert_eq!(k, "p:claims:2:a");
        assert_eq!(until, 180_000 + 600_000);
        let (k2, _) = bucket("p:", "a9", 179_999, 100_000);
        assert_eq!(k2, k);
        assert_ne!(bucket("p:", "a1", 180_000, 100_000).0, k);
    }

    #[test]
    fn a_deadline_long_past_is_kept_from_now_on() {
        // A recovery an hour late: its hash must not be dropped as soon as it is written.
        let now = 10 * 3_600_000 + 12_345;
        let (_, until) = bucket("p:", "0", now - 3_600_000, now);
        assert!(until >= now + 600_000, "{until}");
    }

    #[test]
    fn deadlines_before_1970_do_not_share_a_bucket_with_zero() {
        assert_eq!(bucket("p:", "f", -1, 0).0, "p:claims:-1:f");
    }

    #[test]
    fn a_minute_of_claims_is_spread_over_sixteen_hashes() {
        let shards: std::collections::BTreeSet<String> = (0..1000)
            .map(|i| {
                let e = KeyEvent {
                    kind: crate::event::EventKind::Expired,
                    db: 0,
                    key: format!("k:{i}").into_bytes(),
                    observed_at: chrono::Utc::now(),
                    deadline: chrono::DateTime::from_timestamp_millis(120_000),
                    ttl_ms: None,
                    recovered: false,
                    source: String::new(),
                };
                bucket("p:", &Claims::id(&e), 120_000, 0).0
            })
            .collect();
        assert_eq!(shards.len(), SHARDS, "{shards:?}");
    }
}
