//! Running the real `keywatch` binary: one-shot commands ([`run_keywatch`]), the daemon as a
//! child ([`KeywatchProcess`], [`spawn_run`], [`run_on`]), and the daemon set up on its own Redis
//! with its own rules ([`Daemon`]) and a receiver ([`Rig`]).
//!
//! The child's environment is the test's minus every `KEYWATCH_*` variable, so that a developer's
//! shell (say, `KEYWATCH_REDIS_URL` pointing at a real Redis) cannot steer a test; tests pass what
//! they mean explicitly.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::process::Signal;

use redis::ToRedisArgs;

use super::commands::set_and_expire_now;
use super::http_receiver::HttpReceiver;
use super::redis_server::{RedisServer, send_signal, wait_child};
use super::rules::Rules;
use super::wait::{PATIENCE, poll};

/// The internal event the daemon emits once a subscriber is in place: events flow from then on
/// (docs/operations.md#internal-events).
pub const SUBSCRIBED: &str = "subscribed";

/// The internal event of each attempt of an action: `rule`, `key`, `action`, `channel`,
/// `outcome` (`sent`, `retry`, `failed`), `attempt`, and `answer` or `reason`.
pub const ATTEMPTED: &str = "attempted";

/// The internal event of an action given up for good: `rule`, `key`, `action`, `channel`,
/// `id`, `reason`.
pub const DEAD_LETTERED: &str = "dead_lettered";

/// Upper bound for a one-shot command (`check`, `explain`) to finish.
const ONE_SHOT_TIMEOUT: Duration = Duration::from_secs(60);

/// The `keywatch` binary cargo built for these tests.
pub fn keywatch_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keywatch"))
}

/// A `Command` for the binary with `args` and `envs`, the environment cleaned of `KEYWATCH_*`,
/// stdin closed. For cases [`spawn_keywatch`] and [`run_keywatch`] do not cover (another working
/// directory, say).
pub fn keywatch_command<I, S>(args: I, envs: &[(&str, &str)]) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(keywatch_bin());
    command.args(args).stdin(Stdio::null());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("KEYWATCH_") {
            command.env_remove(name);
        }
    }
    command.envs(envs.iter().copied());
    command
}

/// `keywatch history --json` of the Redis at `url` under the rules at `rules`, with `extra`
/// arguments (`--shadow`, `--rule R` …): its lines, parsed. Panics if it fails.
pub fn history_json(url: &str, rules: &Path, extra: &[&str]) -> Vec<serde_json::Value> {
    let rules = rules.to_string_lossy().into_owned();
    let mut args = vec!["history", "--json", "--redis", url, "-r", &rules];
    args.extend_from_slice(extra);
    let out = run_keywatch(args, &[]);
    assert!(
        out.status.success(),
        "keywatch history failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Runs a one-shot command to completion and returns its output. Panics if it runs longer than a
/// minute (a hung CLI must fail the test, not hang the suite).
pub fn run_keywatch<I, S>(args: I, envs: &[(&str, &str)]) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut process = KeywatchProcess::from_command(keywatch_command(args, envs));
    let Some(status) = process.wait_timeout(ONE_SHOT_TIMEOUT) else {
        panic!(
            "keywatch did not finish within {ONE_SHOT_TIMEOUT:?}\n{}",
            process.describe_output()
        );
    };
    process.join_readers();
    Output {
        status,
        stdout: process.stdout.bytes(),
        stderr: process.stderr.bytes(),
    }
}

/// Starts `keywatch ARGS...` with `envs`, capturing stdout and stderr as they are written.
pub fn spawn_keywatch<I, S>(args: I, envs: &[(&str, &str)]) -> KeywatchProcess
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    KeywatchProcess::from_command(keywatch_command(args, envs))
}

/// How the daemon logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logs {
    /// The default text format.
    Text,
    /// `--log-format json`, so that tests read fields instead of parsing text that may be coloured.
    Json,
}

