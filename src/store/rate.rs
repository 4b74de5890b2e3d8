//! Rate buckets: a channel's token bucket shared by every instance, `{prefix}rate:CHANNEL`, a
//! hash of its tokens and when they were counted (by Redis's clock), expiring when idle. How a
//! channel waits for a token, and what it does while Redis cannot be asked, is the delivery's
//! (`src/delivery/ratelimit.rs`).

use crate::config::Rate;
use crate::keyspace::Conn;

/// Takes a token, or says how long until one is there.
const TAKE: &str = include_str!("rate/take.lua");

/// The bucket of `channel`.
pub fn key(prefix: &str, channel: &str) -> String {
    format!("{prefix}rate:{channel}")
}

/// One channel's bucket in Redis.
pub struct Bucket {
    conn: Conn,
    key: String,
    rate: Rate,
    script: redis::Script,
}

impl Bucket {
    pub fn new(conn: Conn, prefix: &str, channel: &str, rate: Rate) -> Bucket {
        Bucket {
            conn,
            key: key(prefix, channel),
            rate,
            script: redis::Script::new(TAKE),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Takes a token if there is one (0), or says how many ms until there is.
    pub async fn take(&self) -> redis::RedisResult<u64> {
        self.script
            .key(&self.key)
            .arg(self.rate.burst)
            .arg(self.rate.per.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await
    }
}

crate::keyspace::commands::declare! {
    /// The commands shared rate limits send, their script's included
    /// ([`crate::keyspace::commands`]).
    const WHY = "rate limits of channels";
    const SCRIPT = "rate limits of channels (script)";
    [
        Use::new(Server::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)")
            .when(When::RateLimit),
        Use::new(Server::State, "evalsha", WHY)
            .on(Keys::State("rate:*"), Access::ReadWrite)
            .args("{sha} 1 {key} 1 1000")
            .when(When::RateLimit),
        Use::new(Server::State, "time", SCRIPT).when(When::RateLimit),
        Use::new(Server::State, "hmget", SCRIPT)
            .on(Keys::State("rate:*"), Access::Read)
            .args("{key} tokens ts")
            .when(When::RateLimit),
        Use::new(Server::State, "hset", SCRIPT)
            .on(Keys::State("rate:*"), Access::Write)
            .args("{key} tokens 1 ts 0")
            .when(When::RateLimit),
        Use::new(Server::State, "pexpire", SCRIPT)
            .on(Keys::State("rate:*"), Access::Write)
            .args("{key} 1000")
            .when(When::RateLimit),

    ]
}
