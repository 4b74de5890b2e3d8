//! `escalate` and `resolved`: messages sent some time after an alert, from jobs that waited in
//! the durable queue (so one instance sends each, and a restart loses none).
//!
//! When a rule with follow-ups alerts, one job per follow-up channel is stored with the alert's
//! jobs, due later: an escalation at `after`, a resolved notice at the end of `within`. A key
//! heard existing again (its `expire` event: the lock re-acquired with a TTL) makes both due at
//! once; whatever hears it, the jobs decide by looking at Redis when they run:
//! - an escalation is cancelled when the alert was acknowledged (a signed link), or under
//!   `unless: recreated` when the key exists again — which also brings the resolved notices due;
//! - a resolved notice is sent when the key exists again within `within`, and dropped otherwise.
//!
//! A cancelled follow-up ends as [`Outcome::Skipped`]: done for the queue (nothing to retry),
//! `skipped` in history, not counted as escalated or resolved.

use crate::channel::{self, Channel, Followup, FollowupKind, Item, Message};
use crate::config::{FollowupStep, Rule, Unless};
use crate::firing::{Action, Firing};
use crate::keyspace::clock;
use crate::outcome::Outcome;
use crate::store::followups;

use super::context::ActionContext;

/// What stays due for the follow-ups of one alert beyond its longest wait: a resolved notice
/// heard at the last moment still finds its jobs.
const MARKER_SLACK_MS: i64 = 60_000;

/// Whether an alert of `kind` has follow-ups: the key is gone, so it can come back
/// (README.md#follow-ups).
pub fn follows(kind: crate::event::EventKind) -> bool {
    use crate::event::EventKind;
    matches!(
        kind,
        EventKind::Expired | EventKind::Evicted | EventKind::Hexpired
    )
}

/// The follow-up jobs of a firing of `rule`, each with its due time (unix ms, Redis's clock),
/// and how long the marker naming them must live.
pub fn jobs_of(rule: &Rule, now_ms: i64) -> (Vec<(Action, i64)>, i64) {
    let mut out = Vec::new();
    let mut longest = 0;
    if let Some(s) = &rule.escalate {
        let due = now_ms + s.wait.as_millis() as i64;
        longest = longest.max(s.wait.as_millis() as i64);
        out.extend(
            s.to.iter()
                .map(|c| (Action::Escalate { channel: c.clone() }, due)),
        );
    }
    if let Some(s) = &rule.resolved {
        let due = now_ms + s.wait.as_millis() as i64;
        longest = longest.max(s.wait.as_millis() as i64);
        out.extend(
            s.to.iter()
                .map(|c| (Action::Resolved { channel: c.clone() }, due)),
        );
    }
    (out, longest + MARKER_SLACK_MS)
}

/// The jobs of the alert `firing_id` that hearing its key again makes due now: its resolved
/// notices, and its escalations under `unless: recreated`.
pub fn due_on_recreation(rule: &Rule, firing_id: &str) -> Vec<String> {
    let mut ids = Vec::new();
    if let Some(s) = &rule.escalate
        && s.unless == Unless::Recreated
    {
        ids.extend(
            s.to.iter()
                .map(|c| Action::Escalate { channel: c.clone() }.idempotency_key(firing_id)),
        );
    }
    if let Some(s) = &rule.resolved {
        ids.extend(
            s.to.iter()
                .map(|c| Action::Resolved { channel: c.clone() }.idempotency_key(firing_id)),
        );
    }
    ids
}

/// Stores the marker of the alert `f` (see [`marker_key`]) for `ms`, in the caller's
/// transaction.
pub fn marker_cmd(prefix: &str, f: &Firing, ms: i64) -> redis::Cmd {
    followups::marker_cmd(prefix, &f.rule, f.db, &f.key, &f.id, ms)
}

/// The names of the markers of alerts of `key` in `db` by `rules`, for [`bring_forward`].
pub fn markers_of(prefix: &str, rules: &[Rule], db: u32, key: &[u8]) -> Vec<Vec<u8>> {
    rules
        .iter()
        .map(|r| followups::marker_key(prefix, &r.name, db, key))
        .collect()
}

