//! `exec`: a local command, as an argv without a shell (a capture is always one argument, never
//! shell syntax), with a timeout after which it is killed. Its output goes to the log.
//!
//! The command's environment is clean (docs/rules.md#exec-environment): `PATH`, `HOME`, the event's
//! `KEYWATCH_*` and what the rule's `env` names, nothing else of keywatch's own. keywatch's
//! environment holds its secrets (`KEYWATCH_LINK_SECRET`, webhook tokens, passwords), and a
//! child that inherited them could forge signed links or post as keywatch.
//!
//! The command runs in a process group of its own, and the group is what gets killed: a shell
//! that started a background job (`sh -c "…; sleep 40 &"`) exits at once while its child keeps
//! the output pipes open, and neither a timeout nor the end of the output may wait on that child.

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};
use tokio::io::AsyncReadExt;

use crate::config::{ExecStep, Rule};
use crate::firing::Firing;

use super::context::ActionContext;
use crate::outcome::Outcome;

/// `PATH` for a command when keywatch itself has none (a bare container): the usual system
/// folders, so `command: ["rebuild-report"]` still finds its program.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Output kept for the log, per stream.
const KEEP: usize = 4096;

/// How long the output may stay open once the command has exited: what its background
/// processes still write in that time is kept, then the group is killed.
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

/// The command line of one attempt, rendered; a template that fails on this firing's data, or
/// an argv that can never run as the rule means it ([`refused`]), fails for good.
pub fn argv(a: &ActionContext, f: &Firing, step: &ExecStep) -> Result<Vec<OsString>, Outcome> {
    let ctx = a.context_of(f);
    let mut argv = Vec::with_capacity(step.command.len());
    for id in &step.command {
        match a.config.templates.render(*id, &ctx) {
            Ok(bytes) => argv.push(OsString::from_vec(bytes)),
            Err(e) => return Err(Outcome::Failed(format!("exec argument: {}", e.message))),
        }
    }
    match refused(&argv, &step.value_led, &f.key) {
        Some(why) => Err(Outcome::Failed(why)),
        None => Ok(argv),
    }
}

