//! What an action would do, rendered by the same code that does it, and not done: the message a
//! channel would carry, the request a reload would make, the argv an exec would start, the
//! patterns a cleanup would delete. `keywatch test` compares these with what a test expects
//! (docs/rules.md#testing-rules), so a passing test means keywatch would render exactly that.

use std::sync::Arc;

use crate::channel::FollowupKind;
use crate::config::Rule;
use crate::firing::{Action, Firing};
use crate::outcome::Outcome;

use super::context::ActionContext;

/// One action, rendered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Preview {
    /// A message to a channel (one event's, or a digest's), or an alert handed to an
    /// Alertmanager (its summary and description).
    Notify {
        channel: String,
        title: String,
        text: String,
    },
    /// An escalation's message to a channel (`escalate`), due `after` the alert.
    Escalate {
        channel: String,
        title: String,
        text: String,
    },
    /// The request a `reload` makes.
    Reload {
        method: String,
        url: String,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// The program and arguments an `exec` starts (no shell).
    Exec { argv: Vec<String> },
    /// What a `cleanup` deletes: glob patterns, and (hash, field) pairs.
    Cleanup {
        delete: Vec<String>,
        hdel: Vec<(String, String)>,
    },
}

impl Preview {
    /// What it would do, as one text: what a shadow (`run --shadow`) records in history.
    pub fn describe(&self) -> String {
        match self {
            Preview::Notify {
                channel,
                title,
                text,
            }
            | Preview::Escalate {
                channel,
                title,
                text,
            } => format!("{} {channel}: {title}\n{text}", self.action()),
            Preview::Reload {
                method, url, body, ..
            } => match body.is_empty() {
                true => format!("reload {method} {url}"),
                false => format!("reload {method} {url}\n{body}"),
            },
            Preview::Exec { argv } => {
                format!("exec {}", serde_json::to_string(argv).unwrap_or_default())
            }
            Preview::Cleanup { delete, hdel } => format!(
                "cleanup delete {} hdel {}",
                serde_json::to_string(delete).unwrap_or_default(),
                serde_json::to_string(hdel).unwrap_or_default()
            ),
        }
    }

    /// The `action` label of docs/operations.md#metrics.
    pub fn action(&self) -> &'static str {
        match self {
            Preview::Notify { .. } => "notify",
            Preview::Escalate { .. } => "escalate",
            Preview::Reload { .. } => "reload",
            Preview::Exec { .. } => "exec",
            Preview::Cleanup { .. } => "cleanup",
        }
    }
}

/// `action` of `firing` under `rule`, rendered at `a`'s clock; `Err` says why it would fail for
/// good (a template that fails on this data, a URL or argv keywatch refuses to use).
/// `Action::Resolved` has no preview: it is sent only once the key exists again.
pub fn preview(
    a: &ActionContext,
    firing: &Firing,
    rule: &Rule,
    action: &Action,
) -> Result<Preview, String> {
    let failed = |o: Outcome| match o {
        Outcome::Failed(why) => why,
        other => format!("{other:?}"),
    };
    match action {
        Action::Reload => {
            let step = rule.reload.as_ref().ok_or("the rule has no `reload`")?;
            let req = super::reload::request(a, firing, step).map_err(failed)?;
            Ok(Preview::Reload {
                method: req.method.to_string(),
                url: req.url,
                headers: req.headers,
                body: String::from_utf8_lossy(&req.body).into_owned(),
            })
        }
        Action::Exec => {
            let step = rule.exec.as_ref().ok_or("the rule has no `exec`")?;
            let argv = super::exec::argv(a, firing, step).map_err(failed)?;
            Ok(Preview::Exec {
                argv: argv
                    .iter()
                    .map(|arg| arg.to_string_lossy().into_owned())
                    .collect(),
            })
        }
        Action::Cleanup => {
            let step = rule.cleanup.as_ref().ok_or("the rule has no `cleanup`")?;
            let t = super::cleanup::targets(a, firing, step).map_err(failed)?;
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            Ok(Preview::Cleanup {
                delete: t.delete.iter().map(|g| text(g)).collect(),
                hdel: t.hdel.iter().map(|(k, f)| (text(k), text(f))).collect(),
            })
        }
        Action::Notify { channel } | Action::Alert { channel, .. } => {
            let ch = a
                .config
                .channel(channel)
                .ok_or_else(|| format!("channel `{channel}` is not defined"))?;
            let msg = super::notify::compose(a, firing, rule, ch)?;
            Ok(Preview::Notify {
                channel: channel.clone(),
                title: msg.title,
                text: msg.text,
            })
        }
        Action::Escalate { channel } => {
            let step = rule.escalate.as_ref().ok_or("the rule has no `escalate`")?;
            let ch = a
                .config
                .channel(channel)
                .ok_or_else(|| format!("channel `{channel}` is not defined"))?;
            let msg =
                super::followup::compose(a, firing, rule, step, ch, FollowupKind::Escalation)?;
            Ok(Preview::Escalate {
                channel: channel.clone(),
                title: msg.title,
                text: msg.text,
            })
        }
        Action::Resolved { .. } => {
            Err("a resolved notice is sent only once the key exists again".into())
        }
    }
}

/// The digest of `firings` (one rule's, one window's) for `channel`, as its window would send it.
pub fn preview_digest(
    a: &ActionContext,
    firings: &[Arc<Firing>],
    rule: &Rule,
    channel: &str,
) -> Result<Preview, String> {
    let ch = a
        .config
        .channel(channel)
        .ok_or_else(|| format!("channel `{channel}` is not defined"))?;
    let max = rule
        .notify
        .as_ref()
        .and_then(|n| n.group)
        .map_or(usize::MAX, |g| g.max_items);
    let msg = super::notify::compose_digest(a, firings, rule, ch, max)?;
    Ok(Preview::Notify {
        channel: channel.to_string(),
        title: msg.title,
        text: msg.text,
    })
}
