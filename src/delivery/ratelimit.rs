//! Token buckets for channels: up to `burst` messages at once, refilled evenly over `per`
//! (`20/min`: a burst of 20, then one every 3 s), as docs/rules.md defines `rate`.
//!
//! The bucket lives in Redis ([`SharedBucket`], kept by [`crate::store::rate`]), so every instance draws from the same one:
//! three instances together never exceed a DingTalk robot's 20 a minute. If Redis cannot be
//! asked, the instance falls back to a bucket of its own rather than stop sending.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Rate;
use crate::store::rate::Bucket;

pub struct TokenBucket {
    rate: Rate,
    state: Mutex<State>,
}

struct State {
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: Rate) -> TokenBucket {
        TokenBucket {
            rate,
            state: Mutex::new(State {
                tokens: f64::from(rate.burst),
                last: Instant::now(),
            }),
        }
    }

    fn per_token(&self) -> Duration {
        self.rate.per / self.rate.burst
    }

    /// Takes a token now, or says how long until one is there.
    pub fn try_take(&self) -> Result<(), Duration> {
        // A std Mutex is right here: the guard never lives across an await.
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(s.last).as_secs_f64() / self.per_token().as_secs_f64();
        s.tokens = (s.tokens + refill).min(f64::from(self.rate.burst));
        s.last = now;
        if s.tokens >= 1.0 {
            s.tokens -= 1.0;
            Ok(())
        } else {
            Err(self.per_token().mul_f64(1.0 - s.tokens))
        }
    }

    /// Waits for a token; true when one was in hand.
    pub async fn take(&self) -> bool {
        let mut in_hand = true;
        while let Err(wait) = self.try_take() {
            in_hand = false;
            tokio::time::sleep(wait).await;
        }
        in_hand
    }
}

/// A channel's bucket shared by every instance through Redis ([`crate::store::rate`]).
pub struct SharedBucket {
    bucket: Bucket,
    /// Used while Redis cannot be asked.
    local: TokenBucket,
}

impl SharedBucket {
    pub fn new(
        conn: crate::keyspace::Conn,
        prefix: &str,
        channel: &str,
        rate: Rate,
    ) -> SharedBucket {
        SharedBucket {
            bucket: Bucket::new(conn, prefix, channel, rate),
            local: TokenBucket::new(rate),
        }
    }

    /// Waits for a token from the shared bucket; true when one was in hand.
    pub async fn take(&self) -> bool {
        let mut in_hand = true;
        loop {
            match self.bucket.take().await {
                Ok(0) => return in_hand,
                Ok(ms) => {
                    in_hand = false;
                    tokio::time::sleep(Duration::from_millis(ms)).await
                }
                Err(e) => {
                    tracing::warn!(key = %self.bucket.key(), error = %e, "Cannot reach the shared rate limit; limiting this instance alone.");
                    return self.local.take().await && in_hand;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bursts_then_refills_evenly() {
        let b = TokenBucket::new(Rate {
            burst: 20,
            per: Duration::from_secs(60),
        });
        for _ in 0..20 {
            assert!(b.try_take().is_ok());
        }
        let wait = b.try_take().unwrap_err();
        assert!(
            wait <= Duration::from_secs(3) && wait > Duration::from_millis(2900),
            "{wait:?}"
        );
        let start = Instant::now();
        b.take().await;
        b.take().await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(5900) && took <= Duration::from_millis(6100),
            "{took:?}"
        );
    }

    /// The lane merges nothing while tokens are in hand (docs/rules.md#channels), and with a
    /// state every instance draws from the shared bucket: it must say which tokens came without
    /// a wait, or a fresh channel's burst merges as if it were a backlog. 1 token per 2 s, so
    /// the burst is taken well before a token comes back.
    #[tokio::test]
    async fn a_shared_bucket_says_whether_its_token_was_in_hand() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let b = SharedBucket::new(
            conn,
            "keywatch:",
            "robot",
            Rate {
                burst: 3,
                per: Duration::from_secs(6),
            },
        );
        for i in 1..=3 {
            assert!(b.take().await, "token {i} of the burst is in hand");
        }
        assert!(!b.take().await, "the fourth is waited for");
    }
}
