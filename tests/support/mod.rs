//! Shared steps of end-to-end tests of the daemon, on top of the harness in `tests/common/`:
//! start a `redis-server`, write rules, run `keywatch run` until it has subscribed, and make keys
//! expire now.
//!
//! A test binary includes it with `mod common; mod support;` (this module uses `crate::common`).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use redis::ToRedisArgs;

use crate::common::{KeywatchProcess, RedisServer, run_keywatch, write_rules};

/// Generous upper bound for anything to happen; a healthy run never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// What the daemon logs (stderr) once its subscriber is in place: events flow from then on.
pub const SUBSCRIBED: &str = "Subscribed to keyspace events.";

/// A `redis-server` with `notify-keyspace-events Ex` (expired events), as `check` mode needs.
pub fn redis_with_expiry_events() -> RedisServer {
    RedisServer::builder().notify_keyspace_events("Exg").start()
}

/// A rules folder in a temp dir, with `yaml` as `rules.yaml`.
pub struct Rules {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl Rules {
    pub fn new(yaml: &str) -> Rules {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-rules-")
            .tempdir()
            .expect("create a temp dir for rules");
        let path = write_rules(dir.path(), "rules.yaml", yaml);
        Rules { dir, path }
    }

    /// The path as a `-r` argument.
    pub fn arg(&self) -> String {
        self.path.display().to_string()
    }

    /// Runs a one-shot command (`explain`, `check`, `send-test`) with `-r RULES` appended.
    pub fn run(&self, args: &[&str], envs: &[(&str, &str)]) -> Output {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.push("-r".into());
        all.push(self.arg());
        run_keywatch(all, envs)
    }
}

/// `keywatch run` against its own `redis-server`, subscribed and ready for events.
pub struct Daemon {
    /// Declared first so the daemon is killed before its Redis goes away.
    pub process: KeywatchProcess,
    pub redis: RedisServer,
    pub rules: Rules,
}

impl Daemon {
    /// Starts `keywatch run` with `yaml` on a fresh Redis with `Exg` notifications (g: keywatch learns deadlines).
    pub fn start(yaml: &str) -> Daemon {
        Daemon::start_with(redis_with_expiry_events(), yaml, &[])
    }

    /// Starts `keywatch --log-format json run -r RULES --redis URL --listen 127.0.0.1:0` with
    /// `envs` on `redis`, and waits until it has subscribed. JSON logs, so that tests read fields
    /// ([`Daemon::logs`]) instead of parsing text that may be coloured.
    pub fn start_with(redis: RedisServer, yaml: &str, envs: &[(&str, &str)]) -> Daemon {
        let rules = Rules::new(yaml);
        let rules_arg = rules.arg();
        let url = redis.auth_url();
        let mut process = crate::common::Keywatch::spawn(
            [
                "--log-format",
                "json",
                "run",
                "-r",
                rules_arg.as_str(),
                "--redis",
                url.as_str(),
                "--listen",
                "127.0.0.1:0",
            ],
            envs,
        );
        process.wait_for_output(SUBSCRIBED, PATIENCE);
        Daemon {
            process,
            redis,
            rules,
        }
    }

    pub fn conn(&self) -> redis::Connection {
        self.redis.conn()
    }

    /// Makes `key` expire now (see [`expire_now`]).
    pub fn expire<K: ToRedisArgs>(&self, key: K) {
        expire_now(&mut self.conn(), key);
    }

    /// Everything the daemon has logged so far.
    pub fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// Every log line so far that is a JSON object (fields flattened: `message`, `level`,
    /// `rule`, `channel`, `outcome`, `reason`, ...).
    pub fn logs(&self) -> Vec<serde_json::Value> {
        self.stderr()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(serde_json::Value::is_object)
            .collect()
    }

