//! `exec`: a local command, as an argv without a shell (a capture is always one argument, never
//! shell syntax), with a timeout after which it is killed. Its output goes to the log.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::Stdio;

use tokio::io::AsyncReadExt;

use crate::config::{ExecStep, Rule};
use crate::firing::Firing;

use super::context::Actions;
use crate::outcome::Outcome;

/// Output kept for the log, per stream.
const KEEP: usize = 4096;

pub async fn run(a: &Actions, f: &Firing, rule: &Rule, step: &ExecStep) -> Outcome {
    let ctx = f.context();
    let mut argv = Vec::with_capacity(step.command.len());
    for id in &step.command {
        match a.config.templates.render(*id, &ctx) {
            Ok(bytes) => argv.push(OsString::from_vec(bytes)),
            Err(e) => return Outcome::Failed(format!("exec argument: {}", e.message)),
        }
    }
    let Some((program, args)) = argv.split_first() else {
        return Outcome::Failed("exec: empty command".into());
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .env("KEYWATCH_KEY", OsString::from_vec(f.key.clone()))
        .env("KEYWATCH_RULE", &rule.name)
        .env("KEYWATCH_EVENT", f.kind.as_str())
        .env("KEYWATCH_DB", f.db.to_string())
        .env("KEYWATCH_ID", &f.id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
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
    let out = tokio::spawn(read_some(child.stdout.take()));
    let err = tokio::spawn(read_some(child.stderr.take()));
    let status = match tokio::time::timeout(step.timeout, child.wait()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Outcome::Retry {
                reason: format!("`{shown}`: {e}"),
                after: None,
            };
        }
        Err(_) => {
            let _ = child.kill().await;
            return Outcome::Retry {
                reason: format!(
                    "`{shown}` did not finish within {}; killed",
                    humantime::format_duration(step.timeout)
                ),
                after: None,
            };
        }
    };
    let stdout = out.await.unwrap_or_default();
    let stderr = err.await.unwrap_or_default();
    if !stdout.is_empty() || !stderr.is_empty() {
        tracing::info!(rule = %rule.name, program = %shown, stdout = %stdout, stderr = %stderr, "exec output.");
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
