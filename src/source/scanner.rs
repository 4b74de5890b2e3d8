//! The TTL scanner: warnings before deadlines, for rules with `on: [expiring]`.
//!
//! Redis says nothing before a key expires, so keywatch looks, on `scanner.schedule`:
//!
//! - **From the ledger** when it is complete (a fill has walked every database since the last
//!   (re)subscription): one paged range query over `now .. now + max warn_before`, each key's
//!   deadline then confirmed with `PEXPIRETIME`. No scan.
//! - **Else with SCAN**: `SCAN MATCH <glob>` per rule (one `*` walk when the globs are many) and a
//!   pipelined `PEXPIRETIME` of what it returns, never `KEYS`. The walk is paced to
//!   `scanner.max_keys_per_second` keys *walked* (Redis walks every key of a `COUNT`, matching or
//!   not, so that is its load), and pauses when a reply comes back slow: Redis is busy with
//!   others, and they come first. SCAN also makes the master delete every due key it walks over
//!   (publishing `expired`), so a scan doubles as a reaper for late expiries — and, per
//!   redis/redis#15411, a long one can hold back Redis's own expiry cycle elsewhere; keywatch's
//!   poker (the ledger) covers the keys it watches either way.
//!
//! `PEXPIRETIME`, not `PTTL`: an absolute deadline is the same in every scan, which is what lets
//! keywatch warn **once per key per deadline**. Due warnings go to the engine as
//! [`Signal::Warn`], which claims each in Redis (`SET {prefix}warned:{db}:{rule}:{deadline}:{key}
//! NX PXAT deadline + 1 min`) in the same step that records it (`crate::engine::intake`), so
//! every instance and every later scan sees it and no crash falls between claim and record; a
//! renewed key has a new deadline, hence a new claim, and is warned again only once that
//! deadline is within `warn_before`. From there warnings go through the same matching, delivery
//! and digests as expiries.
//!
//! The schedule: `@every DUR` runs at multiples of DUR since the Unix epoch (so instances agree
//! on the instants), cron in `scanner.timezone` (croner, 5 or 6 fields). Runs of one instance
//! never overlap: the next instant is computed when a run ends, so a run longer than the period
//! skips the instants it overran instead of bursting. Each instant is claimed in Redis, so among
//! instances one runs it. The last completed instant is recorded; at start, if an instant passed
//! since (keywatch was down), or none was ever recorded, one run starts at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::keyspace::Conn;
use chrono::{DateTime, TimeZone, Utc};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ScannerSettings, Schedule};
use crate::event::{EventKind, KeyEvent};
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::source::Signal;
use crate::source::ledger::Ledger;

/// Keys asked for per `SCAN` call. Redis walks about this many keys per call whatever matches, so
/// it bounds how long one call keeps other clients waiting: measured 0.35 ms on a busy 2-core
/// box (1.4 µs a key), where 1000 took 1.4 ms and pushed another client's p99 up by as much.
pub const SCAN_COUNT: u64 = 250;
/// Ledger entries per range query.
const LEDGER_PAGE: usize = 1000;
/// A reply slower than this (and than 8× the fastest seen) means Redis is busy: pause.
const SLOW_FLOOR: Duration = Duration::from_millis(2);
/// The longest single pause for a slow reply.
const MAX_PAUSE: Duration = Duration::from_secs(1);

use crate::keyspace::clock::now_ms;

/// `scanner.schedule` in `scanner.timezone`: when runs are due.
#[derive(Clone, Debug)]
pub struct Plan {
    schedule: Schedule,
    timezone: chrono_tz::Tz,
}

impl Plan {
    pub fn new(settings: &ScannerSettings) -> Plan {
        Plan {
            schedule: settings.schedule.clone(),
            timezone: settings.timezone,
        }
    }

