//! The deadline ledger's keys: per watched database, the deadlines of the keys the rules watch,
//! each in the hash of the second it falls in, with the minutes that hold some ([`Names`],
//! docs/how-it-works.md#the-ledgers-compact-form), the keys touched at their deadline and found
//! gone ("poked", tagged with a marker sequence number, their deadlines in a
//! hash beside), the marker sequence shared by every instance, and the pub/sub channel markers
//! go on. What the ledger does with them is [`crate::source`]'s (the poker, reconcile, fill);
//! see `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use crate::keyspace::Conn;
use crate::store::handled;

/// Names a deadline's hash (see the file) and chunks lists: put in front of every script here.
pub const BUCKET: &str = include_str!("ledger/bucket.lua");
/// Records read deadlines unless the handled memory says they were taken.
const RECORD: &str = include_str!("ledger/record.lua");
/// Reads the due deadlines for the poker.
const DUE: &str = include_str!("ledger/due.lua");
/// Reads a minute's deadlines for the walks, its long keys as copies.
const MINUTE: &str = include_str!("ledger/minute.lua");
/// Moves touched-and-gone keys to the poked set.
const MOVE_POKED: &str = include_str!("ledger/move_poked.lua");
/// Reads the poked set up to a marker, its long keys as copies.
const POKED: &str = include_str!("ledger/poked.lua");
/// Converts an earlier keywatch's ledger (one sorted set) to this form.
const CONVERT: &str = include_str!("ledger/convert.lua");
/// Names a far deadline's shard: put after [`BUCKET`] in front of the far buckets' scripts.
const FAR_SHARD: &str = include_str!("ledger/far_shard.lua");
/// Removes deadlines wherever they are, and writes far ones to their hour's shard.
const FAR: &str = include_str!("ledger/far.lua");
/// Moves the far buckets due soon into their seconds' hashes.
const REFINE: &str = include_str!("ledger/refine.lua");
/// Marks a far hour dense, and moves its shards into their seconds' hashes.
const DENSE: &str = include_str!("ledger/dense.lua");

/// A script with [`BUCKET`] in front.
fn with_bucket(lua: &str) -> redis::Script {
    redis::Script::new(&format!("{BUCKET}{lua}"))
}

/// A script with [`BUCKET`] and [`FAR_SHARD`] in front.
fn with_far(lua: &str) -> redis::Script {
    redis::Script::new(&format!("{BUCKET}{FAR_SHARD}{lua}"))
}

/// [`RECORD`] with [`BUCKET`] in front, for a script sent whole where it is not loaded yet.
static RECORD_CODE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{BUCKET}{RECORD}"));

/// The scripts the key and the field ledger share: the poker's read, the walks' and the
/// conversion.
static DUE_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| with_bucket(DUE));
static MINUTE_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| with_bucket(MINUTE));
static POKED_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| with_bucket(POKED));
/// [`MOVE_POKED`] with [`BUCKET`] in front, for a script sent whole where it is not loaded yet.
static MOVE_POKED_CODE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{BUCKET}{MOVE_POKED}"));
static CONVERT_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| with_bucket(CONVERT));

/// A ledger's names in one database: the minutes' sorted set and its hashes' prefix. The key
/// ledger's are `{prefix}ledger:DB:…`, the field ledger's `{prefix}fields:DB:…`; both keep
/// deadlines the same way.
pub struct Names {
    pub minutes: String,
    pub seconds: String,
    /// Where the poker's read copies a due long key (`ledger/due.lua`), by its SHA-1.
    pub copies: String,
}

impl Names {
    /// The names under `base` (`{prefix}ledger:DB`).
    pub fn under(base: &str) -> Names {
        Names {
            minutes: format!("{base}:minutes"),
            seconds: format!("{base}:at:"),
            copies: format!("{base}:copy:"),
        }
    }

    /// The hash holding `key`'s deadline if it falls in `second` (as `ledger/bucket.lua` names
    /// it).
    pub fn bucket(&self, second: i64, key: &[u8]) -> String {
        if key.len() > LONG_KEY {
            format!("{}{second}:long", self.seconds)
        } else {
            format!("{}{second}", self.seconds)
        }
    }

    /// Deadlines up to `until_ms`, `limit` after skipping `offset` of them, earliest minute
    /// first, and the earliest the ledger may hold after them (see `ledger/due.lua`). A due key
    /// longer than `long_key::EXACT` comes as its copy, to be read with [`Due::resolve`].
    pub async fn due(
        &self,
        conn: &mut Conn,
        until_ms: i64,
        offset: usize,
        limit: usize,
    ) -> redis::RedisResult<Due> {
        let (rows, next, copies): (Rows, i64, Vec<Copy>) = DUE_SCRIPT
            .key(&self.minutes)
            .arg(&self.seconds)
            .arg(until_ms)
            .arg(offset)
            .arg(limit)
            .arg(crate::long_key::EXACT)
            .arg(&self.copies)
            .invoke_async(conn)
            .await?;
        Ok(Due {
            rows: rows
                .into_iter()
                .map(|(k, d)| (bytes::Bytes::from(k), d))
                .collect(),
            copies,
            next: (next >= 0).then_some(next),
        })
    }

    /// The earliest deadline the minutes say they may hold (no later than the earliest held),
    /// `None` when they hold none: the poker's safety round, one command
    /// (docs/how-it-works.md#the-poker).
    pub async fn earliest(&self, conn: &mut Conn) -> redis::RedisResult<Option<i64>> {
        let first: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(&self.minutes)
            .arg("-inf")
            .arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await?;
        Ok(first.first().map(|(_, score)| *score as i64))
    }

