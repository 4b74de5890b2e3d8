//! Digests: the notifications of a rule with `group` wait in a window shared by every instance
//! (or, when Redis cannot hold it, in this instance's memory) and go out as one message.

use std::sync::Arc;

use crate::action::notify;
use crate::channel::Message;
use crate::config::Group;
use crate::firing::{Action, DeadLetter, Firing, Job};

use super::attempt::{compose_digest_now, dead_letter, deliver, keep_dead_letter};
use super::queue::{Queue, Window};
use super::state::Inner;
use super::work::{Work, window_jobs};

/// Most jobs of one window taken into one digest: a storm's window of 100,000 becomes a few
/// digests of this many, and no Lua call holds Redis for long.
pub(super) const WINDOW_TAKE_MAX: usize = 5000;

/// Stores the firings' notifications in their shared window (before the caller removes their
/// details); held in this instance's memory only when there is no queue or Redis refused.
pub(super) async fn put_in_window(
    inner: &Arc<Inner>,
    w: Window,
    group: Group,
    firings: Vec<Arc<Firing>>,
) {
    if let Some(q) = &inner.queue {
        let jobs = window_jobs(&firings, &w.channel, 0, None);
        match q.window_put(&w, group.window, &jobs).await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, rule = %w.rule, channel = %w.channel, "Cannot store notifications in their digest window; collecting them in this instance's memory.");
            }
        }
    }
    for f in &firings {
        collect(inner, f, &w.channel, group);
    }
}

/// Sends the digest of every window that has ended (or whose retry is due), as one digest per
/// window (up to [`WINDOW_TAKE_MAX`] events each).
pub(super) async fn take_windows(inner: &Arc<Inner>, queue: &Queue) {
    let windows = match queue.windows().await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "Cannot read the digest windows; retrying.");
            return;
        }
    };
    for w in windows {
        let jobs = match queue.window_take(&w, WINDOW_TAKE_MAX).await {
            Ok(j) if j.is_empty() => continue,
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, rule = %w.rule, "Cannot take a digest window; retrying.");
                continue;
            }
        };
        let attempt = jobs.iter().map(|j| j.attempt).max().unwrap_or(0);
        let failing_since = jobs.iter().filter_map(|j| j.failing_since).min();
        let ids: Vec<String> = jobs.iter().map(Job::id).collect();
        let firings: Vec<Arc<Firing>> = jobs.into_iter().map(|j| j.firing).collect();
        match compose_digest_now(inner, &w.rule, &w.channel, &firings) {
            Ok(message) => {
                let work = Work::Digest {
                    rule: w.rule.clone(),
                    channel: w.channel.clone(),
                    message: Arc::new(message),
                    firings,
                    jobs: ids,
                    window: Some(w),
                };
                let i = inner.clone();
                inner
                    .tracker
                    .spawn(async move { deliver(i, work, attempt, failing_since).await });
            }
            Err(e) => {
                let work = Work::Digest {
                    rule: w.rule.clone(),
                    channel: w.channel.clone(),
                    message: Arc::new(Message::uncomposed_digest(
                        &w.rule,
                        firings.first().map_or("", |f| f.id.as_str()),
                        &w.channel,
                        firings.len(),
                    )),
                    firings,
                    jobs: ids.clone(),
                    window: Some(w.clone()),
                };
                dead_letter(inner, &work, &format!("cannot compose the digest: {e}"));
                if let Err(e) = queue.window_done(&w, &ids).await {
                    tracing::warn!(error = %e, rule = %w.rule, "Cannot remove a dead-lettered digest window; it may be dead-lettered again.");
                }
            }
        }
    }
}

/// Adds a firing to its (rule, channel) digest held in memory (see `Inner::digests`); the first
/// one of a window schedules the send.
pub(super) fn collect(inner: &Arc<Inner>, firing: &Arc<Firing>, channel: &str, group: Group) {
    let key = (firing.rule.clone(), channel.to_string());
    let first = {
        let mut open = inner.digests.lock().unwrap_or_else(|p| p.into_inner());
        let batch = open.entry(key.clone()).or_default();
        batch.push(firing.clone());
        batch.len() == 1
    };
    if !first {
        return;
    }
    let i = inner.clone();
    inner.tracker.spawn(async move {
        tokio::select! {
            biased;
            _ = i.shutdown.cancelled() => {}
            _ = tokio::time::sleep(group.window) => {}
        }
        let batch = i.digests.lock().unwrap_or_else(|p| p.into_inner()).remove(&key).unwrap_or_default();
        if batch.is_empty() {
            return;
        }
        let (rule, channel) = key;
        let actions = i.actions.refreshed();
        let composed = match (actions.config.rule(&rule), actions.config.channel(&channel)) {
            (Some(r), Some(ch)) => notify::compose_digest(&actions, &batch, r, ch, group.max_items),
            _ => Err("the rule or channel is no longer defined".into()),
        };
        match composed {
            Ok(message) => {
                let work = Work::Digest { rule, channel, message: Arc::new(message), firings: batch, jobs: Vec::new(), window: None };
                deliver(i.clone(), work, 0, None).await
            }
            Err(e) => {
                tracing::error!(%rule, %channel, keys = batch.len(), reason = %e, "Dead letter: cannot compose the digest.");
                let letter = DeadLetter::new(
                    &rule,
                    format!("{} keys (digest)", batch.len()),
                    Action::Notify { channel: channel.clone() },
                    &format!("cannot compose the digest: {e}"),
                    batch.iter().map(|f| (**f).clone()).collect(),
                    true,
                );
                keep_dead_letter(&i, letter);
            }
        }
    });
}
