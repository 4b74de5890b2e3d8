//! Running the real `keywatch` binary.
//!
//! The child's environment is the test's minus every `KEYWATCH_*` variable, so that a developer's
//! shell (say, `KEYWATCH_REDIS_URL` pointing at a real Redis) cannot steer a test; tests pass what
//! they mean explicitly.

use std::ffi::OsStr;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::process::Signal;

use super::redis_server::{send_signal, wait_child};

/// Upper bound for a one-shot command (`check`, `explain`) to finish.
const ONE_SHOT_TIMEOUT: Duration = Duration::from_secs(60);

/// The `keywatch` binary cargo built for these tests.
pub fn keywatch_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keywatch"))
}

/// A `Command` for the binary with `args` and `envs`, the environment cleaned of `KEYWATCH_*`,
/// stdin closed. For cases `Keywatch::spawn` and `run_keywatch` do not cover (another working
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

/// Namespace for starting the daemon: `Keywatch::spawn(args, envs)`.
pub struct Keywatch;

impl Keywatch {
    /// Starts `keywatch ARGS...` with `envs`, capturing stdout and stderr as they are written.
    pub fn spawn<I, S>(args: I, envs: &[(&str, &str)]) -> KeywatchProcess
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        KeywatchProcess::from_command(keywatch_command(args, envs))
    }
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

    pub fn sigint(&mut self) {
        self.signal(Signal::INT);
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