    /// Up to `limit` minutes holding deadlines, from minute `from` on and no later than
    /// `until_ms`, in order.
    pub async fn minutes(
        &self,
        conn: &mut Conn,
        from: i64,
        until_ms: i64,
        limit: usize,
    ) -> redis::RedisResult<Vec<i64>> {
        redis::cmd("ZRANGE")
            .arg(&self.minutes)
            .arg(from.saturating_mul(60_000))
            .arg(until_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(conn)
            .await
    }

    /// Every deadline in `minute`, in one round trip (unordered) but for the keys longer than
    /// `long_key::EXACT`, which come as copies (`ledger/minute.lua`) read a MiB at a time: the
    /// walks that read the ledger whole (docs/reliability.md#bounded-whatever-the-key). A copy
    /// gone meanwhile (deleted by hand) leaves its key out of this reading.
    pub async fn in_minute(
        &self,
        conn: &mut Conn,
        minute: i64,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        let (mut rows, copies): (Rows, Vec<Copy>) = MINUTE_SCRIPT
            .key(&self.minutes)
            .arg(&self.seconds)
            .arg(minute)
            .arg(crate::long_key::EXACT)
            .arg(&self.copies)
            .invoke_async(conn)
            .await?;
        read_copies(conn, copies, &mut rows).await?;
        Ok(rows)
    }

    /// Deadlines in `(from_ms, until_ms]`, soonest first, a page at a time: at least
    /// `at_least` (whole minutes of them) unless none are left, from the minute after `after`
    /// (`None`: the first), which is moved on. An empty page is the end.
    pub async fn between(
        &self,
        conn: &mut Conn,
        from_ms: i64,
        until_ms: i64,
        after: &mut Option<i64>,
        at_least: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        let mut out = Vec::new();
        loop {
            let from = after.map_or(from_ms.div_euclid(60_000), |m| m + 1);
            let minutes = self.minutes(conn, from, until_ms, 16).await?;
            if minutes.is_empty() {
                return Ok(out);
            }
            for minute in minutes {
                let mut rows = self.in_minute(conn, minute).await?;
                rows.retain(|(_, d)| *d > from_ms && *d <= until_ms);
                rows.sort_unstable_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
                out.extend(rows);
                *after = Some(minute);
                if out.len() >= at_least {
                    return Ok(out);
                }
            }
        }
    }

    /// Converts up to a batch of an earlier keywatch's sorted set `old`; returns how many
    /// entries it still holds.
    pub async fn convert(&self, conn: &mut Conn, old: &str) -> redis::RedisResult<usize> {
        CONVERT_SCRIPT
            .key(old)
            .key(&self.minutes)
            .arg(&self.seconds)
            .arg(CONVERT_BATCH)
            .invoke_async(conn)
            .await
    }
}

/// A due long key's copy, as `ledger/due.lua` names it: its name, the deadline, the key's length.
type Copy = (String, i64, usize);

/// Due keys and their deadlines.
type Rows = Vec<(Vec<u8>, i64)>;

/// What the poker's read of due deadlines answers ([`Names::due`]).
pub struct Due {
    /// Due (key, deadline) pairs, earliest minute first, but for the long keys.
    pub rows: Vec<(bytes::Bytes, i64)>,
    /// The due keys longer than `long_key::EXACT`, each as its copy's name, its deadline and its
    /// length: read a MiB at a time ([`read_copy`]), and only when the poker touches it (not
    /// at each round of its grace, 16 MiB every 2 ms; docs/reliability.md#bounded-whatever-the-key).
    pub copies: Vec<(String, i64, usize)>,
    /// The earliest deadline the ledger may hold after this read (a minute's score: no later
    /// than its earliest deadline), `None` when it holds none.
    pub next: Option<i64>,
}

impl Due {
    /// Every due key, the long ones read from their copies (one gone meanwhile, its minute over,
    /// is left for the next round, which copies it again).
    pub async fn resolve(self, conn: &mut Conn) -> redis::RedisResult<Vec<(bytes::Bytes, i64)>> {
        let mut rows = self.rows;
        read_copies(conn, self.copies, &mut rows).await?;
        Ok(rows)
    }
}

/// Reads each of `copies` (a long key's copy, its deadline and length) a MiB at a time and adds
/// it to `rows`; a copy gone meanwhile (its minute over, deleted by hand) is left out.
async fn read_copies<K: From<Vec<u8>>>(
    conn: &mut Conn,
    copies: Vec<Copy>,
    rows: &mut Vec<(K, i64)>,
) -> redis::RedisResult<()> {
    for (copy, deadline, len) in copies {
        if let Some(key) = crate::store::long_keys::read_at(conn, &copy, len).await? {
            rows.push((K::from(key), deadline));
        }
    }
    Ok(())
}

/// The due long key of the copy `name` (`len` bytes), read a MiB at a time; `None` if the copy is
/// gone.
pub async fn read_copy(
    conn: &mut Conn,
    name: &str,
    len: usize,
) -> redis::RedisResult<Option<bytes::Bytes>> {
    Ok(crate::store::long_keys::read_at(conn, name, len)
        .await?
        .map(bytes::Bytes::from))
}

/// How far the clock estimate an instance stamped a deadline-less take with may lag Redis's.
pub const TAKEN_SLACK_MS: i64 = 100;

/// Deadlines nearer than this are recorded through the script that asks the handled memory;
/// later ones cannot have been taken yet (see [`Deadlines::record`]). A minute: far more than
/// the clock estimate's error and a write's delay.
const NEAR_MS: i64 = 60_000;

/// Keys longer than this go to a second's `:long` hash: one such field would turn the whole
/// second's hash from a listpack into a hashtable (`hash-max-listpack-value`, 64 by default).
/// The same in `ledger/bucket.lua`: every instance must name the same hash for a key.
pub const LONG_KEY: usize = 64;

/// Entries converted from an earlier ledger per script call.
const CONVERT_BATCH: usize = 1000;

/// A far bucket's width: an hour (docs/how-it-works.md#far-deadlines). 1,000,000 deadlines
/// spread over a year are 114 an hour, enough to share a bucket's own cost (a Redis key, about
/// 80 bytes); denser hours are split into shards.
pub const FAR_WIDTH_MS: i64 = 3_600_000;

/// How long before its hour starts the poker refines a far bucket into its seconds' hashes:
/// time enough for the densest hour, a shard per script, and for a poker that was busy.
pub const REFINE_AHEAD_MS: i64 = 300_000;

/// How much later than [`REFINE_AHEAD_MS`] an hour must start for an instance to send its
/// deadlines to the far buckets: a write that reaches Redis after the refinement began goes to
/// its second anyway (`ledger/far.lua` reads the frontier), so this only spares that script
/// deadlines it would not keep far.
const FAR_MARGIN_MS: i64 = 60_000;

/// How many keys an hour's shards hold on average: an hour is split a shard further
/// (`ledger/far.lua`) when it holds more. Linear hashing leaves the shards not yet split in a
/// round about twice as full as the split ones, so shards hold up to about twice this, a listpack
/// well under Redis's default `hash-max-listpack-entries` (512); fewer keys per shard would walk
/// shorter listpacks but pay a Redis key (about 100 bytes) among fewer keys (docs/performance.md,
/// "Learning far deadlines": the walk is an eighth of Redis's time per key).
const FAR_LOAD: usize = 96;

/// How many deadlines an hour must be expected to hold for a fill to mark it dense
/// (docs/how-it-works.md#dense-hours): 40 a second. Its seconds' hashes then cost about what its
/// shards would (docs/performance.md, "Learning a big keyspace"), and its deadlines are written
/// without a script; 1,000,000 keys over a day are 11.6 a second, and stay in shards.
pub const DENSE_HOUR: u64 = 144_000;

/// About how many deadlines one refinement script moves: a millisecond or so of Redis's time,
/// so on-time pokes beside it are not held up.
const REFINE_BATCH: usize = 500;

/// Far deadlines written per script: the script costs Redis about 3 µs per deadline (one `HSET`
/// and Lua's own work, splits amortised), so a script of 250 holds every other client up for
/// under a millisecond. A page's scripts are sent together, not one after the other.
const FAR_BATCH: usize = 250;

/// A key's hash for naming its far shard: its bytes as a polynomial modulo the prime
/// 4294967291, base 1000003, as `ledger/far_shard.lua` computes it (every product stays below
/// 2^52, exact in Lua's doubles). Computed here and passed in with the key, so Redis's one
/// thread hashes a key only when a split moves it.
pub fn far_hash(key: &[u8]) -> u64 {
    key.iter()
        .fold(0u64, |h, &b| (h * 1_000_003 + u64::from(b)) % 4_294_967_291)
}

/// The start of the hour a deadline's far bucket covers.
pub fn far_start(deadline_ms: i64) -> i64 {
    deadline_ms.div_euclid(FAR_WIDTH_MS) * FAR_WIDTH_MS
}

/// Whether a deadline written at `now_ms` goes to the far buckets (a long key never does: see
/// `ledger/far.lua`).
pub fn goes_far(deadline_ms: i64, key: &[u8], now_ms: i64) -> bool {
    key.len() <= LONG_KEY && far_start(deadline_ms) > now_ms + REFINE_AHEAD_MS + FAR_MARGIN_MS
}

/// When the poker must look after a deadline is written at `now_ms`: at the deadline, or at its
/// far bucket's refinement.
pub fn wake_for(deadline_ms: i64, key: &[u8], now_ms: i64) -> i64 {
    if goes_far(deadline_ms, key, now_ms) {
        far_start(deadline_ms) - REFINE_AHEAD_MS
    } else {
        deadline_ms
    }
}

/// The far buckets' names in one database (see `ledger/far_shard.lua`).
pub struct Far {
    /// The hours that hold far deadlines, scored by their start.
    pub hours: String,
    /// Each hour's shard count.
    pub counts: String,
    /// How many keys each hour's shards hold (what splits them, `ledger/far.lua`).
    pub keys: String,
    /// The latest hour the poker began to refine.
    pub frontier: String,
    /// The shards' prefix: `…:far:HOUR:SHARD`.
    pub shards: String,
}

/// The key ledger's far buckets in `db`.
pub fn far(prefix: &str, db: u32) -> Far {
    let base = format!("{}:far", old_ledger(prefix, db));
    Far {
        counts: format!("{base}:shards"),
        keys: format!("{base}:keys"),
        frontier: format!("{base}:frontier"),
        shards: format!("{base}:"),
        hours: base,
    }
}

/// Where a walk of the ledger is ([`Deadlines::between`]): the seconds' minutes first, then
/// the far buckets, an hour at a time.
#[derive(Default)]
pub struct Cursor {
    minute: Option<i64>,
    seconds_done: bool,
    hour: Option<i64>,
}

/// The second a deadline falls in: the hash that holds it.
pub fn second_of(deadline_ms: i64) -> i64 {
    deadline_ms.div_euclid(1000)
}

/// Which hash of a database a deadline of `key` goes to: its second, and whether it is long.
fn bucket_of(deadline_ms: i64, key: &[u8]) -> (i64, bool) {
    (second_of(deadline_ms), key.len() > LONG_KEY)
}

/// The ledger's keys and scripts on the state server.
#[derive(Clone)]
pub struct Deadlines {
    conn: Conn,
    prefix: String,
    record: redis::Script,
    move_poked: redis::Script,
    far: redis::Script,
    refine: redis::Script,
    dense: redis::Script,
    /// The far hours (database, hour) this instance has seen marked dense: their deadlines go
    /// to their seconds' hashes with plain writes. The mark never goes back before the hour is
    /// refined, and a refined hour's writes go to its seconds anyway, so this may be stale
    /// without harm (docs/how-it-works.md#dense-hours).
    dense_hours: std::sync::Arc<std::sync::Mutex<crate::key_hash::HashSet<(u32, i64)>>>,
}

/// One deadline to record: the key, its deadline as `PEXPIRETIME` answered (-1: no TTL, -2:
/// gone), and the second the instance last knew it in, if any.
pub struct Entry<'a> {
    pub key: &'a [u8],
    pub deadline: i64,
    pub was: Option<i64>,
}