pub async fn run(a: &ActionContext, f: &Firing, rule: &Rule, step: &ExecStep) -> Outcome {
    let argv = match argv(a, f, step) {
        Ok(argv) => argv,
        Err(o) => return o,
    };
    let ctx = a.context_of(f);
    let mut env = Vec::with_capacity(step.env.len());
    for (name, id) in &step.env {
        match a.config.templates.render(*id, &ctx) {
            Ok(bytes) if bytes.contains(&0) => {
                return Outcome::Failed(format!(
                    "exec variable {name} contains a NUL byte, which no environment can carry"
                ));
            }
            Ok(bytes) => env.push((name, OsString::from_vec(bytes))),
            Err(e) => return Outcome::Failed(format!("exec variable {name}: {}", e.message)),
        }
    }
    let Some((program, args)) = argv.split_first() else {
        return Outcome::Failed("exec: empty command".into());
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.env_clear().env(
        "PATH",
        std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
    );
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    // The rule's own first: the event's variables are keywatch's to set (`check` refuses a
    // `KEYWATCH_` name in `env`), and may be replaced by nothing the rule says.
    cmd.envs(env);
    cmd.args(args)
        .env("KEYWATCH_KEY", OsString::from_vec(f.key.to_vec()))
        .env("KEYWATCH_RULE", &rule.name)
        .env("KEYWATCH_EVENT", f.kind.as_str())
        .env("KEYWATCH_DB", f.db.to_string())
        .env("KEYWATCH_ID", &f.id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let shown = program.to_string_lossy().into_owned();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        // A program that is not there now may be deployed later: retried like any failure.
        Err(e) => {
            return Outcome::Retry {
                reason: format!("cannot start `{shown}`: {e}"),
                after: None,
            };
        }
    };
    // The child leads its group (`process_group(0)`), so its pid is the group's id. The guard
    // kills the group if this attempt ends early (shutdown drops the future).
    let mut group = Group(child.id().and_then(|id| Pid::from_raw(id as i32)));
    let mut out = tokio::spawn(read_some(child.stdout.take()));
    let mut err = tokio::spawn(read_some(child.stderr.take()));
    let status = match tokio::time::timeout(step.timeout, child.wait()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Outcome::Retry {
                reason: format!("`{shown}`: {e}"),
                after: None,
            };
        }
        Err(_) => {
            group.kill();
            let _ = child.kill().await;
            crate::internal_events::ExecTimedOut {
                rule: &rule.name,
                program: &printable_masked(&a.config.secrets, &shown),
                timeout: step.timeout,
            }
            .emit();
            return Outcome::Retry {
                reason: format!(
                    "`{shown}` did not finish within {}; killed with its process group",
                    humantime::format_duration(step.timeout)
                ),
                after: None,
            };
        }
    };
    let both = async { ((&mut out).await, (&mut err).await) };
    let (stdout, stderr, held) = match tokio::time::timeout(OUTPUT_GRACE, both).await {
        Ok((o, e)) => (o.unwrap_or_default(), e.unwrap_or_default(), false),
        Err(_) => {
            group.kill();
            // Killed, the group lets go of the pipes; a process that left the group (setsid)
            // may not, and what was read so far is lost with the readers then.
            let rest = async { ((&mut out).await, (&mut err).await) };
            match tokio::time::timeout(OUTPUT_GRACE, rest).await {
                Ok((o, e)) => (o.unwrap_or_default(), e.unwrap_or_default(), true),
                Err(_) => {
                    out.abort();
                    err.abort();
                    (String::new(), String::new(), true)
                }
            }
        }
    };
    group.disarm();
    // A program may echo the arguments it was given, secrets among them; and what it writes
    // (key text, or anything) must not forge a log line or repaint the terminal of whoever
    // tails the log: control and bidi characters written out
    // (docs/rules.md#exec-arguments-options-and-process-groups).
    let for_log = |t: &str| printable_masked(&a.config.secrets, t);
    if held {
        crate::internal_events::ExecGroupKilled {
            rule: &rule.name,
            program: &for_log(&shown),
        }
        .emit();
    }
    if !stdout.is_empty() || !stderr.is_empty() {
        crate::internal_events::ExecOutput {
            rule: &rule.name,
            program: &for_log(&shown),
            stdout: &for_log(&stdout),
            stderr: &for_log(&stderr),
        }
        .emit();
    }
    match status.code() {
        Some(0) => Outcome::Sent("exit 0".into()),
        Some(code) => Outcome::Retry {
            reason: format!("`{shown}` exited with {code}: {}", stderr.trim()),
            after: None,
        },
        None => Outcome::Retry {
            reason: format!("`{shown}` was killed by a signal"),
            after: None,
        },
    }
}

/// `text` as the log shows it: secrets masked, control and bidi characters written out (what a
/// program writes, key text or anything, must not forge a log line or repaint a terminal).
fn printable_masked(secrets: &crate::yaml::Secrets, text: &str) -> String {
    crate::event::printable_whole(secrets.mask(text).as_bytes()).into_owned()
}

/// Why this argv can never run as the rule means it, if it cannot: retrying will not change
/// the key, so these fail for good (a dead letter at once, with the reason).
///
/// - A NUL byte cannot be passed in an argument or an environment variable (`KEYWATCH_KEY`).
/// - An argument whose template starts with a value (`{{ file }}`) and that came out starting
///   with `-` would be read as an option (`rm {{ file }}` with a key `f:-rf`), unless an
///   argument `--` comes before it. `value_led` says which arguments start with a value.
pub fn refused(argv: &[OsString], value_led: &[bool], key: &[u8]) -> Option<String> {
    if let Some(i) = argv.iter().position(|a| a.as_bytes().contains(&0)) {
        return Some(format!(
            "exec argument {i} contains a NUL byte, which no program can receive"
        ));
    }
    if key.contains(&0) {
        return Some(
            "the key contains a NUL byte, which the environment variable KEYWATCH_KEY cannot carry"
                .into(),
        );
    }
    let end_of_options = argv
        .iter()
        .position(|a| a.as_bytes() == b"--")
        .unwrap_or(argv.len());
    let dashed = argv
        .iter()
        .zip(value_led)
        .enumerate()
        .take(end_of_options)
        .skip(1)
        .find(|(_, (a, led))| **led && a.as_bytes().starts_with(b"-"));
    dashed.map(|(i, (a, _))| {
        format!(
            "exec argument {i} ({:?}) starts with `-`, so the program would take it as an option; a key text that starts with `-` is refused unless `--` comes before it in `command` (or the value is glued to its option: `--day={{{{ day }}}}`)",
            a.to_string_lossy()
        )
    })
}