    /// Waits until a log line satisfies `pred`; returns it. Panics after [`PATIENCE`], showing
    /// the logs.
    pub fn wait_for_log(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(line) = self.logs().into_iter().find(|l| pred(l)) {
                return line;
            }
            assert!(
                Instant::now() < deadline,
                "no log line {what} within {PATIENCE:?}\n{}",
                self.process.describe_output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits for the exit; returns the logs. Panics if it does not exit cleanly.
    pub fn stop(mut self) -> String {
        self.process.sigterm();
        let status = self.process.wait_timeout(PATIENCE);
        assert!(
            status.is_some_and(|s| s.success()),
            "keywatch did not exit 0 after SIGTERM ({status:?})\n{}",
            self.process.describe_output()
        );
        self.process.stderr()
    }
}

/// Sets `key` with a 1 ms TTL, then reads it until Redis reports it gone: Redis deletes an
/// expired key (and publishes `expired`) when a client touches it, so this does not wait for
/// Redis's background expiry cycle.
pub fn expire_now<K: ToRedisArgs>(conn: &mut redis::Connection, key: K) {
    set_with_ttl(conn, &key, "v", Duration::from_millis(1));
    touch_until_gone(conn, &key);
}

/// `SET key value PX ttl`.
pub fn set_with_ttl<K: ToRedisArgs, V: ToRedisArgs>(
    conn: &mut redis::Connection,
    key: K,
    value: V,
    ttl: Duration,
) {
    let () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("PX")
        .arg(ttl.as_millis().max(1) as u64)
        .query(conn)
        .expect("SET … PX");
}

/// `PTTL key` every few milliseconds until it answers -2 (gone): touching an expired key makes
/// Redis delete it and publish `expired` right away.
pub fn touch_until_gone<K: ToRedisArgs>(conn: &mut redis::Connection, key: K) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query(conn).expect("PTTL");
        if pttl == -2 {
            return;
        }
        assert!(
            pttl >= 0,
            "PTTL answered {pttl}: the key has no TTL, it will never expire"
        );
        assert!(Instant::now() < deadline, "the key did not expire");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether log line `line` has field `name` equal to the string `value`.
pub fn field_is(line: &serde_json::Value, name: &str, value: &str) -> bool {
    line.get(name).and_then(serde_json::Value::as_str) == Some(value)
}

/// Asserts that `text` (logs, command output) contains none of `secrets`.
pub fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(
            !text.contains(secret),
            "{what} leaks the secret {secret:?}:\n{text}"
        );
    }
}

/// Rules with a webhook channel `hook` to `receiver` (plus `channel_extra` lines, e.g.
/// `"    rate: 5/s\n"`) and one rule, `lock-expired`, on `lock:{id}`.
pub fn lock_rules(
    dir: &std::path::Path,
    receiver: &crate::common::HttpReceiver,
    channel_extra: &str,
) -> PathBuf {
    let yaml = format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{}\"\n{channel_extra}rules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n",
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
}

/// `keywatch run` with the rules at `rules` on `redis`, once it has subscribed; several may run
/// on one Redis (each gets its own free HTTP port).
pub fn run_on(redis: &RedisServer, rules: &std::path::Path) -> KeywatchProcess {
    let mut kw = crate::common::Keywatch::spawn(
        [
            "run",
            "-r",
            rules.to_str().unwrap(),
            "--redis",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    kw.wait_for_output(SUBSCRIBED, PATIENCE);
    kw
}

/// `SET key w PX ms`: a key that expires `ms` from now.
pub fn set_px(conn: &mut redis::Connection, key: &str, ms: u64) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("w")
        .arg("PX")
        .arg(ms)
        .query(conn)
        .unwrap();
}

/// The HTTP endpoint's address, from the start-up log line (text or JSON logs).
pub fn endpoint(kw: &KeywatchProcess) -> String {
    let log = kw.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("HTTP endpoint listening"))
        .expect("the endpoint is logged");
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(line)
        && let Some(addr) = json.get("addr").and_then(serde_json::Value::as_str)
    {
        return addr.to_string();
    }
    let at = line.find("addr=").expect("addr field") + "addr=".len();
    line[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .trim_matches('"')
        .to_string()
}

/// (status, body) of a plain GET.
pub fn get(addr: &str, path: &str) -> (u16, String) {
    http(addr, "GET", path)
}

/// (status, body) of a POST without a body.
pub fn post(addr: &str, path: &str) -> (u16, String) {
    http(addr, "POST", path)
}

fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect to the HTTP endpoint");
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The sum of the samples of the metric lines starting with `prefix`.
pub fn metric(body: &str, prefix: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `ACL SETUSER keywatch …` lines of the least-privilege section of `docs/redis.md`, in
/// order: the line every deployment needs, then the one that adds cleanup. Tests run keywatch and
/// doctor under exactly these, so the documentation and reality cannot drift apart.
pub fn documented_acl_lines() -> Vec<String> {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"),
    )
    .expect("read docs/redis.md");
    let start = readme
        .find("## Least-privilege ACL")
        .expect("docs/redis.md has a `## Least-privilege ACL` section");
    let section = &readme[start..];
    let end = section[4..].find("\n#").map_or(section.len(), |e| e + 4);
    let lines: Vec<String> = section[..end]
        .lines()
        .filter(|l| l.starts_with("ACL SETUSER keywatch "))
        .map(str::to_string)
        .collect();
    assert_eq!(
        lines.len(),
        2,
        "the ACL section of docs/redis.md should have the base line and the cleanup line: {lines:?}"
    );
    lines
}