impl Deadlines {
    pub fn new(conn: Conn, prefix: &str) -> Deadlines {
        Deadlines {
            conn,
            prefix: prefix.to_string(),
            record: with_bucket(RECORD),
            move_poked: with_bucket(MOVE_POKED),
            far: with_far(FAR),
            refine: with_far(REFINE),
            dense: with_far(DENSE),
            dense_hours: Default::default(),
        }
    }

    fn names(&self, db: u32) -> Names {
        names(&self.prefix, db)
    }

    fn conn(&self) -> Conn {
        self.conn.clone()
    }

    /// Records `entries` (see [`Entry`]; -1: the key has no TTL, and leaves; -2: it is gone, and
    /// its deadline stays for the poker to judge), but not a deadline the handled memory says
    /// was taken already; `now_ms` by this instance's estimate of Redis's clock. A deadline that
    /// left the second it was known in leaves that second's hash (or its far bucket).
    pub async fn record(
        &self,
        db: u32,
        entries: &[Entry<'_>],
        now_ms: i64,
    ) -> redis::RedisResult<()> {
        let removals: Vec<(i64, &[u8])> = entries
            .iter()
            .filter_map(|e| {
                let was = e.was?;
                let moved = match e.deadline {
                    -1 => true,
                    d if d > 0 => second_of(d) != was,
                    _ => false,
                };
                moved.then_some((was, e.key))
            })
            .collect();
        // Sorted by the hash they go to, so each hash is written once, in one command. A key
        // longer than `long_key::EXACT` goes on its own (see `Deadlines::record_long`).
        let mut writes: Vec<(i64, &[u8])> = entries
            .iter()
            .filter(|e| e.deadline > 0 && !crate::long_key::is_long(e.key))
            .map(|e| (e.deadline, e.key))
            .collect();
        for e in entries
            .iter()
            .filter(|e| e.deadline > 0 && crate::long_key::is_long(e.key))
        {
            self.record_long(db, e.deadline, e.key, now_ms).await?;
        }
        writes.sort_by_key(|(d, k)| bucket_of(*d, k));
        // A deadline further ahead than NEAR_MS cannot have been taken yet: the handled memory
        // has nothing to say about it, and it is written without the script (a fill's page is
        // nearly all such; the script's Lua cost more than the writes themselves,
        // docs/performance.md#the-ledgers-compact-form). One whose hour the poker refines
        // later goes to the far buckets, through the script that names its shard, unless its
        // hour is dense.
        let (near, rest): (Vec<_>, Vec<_>) = writes
            .into_iter()
            .partition(|(d, _)| *d <= now_ms + NEAR_MS);
        let (far, plain): (Vec<_>, Vec<_>) = {
            let dense = self.dense_hours();
            rest.into_iter().partition(|(d, k)| {
                goes_far(*d, k, now_ms) && !dense.contains(&(db, d.div_euclid(FAR_WIDTH_MS)))
            })
        };
        let plain = async {
            if plain.is_empty() {
                return Ok(());
            }
            self.plain_writes(db, &plain)
                .exec_async(&mut self.conn())
                .await
        };
        let far = self.far_writes(db, &removals, &far);
        let checked = async {
            if near.is_empty() {
                return Ok(());
            }
            let names = self.names(db);
            let mut inv = self.record.prepare_invoke();
            inv.key(&names.minutes)
                .arg(TAKEN_SLACK_MS)
                .arg(handled::memory(&self.prefix, db))
                .arg(now_ms.div_euclid(60_000))
                .arg(handled::HANDLED_MINUTES)
                .arg(&names.seconds);
            for (deadline, key) in &near {
                inv.arg(*deadline).arg(*key);
            }
            inv.invoke_async::<()>(&mut self.conn()).await
        };
        let (plain, far, checked) = tokio::join!(plain, far, checked);
        plain.and(far).and(checked)
    }

    /// Records the deadline of one key longer than `long_key::EXACT` (megabytes, maybe) through
    /// `ledger/record.lua`, however far ahead it is, on a connection of its own with the key
    /// written as it is ([`Conn::direct`], docs/reliability.md#bounded-whatever-the-key):
    /// through the shared connection the key was held three more times, and its write buffer
    /// kept the key's length.
    async fn record_long(
        &self,
        db: u32,
        deadline: i64,
        key: &[u8],
        now_ms: i64,
    ) -> redis::RedisResult<()> {
        let names = self.names(db);
        let (slack, memory) = (
            TAKEN_SLACK_MS.to_string(),
            handled::memory(&self.prefix, db),
        );
        let (minute, minutes) = (
            now_ms.div_euclid(60_000).to_string(),
            handled::HANDLED_MINUTES.to_string(),
        );
        let deadline = deadline.to_string();
        self.direct_script(
            &self.record,
            &RECORD_CODE,
            &[names.minutes.as_bytes()],
            &[
                slack.as_bytes(),
                memory.as_bytes(),
                minute.as_bytes(),
                minutes.as_bytes(),
                names.seconds.as_bytes(),
                deadline.as_bytes(),
                key,
            ],
        )
        .await
        .map(drop)
    }

    /// Runs `script` (whose whole code is `code`) on a connection of its own, its arguments
    /// written as they are: for a key longer than `long_key::EXACT`
    /// (docs/reliability.md#bounded-whatever-the-key). Through the shared connection the key was
    /// held three more times, and its write buffer kept the key's length.
    async fn direct_script(
        &self,
        script: &redis::Script,
        code: &str,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> redis::RedisResult<redis::Value> {
        let (sha, n) = (script.get_hash().to_string(), keys.len().to_string());
        let mut all: Vec<&[u8]> = vec![b"EVALSHA", sha.as_bytes(), n.as_bytes()];
        all.extend_from_slice(keys);
        all.extend_from_slice(args);
        match self.conn.direct(&all).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                all[0] = b"EVAL";
                all[1] = code.as_bytes();
                self.conn.direct(&all).await
            }
            r => r,
        }
    }

