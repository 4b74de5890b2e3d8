//! One job or digest attempted until it is sent or fails for good: logged and counted, through
//! its channel's rate-limited lane, its retries stored in the queue, and its dead letter.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::action::notify;
use crate::channel::{self, Message};
use crate::firing::{Action, Firing, Job};
use crate::outcome::Outcome;

use super::dead::DeadLetter;
use super::lane::{Lane, Turn, Waiting};
use super::queue::Window;
use super::retry::Next;
use super::state::{DIGEST_ITEMS, Inner, inflight, windows_inflight};
use super::work::{Work, window_jobs};

/// One attempt, logged and counted: one line per action sent or failed.
pub(super) async fn attempt(inner: &Inner, work: &Work, n: u32) -> Outcome {
    let started = Instant::now();
    let outcome = match work {
        Work::Job { firing, action } => inner.actions.run(firing, action).await,
        Work::Digest {
            channel, message, ..
        } => match inner.actions.refreshed().config.channel(channel) {
            Some(ch) => channel::send(&inner.actions.http, ch, message).await,
            None => Outcome::Failed(format!("channel `{channel}` is no longer defined")),
        },
    };
    let secs = started.elapsed().as_secs_f64();
    inner
        .metrics
        .action(work.rule(), work.action_name(), outcome.label(), secs);
    if let Some(s) = inner.status.get() {
        let detail = match &outcome {
            Outcome::Sent(what) => what,
            Outcome::Retry { reason, .. } | Outcome::Failed(reason) => reason,
        };
        s.record_outcome(
            work.rule(),
            work.firing_id(),
            &work.status_label(),
            outcome.label(),
            detail,
        );
    }
    let (rule, key, action, channel) = (
        work.rule(),
        work.subject(),
        work.action_name(),
        work.channel().unwrap_or(""),
    );
    match &outcome {
        Outcome::Sent(what) => {
            tracing::info!(%rule, %key, action, channel, outcome = "sent", attempt = n + 1, answer = %what, "Action done.")
        }
        Outcome::Retry { reason, .. } => {
            tracing::warn!(%rule, %key, action, channel, outcome = "retry", attempt = n + 1, %reason, "Action failed; will retry.")
        }
        Outcome::Failed(reason) => {
            tracing::error!(%rule, %key, action, channel, outcome = "failed", attempt = n + 1, %reason, "Action failed for good.")
        }
    }
    outcome
}