/// A key in `db` was heard existing again: the follow-ups of alerts of it by `rules` (whose
/// markers are `markers`, [`markers_of`]) that wait in the queue become due now, and their
/// markers go. `key`: the key, to make sure it exists (`None`: a key over
/// [`crate::long_key::EXACT`], heard again in an `expire` event, is taken as existing: sending
/// megabytes to ask is what docs/reliability.md#bounded-whatever-the-key rules out, and a key
/// re-created with a TTL was re-created even if it expired again meanwhile).
pub async fn bring_forward(
    keyspace: &crate::keyspace::Keyspace,
    state: crate::keyspace::Conn,
    prefix: &str,
    rules: &[Rule],
    db: u32,
    markers: Vec<Vec<u8>>,
    key: Option<&[u8]>,
) -> redis::RedisResult<()> {
    // Markers first: nearly always there are none (no alert of the key waits).
    let markers = followups::Markers::new(state, prefix, markers);
    let ids = markers.read().await?;
    if ids.iter().all(Option::is_none) {
        return Ok(());
    }
    // An `expire` event of the key before its own expiry is no re-creation.
    if let Some(key) = key {
        let mut conn = keyspace.conn(db).await?;
        let n: i64 = redis::cmd("EXISTS").arg(key).query_async(&mut conn).await?;
        if n == 0 {
            return Ok(());
        }
    }
    let mut due = Vec::new();
    for (rule, id) in rules.iter().zip(ids) {
        if let Some(id) = id {
            let jobs = due_on_recreation(rule, &id);
            if !jobs.is_empty() {
                due.push(jobs);
            }
        }
    }
    markers.bring_forward(&due, clock::now_ms()).await
}

/// One attempt of a follow-up job.
pub async fn run(a: &ActionContext, f: &Firing, rule: &Rule, action: &Action) -> Outcome {
    let result = match action {
        Action::Escalate { channel } => escalate(a, f, rule, channel).await,
        Action::Resolved { channel } => resolved(a, f, rule, channel).await,
        other => Err(format!("`{}` is no follow-up", other.name())),
    };
    result.unwrap_or_else(|reason| Outcome::Retry {
        reason,
        after: None,
    })
}

async fn escalate(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    channel: &str,
) -> Result<Outcome, String> {
    let Some(step) = &rule.escalate else {
        return Ok(Outcome::Failed("the rule no longer has `escalate`".into()));
    };
    if acknowledged(a, f).await? {
        return Ok(Outcome::Skipped("acknowledged".into()));
    }
    if step.unless == Unless::Recreated && exists(a, f).await? {
        // The resolved notices need not wait for the end of `within`.
        if let Some(state) = &a.state {
            let ids = due_on_recreation(rule, &f.id);
            let _: redis::RedisResult<i64> =
                followups::due_now_cmd(&a.config.state.prefix, &ids, clock::now_ms())
                    .query_async(&mut state.clone())
                    .await;
        }
        return Ok(Outcome::Skipped("the key exists again".into()));
    }
    if let Some(early) = not_yet(f, step) {
        // Brought forward by hearing the key, which is gone again: wait for `after`.
        return Ok(Outcome::Retry {
            reason: "brought forward, but the key does not exist: waiting for `after`".into(),
            after: Some(early),
        });
    }
    send(a, f, rule, step, channel, FollowupKind::Escalation).await
}

/// How long before its wait is over a follow-up runs: it was brought forward by hearing its
/// key, so it must not decide yet unless the key is there.
fn not_yet(f: &Firing, step: &FollowupStep) -> Option<std::time::Duration> {
    let end = f.observed_at + chrono::Duration::from_std(step.wait).ok()?;
    let left = (end - clock::now()).to_std().ok()?;
    (left > std::time::Duration::from_millis(100)).then_some(left)
}

async fn resolved(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    channel: &str,
) -> Result<Outcome, String> {
    let Some(step) = &rule.resolved else {
        return Ok(Outcome::Failed("the rule no longer has `resolved`".into()));
    };
    if !exists(a, f).await? {
        if let Some(early) = not_yet(f, step) {
            return Ok(Outcome::Retry {
                reason: "brought forward, but the key does not exist: waiting for `within`".into(),
                after: Some(early),
            });
        }
        return Ok(Outcome::Skipped(format!(
            "not re-created within {}",
            humantime::format_duration(step.wait)
        )));
    }
    send(a, f, rule, step, channel, FollowupKind::Resolved).await
}

