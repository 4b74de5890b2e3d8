//! When a failed attempt is tried again: [`Backoff`] (capped exponential, equal jitter),
//! `Retry-After` obeyed, all within the 24 h retry window of docs/reliability.md#guarantees.

use std::time::Duration;

use crate::backoff::Backoff;

/// How failed actions are retried.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub min: Duration,
    pub max: Duration,
    /// Retried for this long after the first failure, then dead-lettered (docs/reliability.md#guarantees: 24 h).
    pub give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(300),
            give_up_after: Duration::from_secs(24 * 3600),
        }
    }
}

impl RetryPolicy {
    /// The wait after failed attempt number `attempt` (1 for the first): the `attempt`-th wait of
    /// a [`Backoff`] from `min` to `max`, so retries of a storm spread out.
    pub fn backoff(&self, attempt: u32) -> Duration {
        Backoff::new(self.min, self.max).wait(attempt.max(1))
    }
}

impl RetryPolicy {
    /// The attempts the backoff would have made in `failing_for_ms` of failures, for work whose
    /// attempts are not counted (a held digest, failing since its quiet period ended): each wait
    /// then is about as long as the work has been failing, so its retries spread out as a
    /// counted job's do — doubling from `min` to `max` — instead of coming at every lease's end.
    pub fn attempts_in(&self, failing_for_ms: i64) -> u32 {
        let min = millis(self.min).max(1);
        let ratio = u64::try_from(failing_for_ms / min).unwrap_or(0).max(1);
        // The ceiling of attempt n is min·2^(n-1): the last one not longer than the time failing.
        1 + ratio.ilog2()
    }
}

/// What follows a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Attempt again at this time (unix ms).
    RetryAt(i64),
    /// The retry window is over: dead-letter the job.
    GiveUp,
}

impl RetryPolicy {
    /// The decision after failed attempt number `attempt` (1 for the first) at `now`, for a job
    /// failing since `failing_since` (both unix ms), when the target asked to wait `retry_after`.
    ///
    /// The retry window bounds every wait: a `Retry-After` of two days, or a backoff reaching past
    /// the window, would otherwise hold a job beyond 24 h before its dead letter. Instead the last
    /// attempt comes at the window's end, and if that fails too the job is dead-lettered then.
    pub fn after_failure(
        &self,
        attempt: u32,
        failing_since: i64,
        now: i64,
        retry_after: Option<Duration>,
    ) -> Next {
        let window_end = failing_since.saturating_add(millis(self.give_up_after));
        if now >= window_end {
            return Next::GiveUp;
        }
        let wait = retry_after.unwrap_or_default().max(self.backoff(attempt));
        Next::RetryAt(now.saturating_add(millis(wait)).min(window_end))
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_capped() {
        let p = RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
            give_up_after: Duration::from_secs(3600),
        };
        for attempt in 0..40 {
            let b = p.backoff(attempt);
            assert!(b >= Duration::from_millis(500), "{attempt}: {b:?}");
            assert!(b <= Duration::from_secs(60), "{attempt}: {b:?}");
        }
        let late: Duration = (0..200).map(|_| p.backoff(10)).sum::<Duration>() / 200;
        assert!(late > Duration::from_secs(20), "{late:?}");
    }

    #[test]
    fn uncounted_attempts_wait_about_as_long_as_they_have_been_failing() {
        let p = RetryPolicy::default();
        for (failing_for, attempts) in [
            (-5, 1),
            (0, 1),
            (1_999, 1),
            (2_000, 2),
            (3_999, 2),
            (4_000, 3),
            (60_000, 6),
            (DAY_MS, 17),
        ] {
            assert_eq!(p.attempts_in(failing_for), attempts, "{failing_for} ms");
        }
        // Never longer than the time failing (beyond the first step), nor than the cap.
        for failing_for in [1_000, 7_000, 100_000, HOUR_MS] {
            let ceiling = Backoff::new(p.min, p.max).ceiling(p.attempts_in(failing_for));
            assert!(
                ceiling.as_millis() as i64 <= failing_for,
                "{failing_for} ms"
            );
            assert!(ceiling <= p.max);
        }
    }

    const HOUR_MS: i64 = 3_600_000;
    const DAY_MS: i64 = 24 * HOUR_MS;

    /// Replays the retry schedule of one job against a target that fails every attempt before
    /// `down_until` (ms after the first attempt): when it was delivered or dead-lettered, and
    /// after how many attempts. Virtual time: a day of retries runs in microseconds.
    fn replay(down_until: i64, retry_after: Option<Duration>) -> (Result<i64, i64>, u32) {
        let p = RetryPolicy::default();
        let (mut now, mut n, mut since) = (0i64, 0u32, None);
        loop {
            n += 1;
            if now >= down_until {
                return (Ok(now), n);
            }
            let first_failure = *since.get_or_insert(now);
            match p.after_failure(n, first_failure, now, retry_after) {
                Next::RetryAt(at) => {
                    assert!(at > now, "attempt {n} at {now} ms retried at {at} ms");
                    assert!(
                        at - now <= 300_000 || retry_after.is_some(),
                        "waited {} ms",
                        at - now
                    );
                    now = at;
                }
                Next::GiveUp => return (Err(now), n),
            }
        }
    }

    #[test]
    fn a_target_down_for_an_hour_gets_its_alert_once_within_five_minutes_of_coming_back() {
        for _ in 0..200 {
            let (outcome, attempts) = replay(HOUR_MS, None);
            let at = outcome.expect("never dead-lettered within the 24 h window");
            assert!(
                (HOUR_MS..=HOUR_MS + 300_000).contains(&at),
                "delivered at {at} ms"
            );
            // 1 s doubling to the 5 min cap, with jitter: about 12–25 attempts in an hour.
            assert!((12..=60).contains(&attempts), "{attempts} attempts");
        }
    }

    #[test]
    fn nothing_is_dead_lettered_before_24_hours_and_everything_at_24_hours() {
        for _ in 0..50 {
            // Back just before the window closes: still delivered, by the attempt at its end.
            let (outcome, _) = replay(DAY_MS - 1, None);
            assert!(outcome.is_ok_and(|at| at <= DAY_MS), "{outcome:?}");
            // Never back: dead-lettered exactly when the window closes, not a backoff later.
            let (outcome, attempts) = replay(i64::MAX, None);
            assert_eq!(outcome, Err(DAY_MS), "after {attempts} attempts");
        }
    }

    #[test]
    fn a_retry_after_beyond_the_window_does_not_hold_the_dead_letter_back() {
        let p = RetryPolicy::default();
        let two_days = Some(Duration::from_secs(2 * 24 * 3600));
        assert_eq!(p.after_failure(1, 0, 0, two_days), Next::RetryAt(DAY_MS));
        assert_eq!(p.after_failure(2, 0, DAY_MS, two_days), Next::GiveUp);
        // Within the window, Retry-After is obeyed even when it is longer than the backoff.
        assert_eq!(
            p.after_failure(1, 0, 1000, Some(Duration::from_secs(3600))),
            Next::RetryAt(1000 + HOUR_MS)
        );
        assert_eq!(replay(i64::MAX, two_days), (Err(DAY_MS), 2));
    }
}