    /// The first instant strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.schedule {
            Schedule::Every(d) => {
                let period = (d.as_millis() as i64).max(1);
                let ms = t.timestamp_millis();
                Utc.timestamp_millis_opt((ms.div_euclid(period) + 1) * period)
                    .single()
            }
            Schedule::Cron(c) => c
                .find_next_occurrence(&t.with_timezone(&self.timezone), false)
                .ok()
                .map(|x| x.with_timezone(&Utc)),
        }
    }

    /// The last instant at or before `t`.
    pub fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.schedule {
            Schedule::Every(d) => {
                let period = (d.as_millis() as i64).max(1);
                let ms = t.timestamp_millis();
                Utc.timestamp_millis_opt(ms.div_euclid(period) * period)
                    .single()
            }
            Schedule::Cron(c) => c
                .find_previous_occurrence(&t.with_timezone(&self.timezone), true)
                .ok()
                .map(|x| x.with_timezone(&Utc)),
        }
    }

    /// The instant a start-up run stands for: the latest one passed since `last` (the last
    /// completed run, `None` if there never was one), if any.
    pub fn missed(&self, last_ms: Option<i64>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let latest = self.latest_at_or_before(now)?;
        match last_ms {
            Some(l) if latest.timestamp_millis() <= l => None,
            _ => Some(latest),
        }
    }
}

/// Paces a walk to `per_second` keys and backs off when Redis answers slowly.
#[derive(Debug)]
pub struct Pacer {
    per_second: f64,
    since: Instant,
    walked: u64,
    fastest: Option<Duration>,
    /// How often a slow reply made the walk pause.
    pub pauses: u64,
}

impl Pacer {
    pub fn new(per_second: u64) -> Pacer {
        Pacer {
            per_second: per_second.max(1) as f64,
            since: Instant::now(),
            walked: 0,
            fastest: None,
            pauses: 0,
        }
    }

    /// After a round trip that walked `walked` keys and took `reply`: waits as long as the pace
    /// asks, or longer when the reply was slow.
    pub async fn step(&mut self, walked: u64, reply: Duration) {
        let fastest = *self
            .fastest
            .insert(self.fastest.map_or(reply, |f| f.min(reply)));
        if reply > (fastest * 8).max(SLOW_FLOOR) {
            // Others are queuing behind Redis: give it four times the reply's length to itself,
            // then restart the pace from here instead of catching up in a burst.
            self.pauses += 1;
            tokio::time::sleep((reply * 4).min(MAX_PAUSE)).await;
            self.since = Instant::now();
            self.walked = 0;
            return;
        }
        self.walked += walked;
        let due = self.since + Duration::from_secs_f64(self.walked as f64 / self.per_second);
        tokio::time::sleep_until(due).await;
    }
}

/// The SCAN globs that cover `globs`: each distinct one, or one `*` walk when there are many
/// (each glob is a full walk of the keyspace) or one is `*` already.
pub fn covering_globs(mut globs: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    globs.sort();
    globs.dedup();
    if globs.len() > 8 || globs.iter().any(|g| g.as_slice() == b"*") {
        globs = vec![b"*".to_vec()];
    }
    globs
}

/// A paced `SCAN MATCH` walk over one database, reading each returned key's deadline.
pub struct ScanWalk {
    conn: Conn,
    /// Where a key longer than [`crate::long_key::EXACT`] has its deadline read, on a
    /// connection of its own ([`Conn::direct`]).
    long: Conn,
    globs: Vec<Vec<u8>>,
    glob: usize,
    cursor: u64,
    skip_prefix: Vec<u8>,
    /// `COUNT` of each `SCAN` ([`SCAN_COUNT`]).
    pub count: u64,
    pub pacer: Pacer,
    /// Keys the last `SCAN` returned, whose deadlines the next step reads.
    pending: Vec<Vec<u8>>,
    /// Keys SCAN returned (before the own-prefix filter).
    pub read: u64,
}

impl ScanWalk {
    /// Walks `globs` in turn on `conn` (one node's, made for the walk: a page may hold a key of
    /// megabytes, which grows its read buffer for as long as it lives); keys under
    /// `skip_prefix` (keywatch's own) are never returned. A long key's deadline is read through
    /// `long` ([`Conn::direct`]), never pipelined (docs/reliability.md#bounded-whatever-the-key).
    pub fn new(
        conn: Conn,
        long: Conn,
        globs: Vec<Vec<u8>>,
        skip_prefix: &str,
        max_keys_per_second: u64,
    ) -> ScanWalk {
        ScanWalk {
            conn,
            long,
            globs,
            glob: 0,
            cursor: 0,
            skip_prefix: skip_prefix.as_bytes().to_vec(),
            count: SCAN_COUNT,
            pending: Vec::new(),
            pacer: Pacer::new(max_keys_per_second),
            read: 0,
        }
    }

