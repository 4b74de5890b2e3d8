//! What every end-to-end pipeline test needs: a redis-server, a receiver, a folder for rules and
//! marker files, and a `keywatch run` that is subscribed before the test expires anything.
//!
//! Rule texts may say `@RECEIVER@` (the receiver's base URL) and `@DIR@` (the test's folder);
//! they are replaced before the file is written.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{HttpReceiver, Keywatch, KeywatchProcess, RedisServer, write_rules};

/// Upper bound for anything to happen; a healthy run never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// What keywatch logs once its subscriber is subscribed.
pub const SUBSCRIBED: &str = "Subscribed to keyspace events.";

/// A redis-server with `flags` as its `notify-keyspace-events` on the command line (so a restart
/// keeps them); `""` for a server without notifications.
pub fn redis_with_flags(flags: &str) -> RedisServer {
    let builder = RedisServer::builder();
    if flags.is_empty() {
        builder.start()
    } else {
        builder.notify_keyspace_events(flags).start()
    }
}

/// `CONFIG GET notify-keyspace-events`.
pub fn notify_flags(conn: &mut redis::Connection) -> String {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query(conn)
        .expect("CONFIG GET notify-keyspace-events");
    pair.get(1).cloned().unwrap_or_default()
}

/// `keywatch run -r RULES --redis URL --listen 127.0.0.1:0`, not waited for.
pub fn spawn_run(redis: &RedisServer, rules: &Path) -> KeywatchProcess {
    let rules = rules.to_string_lossy().into_owned();
    let url = redis.url();
    Keywatch::spawn(
        [
            "run",
            "-r",
            rules.as_str(),
            "--redis",
            url.as_str(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    )
}

/// A running pipeline: redis-server, receiver, a temp folder and a subscribed keywatch.
pub struct Rig {
    pub redis: RedisServer,
    pub receiver: HttpReceiver,
    pub dir: tempfile::TempDir,
    pub keywatch: KeywatchProcess,
}

impl Rig {
    /// Starts a server with `flags`, a receiver answering 200 `ok`, and keywatch with `rules`;
    /// returns once keywatch is subscribed.
    pub fn start(flags: &str, rules: &str) -> Rig {
        Self::start_with(redis_with_flags(flags), HttpReceiver::start(), rules)
    }

    pub fn start_with(redis: RedisServer, receiver: HttpReceiver, rules: &str) -> Rig {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-pipeline-")
            .tempdir()
            .expect("create a temp dir");
        let text = rules
            .replace("@RECEIVER@", &receiver.url())
            .replace("@DIR@", &dir.path().to_string_lossy());
        let path = write_rules(dir.path(), "rules.yaml", &text);
        let mut keywatch = spawn_run(&redis, &path);
        keywatch.wait_for_output(SUBSCRIBED, PATIENCE);
        Rig {
            redis,
            receiver,
            dir,
            keywatch,
        }
    }

    pub fn conn(&self) -> redis::Connection {
        self.redis.conn()
    }

    /// A file in the test's folder.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Sets each key to `v` and expires it now (see [`expire_now`]).
    pub fn set_and_expire(&self, keys: &[&str]) {
        let mut conn = self.conn();
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("SET").arg(*k).arg("v").ignore();
        }
        pipe.exec(&mut conn).expect("SET the keys");
        expire_now(&mut conn, keys);
    }

    /// The whole stderr so far (logs).
    pub fn log(&self) -> String {
        self.keywatch.stderr()
    }

    /// Waits until the log holds `needle` at least `n` times; panics with the log after
    /// `PATIENCE`.
    pub fn wait_for_log_count(&self, needle: &str, n: usize) {
        let deadline = std::time::Instant::now() + PATIENCE;
        while occurrences(&self.log(), needle) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the log did not show {needle:?} {n} times within {PATIENCE:?}\n{}",
                self.keywatch.describe_output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, and panics unless keywatch exits 0 within `PATIENCE`.
    pub fn stop(mut self) {
        self.keywatch.sigterm();
        let status = self.keywatch.wait_timeout(PATIENCE);
        assert!(
            status.is_some_and(|s| s.success()),
            "keywatch did not exit 0 after SIGTERM: {status:?}\n{}",
            self.keywatch.describe_output()
        );
    }
}

/// Makes existing `keys` expire now, with an `expired` event: Redis publishes one only when it
/// deletes a key, so give each key a 1 ms TTL (a deadline in the past would be a `del`) and read
/// its TTL until Redis reports it gone, which deletes it lazily.
pub fn expire_now(conn: &mut redis::Connection, keys: &[&str]) {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("PEXPIRE").arg(*k).arg(1);
    }
    let set: Vec<i64> = pipe.query(conn).expect("PEXPIRE the keys");
    for (k, s) in keys.iter().zip(&set) {
        assert_eq!(*s, 1, "key {k:?} does not exist, so it cannot expire");
    }
    let mut left: Vec<&str> = keys.to_vec();
    let deadline = std::time::Instant::now() + PATIENCE;
    while !left.is_empty() {
        std::thread::sleep(Duration::from_millis(2));
        let mut pipe = redis::pipe();
        for k in &left {
            pipe.cmd("PTTL").arg(*k);
        }
        let ttls: Vec<i64> = pipe.query(conn).expect("PTTL the keys");
        left = left
            .into_iter()
            .zip(ttls)
            .filter(|(_, t)| *t != -2)
            .map(|(k, _)| k)
            .collect();
        assert!(
            std::time::Instant::now() < deadline,
            "keys did not expire: {left:?}"
        );
    }
}

/// How often `needle` occurs in `haystack`.
pub fn occurrences(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}