/// `keywatch [--log-format json] run -r RULES --redis URL --listen 127.0.0.1:0` with `envs`, not
/// waited for. Each daemon gets its own free HTTP port, so several may run on one Redis.
pub fn spawn_run(url: &str, rules: &Path, logs: Logs, envs: &[(&str, &str)]) -> KeywatchProcess {
    let mut args: Vec<&OsStr> = Vec::new();
    if logs == Logs::Json {
        args.extend(["--log-format", "json"].map(OsStr::new));
    }
    args.extend(["run", "-r"].map(OsStr::new));
    args.push(rules.as_os_str());
    args.extend(["--redis", url, "--listen", "127.0.0.1:0"].map(OsStr::new));
    spawn_keywatch(args, envs)
}

/// [`spawn_run`], once the daemon has logged [`SUBSCRIBED`].
pub fn run_subscribed(
    url: &str,
    rules: &Path,
    logs: Logs,
    envs: &[(&str, &str)],
) -> KeywatchProcess {
    let mut kw = spawn_run(url, rules, logs, envs);
    kw.wait_for_event(SUBSCRIBED, "of the subscriber in place", |_| true);
    kw
}

/// `keywatch run` with text logs and the rules at `rules` on `redis`, once it has subscribed.
pub fn run_on(redis: &RedisServer, rules: &Path) -> KeywatchProcess {
    run_subscribed(&redis.url(), rules, Logs::Text, &[])
}

/// Output of one stream, filled by a reader thread.
#[derive(Clone, Default)]
struct Captured {
    inner: Arc<(Mutex<Vec<u8>>, Condvar)>,
}

impl Captured {
    fn bytes(&self) -> Vec<u8> {
        self.inner
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes()).into_owned()
    }

    fn reader(&self, mut source: impl Read + Send + 'static) -> JoinHandle<()> {
        let inner = Arc::clone(&self.inner);
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                match source.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        inner
                            .0
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .extend_from_slice(&buf[..n]);
                        inner.1.notify_all();
                    }
                }
            }
        })
    }
}

/// A running `keywatch`; killed (SIGKILL) when dropped.
pub struct KeywatchProcess {
    child: Child,
    status: Option<ExitStatus>,
    stdout: Captured,
    stderr: Captured,
    readers: Vec<JoinHandle<()>>,
}

impl KeywatchProcess {
    /// Spawns `command` with stdout and stderr piped into buffers.
    pub fn from_command(mut command: Command) -> KeywatchProcess {
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", command.get_program()));
        let stdout = Captured::default();
        let stderr = Captured::default();
        let out: ChildStdout = child.stdout.take().expect("piped stdout");
        let err: ChildStderr = child.stderr.take().expect("piped stderr");
        let readers = vec![stdout.reader(out), stderr.reader(err)];
        KeywatchProcess {
            child,
            status: None,
            stdout,
            stderr,
            readers,
        }
    }

