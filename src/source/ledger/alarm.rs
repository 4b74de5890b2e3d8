//! When a poker looks next: per database, the earliest deadline it knows of, and a wake-up when
//! a deadline earlier than that is written (docs/how-it-works.md#the-poker).
//!
//! A poker that looked every few milliseconds whether something was due cost an idle Redis two
//! thousand commands a second; it knows when the next deadline is, so it sleeps until then, as
//! mini-redis's expiry task sleeps until the next expiry or a `Notify`. The key ledger and the
//! field ledger each have one.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::Notify;

/// The plans of one poker, shared with whatever writes deadlines.
#[derive(Default)]
pub struct Alarm {
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Default)]
struct State {
    /// Per database, when the poker plans to look next (Redis's clock, ms). Absent: it is
    /// looking now, or has not looked yet, and will plan when done.
    planned: HashMap<u32, i64>,
    /// Per database, the earliest deadline written while the poker was looking: its read may
    /// have come before the write, so the plan it makes takes this into account.
    learnt: HashMap<u32, i64>,
}

impl Alarm {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A deadline was written to `db`'s ledger (call once the write is done, so that a poker it
    /// wakes finds it there): the poker is woken if it planned to look later.
    pub fn learnt(&self, db: u32, deadline_ms: i64) {
        let mut st = self.state();
        match st.planned.get_mut(&db) {
            Some(p) if deadline_ms < *p => {
                *p = deadline_ms;
                drop(st);
                self.wake.notify_one();
            }
            Some(_) => {}
            None => {
                let l = st.learnt.entry(db).or_insert(deadline_ms);
                *l = (*l).min(deadline_ms);
            }
        }
    }

    /// The poker begins to look at `db`: deadlines written from now on are kept for its plan.
    pub fn looking(&self, db: u32) {
        let mut st = self.state();
        st.planned.remove(&db);
        st.learnt.remove(&db);
    }

    /// The poker is done looking at `db` and plans to look again at `next` (`None`: nothing is
    /// known there), or earlier if a deadline written meanwhile is earlier. Returns the plan.
    pub fn plan(&self, db: u32, next: Option<i64>) -> i64 {
        let mut st = self.state();
        let learnt = st.learnt.remove(&db).unwrap_or(i64::MAX);
        let at = next.unwrap_or(i64::MAX).min(learnt);
        st.planned.insert(db, at);
        at
    }

    /// Brings `db`'s plan forward to `at` if that is earlier (the safety round's answer).
    pub fn lower(&self, db: u32, at: i64) {
        let mut st = self.state();
        if let Some(p) = st.planned.get_mut(&db) {
            *p = (*p).min(at);
        }
    }

    /// When the poker should look at `db` next: `None` if it has no plan (it looks now).
    pub fn planned(&self, db: u32) -> Option<i64> {
        self.state().planned.get(&db).copied()
    }

    /// Forgets the plans of databases no longer watched (a reload).
    pub fn keep(&self, dbs: &[u32]) {
        let mut st = self.state();
        st.planned.retain(|db, _| dbs.contains(db));
        st.learnt.retain(|db, _| dbs.contains(db));
    }

    /// Resolves when a deadline earlier than a plan was written (or at once if one was since
    /// the last call).
    pub async fn woken(&self) {
        self.wake.notified().await
    }
}

/// The longest a poker sleeps at once: a plan further ahead (or none, `i64::MAX`) is slept
/// towards in steps of this.
const LONGEST_SLEEP: std::time::Duration = std::time::Duration::from_secs(3600);

/// How long from now until `at_ms` of Redis's clock is past (Redis expires a key once its clock
/// is beyond the deadline, so the poker aims at the millisecond after it), measured to the
/// microsecond of the host's clock, at most [`LONGEST_SLEEP`].
pub fn until_past(at_ms: i64) -> std::time::Duration {
    let now_us = crate::keyspace::clock::now_us();
    let target_us = at_ms.saturating_add(1).saturating_mul(1000);
    std::time::Duration::from_micros(target_us.saturating_sub(now_us).max(0) as u64)
        .min(LONGEST_SLEEP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_earlier_than_the_plan_wakes_the_poker_and_one_later_does_not() {
        let a = Alarm::default();
        a.looking(0);
        assert_eq!(a.plan(0, Some(5_000)), 5_000);
        a.learnt(0, 9_000);
        assert_eq!(a.planned(0), Some(5_000));
        a.learnt(0, 3_000);
        assert_eq!(a.planned(0), Some(3_000));
        // The wake-up was stored: the poker's next wait ends at once.
        let woke = futures_util::FutureExt::now_or_never(a.woken());
        assert!(woke.is_some());
    }

    #[test]
    fn a_deadline_written_while_looking_is_in_the_plan() {
        let a = Alarm::default();
        a.looking(1);
        // The poker's read may have come before this write.
        a.learnt(1, 2_000);
        assert_eq!(a.plan(1, Some(7_000)), 2_000);
        assert_eq!(a.plan(1, None), i64::MAX);
        a.lower(1, 4_000);
        assert_eq!(a.planned(1), Some(4_000));
        a.keep(&[0]);
        assert_eq!(a.planned(1), None);
    }
}
