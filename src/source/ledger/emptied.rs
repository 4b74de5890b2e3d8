//! Databases emptied without a keyevent: `FLUSHDB`, `FLUSHALL` and `SWAPDB` publish none, so
//! without this the ledger kept the deadlines of the keys they took away and, when those came
//! due, found the keys gone and recovered them as missed expiries; and the keys a swap brought in
//! were learnt only at the next fill (docs/how-it-works.md#flushes-and-swaps).
//!
//! When the subscriber hears of one ([`crate::source::flushes`]), every watched database gets a
//! *cut-off*: from then until its walk is done, a key found gone whose deadline is at or after the
//! cut-off is dropped from the ledger, by the poker as by the walk, never recorded as missed. Then,
//! one run at a time, each database that lost keys is walked as at a reconnect
//! ([`Ledger::reconcile`]) and, after a swap, the deadlines of the keys it brought are learnt
//! ([`super::fill_all`]).

use std::collections::HashMap;

use super::Ledger;
use crate::config::LiveConfig;

/// Deadlines of the soonest keys looked at to tell whether a database lost its keys: a flush
/// takes every key, so one of them gone is enough to walk the whole ledger, and none gone (a
/// flush of a database keywatch does not watch) spares the walk.
const SAMPLE: usize = 256;

/// Cut-offs in force, and the run that follows them (one at a time: a script that flushes in a
/// loop must not stack walks).
#[derive(Default)]
pub(super) struct Emptied {
    /// Per database, the earliest deadline a key found gone is dropped from rather than
    /// recovered.
    since: HashMap<u32, i64>,
    /// A run is under way.
    running: bool,
    /// What the next run has to do: `Some(swapped)` when asked for while one ran.
    again: Option<bool>,
}

impl Ledger {
    fn emptied_state(&self) -> std::sync::MutexGuard<'_, Emptied> {
        self.inner.emptied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cut-offs in force, per database: taken once per round by the poker and the walk.
    pub(super) fn cut_offs(&self) -> HashMap<u32, i64> {
        let state = self.emptied_state();
        if state.since.is_empty() {
            return HashMap::new();
        }
        state.since.clone()
    }

    /// Keys may have left every database of `live`'s rules from `since_ms` on (a flush, or a swap
    /// if `swapped`), with no keyevent: until the walk that follows is done, a key found gone
    /// whose deadline is that late is dropped, not recovered; then each database that lost keys
    /// is walked (all of them after a swap, whose keys are learnt again too). `only`: the cluster
    /// master it was heard on, whose keys alone are learnt again.
    pub fn emptied(&self, live: &LiveConfig, only: Option<String>, swapped: bool, since_ms: i64) {
        let config = live.current();
        if !config.uses_ledger() {
            return;
        }
        {
            let mut state = self.emptied_state();
            for &db in &config.redis.databases {
                let at = state.since.entry(db).or_insert(since_ms);
                *at = (*at).min(since_ms);
            }
            if state.running {
                state.again = Some(state.again.unwrap_or(false) || swapped);
                return;
            }
            state.running = true;
        }
        let ledger = self.clone();
        let live = live.clone();
        tokio::spawn(async move {
            let mut swapped = swapped;
            loop {
                ledger.settle(&live, only.as_deref(), swapped).await;
                let mut state = ledger.emptied_state();
                match state.again.take() {
                    Some(s) => swapped = s,
                    None => {
                        state.running = false;
                        state.since.clear();
                        return;
                    }
                }
            }
        });
    }

    /// One run after a flush or a swap: walks what lost keys, learns what came in.
    async fn settle(&self, live: &LiveConfig, only: Option<&str>, swapped: bool) {
        let config = live.current();
        for &db in &config.redis.databases {
            let lost = match swapped {
                true => Ok(true),
                false => self.lost_keys(db).await,
            };
            let walked = match lost {
                Ok(false) => Ok(0),
                Ok(true) => self.reconcile(db).await,
                Err(e) => Err(e),
            };
            match walked {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    db,
                    dropped = n,
                    swapped,
                    "Ledger: dropped the deadlines of keys a flush or a swap took away; none is reported as expired."
                ),
                // Its cut-off stays until the run ends; what is left is found at its deadline.
                Err(e) => {
                    tracing::warn!(db, error = %e, "Ledger: cannot walk a database after a flush or a swap.")
                }
            }
        }
        if swapped {
            super::fill_all(self, &config, only).await;
        }
    }

    /// Whether `db` lost keys whose deadlines the ledger holds: one of the soonest future ones
    /// is gone.
    async fn lost_keys(&self, db: u32) -> redis::RedisResult<bool> {
        let now = super::now_ms();
        let rows = self.between(db, now, i64::MAX, &mut None, SAMPLE).await?;
        let keys: Vec<Vec<u8>> = rows.into_iter().take(SAMPLE).map(|(k, _)| k).collect();
        if keys.is_empty() {
            return Ok(false);
        }
        let conn = self.inner.keyspace.conn(db).await?;
        let exists: Vec<i64> = conn.each(crate::keyspace::per_key("EXISTS", &keys)).await?;
        Ok(exists.contains(&0))
    }
}
