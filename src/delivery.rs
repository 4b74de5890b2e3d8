//! The delivery stage: runs the jobs of each firing, retries what failed with capped
//! exponential backoff and full jitter (`Retry-After` obeyed), and dead-letters what failed for
//! good or for too long.
//!
//! The first attempts of one firing run in the order of SPEC §2 (reload → exec → cleanup →
//! notify); a failing step is handed to its own retry loop and does not hold back the next.
//! Notifications wait for their channel's token bucket in their own task, so one slow or
//! throttled channel never delays another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::notify::{self, Message};
use crate::action::{Actions, Outcome, actions_of};
use crate::config::Group;
use crate::job::{Action, Firing};
use crate::metrics::Metrics;
use crate::ratelimit::TokenBucket;
use crate::status::{DeadLetter, Status};

/// How failed actions are retried.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub min: Duration,
    pub max: Duration,
    /// Retried for this long after the first failure, then dead-lettered (SPEC §5: 24 h).
    pub give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(300),
            give_up_after: Duration::from_secs(24 * 3600),
        }
    }
}

impl RetryPolicy {
    /// Full jitter over a capped exponential (Vector's `retries.rs`): random in
    /// [min/2, min(max, min·2^attempt)], so retries of a storm spread out.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let cap = self
            .min
            .saturating_mul(2u32.saturating_pow(attempt.min(30)))
            .min(self.max);
        let floor = self.min / 2;
        floor + cap.saturating_sub(floor).mul_f64(fastrand::f64())
    }
}

#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

struct Inner {
    actions: Actions,
    metrics: Arc<Metrics>,
    limiters: HashMap<String, Arc<TokenBucket>>,
    policy: RetryPolicy,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Bounds the firings whose first attempts run at once, so a storm queues instead of
    /// opening ten thousand connections.
    concurrent: Arc<Semaphore>,
    /// Open digest windows, by (rule, channel).
    digests: Mutex<HashMap<DigestKey, Vec<Arc<Firing>>>>,
    /// Where outcomes and dead letters are shown (the status page); set once by `report_to`
    /// so that the constructor stays the same for callers that have no status page.
    status: OnceLock<Arc<Status>>,
}

/// A digest window is per (rule, channel).
type DigestKey = (String, String);

/// A unit of delivery: one action of one firing, or one digest message.
#[derive(Clone)]
enum Work {
    Step {
        firing: Arc<Firing>,
        action: Action,
    },
    Digest {
        rule: String,
        channel: String,
        message: Arc<Message>,
    },
}

impl Work {
    fn rule(&self) -> &str {
        match self {
            Work::Step { firing, .. } => &firing.rule,
            Work::Digest { rule, .. } => rule,
        }
    }

    fn action_name(&self) -> &'static str {
        match self {
            Work::Step { action, .. } => action.name(),
            Work::Digest { .. } => "notify",
        }
    }

    fn channel(&self) -> Option<&str> {
        match self {
            Work::Step {
                action: Action::Notify { channel },
                ..
            } => Some(channel),
            Work::Step { .. } => None,
            Work::Digest { channel, .. } => Some(channel),
        }
    }

    /// What the log line names: the key, or how many keys a digest stands for.
    fn subject(&self) -> String {
        match self {
            Work::Step { firing, .. } => String::from_utf8_lossy(&firing.key).into_owned(),
            Work::Digest { message, .. } => format!("{} keys (digest)", message.count),
        }
    }

    fn id(&self) -> &str {
        match self {
            Work::Step { firing, .. } => &firing.id,
            Work::Digest { message, .. } => &message.idempotency_key,
        }
    }

    /// The firing this work belongs to; a digest stands for many.
    fn firing_id(&self) -> Option<&str> {
        match self {
            Work::Step { firing, .. } => Some(&firing.id),
            Work::Digest { .. } => None,
        }
    }

    /// The action as the status page names it: `notify:CHANNEL` for notifications.
    fn status_label(&self) -> String {
        match self.channel() {
            Some(c) => format!("notify:{c}"),
            None => self.action_name().to_string(),
        }
    }
}

impl Delivery {
    pub fn new(
        actions: Actions,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        shutdown: CancellationToken,
    ) -> Delivery {
        let limiters = actions
            .config
            .channels
            .iter()
            .filter_map(|c| {
                c.rate
                    .map(|r| (c.name.clone(), Arc::new(TokenBucket::new(r))))
            })
            .collect();
        Delivery {
            inner: Arc::new(Inner {
                actions,
                metrics,
                limiters,
                policy,
                tracker: TaskTracker::new(),
                shutdown,
                concurrent: Arc::new(Semaphore::new(256)),
                digests: Mutex::new(HashMap::new()),
                status: OnceLock::new(),
            }),
        }
    }

    /// Reports every attempt and dead letter to `status` from now on (the first call wins).
    pub fn report_to(&self, status: Arc<Status>) {
        let _ = self.inner.status.set(status);
    }

    /// Takes a firing; its jobs run in the background.
    pub fn submit(&self, firing: Firing) {
        let inner = self.inner.clone();
        self.inner
            .tracker
            .spawn(async move { run_firing(inner, Arc::new(firing)).await });
    }

    /// Stops retry loops and waits up to `grace` for attempts in flight.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        self.inner.tracker.close();
        self.inner.shutdown.cancel();
        tokio::time::timeout(grace, self.inner.tracker.wait())
            .await
            .is_ok()
    }
}