    /// The process id, to read its `/proc` entries (memory, sockets).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything written to stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.text()
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Waits until stdout or stderr contains `needle`; returns that stream's text so far. Panics
    /// after `timeout`, or earlier if the process exits without writing it, showing both streams.
    pub fn wait_for_output(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            for stream in [&self.stdout, &self.stderr] {
                let text = stream.text();
                if text.contains(needle) {
                    return text;
                }
            }
            if let Some(status) = self.try_status() {
                // The readers may still hold the last bytes; give them a moment to finish.
                self.join_readers();
                if self.stdout().contains(needle) {
                    return self.stdout();
                }
                if self.stderr().contains(needle) {
                    return self.stderr();
                }
                panic!(
                    "keywatch exited ({status}) without writing {needle:?}\n{}",
                    self.describe_output()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "keywatch did not write {needle:?} within {timeout:?}\n{}",
                    self.describe_output()
                );
            }
            // Wake on new stderr output (where logs go) or poll every 20 ms.
            let (lock, changed) = &*self.stderr.inner;
            let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            let _ = changed.wait_timeout(guard, Duration::from_millis(20));
        }
    }

    /// The internal events named `event` (docs/operations.md#internal-events) emitted so far,
    /// each as a JSON object of its fields (`message` and `internal_event` among them), from
    /// JSON or text logs alike.
    pub fn events(&self, event: &str) -> Vec<serde_json::Value> {
        internal_events(&self.stderr(), event)
    }

    /// The internal events named in `events`, in the order they were emitted: which came
    /// first.
    pub fn events_in_order(&self, events: &[&str]) -> Vec<serde_json::Value> {
        internal_events_of(&self.stderr(), events)
    }

    /// Waits until the process has emitted internal event `event` with fields satisfying
    /// `pred`; returns them. Panics after [`PATIENCE`], or when the process exits first.
    pub fn wait_for_event(
        &mut self,
        event: &str,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut found = self.wait_for_events(event, 1, what, pred);
        found.swap_remove(0)
    }

    /// Waits until the process has emitted internal event `event` with fields satisfying
    /// `pred` at least `n` times; returns those so far. Panics after [`PATIENCE`], or when the
    /// process exits first.
    pub fn wait_for_events(
        &mut self,
        event: &str,
        n: usize,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + PATIENCE;
        let matching = |p: &Self| -> Vec<serde_json::Value> {
            p.events(event).into_iter().filter(|e| pred(e)).collect()
        };
        loop {
            let found = matching(self);
            if found.len() >= n {
                return found;
            }
            if let Some(status) = self.try_status() {
                self.join_readers();
                let found = matching(self);
                if found.len() >= n {
                    return found;
                }
                panic!(
                    "keywatch exited ({status}) with {} of {n} internal events `{event}` {what}\n{}",
                    found.len(),
                    self.describe_output()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} of {n} internal events `{event}` {what} within {PATIENCE:?}\n{}",
                    found.len(),
                    self.describe_output()
                );
            }
            let (lock, changed) = &*self.stderr.inner;
            let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            let _ = changed.wait_timeout(guard, Duration::from_millis(20));
        }
    }

    /// Sends `signal` (e.g. `Signal::HUP`). Panics if the process has already been reaped.
    pub fn signal(&mut self, signal: Signal) {
        assert!(
            self.try_status().is_none(),
            "signal {signal:?} to keywatch, which has already exited\n{}",
            self.describe_output()
        );
        send_signal(&self.child, signal);
    }

    pub fn sigterm(&mut self) {
        self.signal(Signal::TERM);
    }

    /// SIGTERM, then waits for the exit; returns stderr (the logs). Panics unless it exits 0
    /// within [`PATIENCE`].
    pub fn stop(&mut self) -> String {
        self.sigterm();
        let status = self.wait_timeout(PATIENCE);
        assert!(
            status.is_some_and(|s| s.success()),
            "keywatch did not exit 0 after SIGTERM ({status:?})\n{}",
            self.describe_output()
        );
        self.stderr()
    }

    pub fn sighup(&mut self) {
        self.signal(Signal::HUP);
    }

    pub fn sigkill(&mut self) {
        if self.try_status().is_none() {
            let _ = self.child.kill();
            self.status = Some(self.child.wait().expect("wait for killed keywatch"));
        }
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = wait_child(&mut self.child, timeout);
        }
        self.status
    }

    /// The exit status if the process has exited.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// The local ports of the TCP sockets the process holds now (read from `/proc`): which of
    /// a receiver's connections ([`HttpReceiver::open_peers`]) are this process's.
    pub fn tcp_ports(&self) -> std::collections::HashSet<u16> {
        let pid = self.child.id();
        let inodes: std::collections::HashSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter_map(|target| {
                    let target = target.to_str()?;
                    let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
                    Some(inode.to_string())
                })
                .collect();
        let mut ports = std::collections::HashSet::new();
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
                continue;
            };
            // `sl local_address rem_address st … uid timeout inode`, addresses as HEX:PORT.
            for line in text.lines().skip(1) {
                let columns: Vec<&str> = line.split_whitespace().collect();
                if columns.len() > 9
                    && inodes.contains(columns[9])
                    && let Some(port) = columns[1]
                        .rsplit(':')
                        .next()
                        .and_then(|p| u16::from_str_radix(p, 16).ok())
                {
                    ports.insert(port);
                }
            }
        }
        ports
    }

    /// Both streams, labelled, for panic messages.
    pub fn describe_output(&self) -> String {
        format!(
            "--- keywatch stdout ---\n{}\n--- keywatch stderr ---\n{}",
            self.stdout(),
            self.stderr()
        )
    }

    /// Waits for the reader threads after the process has exited (a grandchild holding the pipes
    /// open could delay them, hence the bound).
    fn join_readers(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for reader in std::mem::take(&mut self.readers) {
            if reader.is_finished() {
                let _ = reader.join();
            }
        }
    }
}