    /// The next batch of `(key, deadline_ms)` of keys that have a TTL (possibly empty);
    /// `None` when the walk is over.
    ///
    /// One round trip per step: the deadlines of the keys the previous `SCAN` returned travel
    /// in the same pipeline as the next `SCAN`.
    pub async fn next(&mut self) -> redis::RedisResult<Option<Vec<(Vec<u8>, i64)>>> {
        let glob = self.globs.get(self.glob).cloned();
        if glob.is_none() && self.pending.is_empty() {
            return Ok(None);
        }
        let asked = std::mem::take(&mut self.pending);
        let is_long = |k: &[u8]| crate::long_key::is_long(k);
        let mut pipe = redis::pipe();
        for k in asked.iter().filter(|k| !is_long(k)) {
            pipe.cmd("PEXPIRETIME").arg(k);
        }
        if let Some(glob) = &glob {
            pipe.cmd("SCAN")
                .arg(self.cursor)
                .arg("MATCH")
                .arg(glob)
                .arg("COUNT")
                .arg(self.count);
        }
        let started = Instant::now();
        let mut replies: Vec<redis::Value> = pipe.query_async(&mut self.conn).await?;
        let reply = started.elapsed();
        if glob.is_some() {
            let scan = replies.pop().unwrap_or(redis::Value::Nil);
            let (next, mut keys): (u64, Vec<Vec<u8>>) = redis::from_redis_value(scan)?;
            if next == 0 {
                self.glob += 1;
            }
            self.cursor = next;
            self.read += keys.len() as u64;
            keys.retain(|k| !k.starts_with(&self.skip_prefix));
            self.pending = keys;
        }
        let mut found = Vec::with_capacity(asked.len());
        let mut replies = replies.into_iter();
        for k in asked {
            let d = match is_long(&k) {
                true => self.long.direct(&[b"PEXPIRETIME", &k]).await?,
                false => replies.next().unwrap_or(redis::Value::Int(-2)),
            };
            let d: i64 = redis::from_redis_value(d)?;
            if d > 0 {
                found.push((k, d));
            }
        }
        if glob.is_some() {
            self.pacer.step(self.count, reply).await;
        }
        Ok(Some(found))
    }
}

/// `PEXPIRETIME` of each key, pipelined (a long one on a connection of its own,
/// [`crate::keyspace::each_key`]): the deadline in ms, -1 without a TTL, -2 when gone.
pub async fn pexpiretime(conn: &Conn, keys: &[Vec<u8>]) -> redis::RedisResult<Vec<i64>> {
    crate::keyspace::each_key(conn, "PEXPIRETIME", keys).await
}

/// What one run did, for the log.
#[derive(Debug, Default)]
pub struct RunStats {
    /// Keys read: returned by SCAN, or ledger entries.
    pub keys: u64,
    /// Keys within a rule's `warn_before` handed to the engine (one per key and rule). The
    /// engine warns each once per deadline, so a key keeps counting here, run after run, long
    /// after its one warning went out: the log calls them `due`, not warnings sent.
    pub due: u64,
    pub pauses: u64,
    pub from_ledger: bool,
}

/// The scanner task of `keywatch run`.
#[derive(Clone)]
pub struct Scanner {
    pub config: Arc<Config>,
    pub keyspace: Keyspace,
    /// Where claims and the schedule's bookkeeping live (`state.url`, or the watched Redis).
    pub state: Conn,
    /// Asked instead of scanning once it is complete.
    pub ledger: Option<Ledger>,
    pub metrics: Arc<Metrics>,
    pub tx: mpsc::Sender<Signal>,
    /// Claims hold it, so a claim's owner can be told in Redis.
    pub instance: String,
}

impl Scanner {
    pub fn new(
        config: Arc<Config>,
        keyspace: Keyspace,
        state: Conn,
        ledger: Option<Ledger>,
        metrics: Arc<Metrics>,
        tx: mpsc::Sender<Signal>,
    ) -> Scanner {
        Scanner {
            config,
            keyspace,
            state,
            ledger,
            metrics,
            tx,
            instance: format!("{:016x}", fastrand::u64(..)),
        }
    }