async fn run_firing(inner: Arc<Inner>, firing: Arc<Firing>) {
    let Ok(_permit) = inner.concurrent.clone().acquire_owned().await else {
        return;
    };
    let Some(rule) = inner.actions.config.rule(&firing.rule) else {
        return;
    };
    let group = rule.notify.as_ref().and_then(|n| n.group);
    for action in actions_of(rule) {
        if inner.shutdown.is_cancelled() {
            return;
        }
        if let (Action::Notify { channel }, Some(g)) = (&action, group) {
            collect(&inner, &firing, channel, g);
            continue;
        }
        inner.metrics.queue_pending.inc();
        let work = Work::Step {
            firing: firing.clone(),
            action,
        };
        if matches!(
            &work,
            Work::Step {
                action: Action::Notify { .. },
                ..
            }
        ) {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { deliver(i, work, 0, None).await });
            continue;
        }
        let outcome = attempt(&inner, &work, 0).await;
        if let Outcome::Retry { after, .. } = outcome {
            let i = inner.clone();
            inner
                .tracker
                .spawn(async move { deliver(i, work, 1, Some((Instant::now(), after))).await });
        } else {
            inner.metrics.queue_pending.dec();
        }
    }
}

/// Adds a firing to its (rule, channel) digest; the first one of a window schedules the send.
fn collect(inner: &Arc<Inner>, firing: &Arc<Firing>, channel: &str, group: Group) {
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
        let composed = match (i.actions.config.rule(&rule), i.actions.config.channel(&channel)) {
            (Some(r), Some(ch)) => notify::compose_digest(&i.actions, &batch, r, ch, group.max_items),
            _ => Err("the rule or channel is no longer defined".into()),
        };
        i.metrics.queue_pending.inc();
        match composed {
            Ok(message) => deliver(i.clone(), Work::Digest { rule, channel, message: Arc::new(message) }, 0, None).await,
            Err(e) => {
                i.metrics.queue_pending.dec();
                i.metrics.dead_letters.inc();
                if let Some(s) = i.status.get() {
                    s.record_dead_letter(DeadLetter {
                        at: chrono::Utc::now(),
                        rule: rule.clone(),
                        key: format!("{} keys (digest)", batch.len()),
                        action: format!("notify:{channel}"),
                        id: String::new(),
                        reason: format!("cannot compose the digest: {e}"),
                    });
                }
                tracing::error!(%rule, %channel, keys = batch.len(), reason = %e, "Dead letter: cannot compose the digest.");
            }
        }
    });
}

/// One attempt, logged and counted: one line per action sent or failed.
async fn attempt(inner: &Inner, work: &Work, n: u32) -> Outcome {
    let started = Instant::now();
    let outcome = match work {
        Work::Step { firing, action } => inner.actions.run(firing, action).await,
        Work::Digest {
            channel, message, ..
        } => match inner.actions.config.channel(channel) {
            Some(ch) => notify::send(&inner.actions.http, ch, message).await,
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

/// Attempts `work` until it is sent, fails for good, or has failed for too long.
/// `failing` is when the first failure happened and what the target asked to wait.
async fn deliver(
    inner: Arc<Inner>,
    work: Work,
    mut n: u32,
    mut failing: Option<(Instant, Option<Duration>)>,
) {
    let limiter = work.channel().and_then(|c| inner.limiters.get(c).cloned());
    loop {
        if let Some((since, after)) = failing {
            if since.elapsed() >= inner.policy.give_up_after {
                dead_letter(
                    &inner,
                    &work,
                    "gave up: failing for longer than the retry window",
                );
                return;
            }
            let wait = after.unwrap_or_default().max(inner.policy.backoff(n));
            tokio::select! {
                biased;
                _ = inner.shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        if let Some(l) = &limiter {
            tokio::select! {
                biased;
                _ = inner.shutdown.cancelled() => return,
                _ = l.take() => {}
            }
        }
        match attempt(&inner, &work, n).await {
            Outcome::Sent(_) => {
                inner.metrics.queue_pending.dec();
                return;
            }
            Outcome::Failed(reason) => {
                dead_letter(&inner, &work, &reason);
                return;
            }
            Outcome::Retry { after, .. } => {
                let since = failing.map_or_else(Instant::now, |(s, _)| s);
                failing = Some((since, after));
                n += 1;
            }
        }
    }
}

fn dead_letter(inner: &Inner, work: &Work, reason: &str) {
    inner.metrics.queue_pending.dec();
    inner.metrics.dead_letters.inc();
    if let Some(s) = inner.status.get() {
        s.record_dead_letter(DeadLetter {
            at: chrono::Utc::now(),
            rule: work.rule().to_string(),
            key: work.subject(),
            action: work.status_label(),
            id: work.id().to_string(),
            reason: reason.to_string(),
        });
    }
    tracing::error!(rule = %work.rule(), key = %work.subject(), action = work.action_name(), channel = work.channel().unwrap_or(""), id = %work.id(), %reason, "Dead letter: the action will not be retried.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_capped() {
        let p = RetryPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
            give_up_after: Duration::from_secs(3600),
        };
        for attempt in 0..40 {
            let b = p.backoff(attempt);
            assert!(b >= Duration::from_millis(500), "{attempt}: {b:?}");
            assert!(b <= Duration::from_secs(60), "{attempt}: {b:?}");
        }
        let late: Duration = (0..200).map(|_| p.backoff(10)).sum::<Duration>() / 200;
        assert!(late > Duration::from_secs(20), "{late:?}");
    }
}