    /// Which of `keys` (with `deadlines` as `PEXPIRETIME` answered) [`Deadlines::record`] would
    /// write at `now_ms` with a plain `HSET` to a dense far hour this instance knows of: a
    /// deadline that cannot be due for minutes, which a fill may hold back to write with others
    /// of its second (`source::ledger::held`).
    pub fn holds(&self, db: u32, keys: &[Vec<u8>], deadlines: &[i64], now_ms: i64) -> Vec<bool> {
        let dense = self.dense_hours();
        keys.iter()
            .zip(deadlines)
            .map(|(k, &d)| {
                d > now_ms + NEAR_MS
                    && !crate::long_key::is_long(k)
                    && goes_far(d, k, now_ms)
                    && dense.contains(&(db, d.div_euclid(FAR_WIDTH_MS)))
            })
            .collect()
    }

    fn dense_hours(&self) -> std::sync::MutexGuard<'_, crate::key_hash::HashSet<(u32, i64)>> {
        self.dense_hours.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes `hours` of `db` as dense, and forgets the hours already past.
    fn saw_dense(&self, db: u32, hours: &[i64]) {
        if hours.is_empty() {
            return;
        }
        let mut dense = self.dense_hours();
        let past = crate::keyspace::clock::now_ms().div_euclid(FAR_WIDTH_MS);
        dense.retain(|(_, h)| *h >= past);
        dense.extend(hours.iter().map(|h| (db, *h)));
    }