/// The command's process group, killed as a whole.
struct Group(Option<Pid>);

impl Group {
    /// Kills the group once: after that its id may be reused by a stranger's group.
    fn kill(&mut self) {
        if let Some(pid) = self.0.take() {
            // ESRCH: the group is already gone, which is what we want.
            let _ = kill_process_group(pid, Signal::KILL);
        }
    }

    /// The command is done and its output closed: whatever it left running that closed its
    /// output (a daemon it started on purpose) is not ours to kill.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn read_some<R: tokio::io::AsyncRead + Unpin>(r: Option<R>) -> String {
    let Some(mut r) = r else { return String::new() };
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    // Read to the end so the child never blocks on a full pipe, keeping only the start.
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let room = KEEP.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
    String::from_utf8_lossy(&kept).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&[u8]]) -> Vec<OsString> {
        args.iter()
            .map(|a| OsString::from_vec(a.to_vec()))
            .collect()
    }

    #[test]
    fn nul_bytes_are_refused_for_good() {
        let why = refused(&argv(&[b"/bin/echo", b"a\0b"]), &[false, true], b"k").unwrap();
        assert!(why.contains("argument 1 contains a NUL byte"), "{why}");
        let why = refused(&argv(&[b"/bin/echo"]), &[false], b"k\0").unwrap();
        assert!(why.contains("KEYWATCH_KEY"), "{why}");
    }

    #[test]
    fn a_value_that_looks_like_an_option_is_refused_unless_after_double_dash() {
        let led = [false, false, true];
        let why = refused(&argv(&[b"/bin/rm", b"-v", b"-rf"]), &led, b"k").unwrap();
        assert!(
            why.contains("argument 2 (\"-rf\") starts with `-`"),
            "{why}"
        );
        assert_eq!(refused(&argv(&[b"/bin/rm", b"-v", b"f"]), &led, b"k"), None);
        // The author's own options, and values glued to them, are theirs.
        assert_eq!(
            refused(
                &argv(&[b"/bin/rm", b"-v", b"--x=-1"]),
                &[false, false, false],
                b"k"
            ),
            None
        );
        let led = [false, false, false, true];
        assert_eq!(
            refused(&argv(&[b"/bin/rm", b"-v", b"--", b"-rf"]), &led, b"k"),
            None
        );
    }

    /// The log lines written while `f` runs, as text logs show them.
    async fn logged<F: std::future::Future>(f: F) -> (F::Output, String) {
        use std::sync::{Arc, Mutex};
        #[derive(Clone)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines(Arc::default());
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let out = f.await;
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        (out, text)
    }

    /// Issue 36: a job's output reached the log as it was, so a job (or whatever it echoes of a
    /// key) could write log lines of its own, repaint the terminal of whoever tails the log, or
    /// turn keywatch's words around.
    #[tokio::test]
    async fn the_output_is_logged_with_control_and_bidi_characters_escaped() {
        let actions = ActionContext::of_yaml(
            r#"
rules:
  - name: job
    match: 'job:*'
    exec:
      command: ["/bin/sh", "-c", 'printf "done\n2026-01-01T00:00:00Z  INFO forged\033[2J\342\200\256"; printf "oops\a\r" >&2']
"#,
            crate::config::Mode::Run,
        );
        let event = crate::event::KeyEvent {
            kind: crate::event::EventKind::Expired,
            db: 0,
            key: bytes::Bytes::from(b"job:1".to_vec()),
            field: None,
            observed_at: chrono::Utc::now(),
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: "127.0.0.1:1".into(),
            place: None,
        };
        let firing = Firing::new("job", &event, &[], vec![], None);
        let (outcome, logs) = logged(actions.run(&firing, &crate::firing::Action::Exec)).await;
        assert!(matches!(outcome, Outcome::Sent(_)), "{outcome:?}");
        let line = logs
            .lines()
            .find(|l| l.contains("exec output."))
            .unwrap_or_else(|| panic!("no output line in:\n{logs}"));
        assert_eq!(logs.lines().count(), 1, "one line, none forged:\n{logs}");
        assert!(
            line.contains(r"done\n2026-01-01T00:00:00Z  INFO forged\u{1b}[2J\u{202e}"),
            "{line}"
        );
        assert!(line.contains(r"oops\u{7}\r"), "{line}");
        assert!(
            !logs.contains(['\u{1b}', '\u{7}', '\r', '\u{202e}']),
            "{logs:?}"
        );
    }
}