/// Attempts `work` until it is sent or fails for good. A job in the durable queue leaves for
/// the queue between attempts (any instance may take the next one); a digest (held only in
/// memory) waits here. `failing_since` is when the first attempt failed, unix ms.
pub(super) async fn deliver(
    inner: Arc<Inner>,
    work: Work,
    mut n: u32,
    mut failing_since: Option<i64>,
) {
    let id = work.job_id();
    inflight(&inner).insert(id.clone());
    let window = match &work {
        Work::Digest {
            window: Some(w),
            jobs,
            ..
        } => {
            windows_inflight(&inner)
                .entry(w.clone())
                .or_default()
                .extend(jobs.iter().cloned());
            Some(w.clone())
        }
        _ => None,
    };
    // A notification of a rate-limited channel waits in its channel's line, and may come out of
    // it carrying the channel's backlog as a digest.
    let (work, mut token) = match lane_of(&inner, &work) {
        Some(lane) => match take_turn(&inner, &lane, work, &id).await {
            Some(w) => (w, true),
            // Left in flight: shutdown hands it back, or the digest it joined acknowledges it.
            None => return,
        },
        None => (work, false),
    };
    // The queued jobs this work acknowledges when it is finished.
    let jobs: Vec<String> = match (&work, &inner.queue) {
        (_, None) => Vec::new(),
        (Work::Job { .. }, Some(_)) => vec![id.clone()],
        (Work::Digest { jobs, .. }, Some(_)) => jobs.clone(),
    };
    let durable = match (&work, &inner.queue) {
        (Work::Job { .. }, Some(q)) => Some(q.clone()),
        _ => None,
    };
    let finish = |inner: &Inner| {
        let mut set = inflight(inner);
        set.remove(&id);
        for j in &jobs {
            set.remove(j);
        }
        if let Some(w) = &window {
            let mut windows = windows_inflight(inner);
            if let Some(ids) = windows.get_mut(w) {
                for j in &jobs {
                    ids.remove(j);
                }
                if ids.is_empty() {
                    windows.remove(w);
                }
            }
        }
    };
    let limiter = work
        .channel()
        .and_then(|c| inner.limiters.get(&inner.actions.live.current(), c))
        .map(|l| l.limiter);
    loop {
        if let Some(l) = &limiter
            && !std::mem::take(&mut token)
        {
            tokio::select! {
                biased;
                // Left in flight: shutdown hands it back.
                _ = inner.shutdown.cancelled() => return,
                _ = l.take() => {}
            }
        }
        let outcome = attempt(&inner, &work, n).await;
        match outcome {
            Outcome::Sent(_) | Outcome::Failed(_) => {
                if let Outcome::Failed(reason) = &outcome {
                    dead_letter(&inner, &work, reason);
                }
                acknowledge(&inner, window.as_ref(), &jobs).await;
                finish(&inner);
                return;
            }
            Outcome::Retry { after, .. } => {
                let now = super::queue::now_ms();
                let since = *failing_since.get_or_insert(now);
                n += 1;
                let Next::RetryAt(at) = inner.policy.after_failure(n, since, now, after) else {
                    dead_letter(
                        &inner,
                        &work,
                        "gave up: failing for longer than the retry window",
                    );
                    acknowledge(&inner, window.as_ref(), &jobs).await;
                    finish(&inner);
                    return;
                };
                let wait = Duration::from_millis(u64::try_from(at - now).unwrap_or(0));
                if let (Some(q), Work::Job { firing, action }) = (&durable, &work) {
                    let job = Job {
                        firing: firing.clone(),
                        action: action.clone(),
                        attempt: n,
                        failing_since,
                    };
                    // Out of the in-flight set first, so a lease renewal cannot push the retry back.
                    finish(&inner);
                    match q.reschedule(&job, at).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, id = %id, "Cannot requeue the job; retrying from memory.")
                        }
                    }
                }
                // A window's digest leaves for its window: any instance attempts it next.
                if let (
                    Some(q),
                    Some(w),
                    Work::Digest {
                        firings, channel, ..
                    },
                ) = (&inner.queue, &window, &work)
                {
                    let again = window_jobs(firings, channel, n, failing_since);
                    finish(&inner);
                    match q.window_retry(w, &again, at).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, rule = %w.rule, "Cannot requeue the digest; retrying from memory.")
                        }
                    }
                }
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Removes finished jobs from the queue, or from their window (one round trip for all).
pub(super) async fn acknowledge(inner: &Inner, window: Option<&Window>, jobs: &[String]) {
    let Some(q) = &inner.queue else { return };
    if let Some(w) = window {
        if let Err(e) = q.window_done(w, jobs).await {
            tracing::warn!(error = %e, jobs = jobs.len(), rule = %w.rule, "Cannot mark a digest window done; it may be sent again when its lease ends.");
        }
        return;
    }
    let acks = futures_util::future::join_all(jobs.iter().map(|j| q.done(j))).await;
    if let Some(Err(e)) = acks.into_iter().find(|r| r.is_err()) {
        tracing::warn!(error = %e, jobs = jobs.len(), "Cannot mark jobs done; they may run again when their lease ends.");
    }
}

/// The waiting line of a notification's channel, if the channel has a rate.
pub(super) fn lane_of(inner: &Inner, work: &Work) -> Option<Arc<Lane>> {
    match work {
        Work::Job {
            action: Action::Notify { channel },
            ..
        } => inner
            .limiters
            .get(&inner.actions.live.current(), channel)
            .map(|l| l.lane),
        _ => None,
    }
}

