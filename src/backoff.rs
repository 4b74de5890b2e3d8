//! The one backoff of every retry loop: capped exponential, with equal jitter.
//!
//! The `n`-th wait in a row (from 1) is drawn from `[d/2, d]`, where `d` is `min` doubled
//! `n - 1` times and capped at `max`. Equal jitter, not full jitter (`[0, d]`): several
//! instances (or a storm's many retries) still spread out, and no retry comes at once after a
//! failure, which against a server that is down would only be one more refused request.

use std::time::Duration;

/// A capped exponential backoff with equal jitter (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { min, max }
    }

    /// The longest the `n`-th wait in a row (from 1) may be: `min` doubled `n - 1` times, at most
    /// `max`.
    pub fn ceiling(&self, n: u32) -> Duration {
        self.min
            .saturating_mul(2u32.saturating_pow(n.saturating_sub(1).min(30)))
            .min(self.max)
    }

    /// The `n`-th wait in a row (from 1): random in `[ceiling / 2, ceiling]`.
    pub fn wait(&self, n: u32) -> Duration {
        let d = self.ceiling(n);
        d / 2 + (d - d / 2).mul_f64(fastrand::f64())
    }

    /// The waits of one loop, counted for it.
    pub fn waits(self) -> Waits {
        Waits {
            backoff: self,
            n: 0,
        }
    }
}

/// The waits of one retry loop: each [`Waits::next`] is the next wait in a row, until
/// [`Waits::reset`] says the loop is healthy again.
#[derive(Clone, Debug)]
pub struct Waits {
    backoff: Backoff,
    n: u32,
}

impl Waits {
    /// The wait before the next try.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Duration {
        self.n = self.n.saturating_add(1);
        self.backoff.wait(self.n)
    }

    /// Succeeded (or healthy long enough): the next failure waits as the first did.
    pub fn reset(&mut self) {
        self.n = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));

    #[test]
    fn each_wait_is_within_half_its_ceiling_and_its_ceiling() {
        let mut waits = B.waits();
        for n in 1..=40 {
            let ceiling = B.ceiling(n);
            let w = waits.next();
            assert!(
                w >= ceiling / 2 && w <= ceiling,
                "wait {n}: {w:?} of {ceiling:?}"
            );
        }
    }

    #[test]
    fn the_ceiling_doubles_from_min_to_max_and_stays_there() {
        let ms = |n| Duration::from_millis(n);
        let ceilings: Vec<Duration> = (1..=6).map(|n| B.ceiling(n)).collect();
        assert_eq!(
            ceilings,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        assert_eq!(B.ceiling(u32::MAX), ms(1000));
    }

    #[test]
    fn the_waits_spread_over_their_range() {
        let waits: Vec<Duration> = (0..200).map(|_| B.wait(5)).collect();
        let low = waits
            .iter()
            .filter(|w| **w < Duration::from_millis(750))
            .count();
        assert!((40..=160).contains(&low), "{low} of 200 in the lower half");
    }

    #[test]
    fn a_reset_starts_again_from_the_first_wait() {
        let mut waits = B.waits();
        for _ in 0..10 {
            waits.next();
        }
        waits.reset();
        assert!(waits.next() <= B.min);
    }
}