    /// The commands that write `writes` (deadline, key, sorted by hash, each more than
    /// [`NEAR_MS`] ahead) to their seconds: one `ZADD LT` of the minutes, then an `HSET` per hash.
    ///
    /// No transaction: the minutes go first, so a write cut off halfway (a connection lost)
    /// leaves a minute scored earlier than what it holds, never a deadline in a minute not
    /// listed; and the poker reads a minute (and drops it if empty) only once its score is due,
    /// a minute or more after these writes, which have all landed by then. `MULTI` and the
    /// queuing of each `HSET` cost Redis about 0.3 µs per key learnt
    /// (docs/performance.md#learning-a-big-keyspace).
    fn plain_writes(&self, db: u32, writes: &[(i64, &[u8])]) -> redis::Pipeline {
        let names = self.names(db);
        let mut pipe = redis::pipe();
        let mut lows: Vec<(i64, i64)> = Vec::new();
        for &(d, _) in writes {
            let minute = d.div_euclid(60_000);
            match lows.last_mut() {
                Some((m, low)) if *m == minute => *low = (*low).min(d),
                _ => lows.push((minute, d)),
            }
        }
        if !lows.is_empty() {
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(&names.minutes).arg("LT");
            for (m, low) in &lows {
                zadd.arg(*low).arg(*m);
            }
            pipe.add_command(zadd).ignore();
        }
        for run in writes.chunk_by(|a, b| bucket_of(a.0, a.1) == bucket_of(b.0, b.1)) {
            let (d, k) = run[0];
            let mut hset = redis::cmd("HSET");
            hset.arg(names.bucket(second_of(d), k));
            for &(d, k) in run {
                hset.arg(k).arg(d - second_of(d) * 1000);
            }
            pipe.add_command(hset).ignore();
        }
        pipe
    }

    /// Removes `removals` (second, key) from wherever they are, its second's hash or its far
    /// bucket, and writes `far` (deadline, key) to the far buckets (`ledger/far.lua`), at most
    /// [`FAR_BATCH`] of them per script.
    async fn far_writes(
        &self,
        db: u32,
        removals: &[(i64, &[u8])],
        far: &[(i64, &[u8])],
    ) -> redis::RedisResult<()> {
        // A key longer than `long_key::EXACT` is never far (`ledger/far.lua`): its old second's
        // `:long` hash is all it leaves, by an `HDEL` on a connection of its own, so that no
        // shared connection carries it (docs/reliability.md#bounded-whatever-the-key).
        let (long, removals): (Vec<_>, Vec<_>) = removals
            .iter()
            .copied()
            .partition(|(_, k)| crate::long_key::is_long(k));
        for (second, key) in long {
            let hash = self.names(db).bucket(second, key);
            self.conn.direct(&[b"HDEL", hash.as_bytes(), key]).await?;
        }
        if removals.is_empty() && far.is_empty() {
            return Ok(());
        }
        let removals = &removals[..];
        let mut chunks = far.chunks(FAR_BATCH);
        let script = |removals: &[(i64, &[u8])], writes: &[(i64, &[u8])]| {
            let mut inv = self.far_invoke(&self.far, db);
            inv.arg(FAR_LOAD).arg(removals.len());
            for (second, key) in removals {
                inv.arg(*second).arg(*key).arg(far_hash(key));
            }
            for (deadline, key) in writes {
                inv.arg(*deadline).arg(*key).arg(far_hash(key));
            }
            let mut conn = self.conn();
            async move {
                let dense: Vec<i64> = inv.invoke_async(&mut conn).await?;
                self.saw_dense(db, &dense);
                Ok::<_, redis::RedisError>(())
            }
        };
        // Removals go first, alone with the first writes: a later script may write a key's new
        // deadline into the shard its old one is removed from.
        if !removals.is_empty() {
            script(removals, chunks.next().unwrap_or(&[])).await?;
        }
        // The rest are sent together on the multiplexed connection: Redis runs them one after the
        // other, other clients' commands in between, without a round trip each.
        for done in futures_util::future::join_all(chunks.map(|w| script(&[], w))).await {
            done?;
        }
        Ok(())
    }

