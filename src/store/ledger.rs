//! The deadline ledger's keys: per watched database, a sorted set of the deadlines of the keys
//! the rules watch (member: the key, score: its deadline in ms), the keys touched at their
//! deadline and found gone ("poked", tagged with a marker sequence number, their deadlines in a
//! hash beside), the marker sequence shared by every instance, and the pub/sub channel markers
//! go on. What the ledger does with them is [`crate::source`]'s (the poker, reconcile, fill);
//! see `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use crate::keyspace::Conn;
use crate::store::handled;

/// Records read deadlines unless the handled memory says they were taken.
const RECORD: &str = include_str!("ledger/record.lua");
/// Moves touched-and-gone keys to the poked set.
const MOVE_POKED: &str = include_str!("ledger/move_poked.lua");

/// How far the clock estimate an instance stamped a deadline-less take with may lag Redis's.
const TAKEN_SLACK_MS: i64 = 100;

/// The ledger's keys and scripts on the state server.
#[derive(Clone)]
pub struct Deadlines {
    conn: Conn,
    prefix: String,
    record: redis::Script,
    move_poked: redis::Script,
}

impl Deadlines {
    pub fn new(conn: Conn, prefix: &str) -> Deadlines {
        Deadlines {
            conn,
            prefix: prefix.to_string(),
            record: redis::Script::new(RECORD),
            move_poked: redis::Script::new(MOVE_POKED),
        }
    }

    fn conn(&self) -> Conn {
        self.conn.clone()
    }

    /// Records `deadlines` of `keys` as `PEXPIRETIME` answers them (-1: the key has no TTL, and
    /// leaves; -2: it is gone, and its deadline stays for the poker to judge), but not one the
    /// handled memory says was taken already; `now_ms` by this instance's estimate of Redis's
    /// clock.
    pub async fn record(
        &self,
        db: u32,
        keys: &[Vec<u8>],
        deadlines: &[i64],
        now_ms: i64,
    ) -> redis::RedisResult<()> {
        let mut inv = self.record.prepare_invoke();
        inv.key(deadlines_key(&self.prefix, db))
            .arg(TAKEN_SLACK_MS)
            .arg(handled::memory(&self.prefix, db))
            .arg(now_ms.div_euclid(60_000))
            .arg(handled::HANDLED_MINUTES);
        for (k, d) in keys.iter().zip(deadlines) {
            inv.arg(*d).arg(k);
        }
        inv.invoke_async(&mut self.conn()).await
    }

    /// Drops the deadlines of `keys`.
    pub async fn forget(&self, db: u32, keys: &[Vec<u8>]) -> redis::RedisResult<()> {
        redis::cmd("ZREM")
            .arg(deadlines_key(&self.prefix, db))
            .arg(keys)
            .exec_async(&mut self.conn())
            .await
    }