/// Waits for the channel's token; the work to send with it (this notification, or a digest of
/// it and the backlog of its rule), or `None` when there is nothing more to do here.
pub(super) async fn take_turn(
    inner: &Arc<Inner>,
    lane: &Arc<Lane>,
    work: Work,
    id: &str,
) -> Option<Work> {
    let Work::Job { firing, action } = &work else {
        return Some(work);
    };
    let waiting = Waiting {
        firing: firing.clone(),
        job: id.to_string(),
    };
    let others = match lane.wait(waiting, &inner.tracker, &inner.shutdown).await? {
        Turn::Alone => return Some(work),
        Turn::Merged => return None,
        Turn::Lead(others) => others,
    };
    let Action::Notify { channel } = action else {
        return Some(work);
    };
    let mut firings = vec![firing.clone()];
    let mut jobs = vec![id.to_string()];
    for w in others {
        firings.push(w.firing);
        jobs.push(w.job);
    }
    match compose_digest_now(inner, &firing.rule, channel, &firings) {
        Ok(message) => Some(Work::Digest {
            rule: firing.rule.clone(),
            channel: channel.clone(),
            message: Arc::new(message),
            firings,
            jobs,
            window: None,
        }),
        Err(e) => {
            // Sent alone, then; the others go back to the queue for their own turns.
            tracing::error!(rule = %firing.rule, %channel, reason = %e, "Cannot merge the channel's backlog into a digest; sending one by one.");
            let back = jobs.split_off(1);
            if let Some(q) = &inner.queue
                && let Err(e) = q.hand_back(&back).await
            {
                tracing::warn!(error = %e, "Cannot hand jobs back; they come due again when their lease ends.");
            }
            let mut set = inflight(inner);
            for j in &back {
                set.remove(j);
            }
            Some(work)
        }
    }
}

/// A digest of `firings` of `rule` for `channel` under the rules in force now, listing the rule's
/// `group.max_items` (or [`DIGEST_ITEMS`] for a merged backlog of a rule without `group`).
pub(super) fn compose_digest_now(
    inner: &Inner,
    rule: &str,
    channel: &str,
    firings: &[Arc<Firing>],
) -> Result<Message, String> {
    let actions = inner.actions.refreshed();
    match (actions.config.rule(rule), actions.config.channel(channel)) {
        (Some(r), Some(ch)) => {
            let max = r
                .notify
                .as_ref()
                .and_then(|n| n.group)
                .map_or(DIGEST_ITEMS, |g| g.max_items);
            notify::compose_digest(&actions, firings, r, ch, max)
        }
        _ => Err("the rule or channel is no longer defined".into()),
    }
}

/// Gives `work` up for good: a dead letter that says why.
pub(super) fn dead_letter(inner: &Inner, work: &Work, reason: &str) {
    tracing::error!(rule = %work.rule(), key = %work.subject(), action = work.action_name(), channel = work.channel().unwrap_or(""), id = %work.id(), %reason, "Dead letter: the action will not be retried.");
    let (action, firings, digest) = match work {
        Work::Job { firing, action } => (action.clone(), vec![(**firing).clone()], false),
        Work::Digest {
            channel, firings, ..
        } => (
            Action::Notify {
                channel: channel.clone(),
            },
            firings.iter().map(|f| (**f).clone()).collect(),
            true,
        ),
    };
    keep_dead_letter(
        inner,
        DeadLetter::new(work.rule(), work.subject(), action, reason, firings, digest),
    );
}

/// Counts a dead letter, shows it on the status page and keeps it in Redis.
pub(super) fn keep_dead_letter(inner: &Inner, letter: DeadLetter) {
    inner.metrics.dead_letters.inc();
    if let Some(s) = inner.status.get() {
        s.record_dead_letter(letter.clone());
    }
    if let Some(store) = inner.dead.clone() {
        tokio::spawn(async move {
            if let Err(e) = store.store(&letter).await {
                tracing::error!(id = %letter.id, error = %e, "Cannot store the dead letter in Redis; it is only in this log.");
            }
        });
    }
}
