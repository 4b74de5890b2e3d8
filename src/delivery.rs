//! The delivery stage: runs the jobs of each firing, retries what failed with capped
//! exponential backoff and full jitter (`Retry-After` obeyed), and dead-letters what failed for
//! good or for too long.
//!
//! The first attempts of one firing run in the order of SPEC §2 (reload → exec → cleanup →
//! notify); a failing step is handed to its own retry loop and does not hold back the next.
//! Notifications wait for their channel's token bucket in their own task, so one slow or
//! throttled channel never delays another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::action::notify::{self, Message};
use crate::action::{Actions, Outcome, actions_of};
use crate::config::Group;
use crate::dead::{DeadLetter, DeadStore};
use crate::job::{Action, Firing};
use crate::metrics::Metrics;
use crate::ratelimit::{SharedBucket, TokenBucket};

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
    limiters: HashMap<String, Arc<Limiter>>,
    policy: RetryPolicy,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Bounds the firings whose first attempts run at once, so a storm queues instead of
    /// opening ten thousand connections.
    concurrent: Arc<Semaphore>,
    /// Open digest windows, by (rule, channel).
    digests: Mutex<HashMap<DigestKey, Vec<Arc<Firing>>>>,
    /// Where dead letters are kept (Redis); `None` only in tests of this module.
    dead: Option<DeadStore>,
}

/// A channel's rate limit: shared by every instance through Redis, or this instance's own.
enum Limiter {
    Shared(SharedBucket),
    Local(TokenBucket),
}

impl Limiter {
    async fn take(&self) {
        match self {
            Limiter::Shared(b) => b.take().await,
            Limiter::Local(b) => b.take().await,
        }
    }
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
        firings: Vec<Arc<Firing>>,
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
}

impl Delivery {
    pub fn new(
        actions: Actions,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
        state: Option<redis::aio::ConnectionManager>,
        shutdown: CancellationToken,
    ) -> Delivery {
        let prefix = actions.config.state.prefix.clone();
        let limiters = actions
            .config
            .channels
            .iter()
            .filter_map(|c| {
                let r = c.rate?;
                let limiter = match &state {
                    Some(conn) => {
                        Limiter::Shared(SharedBucket::new(conn.clone(), &prefix, &c.name, r))
                    }
                    None => Limiter::Local(TokenBucket::new(r)),
                };
                Some((c.name.clone(), Arc::new(limiter)))
            })
            .collect();
        let dead = state.map(|conn| DeadStore::new(conn, &prefix));
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
                dead,
            }),
        }
    }

    /// Picks up dead letters re-driven with `keywatch dead retry`, every second, until shutdown.
    pub fn start_redrive(&self) {
        let Some(store) = self.inner.dead.clone() else {
            return;
        };
        let inner = self.inner.clone();
        self.inner.tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let letters = match store.take_redriven(100).await {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(error = %e, "Cannot read re-driven dead letters.");
                        continue;
                    }
                };
                for d in letters {
                    tracing::info!(id = %d.id, rule = %d.rule, action = d.action.name(), "Re-driving a dead letter.");
                    redrive(&inner, d);
                }
            }
        });
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
            Ok(message) => {
                let work = Work::Digest { rule, channel, message: Arc::new(message), firings: batch };
                deliver(i.clone(), work, 0, None).await
            }
            Err(e) => {
                i.metrics.queue_pending.dec();
                i.metrics.dead_letters.inc();
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

/// Gives a dead letter a second life: the same firings, the same action, from attempt one.
fn redrive(inner: &Arc<Inner>, d: DeadLetter) {
    let firings: Vec<Arc<Firing>> = d.firings.into_iter().map(Arc::new).collect();
    inner.metrics.queue_pending.inc();
    let i = inner.clone();
    if d.digest {
        let Action::Notify { channel } = d.action else {
            return;
        };
        inner.tracker.spawn(async move {
            let composed = match (
                i.actions.config.rule(&d.rule),
                i.actions.config.channel(&channel),
            ) {
                (Some(r), Some(ch)) => {
                    let max = r
                        .notify
                        .as_ref()
                        .and_then(|n| n.group)
                        .map_or(20, |g| g.max_items);
                    notify::compose_digest(&i.actions, &firings, r, ch, max)
                }
                _ => Err("the rule or channel is no longer defined".into()),
            };
            match composed {
                Ok(message) => {
                    let work = Work::Digest {
                        rule: d.rule,
                        channel,
                        message: Arc::new(message),
                        firings,
                    };
                    deliver(i.clone(), work, 0, None).await
                }
                Err(e) => {
                    i.metrics.queue_pending.dec();
                    tracing::error!(rule = %d.rule, reason = %e, "Cannot re-drive the digest.");
                }
            }
        });
    } else if let Some(firing) = firings.into_iter().next() {
        let work = Work::Step {
            firing,
            action: d.action,
        };
        inner
            .tracker
            .spawn(async move { deliver(i, work, 0, None).await });
    }
}

fn dead_letter(inner: &Inner, work: &Work, reason: &str) {
    inner.metrics.queue_pending.dec();
    inner.metrics.dead_letters.inc();
    if let Some(store) = inner.dead.clone() {
        let (action, firings, digest) = match work {
            Work::Step { firing, action } => (action.clone(), vec![(**firing).clone()], false),
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
        let letter = DeadLetter {
            id: format!("{:012x}", fastrand::u64(..) >> 16),
            at: chrono::Utc::now(),
            rule: work.rule().to_string(),
            key: work.subject(),
            action,
            reason: reason.to_string(),
            firings,
            digest,
        };
        tokio::spawn(async move {
            if let Err(e) = store.store(&letter).await {
                tracing::error!(id = %letter.id, error = %e, "Cannot store the dead letter in Redis; it is only in this log.");
            }
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