    fn expiring_rules(&self) -> Vec<usize> {
        (0..self.config.rules.len())
            .filter(|&i| self.config.rules[i].on.contains(&EventKind::Expiring))
            .collect()
    }

    /// Runs on the schedule until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let Some(settings) = self.config.scanner.clone() else {
            return;
        };
        if self.expiring_rules().is_empty() {
            return;
        }
        let plan = Plan::new(&settings);
        let runs = crate::store::scanner::Runs::new(self.state.clone(), &self.config.state.prefix);
        let last: Option<i64> = match runs.last().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "Scanner: cannot read when it last ran; running now.");
                None
            }
        };
        let mut pending = plan.missed(last, crate::keyspace::clock::now());
        if pending.is_some() {
            tracing::info!(schedule = %settings.schedule_text, "Scanner: a scheduled run was missed (or none ever ran); running once now.");
        }
        let mut previous = pending.unwrap_or_else(crate::keyspace::clock::now);
        loop {
            let instant = match pending.take() {
                Some(t) => t,
                None => {
                    // From the later of now and the last instant: a timer that fires a hair early
                    // by the wall clock must not run the same instant twice.
                    let Some(next) = plan.next_after(crate::keyspace::clock::now().max(previous))
                    else {
                        tracing::warn!(schedule = %settings.schedule_text, "Scanner: the schedule has no next run; the scanner stops.");
                        return;
                    };
                    let wait = (next - crate::keyspace::clock::now())
                        .to_std()
                        .unwrap_or_default();
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    next
                }
            };
            previous = instant;
            if !self.claim_run(&runs, &plan, instant).await {
                tracing::debug!(%instant, "Scanner: another instance runs this one.");
                continue;
            }
            let started = Instant::now();
            let outcome = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                r = self.run_once() => r,
            };
            let took = started.elapsed();
            match outcome {
                Ok(stats) => {
                    crate::internal_events::ScanDone {
                        keys: stats.keys,
                        due: stats.due,
                        pauses: stats.pauses,
                        from: if stats.from_ledger { "ledger" } else { "scan" },
                        took,
                    }
                    .emit(&self.metrics);
                    let _ = runs.ran(instant.timestamp_millis()).await;
                }
                Err(e) => {
                    self.metrics.scan_seconds.observe(took.as_secs_f64());
                    tracing::warn!(error = %e, "Scanner: the run failed; the next one tries again.")
                }
            }
        }
    }

    /// Claims `instant` for this instance; on a Redis error it runs anyway (claims of the
    /// warnings still keep them single).
    async fn claim_run(
        &self,
        runs: &crate::store::scanner::Runs,
        plan: &Plan,
        instant: DateTime<Utc>,
    ) -> bool {
        let period = plan
            .next_after(instant)
            .map_or(Duration::from_secs(60), |n| {
                (n - instant).to_std().unwrap_or_default()
            });
        // Long enough to cover instances whose clocks differ a little, short enough that a
        // restart after a crash mid-run can catch up.
        let hold = (period / 2).clamp(Duration::from_millis(500), Duration::from_secs(60));
        runs.claim(instant.timestamp_millis(), &self.instance, hold)
            .await
            .unwrap_or(true)
    }

    /// One run: every key of an `expiring` rule whose TTL is within its rule's `warn_before`,
    /// warned unless already warned for this deadline.
    pub async fn run_once(&self) -> redis::RedisResult<RunStats> {
        let rules = self.expiring_rules();
        let horizon = rules
            .iter()
            .filter_map(|&i| self.config.rules[i].warn_before)
            .max()
            .unwrap_or_default()
            .as_millis() as i64;
        let mut stats = RunStats::default();
        let ledger = self.ledger.as_ref().filter(|l| l.is_filled());
        stats.from_ledger = ledger.is_some();
        for &db in &self.config.redis.databases {
            let here: Vec<usize> = rules
                .iter()
                .copied()
                .filter(|&i| self.config.rules[i].fires_on(EventKind::Expiring, db))
                .collect();
            if here.is_empty() {
                continue;
            }
            match ledger {
                Some(l) => self.via_ledger(l, db, horizon, &mut stats).await?,
                None => self.via_scan(db, &here, &mut stats).await?,
            }
        }
        Ok(stats)
    }

    async fn via_ledger(
        &self,
        ledger: &Ledger,
        db: u32,
        horizon: i64,
        stats: &mut RunStats,
    ) -> redis::RedisResult<()> {
        let now = now_ms();
        let conn = self.keyspace.conn(db).await?;
        let mut after = crate::store::ledger::Cursor::default();
        loop {
            let rows = ledger
                .between(db, now, now + horizon, &mut after, LEDGER_PAGE)
                .await?;
            let n = rows.len();
            if n == 0 {
                return Ok(());
            }
            stats.keys += n as u64;
            self.metrics.scan_keys.inc_by(n as u64);
            // The ledger may lag (a plain SET drops a TTL silently): Redis has the last word.
            let keys: Vec<Vec<u8>> = rows.into_iter().map(|(k, _)| k).collect();
            let deadlines = pexpiretime(&conn, &keys).await?;
            let found = keys
                .into_iter()
                .zip(deadlines)
                .filter(|(_, d)| *d > 0)
                .collect();
            stats.due += self.warn(db, found).await?;
        }
    }

    async fn via_scan(
        &self,
        db: u32,
        rules: &[usize],
        stats: &mut RunStats,
    ) -> redis::RedisResult<()> {
        let globs = covering_globs(
            rules
                .iter()
                .map(|&i| self.config.rules[i].pattern.scan_glob().to_vec())
                .collect(),
        );
        let pace = self
            .config
            .scanner
            .as_ref()
            .map_or(50_000, |s| s.max_keys_per_second);
        let long = self.keyspace.conn(db).await?;
        for conn in self.keyspace.walk_conns(db, None).await? {
            let mut walk = ScanWalk::new(
                conn,
                long.clone(),
                globs.clone(),
                &self.config.state.prefix,
                pace,
            );
            let mut read = 0;
            while let Some(found) = walk.next().await? {
                self.metrics.scan_keys.inc_by(walk.read - read);
                read = walk.read;
                if !found.is_empty() {
                    stats.due += self.warn(db, found).await?;
                }
            }
            stats.keys += walk.read;
            stats.pauses += walk.pacer.pauses;
        }
        Ok(())
    }

    /// Sends the warnings due among `found` (`(key, deadline_ms)`) to be claimed and fired;
    /// returns how many.
    async fn warn(&self, db: u32, found: Vec<(Vec<u8>, i64)>) -> redis::RedisResult<u64> {
        let config = &self.config;
        let now = now_ms();
        let mut idx = Vec::new();
        // (position in `found`, rule) for every warning due now.
        let mut due: Vec<(usize, usize)> = Vec::new();
        for (i, (key, deadline)) in found.iter().enumerate() {
            let ttl = deadline - now;
            if ttl <= 0 {
                continue; // due: the expiry, not a warning
            }
            config.matching_rules(key, &mut idx);
            for &r in &idx {
                let rule = &config.rules[r];
                if rule.fires_on(EventKind::Expiring, db)
                    && rule
                        .warn_before
                        .is_some_and(|w| ttl <= w.as_millis() as i64)
                {
                    due.push((i, r));
                }
            }
        }
        if due.is_empty() {
            return Ok(0);
        }
        // Claimed by the engine, in the same step that records the warning (see
        // `crate::engine::intake`): a claim made here, before the warning is stored, was lost
        // with the process that made it.
        let mut by_key: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for &(i, r) in &due {
            by_key
                .entry(i)
                .or_default()
                .push(config.rules[r].name.clone());
        }
        let mut sent = 0;
        let node = self.keyspace.node();
        for (i, rules) in by_key {
            let (key, deadline) = &found[i];
            let observed_at = crate::keyspace::clock::now();
            sent += rules.len() as u64;
            let event = KeyEvent {
                kind: EventKind::Expiring,
                db,
                key: key.clone().into(),
                field: None,
                observed_at,
                deadline: DateTime::from_timestamp_millis(*deadline),
                ttl_ms: Some((deadline - observed_at.timestamp_millis()).max(0)),
                recovered: false,
                source: node.clone(),
                place: None,
            };
            if self.tx.send(Signal::Warn { event, rules }).await.is_err() {
                break; // the engine is gone: shutting down
            }
        }
        Ok(sent)
    }
}