impl Drop for KeywatchProcess {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `keywatch run` against its own `redis-server` and its own rules, subscribed and ready for events.
pub struct Daemon {
    /// Declared first so the daemon is killed before its Redis goes away.
    pub process: KeywatchProcess,
    pub redis: RedisServer,
    pub rules: Rules,
}

impl Daemon {
    /// Starts `keywatch run` with `yaml` on a fresh Redis with `Exg` notifications (g: keywatch
    /// learns deadlines), with JSON logs.
    pub fn start(yaml: &str) -> Daemon {
        Daemon::start_with(RedisServer::with_events("Exg"), yaml, &[])
    }

    /// Starts `keywatch --log-format json run` with `yaml` and `envs` on `redis` (with its
    /// credentials, if any), and waits until it has subscribed. JSON logs, so that tests read
    /// fields ([`Daemon::logs`]).
    pub fn start_with(redis: RedisServer, yaml: &str, envs: &[(&str, &str)]) -> Daemon {
        Daemon::launch(redis, Rules::new(yaml), Logs::Json, envs)
    }

    /// Starts `keywatch run` with `rules` on `redis` and waits until it has subscribed.
    pub fn launch(redis: RedisServer, rules: Rules, logs: Logs, envs: &[(&str, &str)]) -> Daemon {
        let process = run_subscribed(&redis.auth_url(), &rules.path, logs, envs);
        Daemon {
            process,
            redis,
            rules,
        }
    }

    pub fn conn(&self) -> redis::Connection {
        self.redis.conn()
    }

    /// Sets `key` and makes it expire now (see [`set_and_expire_now`]).
    pub fn expire<K: ToRedisArgs>(&self, key: K) {
        self.expire_all(&[key]);
    }

    /// Sets each of `keys` and makes them expire now (see [`set_and_expire_now`]).
    pub fn expire_all<K: ToRedisArgs>(&self, keys: &[K]) {
        set_and_expire_now(&mut self.conn(), keys);
    }

    /// Everything the daemon has logged so far.
    pub fn stderr(&self) -> String {
        self.process.stderr()
    }

    /// The internal events named `event` emitted so far (docs/operations.md#internal-events),
    /// each as a JSON object of its fields.
    pub fn events(&self, event: &str) -> Vec<serde_json::Value> {
        self.process.events(event)
    }

    /// Waits until the daemon has emitted internal event `event` with fields satisfying `pred`;
    /// returns them. Panics after [`PATIENCE`], showing the logs.
    pub fn wait_for_event(
        &self,
        event: &str,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        self.wait_for_events(event, 1, what, pred).swap_remove(0)
    }

    /// Waits until the daemon has emitted internal event `event` with fields satisfying `pred`
    /// at least `n` times; returns those so far. Panics after [`PATIENCE`], showing the logs.
    pub fn wait_for_events(
        &self,
        event: &str,
        n: usize,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        poll(
            &format!("{n} internal events `{event}` {what}"),
            PATIENCE,
            || {
                let found: Vec<serde_json::Value> =
                    self.events(event).into_iter().filter(|e| pred(e)).collect();
                (found.len() >= n).then_some(found)
            },
            || self.process.describe_output(),
        )
    }

    /// Waits until the daemon has emitted an `attempted` event on `channel` that ended with
    /// `outcome` (`sent`, `retry`, `failed`); returns its fields.
    pub fn attempt_on(&self, channel: &str, outcome: &str) -> serde_json::Value {
        self.wait_for_event(
            ATTEMPTED,
            &format!("on {channel} with outcome {outcome}"),
            |e| field_is(e, "channel", channel) && field_is(e, "outcome", outcome),
        )
    }

    /// Waits until the daemon has emitted a `dead_lettered` event on `channel`; returns its
    /// fields.
    pub fn dead_letter_on(&self, channel: &str) -> serde_json::Value {
        self.wait_for_event(DEAD_LETTERED, &format!("on {channel}"), |e| {
            field_is(e, "channel", channel)
        })
    }