async fn send(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    step: &FollowupStep,
    channel: &str,
    which: FollowupKind,
) -> Result<Outcome, String> {
    let Some(ch) = a.config.channel(channel) else {
        return Ok(Outcome::Failed(format!(
            "channel `{channel}` is no longer defined"
        )));
    };
    // An Alertmanager's alert is its own jobs (one per URL): ending it is their work.
    if which == FollowupKind::Resolved
        && let Some(am) = ch.integration.alertmanager()
    {
        return Ok(super::alert::end(a, f, ch, am).await);
    }
    match compose(a, f, rule, step, ch, which) {
        Ok(msg) => Ok(channel::send(&a.http, ch, &msg).await),
        Err(e) => Ok(Outcome::Failed(e)),
    }
}

/// The follow-up's message for `ch`: its templates with `gap`, and the alert's event JSON with
/// `"followup"` (the alert's `id`, so a receiver ties the two together).
pub fn compose(
    a: &ActionContext,
    f: &Firing,
    rule: &Rule,
    step: &FollowupStep,
    ch: &Channel,
    kind: FollowupKind,
) -> Result<Message, String> {
    let which = kind.as_str();
    let escape = ch.escape();
    let t = &a.config.templates;
    let links = super::notify::links_of(a, f, rule);
    // As the channel shows it (docs/reliability.md#bounded-whatever-the-key).
    let cut = f.cut(ch.integration.key_limit());
    let f = cut.as_ref().unwrap_or(f);
    let gap_ms = (a.now() - f.observed_at).num_milliseconds().max(0);
    let ctx = a.context_of(f).with_gap(gap_ms);
    let render = |id: Option<crate::template::TemplateId>, field: &str| match id {
        Some(id) => t
            .render_text(id, &ctx)
            .map(Some)
            .map_err(|e| format!("{field}: {}", e.message)),
        None => Ok(None),
    };
    let field = if kind == FollowupKind::Escalation {
        "escalate"
    } else {
        "resolved"
    };
    let title = render(step.title.get(escape), &format!("{field}.title"))?
        .unwrap_or_else(|| format!("{} ({which})", rule.name));
    let text = render(step.message.get(escape), &format!("{field}.message"))?.unwrap_or_default();
    let mut event = f.to_json();
    event["followup"] = which.into();
    let action = if kind == FollowupKind::Escalation {
        Action::Escalate {
            channel: ch.name.clone(),
        }
    } else {
        Action::Resolved {
            channel: ch.name.clone(),
        }
    };
    Ok(Message {
        rule: rule.name.clone(),
        event: f.kind.as_str().to_string(),
        title,
        text: text.clone(),
        items: vec![Item { event, text }],
        count: 1,
        digest: false,
        idempotency_key: action.idempotency_key(&f.id),
        custom_body: None,
        mention: Default::default(),
        links,
        channel_fields: super::notify::channel_fields(t, ch, &ctx)?,
        followup: Some(Followup {
            kind,
            alert_id: f.id.clone(),
        }),
    })
}

async fn exists(a: &ActionContext, f: &Firing) -> Result<bool, String> {
    let mut conn = a
        .keyspace
        .conn(f.db)
        .await
        .map_err(|e| format!("cannot reach Redis to see whether the key exists again: {e}"))?;
    // A hash field's alert follows the field, not its hash (which holds other fields).
    let cmd = match &f.field {
        Some(field) => {
            let mut c = redis::cmd("HEXISTS");
            c.arg(&f.key[..]).arg(field);
            c
        }
        None => {
            let mut c = redis::cmd("EXISTS");
            c.arg(&f.key[..]);
            c
        }
    };
    let n: i64 = cmd
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("cannot see whether the key exists again: {e}"))?;
    Ok(n > 0)
}

async fn acknowledged(a: &ActionContext, f: &Firing) -> Result<bool, String> {
    let Some(state) = &a.state else {
        return Ok(false);
    };
    followups::acknowledged(&mut state.clone(), &a.config.state.prefix, &f.id)
        .await
        .map_err(|e| format!("cannot read acknowledgements: {e}"))
}

crate::keyspace::commands::declare! {
    /// The commands follow-ups send ([`crate::keyspace::commands`]).
    const WHY = "escalate and resolved";
    [
        Use::new(Server::Watched, "exists", WHY)
            .on(Keys::Watched, Access::Read)
            .args("{key}"),
        Use::new(Server::Watched, "hexists", WHY)
            .on(Keys::Watched, Access::Read)
            .args("{key} f"),
        // Its keys' commands are declared with them (`store::followups`).
    ]
}