    /// Up to `limit` poked keys numbered at most `seq`, lowest first, with their deadlines.
    pub async fn poked(
        &self,
        db: u32,
        seq: u64,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        let keys: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(poked(&self.prefix, db))
            .arg("-inf")
            .arg(seq)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut self.conn())
            .await?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let deadlines: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(poked_deadlines(&self.prefix, db))
            .arg(&keys)
            .query_async(&mut self.conn())
            .await?;
        Ok(keys
            .into_iter()
            .zip(deadlines)
            .map(|(key, d)| {
                let d = d.and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0) as i64;
                (key, d)
            })
            .collect())
    }

    /// The next number of `db`'s marker sequence.
    pub async fn next_marker(&self, db: u32) -> redis::RedisResult<u64> {
        redis::cmd("INCR")
            .arg(seq(&self.prefix, db))
            .query_async(&mut self.conn())
            .await
    }

    /// Deadlines of `db` up to `until_ms`, soonest first, `limit` from `offset`.
    pub async fn due(
        &self,
        db: u32,
        until_ms: i64,
        offset: usize,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, f64)>> {
        redis::cmd("ZRANGE")
            .arg(deadlines_key(&self.prefix, db))
            .arg("-inf")
            .arg(until_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(offset)
            .arg(limit)
            .arg("WITHSCORES")
            .query_async(&mut self.conn())
            .await
    }

    /// Corrects deadlines in one round trip, in order: `None` drops the key's, `Some(t)` moves it
    /// to `t`.
    pub async fn fix(&self, db: u32, fixes: &[(&[u8], Option<i64>)]) -> redis::RedisResult<()> {
        let zset = deadlines_key(&self.prefix, db);
        let mut fix = redis::pipe();
        for (k, t) in fixes {
            match t {
                None => fix.cmd("ZREM").arg(&zset).arg(*k).ignore(),
                Some(t) => fix.cmd("ZADD").arg(&zset).arg(*t).arg(*k).ignore(),
            };
        }
        fix.exec_async(&mut self.conn()).await
    }

    /// Moves keys found gone (`gone`: key, deadline as seen) to the poked set, only those whose
    /// deadline the ledger still holds; returns the marker number they were given.
    pub async fn move_poked(&self, db: u32, gone: &[(&[u8], i64)]) -> redis::RedisResult<u64> {
        let p = &self.prefix;
        let mut inv = self.move_poked.prepare_invoke();
        inv.key(deadlines_key(p, db))
            .key(poked(p, db))
            .key(poked_deadlines(p, db))
            .key(seq(p, db));
        for (k, d) in gone {
            inv.arg(*k).arg(*d);
        }
        inv.invoke_async(&mut self.conn()).await
    }

    /// The keys of `db`'s ledger from index `start`, at most `n`.
    pub async fn page(&self, db: u32, start: isize, n: isize) -> redis::RedisResult<Vec<Vec<u8>>> {
        redis::cmd("ZRANGE")
            .arg(deadlines_key(&self.prefix, db))
            .arg(start)
            .arg(start + n - 1)
            .query_async(&mut self.conn())
            .await
    }

    /// The deadlines of `keys`, in one round trip.
    pub async fn scores(&self, db: u32, keys: &[&Vec<u8>]) -> redis::RedisResult<Vec<Option<f64>>> {
        let zset = deadlines_key(&self.prefix, db);
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("ZSCORE").arg(&zset).arg(*k);
        }
        pipe.query_async(&mut self.conn()).await
    }

    /// The number of deadlines known in `dbs`.
    pub async fn size(&self, dbs: &[u32]) -> redis::RedisResult<i64> {
        let mut pipe = redis::pipe();
        for db in dbs {
            pipe.cmd("ZCARD").arg(deadlines_key(&self.prefix, *db));
        }
        let sizes: Vec<i64> = pipe.query_async(&mut self.conn()).await?;
        Ok(sizes.iter().sum())
    }

    /// Deadlines of `db` in `(from_ms, until_ms]`, soonest first, `limit` from `offset`.
    pub async fn between(
        &self,
        db: u32,
        from_ms: i64,
        until_ms: i64,
        offset: usize,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        let rows: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(deadlines_key(&self.prefix, db))
            .arg(format!("({from_ms}"))
            .arg(until_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(offset)
            .arg(limit)
            .arg("WITHSCORES")
            .query_async(&mut self.conn())
            .await?;
        Ok(rows.into_iter().map(|(k, s)| (k, s as i64)).collect())
    }

    /// The next `limit` deadlines of `db` up to `until_ms`, soonest first.
    pub async fn upcoming(
        &self,
        db: u32,
        until_ms: i64,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        Ok(self
            .due(db, until_ms, 0, limit)
            .await?
            .into_iter()
            .map(|(k, s)| (k, s as i64))
            .collect())
    }
}

crate::keyspace::commands::declare! {
    /// The commands the ledger sends to its keys, its scripts' included
    /// ([`crate::keyspace::commands`]).
    const WHY = "ledger: deadlines of the watched keys";
    const SCRIPTS = "ledger: poked keys (script)";
    [
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("ledger:*"), Access::Write)
            .args("{key} 0 k")
            .when(When::Ledger),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("ledger:*"), Access::Write)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1 WITHSCORES")
            .when(When::Ledger),
        Use::new(Server::State, "zscore", WHY)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "zmscore", WHY)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "zcard", WHY)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "incr", "ledger: marker sequence")
            .on(Keys::State("ledger:*:seq"), Access::ReadWrite)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "script|load", "ledger: scripts")
            .access(Access::Write)
            .args("return(1)")
            .when(When::Ledger),
        Use::new(Server::State, "evalsha", "ledger: scripts")
            .on(Keys::State("ledger:*"), Access::ReadWrite)
            .args("{sha} 4 {prefix}ledger:0 {prefix}ledger:0:poked {prefix}ledger:0:poked-deadline {prefix}ledger:0:seq")
            .when(When::Ledger),
        Use::new(Server::State, "hmget", "ledger: missed expiries")
            .on(Keys::State("ledger:*:poked-deadline"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "hset", SCRIPTS)
            .on(Keys::State("ledger:*:poked-deadline"), Access::Write)
            .args("{key} k 0")
            .when(When::Ledger),
        Use::new(Server::State, "exists", "ledger: the handled memory (record script)")
            .on(Keys::State("ledger:*:handled:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "hmget", "ledger: the handled memory (record script)")
            .on(Keys::State("ledger:*:handled:*"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
    ]
}

/// The sorted set of deadlines of `db`: `{prefix}ledger:DB`.
pub fn deadlines(prefix: &str, db: u32) -> String {
    deadlines_key(prefix, db)
}

fn deadlines_key(prefix: &str, db: u32) -> String {
    format!("{prefix}ledger:{db}")
}

/// The keys of `db` found gone at their deadline, scored by marker sequence number.
pub fn poked(prefix: &str, db: u32) -> String {
    format!("{prefix}ledger:{db}:poked")
}

/// The deadlines of the poked keys of `db`: key → deadline.
pub fn poked_deadlines(prefix: &str, db: u32) -> String {
    format!("{prefix}ledger:{db}:poked-deadline")
}

/// The marker sequence of `db`, one for all instances (`INCR`).
pub fn seq(prefix: &str, db: u32) -> String {
    format!("{prefix}ledger:{db}:seq")
}

/// The pub/sub channel markers go on (subscribed by the keyevent subscriber).
pub fn marker_channel(prefix: &str) -> String {
    format!("{prefix}poke")
}
