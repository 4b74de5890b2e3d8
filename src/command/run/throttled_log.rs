//! A log line that a stranger can cause (a forged link, a wrong token, a flood of connections) is
//! written at most once per period, with how many were left out since: a request per line would
//! let anyone fill the disk and bury what matters (docs/operations.md#exposing-the-endpoint).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

pub struct Throttled {
    every: Duration,
    state: Mutex<State>,
}

struct State {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttled {
    pub const fn new(every: Duration) -> Throttled {
        Throttled {
            every,
            state: Mutex::new(State {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// `Some(n)` when this occurrence is to be logged, `n` being how many were left out since
    /// the last one logged; `None` when it is to be left out (and counted).
    pub fn pass(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.last {
            Some(last) if now.duration_since(last) < self.every => {
                s.suppressed += 1;
                None
            }
            _ => {
                s.last = Some(now);
                Some(std::mem::take(&mut s.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_period_with_the_count_of_the_others() {
        let t = Throttled::new(Duration::from_secs(10));
        assert_eq!(t.pass(), Some(0));
        for _ in 0..1_000 {
            assert_eq!(t.pass(), None);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(t.pass(), Some(1_000));
        assert_eq!(t.pass(), None);
    }
}