    /// SIGTERM, then waits for the exit; returns the logs. Panics if it does not exit cleanly.
    pub fn stop(mut self) -> String {
        self.process.stop()
    }
}

/// A whole pipeline: a [`Daemon`] with text logs whose rules send to `receiver`.
///
/// Rule texts may say `@RECEIVER@` (the receiver's base URL) and `@DIR@` (the rules' folder, for
/// marker files); they are replaced before the file is written.
pub struct Rig {
    pub daemon: Daemon,
    pub receiver: HttpReceiver,
}

impl Rig {
    /// Starts a server with `flags` as its `notify-keyspace-events` (`""`: none), a receiver
    /// answering 200 `ok`, and keywatch with `rules`; returns once keywatch is subscribed.
    pub fn start(flags: &str, rules: &str) -> Rig {
        Self::start_with(
            RedisServer::with_events(flags),
            HttpReceiver::start(),
            rules,
        )
    }

    pub fn start_with(redis: RedisServer, receiver: HttpReceiver, rules: &str) -> Rig {
        let rules = Rules::new_with(|dir| {
            rules
                .replace("@RECEIVER@", &receiver.url())
                .replace("@DIR@", &dir.to_string_lossy())
        });
        let daemon = Daemon::launch(redis, rules, Logs::Text, &[]);
        Rig { daemon, receiver }
    }

    /// A file in the rules' folder.
    pub fn path(&self, name: &str) -> PathBuf {
        self.daemon.rules.dir.path().join(name)
    }

    /// SIGTERM, and panics unless keywatch exits 0 within [`PATIENCE`].
    pub fn stop(self) {
        self.daemon.stop();
    }
}

impl std::ops::Deref for Rig {
    type Target = Daemon;

    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl std::ops::DerefMut for Rig {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

/// The internal events named `event` in `log` (JSON or text lines), each as a JSON object of
/// its fields: a JSON line as it is, a text line's `name=value` and `name="value"` fields (and
/// its `message`, the text before the first field). An unquoted text value runs to the next
/// ` name=`: read a free text that may hold one (a target's answer) from JSON logs.
pub fn internal_events(log: &str, event: &str) -> Vec<serde_json::Value> {
    internal_events_of(log, &[event])
}

/// The internal events named in `events` in `log`, in the order they were logged.
pub fn internal_events_of(log: &str, events: &[&str]) -> Vec<serde_json::Value> {
    log.lines()
        .filter_map(
            |line| match serde_json::from_str::<serde_json::Value>(line) {
                Ok(json) if json.is_object() => Some(json),
                _ => text_fields(line),
            },
        )
        .filter(|fields| events.iter().any(|e| field_is(fields, "internal_event", e)))
        .collect()
}

/// The fields of a text log line that carries `internal_event`.
fn text_fields(line: &str) -> Option<serde_json::Value> {
    let at = line.find(" internal_event=")?;
    let mut fields = serde_json::Map::new();
    let head = &line[..at];
    // `2026-…Z  INFO keywatch::module: The message.`
    let message = head.split_once(": ").map_or(head, |(_, m)| m).trim();
    fields.insert("message".into(), message.into());
    let mut rest = line[at + 1..].trim_end();
    while let Some(eq) = rest.find('=') {
        let name = rest[..eq].trim().to_string();
        let after = &rest[eq + 1..];
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            // A Debug-quoted string: up to the next unescaped quote.
            let mut end = None;
            let mut escaped = false;
            for (i, c) in quoted.char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let end = end?;
            let value = serde_json::from_str::<String>(&format!("\"{}\"", &quoted[..end]))
                .unwrap_or_else(|_| quoted[..end].to_string());
            (value, &quoted[end + 1..])
        } else {
            // A value written with `%` (Display) is not quoted and may hold spaces: it ends
            // where the next ` name=` begins.
            let end = next_field(after).unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        fields.insert(name, value.into());
        rest = next.trim_start();
    }
    Some(serde_json::Value::Object(fields))
}

/// Where the next ` name=` of a text log line starts in `rest` (field names are snake_case).
fn next_field(rest: &str) -> Option<usize> {
    rest.match_indices(' ').map(|(at, _)| at).find(|&at| {
        let name: String = rest[at + 1..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && rest[at + 1 + name.len()..].starts_with('=')
    })
}

/// The number in field `name` of an event, as JSON logs (a number) and text logs (its digits)
/// write it.
pub fn field_u64(event: &serde_json::Value, name: &str) -> Option<u64> {
    let value = event.get(name)?;
    value
        .as_u64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

/// Whether JSON log line `line` has field `name` equal to the string `value`.
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
