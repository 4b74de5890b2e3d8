//! Token buckets for channels: up to `burst` messages at once, refilled evenly over `per`
//! (`20/min`: a burst of 20, then one every 3 s), as SPEC §2 defines `rate`.
//!
//! The bucket lives in Redis ([`SharedBucket`]), so every instance draws from the same one:
//! three instances together never exceed a DingTalk robot's 20 a minute. If Redis cannot be
//! asked, the instance falls back to a bucket of its own rather than stop sending.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Rate;

/// A channel's rate limit: shared by every instance through Redis, or this instance's own.
pub enum Limiter {
    Shared(SharedBucket),
    Local(TokenBucket),
}

impl Limiter {
    /// Waits for a token; true when one was in hand (no wait was needed).
    pub async fn take(&self) -> bool {
        match self {
            Limiter::Shared(b) => b.take().await,
            Limiter::Local(b) => b.take().await,
        }
    }
}

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

// Takes a token if there is one (0), or says how many ms until there is. Redis's own clock is
// used, so instances with skewed clocks still share one rate.
const TAKE: &str = r"
local burst = tonumber(ARGV[1])
local per = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
local rate = burst / per
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = math.ceil((1 - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
redis.call('PEXPIRE', KEYS[1], per * 2 + 1000)
return wait
";

/// A channel's bucket shared by every instance through Redis.
pub struct SharedBucket {
    conn: crate::keyspace::Conn,
    key: String,
    rate: Rate,
    script: redis::Script,
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
            conn,
            key: format!("{prefix}rate:{channel}"),
            rate,
            script: redis::Script::new(TAKE),
            local: TokenBucket::new(rate),
        }
    }

    /// Waits for a token from the shared bucket; true when one was in hand.
    pub async fn take(&self) -> bool {
        let mut in_hand = true;
        loop {
            let wait: redis::RedisResult<u64> = self
                .script
                .key(&self.key)
                .arg(self.rate.burst)
                .arg(self.rate.per.as_millis() as u64)
                .invoke_async(&mut self.conn.clone())
                .await;
            match wait {
                Ok(0) => return in_hand,
                Ok(ms) => {
                    in_hand = false;
                    tokio::time::sleep(Duration::from_millis(ms)).await
                }
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "Cannot reach the shared rate limit; limiting this instance alone.");
                    return self.local.take().await && in_hand;
                }
            }
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands shared rate limits send, their script's included
    /// ([`crate::keyspace::commands`]).
    const WHY = "rate limits of channels";
    const SCRIPT = "rate limits of channels (script)";
    [
        Use::new(Conn::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)")
            .when(When::RateLimit),
        Use::new(Conn::State, "evalsha", WHY)
            .on(Keys::State("rate:*"), Access::ReadWrite)
            .args("{sha} 1 {key} 1 1000")
            .when(When::RateLimit),
        Use::new(Conn::State, "time", SCRIPT).when(When::RateLimit),
        Use::new(Conn::State, "hmget", SCRIPT)
            .on(Keys::State("rate:*"), Access::Read)
            .args("{key} tokens ts")
            .when(When::RateLimit),
        Use::new(Conn::State, "hset", SCRIPT)
            .on(Keys::State("rate:*"), Access::Write)
            .args("{key} tokens 1 ts 0")
            .when(When::RateLimit),
        Use::new(Conn::State, "pexpire", SCRIPT)
            .on(Keys::State("rate:*"), Access::Write)
            .args("{key} 1000")
            .when(When::RateLimit),

    ]
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
}
