//! Hearing of keys that leave a database without a keyevent: `FLUSHDB`, `FLUSHALL` and `SWAPDB`
//! publish none (Redis 7.0, Valkey 9), and the deadline ledger must not take the keys they took
//! away for missed expiries (docs/how-it-works.md#flushes-and-swaps).
//!
//! - A flush: Redis tells every client that tracks keys for client-side caching to drop all it
//!   holds (an `invalidate` push without keys, `trackingInvalidateKeysOnFlush`), whatever those
//!   clients read. The subscriber's command connection speaks RESP3, turns tracking on and reads
//!   no key, so Redis remembers nothing for it and sends it nothing else: a flush is heard within
//!   milliseconds, and costs nothing while idle. (The subscribed connection cannot be the one:
//!   redis-rs sends it nothing but subscriptions, and a RESP2 redirect needs its client id.)
//! - A swap tells no client anything, nor does a flush where tracking is refused: once a second
//!   while the ledger is kept, `INFO commandstats` says whether the `calls` of `swapdb` (or of
//!   `flushdb` and `flushall`) changed since the last reading.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, Value};
use tokio::sync::mpsc;

/// How often the calls of `swapdb` (and of the flushes, where tracking is refused) are read.
pub const STATS_EVERY: Duration = Duration::from_secs(1);

/// How far before a flush was heard it may have happened: what a `FLUSHDB` took away with a
/// deadline since then is dropped, not recovered. The push comes within milliseconds; the margin
/// covers a subscriber busy with a storm.
pub const HEARD_WITHIN_MS: i64 = 250;

/// The subscriber's command connection, and what tells it of a flush.
pub struct Commands {
    pub conn: MultiplexedConnection,
    /// Pushes of client-side tracking; `None` where it was refused.
    pub pushes: Option<mpsc::UnboundedReceiver<PushInfo>>,
    /// Why tracking was refused, for the operator (`None`: it is on).
    pub refused: Option<String>,
}

/// Opens the command connection of a subscriber to `client`'s node: RESP3 with client-side
/// tracking on where the node and the user allow it, else as before (RESP2, no tracking). Only a
/// failure to connect at all is an error.
pub async fn connect(
    client: &redis::Client,
    config: &AsyncConnectionConfig,
) -> redis::RedisResult<Commands> {
    let (tx, rx) = mpsc::unbounded_channel();
    let resp3 = {
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        redis::Client::open(info.set_redis_settings(settings))
    };
    let opened = match resp3 {
        Ok(c) => {
            c.get_multiplexed_async_connection_with_config(&config.clone().set_push_sender(tx))
                .await
        }
        Err(e) => Err(e),
    };
    let mut conn = match opened {
        Ok(conn) => conn,
        Err(e) => {
            // `HELLO 3` refused (a server before 6.0, or one that forbids RESP3): go on without.
            let conn = client
                .get_multiplexed_async_connection_with_config(config)
                .await?;
            return Ok(Commands {
                conn,
                pushes: None,
                refused: Some(format!("HELLO 3 failed: {e}")),
            });
        }
    };
    match redis::cmd("CLIENT")
        .arg("TRACKING")
        .arg("ON")
        .query_async::<()>(&mut conn)
        .await
    {
        Ok(()) => Ok(Commands {
            conn,
            pushes: Some(rx),
            refused: None,
        }),
        Err(e) => Ok(Commands {
            conn,
            pushes: None,
            refused: Some(format!("CLIENT TRACKING ON failed: {e}")),
        }),
    }
}

/// What a tracking push says.
#[derive(Debug, PartialEq, Eq)]
pub enum Push {
    /// Invalidate everything: a `FLUSHDB` or `FLUSHALL`, of some database.
    Flush,
    /// The connection ended.
    Closed,
    /// Anything else (keys this connection read: it reads none).
    Other,
}

pub fn push(p: &PushInfo) -> Push {
    match p.kind {
        PushKind::Invalidate if matches!(p.data.first(), None | Some(Value::Nil)) => Push::Flush,
        PushKind::Disconnection => Push::Closed,
        _ => Push::Other,
    }
}

/// The calls of the commands that empty databases, from `INFO commandstats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    /// `flushdb` and `flushall`.
    pub flushes: u64,
    pub swaps: u64,
}

impl Calls {
    /// Reads them on `conn`.
    pub async fn read(conn: &mut MultiplexedConnection) -> redis::RedisResult<Calls> {
        let text: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await?;
        Ok(Calls::parse(&text))
    }

    /// `cmdstat_swapdb:calls=2,usec=…` lines; a command never called is not listed.
    pub fn parse(text: &str) -> Calls {
        let mut out = Calls::default();
        for line in text.lines() {
            let Some((name, stats)) = line.trim().split_once(':') else {
                continue;
            };
            let calls = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            match name {
                "cmdstat_flushdb" | "cmdstat_flushall" => out.flushes += calls,
                "cmdstat_swapdb" => out.swaps += calls,
                _ => {}
            }
        }
        out
    }
}

crate::keyspace::commands::declare! {
    /// The commands that tell the subscriber of flushes and swaps ([`crate::keyspace::commands`]),
    /// with `HELLO 3`, which the client sends and every user may (as `AUTH`). Tracking is
    /// optional: refused, keywatch notices flushes within a second and says so.
    [
        Use::new(Server::Watched, "client|tracking", "ledger: hears of flushes at once (client-side tracking, no key read)")
            .args("on")
            .access(Access::Write)
            .when(When::Ledger)
            .optional(),
        Use::new(Server::Watched, "info", "ledger: notices SWAPDB (INFO commandstats, once a second)")
            .args("commandstats")
            .when(When::Ledger),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calls_of_flushes_and_swaps_are_read_from_commandstats() {
        let text = "# Commandstats\r\ncmdstat_flushdb:calls=3,usec=40,usec_per_call=13.33,rejected_calls=0,failed_calls=0\r\ncmdstat_flushall:calls=1,usec=9,usec_per_call=9.00,rejected_calls=0,failed_calls=0\r\ncmdstat_swapdb:calls=2,usec=5,usec_per_call=2.50,rejected_calls=1,failed_calls=0\r\ncmdstat_get:calls=99,usec=1\r\n";
        assert_eq!(
            Calls::parse(text),
            Calls {
                flushes: 4,
                swaps: 2
            }
        );
        assert_eq!(Calls::parse("# Commandstats\r\n"), Calls::default());
    }

    #[test]
    fn an_invalidation_without_keys_is_a_flush() {
        let p = |kind, data| PushInfo { kind, data };
        assert_eq!(
            push(&p(PushKind::Invalidate, vec![Value::Nil])),
            Push::Flush
        );
        assert_eq!(
            push(&p(
                PushKind::Invalidate,
                vec![Value::Array(vec![Value::BulkString(b"k".to_vec())])]
            )),
            Push::Other
        );
        assert_eq!(push(&p(PushKind::Disconnection, vec![])), Push::Closed);
    }
}