    /// An invocation of a far buckets' script (`ledger/far.lua`, `ledger/refine.lua`) for `db`:
    /// the keys and the first arguments both take.
    fn far_invoke<'a>(&self, script: &'a redis::Script, db: u32) -> redis::ScriptInvocation<'a> {
        let names = self.names(db);
        let f = far(&self.prefix, db);
        let mut inv = script.prepare_invoke();
        inv.key(&f.hours)
            .key(&f.counts)
            .key(&f.frontier)
            .key(&names.minutes)
            .key(&f.keys)
            .arg(&names.seconds)
            .arg(&f.shards)
            .arg(FAR_WIDTH_MS);
        inv
    }

    /// Drops the deadlines of `keys`, each from the second given (or its far bucket).
    pub async fn forget(&self, db: u32, keys: &[(&[u8], i64)]) -> redis::RedisResult<()> {
        let removals: Vec<(i64, &[u8])> = keys.iter().map(|(k, s)| (*s, *k)).collect();
        self.far_writes(db, &removals, &[]).await
    }

    /// One step of the poker's refinement of `db`'s far buckets whose hour starts by `now_ms`
    /// plus [`REFINE_AHEAD_MS`] (a script, about [`REFINE_BATCH`] deadlines): returns when the
    /// next step is due, `now_ms` if some are left now (the poker's next round goes on, its
    /// pokes in between), `None` when no far bucket is left.
    pub async fn refine(&self, db: u32, now_ms: i64) -> redis::RedisResult<Option<i64>> {
        let (more, next) = self
            .refine_step(db, now_ms + REFINE_AHEAD_MS, REFINE_BATCH)
            .await?;
        Ok(if more {
            Some(now_ms)
        } else {
            next.map(|start| start - REFINE_AHEAD_MS)
        })
    }

    /// Marks `db`'s far hour `hour` dense (docs/how-it-works.md#dense-hours) and moves what its
    /// shards hold into their seconds' hashes, a script of about [`REFINE_BATCH`] deadlines at
    /// a time, so due deadlines are poked in between. From then on this instance writes that
    /// hour's deadlines without a script. An hour already refining is left as it is.
    pub async fn make_dense(&self, db: u32, hour: i64) -> redis::RedisResult<()> {
        while self.make_dense_step(db, hour, REFINE_BATCH).await? {}
        Ok(())
    }

    /// One script of [`Deadlines::make_dense`], moving about `most` deadlines: returns whether
    /// the hour's shards still hold some.
    pub async fn make_dense_step(
        &self,
        db: u32,
        hour: i64,
        most: usize,
    ) -> redis::RedisResult<bool> {
        let left: i64 = self
            .far_invoke(&self.dense, db)
            .arg(hour)
            .arg(most)
            .invoke_async(&mut self.conn())
            .await?;
        self.saw_dense(db, &[hour]);
        Ok(left == 1)
    }

    /// One script of a refinement: moves about `most` deadlines (whole shards) of the far
    /// hours that start by `until_ms`, earliest first. Returns whether some are left, and the
    /// start of the earliest hour still far.
    pub async fn refine_step(
        &self,
        db: u32,
        until_ms: i64,
        most: usize,
    ) -> redis::RedisResult<(bool, Option<i64>)> {
        let (more, next): (i64, i64) = self
            .far_invoke(&self.refine, db)
            .arg(until_ms)
            .arg(most)
            .invoke_async(&mut self.conn())
            .await?;
        Ok((more == 1, (next >= 0).then_some(next)))
    }

    /// The deadlines of the next far hour of `db` after `hour` (`None`: from the one `from_ms`
    /// falls in) that starts by `until_ms`, unordered; `None` when there is none.
    async fn far_hour(
        &self,
        db: u32,
        from_ms: i64,
        until_ms: i64,
        hour: &mut Option<i64>,
    ) -> redis::RedisResult<Option<Vec<(Vec<u8>, i64)>>> {
        let f = far(&self.prefix, db);
        let mut conn = self.conn();
        let low = match *hour {
            Some(h) => format!("({}", h * FAR_WIDTH_MS),
            None if from_ms == i64::MIN => "-inf".to_string(),
            None => far_start(from_ms).to_string(),
        };
        let first: Vec<i64> = redis::cmd("ZRANGE")
            .arg(&f.hours)
            .arg(low)
            .arg(until_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .query_async(&mut conn)
            .await?;
        let Some(&h) = first.first() else {
            return Ok(None);
        };
        *hour = Some(h);
        // Negative once the hour is dense: its shards may still hold as many.
        let n: Option<i64> = redis::cmd("HGET")
            .arg(&f.counts)
            .arg(h)
            .query_async(&mut conn)
            .await?;
        let mut pipe = redis::pipe();
        for j in 0..n.unwrap_or(0).unsigned_abs() {
            pipe.cmd("HGETALL").arg(format!("{}{h}:{j}", f.shards));
        }
        let shards: Vec<Vec<(Vec<u8>, i64)>> = pipe.query_async(&mut conn).await?;
        Ok(Some(
            shards
                .into_iter()
                .flatten()
                .map(|(k, off)| (k, h * FAR_WIDTH_MS + off))
                .collect(),
        ))
    }

    /// Up to `limit` poked keys numbered at most `seq`, lowest first, with their deadlines.
    pub async fn poked(
        &self,
        db: u32,
        seq: u64,
        limit: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        // A long key comes as a copy (`ledger/poked.lua`), read a MiB at a time
        // (docs/reliability.md#bounded-whatever-the-key); one gone meanwhile is left out.
        let mut conn = self.conn();
        let (mut rows, copies): (Rows, Vec<Copy>) = POKED_SCRIPT
            .key(poked(&self.prefix, db))
            .key(poked_deadlines(&self.prefix, db))
            .arg(seq)
            .arg(limit)
            .arg(crate::long_key::EXACT)
            .arg(self.names(db).copies)
            .invoke_async(&mut conn)
            .await?;
        read_copies(&mut conn, copies, &mut rows).await?;
        Ok(rows)
    }

    /// Whether `db`'s poked set holds anything.
    pub async fn any_poked(&self, db: u32) -> redis::RedisResult<bool> {
        redis::cmd("EXISTS")
            .arg(poked(&self.prefix, db))
            .query_async(&mut self.conn())
            .await
    }

    /// The next number of `db`'s marker sequence.
    pub async fn next_marker(&self, db: u32) -> redis::RedisResult<u64> {
        redis::cmd("INCR")
            .arg(seq(&self.prefix, db))
            .query_async(&mut self.conn())
            .await
    }

    /// Deadlines of `db` up to `until_ms`, `limit` after skipping `offset` of them, earliest
    /// minute first (see `ledger/due.lua`).
    pub async fn due(
        &self,
        db: u32,
        until_ms: i64,
        offset: usize,
        limit: usize,
    ) -> redis::RedisResult<Due> {
        self.names(db)
            .due(&mut self.conn(), until_ms, offset, limit)
            .await
    }

    /// The due long key of the copy `name` ([`Due::copies`]).
    pub async fn read_copy(
        &self,
        name: &str,
        len: usize,
    ) -> redis::RedisResult<Option<bytes::Bytes>> {
        read_copy(&mut self.conn(), name, len).await
    }

    /// The earliest deadline `db`'s seconds may hold (see [`Names::earliest`]), and when its
    /// earliest far bucket is to be refined (`None` inside: none), read only if `far`.
    pub async fn earliest(
        &self,
        db: u32,
        far: bool,
    ) -> redis::RedisResult<(Option<i64>, Option<Option<i64>>)> {
        let names = self.names(db);
        if !far {
            return Ok((names.earliest(&mut self.conn()).await?, None));
        }
        let f = self::far(&self.prefix, db);
        let mut pipe = redis::pipe();
        for zset in [&names.minutes, &f.hours] {
            pipe.cmd("ZRANGE")
                .arg(zset)
                .arg("-inf")
                .arg("+inf")
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(0)
                .arg(1)
                .arg("WITHSCORES");
        }
        type Firsts = Vec<(Vec<u8>, f64)>;
        let (seconds, hours): (Firsts, Firsts) = pipe.query_async(&mut self.conn()).await?;
        Ok((
            seconds.first().map(|(_, score)| *score as i64),
            Some(
                hours
                    .first()
                    .map(|(_, start)| *start as i64 - REFINE_AHEAD_MS),
            ),
        ))
    }

    /// Moves keys found gone (`gone`: key, deadline as seen) to the poked set, only those whose
    /// deadline the ledger still holds; returns the marker number they were given.
    /// A key longer than `long_key::EXACT` is moved by a script of its own on a connection of
    /// its own ([`Deadlines::direct_script`]); the number returned is then the greatest given.
    pub async fn move_poked(&self, db: u32, gone: &[(&[u8], i64)]) -> redis::RedisResult<u64> {
        let p = &self.prefix;
        let (long, short): (Vec<_>, Vec<_>) =
            gone.iter().partition(|(k, _)| crate::long_key::is_long(k));
        let (poked, deadlines, seq, seconds) = (
            poked(p, db),
            poked_deadlines(p, db),
            seq(p, db),
            names(p, db).seconds,
        );
        let mut given = 0;
        if !short.is_empty() || long.is_empty() {
            let mut inv = self.move_poked.prepare_invoke();
            inv.key(&poked).key(&deadlines).key(&seq).arg(&seconds);
            for (k, d) in short {
                inv.arg(k).arg(d);
            }
            given = inv.invoke_async(&mut self.conn()).await?;
        }
        for (k, d) in long {
            let d = d.to_string();
            let n = self
                .direct_script(
                    &self.move_poked,
                    &MOVE_POKED_CODE,
                    &[poked.as_bytes(), deadlines.as_bytes(), seq.as_bytes()],
                    &[seconds.as_bytes(), k, d.as_bytes()],
                )
                .await?;
            given = given.max(redis::from_redis_value::<u64>(n)?);
        }
        Ok(given)
    }

    /// Deadlines of `db` in `(from_ms, until_ms]`, a page at a time: the seconds' soonest first
    /// (see [`Names::between`]), then the far buckets', an hour at a time, each hour's soonest
    /// first. At least `at_least` unless none are left; an empty page is the end.
    pub async fn between(
        &self,
        db: u32,
        from_ms: i64,
        until_ms: i64,
        cursor: &mut Cursor,
        at_least: usize,
    ) -> redis::RedisResult<Vec<(Vec<u8>, i64)>> {
        if !cursor.seconds_done {
            let rows = self
                .names(db)
                .between(
                    &mut self.conn(),
                    from_ms,
                    until_ms,
                    &mut cursor.minute,
                    at_least,
                )
                .await?;
            if !rows.is_empty() {
                return Ok(rows);
            }
            cursor.seconds_done = true;
        }
        let mut out = Vec::new();
        while out.len() < at_least {
            let Some(mut rows) = self
                .far_hour(db, from_ms, until_ms, &mut cursor.hour)
                .await?
            else {
                break;
            };
            rows.retain(|(_, d)| *d > from_ms && *d <= until_ms);
            rows.sort_unstable_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
            out.extend(rows);
        }
        Ok(out)
    }

    /// Whether `db` holds any deadline.
    pub async fn any(&self, db: u32) -> redis::RedisResult<bool> {
        let n: usize = redis::cmd("EXISTS")
            .arg(self.names(db).minutes)
            .arg(far(&self.prefix, db).hours)
            .query_async(&mut self.conn())
            .await?;
        Ok(n > 0)
    }

    /// Converts up to a batch of an earlier keywatch's ledger of `db` (one sorted set); returns
    /// how many entries it still holds.
    pub async fn convert(&self, db: u32) -> redis::RedisResult<usize> {
        self.names(db)
            .convert(&mut self.conn(), &old_ledger(&self.prefix, db))
            .await
    }
}