crate::keyspace::commands::declare! {
    /// The commands the scanner sends to the watched Redis ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "scan", "scanner: finds keys")
            .on(Keys::Watched, Access::Read)
            .args("0 MATCH {glob} COUNT 10")
            .when(When::Expiring),
        Use::new(Server::Watched, "pexpiretime", "scanner: reads deadlines")
            .on(Keys::Watched, Access::Read)
            .args("{key}")
            .when(When::Expiring),
        // Its runs' marks are declared with them (`store::scanner`).
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(schedule: Schedule, tz: chrono_tz::Tz) -> Plan {
        Plan {
            schedule,
            timezone: tz,
        }
    }

    fn cron(s: &str) -> Schedule {
        let c = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .build()
            .parse(s)
            .unwrap();
        Schedule::Cron(Box::new(c))
    }

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn every_is_aligned_to_the_epoch() {
        let p = plan(Schedule::Every(Duration::from_secs(60)), chrono_tz::UTC);
        let t = at("2026-11-29T10:15:42.500Z");
        assert_eq!(p.next_after(t), Some(at("2026-11-29T10:16:00Z")));
        assert_eq!(p.latest_at_or_before(t), Some(at("2026-11-29T10:15:00Z")));
        // Strictly after: an instant is never its own next.
        let on = at("2026-11-29T10:16:00Z");
        assert_eq!(p.next_after(on), Some(at("2026-11-29T10:17:00Z")));
        assert_eq!(p.latest_at_or_before(on), Some(on));
    }

    #[test]
    fn cron_runs_in_its_timezone() {
        // 09:00 in Shanghai is 01:00 UTC.
        let p = plan(cron("0 9 * * *"), chrono_tz::Asia::Shanghai);
        let t = at("2026-11-29T00:30:00Z");
        assert_eq!(p.next_after(t), Some(at("2026-11-29T01:00:00Z")));
        assert_eq!(p.latest_at_or_before(t), Some(at("2026-11-28T01:00:00Z")));
        // Six fields: seconds first.
        let p = plan(cron("*/10 * * * * *"), chrono_tz::UTC);
        assert_eq!(
            p.next_after(at("2026-11-29T00:00:05Z")),
            Some(at("2026-11-29T00:00:10Z"))
        );
    }

    #[test]
    fn a_missed_run_runs_once_at_start() {
        let p = plan(cron("*/5 * * * *"), chrono_tz::UTC);
        let now = at("2026-11-29T10:17:00Z");
        // Never ran: run now, standing for the latest instant.
        assert_eq!(p.missed(None, now), Some(at("2026-11-29T10:15:00Z")));
        // Down over several instants: one run, not one per instant.
        let long_ago = at("2026-11-29T09:00:00Z").timestamp_millis();
        assert_eq!(
            p.missed(Some(long_ago), now),
            Some(at("2026-11-29T10:15:00Z"))
        );
        // The latest instant ran: nothing missed.
        let ran = at("2026-11-29T10:15:00Z").timestamp_millis();
        assert_eq!(p.missed(Some(ran), now), None);
    }

    #[test]
    fn many_globs_become_one_walk() {
        assert_eq!(
            covering_globs(vec![b"a:*".to_vec(), b"b:*".to_vec(), b"a:*".to_vec()]),
            vec![b"a:*".to_vec(), b"b:*".to_vec()]
        );
        assert_eq!(
            covering_globs(vec![b"a:*".to_vec(), b"*".to_vec()]),
            vec![b"*".to_vec()]
        );
        let many = (0..9).map(|i| format!("k{i}:*").into_bytes()).collect();
        assert_eq!(covering_globs(many), vec![b"*".to_vec()]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_pacer_keeps_the_pace_and_backs_off_when_redis_is_slow() {
        let mut p = Pacer::new(10_000);
        let t0 = Instant::now();
        for _ in 0..10 {
            p.step(1000, Duration::from_micros(200)).await;
        }
        // 10 000 keys at 10 000/s: one second.
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        let t1 = Instant::now();
        p.step(1000, Duration::from_millis(50)).await;
        assert_eq!(p.pauses, 1);
        assert_eq!(t1.elapsed(), Duration::from_millis(200));
        // The pace restarts after a pause: no burst to catch up.
        let t2 = Instant::now();
        p.step(1000, Duration::from_micros(200)).await;
        assert_eq!(t2.elapsed(), Duration::from_millis(100));
    }
}