crate::keyspace::commands::declare! {
    /// The commands the ledger sends to its keys, its scripts' included
    /// ([`crate::keyspace::commands`]).
    const WHY = "ledger: deadlines of the watched keys";
    const SCRIPTS = "ledger: deadlines of the watched keys (script)";
    const FIELDS = "field ledger: deadlines of watched hash fields (script)";
    [
        Use::new(Server::State, "hset", SCRIPTS)
            .on(Keys::State("ledger:*:at:*"), Access::Write)
            .args("{key} k 0")
            .when(When::Ledger),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("ledger:*:at:*"), Access::ReadWrite)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "hmget", SCRIPTS)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "hscan", SCRIPTS)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key} 0 COUNT 1000")
            .when(When::Ledger),
        Use::new(Server::State, "hgetall", WHY)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "zadd", SCRIPTS)
            .on(Keys::State("ledger:*:minutes"), Access::Write)
            .args("{key} LT 0 0")
            .when(When::Ledger),
        Use::new(Server::State, "zrem", SCRIPTS)
            .on(Keys::State("ledger:*:minutes"), Access::Write)
            .args("{key} 0")
            .when(When::Ledger),
        Use::new(Server::State, "exists", SCRIPTS)
            .on(Keys::State("ledger:*:at:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("ledger:*:minutes"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1 WITHSCORES")
            .when(When::Ledger),
        Use::new(Server::State, "exists", WHY)
            .on(Keys::State("ledger:*:minutes"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        // The far buckets (`ledger/far.lua`, `ledger/refine.lua`, docs/how-it-works.md#far-deadlines).
        Use::new(Server::State, "hsetnx", SCRIPTS)
            .on(Keys::State("ledger:*:at:*"), Access::Write)
            .args("{key} k 0")
            .when(When::Ledger),
        Use::new(Server::State, "hset", SCRIPTS)
            .on(Keys::State("ledger:*:far:*"), Access::Write)
            .args("{key} k 0")
            .when(When::Ledger),
        Use::new(Server::State, "hdel", SCRIPTS)
            .on(Keys::State("ledger:*:far:*"), Access::ReadWrite)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "hget", WHY)
            .on(Keys::State("ledger:*:far:*"), Access::Read)
            .args("{key} 0")
            .when(When::Ledger),
        Use::new(Server::State, "hmget", SCRIPTS)
            .on(Keys::State("ledger:*:far:*"), Access::Read)
            .args("{key} 0")
            .when(When::Ledger),
        Use::new(Server::State, "hincrby", SCRIPTS)
            .on(Keys::State("ledger:*:far:keys"), Access::Write)
            .args("{key} 0 1")
            .when(When::Ledger),
        Use::new(Server::State, "hgetall", WHY)
            .on(Keys::State("ledger:*:far:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "exists", SCRIPTS)
            .on(Keys::State("ledger:*:far:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "del", SCRIPTS)
            .on(Keys::State("ledger:*:far:*"), Access::Write)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "get", SCRIPTS)
            .on(Keys::State("ledger:*:far:frontier"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "set", SCRIPTS)
            .on(Keys::State("ledger:*:far:frontier"), Access::Write)
            .args("{key} 0")
            .when(When::Ledger),
        Use::new(Server::State, "zadd", SCRIPTS)
            .on(Keys::State("ledger:*:far"), Access::Write)
            .args("{key} 0 0")
            .when(When::Ledger),
        Use::new(Server::State, "zrem", SCRIPTS)
            .on(Keys::State("ledger:*:far"), Access::Write)
            .args("{key} 0")
            .when(When::Ledger),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("ledger:*:far"), Access::Read)
            .args("{key} -inf +inf BYSCORE LIMIT 0 1 WITHSCORES")
            .when(When::Ledger),
        Use::new(Server::State, "exists", WHY)
            .on(Keys::State("ledger:*:far"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        // A due long key's copy (`ledger/due.lua`), read a MiB at a time (`store::long_keys`,
        // docs/reliability.md#bounded-whatever-the-key).
        Use::new(Server::State, "set", SCRIPTS)
            .on(Keys::State("ledger:*:copy:*"), Access::Write)
            .args("{key} k NX PX 60000")
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
            .args("{sha} 3 {prefix}ledger:0:poked {prefix}ledger:0:poked-deadline {prefix}ledger:0:seq")
            .when(When::Ledger),
        Use::new(Server::State, "zadd", SCRIPTS)
            .on(Keys::State("ledger:*:poked"), Access::Write)
            .args("{key} 0 k")
            .when(When::Ledger),
        Use::new(Server::State, "exists", "ledger: is a marker worth publishing?")
            .on(Keys::State("ledger:*:poked"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "zrange", "ledger: missed expiries")
            .on(Keys::State("ledger:*:poked"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1")
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
        // The field ledger keeps its deadlines in the same form, through the same scripts
        // (`store::fields`).
        Use::new(Server::State, "hscan", FIELDS)
            .on(Keys::State("fields:*:at:*"), Access::Read)
            .args("{key} 0 COUNT 1000")
            .when(When::Fields),
        Use::new(Server::State, "exists", FIELDS)
            .on(Keys::State("fields:*:at:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "zrem", FIELDS)
            .on(Keys::State("fields:*:minutes"), Access::Write)
            .args("{key} 0")
            .when(When::Fields),
        Use::new(Server::State, "zrange", FIELDS)
            .on(Keys::State("fields:*:minutes"), Access::Read)
            .args("{key} -inf 0 BYSCORE LIMIT 0 1 WITHSCORES")
            .when(When::Fields),
        // A due long member's copy (`ledger/due.lua`), read a MiB at a time (`store::long_keys`).
        Use::new(Server::State, "set", FIELDS)
            .on(Keys::State("fields:*:copy:*"), Access::Write)
            .args("{key} k NX PX 60000")
            .when(When::Fields),
        // The conversion of an earlier keywatch's field ledger (docs/operations.md#upgrading).
        Use::new(Server::State, "type", FIELDS)
            .on(Keys::State("fields:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        Use::new(Server::State, "zrange", FIELDS)
            .on(Keys::State("fields:*"), Access::Read)
            .args("{key} 0 1 WITHSCORES")
            .when(When::Fields),
        Use::new(Server::State, "zrem", FIELDS)
            .on(Keys::State("fields:*"), Access::Write)
            .args("{key} k")
            .when(When::Fields),
        Use::new(Server::State, "zcard", FIELDS)
            .on(Keys::State("fields:*"), Access::Read)
            .args("{key}")
            .when(When::Fields),
        // The conversion of an earlier keywatch's ledger (docs/operations.md#upgrading).
        Use::new(Server::State, "type", SCRIPTS)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "zrange", SCRIPTS)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key} 0 1 WITHSCORES")
            .when(When::Ledger),
        Use::new(Server::State, "zrem", SCRIPTS)
            .on(Keys::State("ledger:*"), Access::Write)
            .args("{key} k")
            .when(When::Ledger),
        Use::new(Server::State, "zcard", SCRIPTS)
            .on(Keys::State("ledger:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
    ]
}

/// The key ledger's names in `db`: `{prefix}ledger:DB:minutes` (the minutes that hold deadlines,
/// each scored no later than the earliest it holds), `{prefix}ledger:DB:at:SECOND` (a second's
/// deadlines).
pub fn names(prefix: &str, db: u32) -> Names {
    Names::under(&old_ledger(prefix, db))
}

/// An earlier keywatch's ledger of `db`, one sorted set (converted at start-up).
pub fn old_ledger(prefix: &str, db: u32) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_and_lua_name_the_same_hash() {
        assert!(BUCKET.contains(&format!("local LONG_KEY = {LONG_KEY}\n")));
        let long = vec![b'k'; LONG_KEY + 1];
        let names = names("kw:", 0);
        assert_eq!(names.minutes, "kw:ledger:0:minutes");
        assert_eq!(names.bucket(17, b"k"), "kw:ledger:0:at:17");
        assert_eq!(names.bucket(17, &long), "kw:ledger:0:at:17:long");
        assert_eq!(names.bucket(17, &long[1..]), "kw:ledger:0:at:17");
        assert_eq!(second_of(1_999), 1);
        assert_eq!(second_of(-1), -1);
    }

    #[test]
    fn rust_and_lua_hash_a_far_key_alike() {
        // The same polynomial in `ledger/far_shard.lua` (checked against Redis by the drill
        // `ledger::far_shards_are_named_alike_by_every_instance_while_hours_split`).
        assert!(FAR_SHARD.contains("h = (h * 1000003 + string.byte(key, i)) % 4294967291"));
        assert_eq!(far_hash(b""), 0);
        assert_eq!(far_hash(b"a"), 97);
        assert_eq!(far_hash(b"ab"), 97_000_389);
        // Below the prime: each step's product, under 2^32 times 1000003, is exact in Lua.
        let top = far_hash(&[0xff; LONG_KEY]);
        assert!(top < 4_294_967_291);
    }
}
