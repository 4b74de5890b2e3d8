//! One job or digest attempted until it is sent or fails for good: logged and counted, through
//! its channel's rate-limited lane, its retries stored in the queue, and its dead letter.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::action::notify;
use crate::channel::{self, Message};
use crate::firing::{Action, Firing, Job};
use crate::outcome::Outcome;

use super::lane::{Lane, Turn, Waiting};
use super::retry::Next;
use super::slots::{Slot, SlotKey};
use super::state::{DIGEST_ITEMS, Held, Inner, Room, inflight, windows_inflight};
use super::work::{Work, window_jobs};
use crate::store::dead::DeadLetter;
use crate::store::queue::{Unreadable, Window, now_ms};

/// One attempt, logged and counted: one line per action sent or failed. `n` attempts came before
/// it, failing since `failing_since`. A failure that may be retried is decided here, before it is
/// counted: past the retry window it is the last attempt, counted and logged as failed (the dead
/// letter follows), not as a retry; else the answer carries when to attempt again (`RetryAt`).
pub(super) async fn attempt(
    inner: &Inner,
    work: &Work,
    n: u32,
    failing_since: &mut Option<i64>,
) -> (Outcome, Option<i64>) {
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
    // The one place every attempt's text passes before it is logged, counted, kept in history
    // or dead-lettered: an error may quote a rendered URL, argument or answer with a secret.
    // Masked before it is cut, so a cut never leaves the start of a secret; control and bidi
    // characters of an answer written out, so it cannot forge a log line or repaint a terminal.
    let secrets = &inner.actions.live.current().secrets;
    let outcome = outcome.map_text(|t| {
        crate::event::printable(secrets.mask_bounded(t, crate::outcome::SHOWN).as_bytes())
            .into_owned()
    });
    let mut retry_at = None;
    let outcome = match outcome {
        Outcome::Retry { reason, after } => {
            let now = now_ms();
            let since = *failing_since.get_or_insert(now);
            match inner.policy.after_failure(n + 1, since, now, after) {
                Next::RetryAt(at) => {
                    retry_at = Some(at);
                    Outcome::Retry { reason, after }
                }
                Next::GiveUp => Outcome::Failed(format!(
                    "gave up: failing for longer than the retry window; last: {reason}"
                )),
            }
        }
        other => other,
    };
    let secs = started.elapsed().as_secs_f64();
    inner
        .metrics
        .action(work.rule(), work.action_name(), outcome.label(), secs);
    if let Some(s) = inner.status.get() {
        let detail = outcome.text();
        s.record_outcome(
            work.rule(),
            work.firing_id(),
            &work.status_label(),
            outcome.label(),
            &detail,
        );
        if let Some(h) = s.history() {
            let action = work.action();
            for f in work.firings() {
                h.attempt(f, &action, &outcome, n + 1);
            }
        }
    }
    if let (Outcome::Sent(_), Work::Job { action, .. }) = (&outcome, work) {
        match action {
            Action::Escalate { .. } => inner.metrics.escalated_for(work.rule()),
            Action::Resolved { .. } => inner.metrics.resolved_for(work.rule()),
            _ => {}
        }
    }
    let (rule, key, action, channel) = (
        work.rule(),
        work.subject_shown(),
        work.action_name(),
        work.channel().unwrap_or(""),
    );
    match &outcome {
        Outcome::Sent(_) | Outcome::Skipped(_) => {
            tracing::info!(%rule, %key, action, channel, outcome = "sent", attempt = n + 1, answer = %outcome.text(), "Action done.")
        }
        Outcome::Again { answer, after } => {
            tracing::info!(%rule, %key, action, channel, outcome = "sent", attempt = n + 1, %answer, again_in = %humantime::format_duration(*after), "Action done; it runs again later.")
        }
        Outcome::Retry { reason, .. } => {
            tracing::warn!(%rule, %key, action, channel, outcome = "retry", attempt = n + 1, %reason, "Action failed; will retry.")
        }
        Outcome::Failed(reason) => {
            tracing::error!(%rule, %key, action, channel, outcome = "failed", attempt = n + 1, %reason, "Action failed for good.")
        }
    }
    (outcome, retry_at)
}

/// Attempts `work` until it is sent or fails for good, holding nothing of this instance's room
/// (a digest, a re-driven dead letter): see [`deliver_held`].
pub(super) async fn deliver(inner: Arc<Inner>, work: Work, n: u32, failing_since: Option<i64>) {
    deliver_held(inner, work, n, failing_since, Held::default()).await
}

/// Attempts `work` until it is sent or fails for good. A job leaves for the queue between
/// attempts, and a window's digest for its window (any instance may take the next one); a
/// merged backlog's digest, or work the queue would not take back, waits here. `failing_since`
/// is when the first attempt failed, unix ms. `held` is the job's room in this instance, given
/// back when it finishes, leaves for the queue or waits for a rate token, and its ticket for
/// its slot: each attempt holds one of the slot's permits.
pub(super) async fn deliver_held(
    inner: Arc<Inner>,
    work: Work,
    mut n: u32,
    mut failing_since: Option<i64>,
    held: Held,
) {
    let Held { mut room, ticket } = held;
    let mut ticket = Some(ticket);
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
    let channel = work.notify_channel().unwrap_or_default().to_string();
    let (work, mut token) = match lane_of(&inner, &work) {
        Some(lane) => match take_turn(&inner, &lane, work, &id, &mut room).await {
            Turned::Go(w) => (w, true),
            // Left in flight: shutdown hands it back, or the digest it joined acknowledges it.
            Turned::Gone => return,
            Turned::Wait => {
                let target = SlotKey::Channel(channel).target();
                park(&inner, vec![(target, id)]).await;
                return;
            }
        },
        None => (work, false),
    };
    // The queued jobs this work acknowledges when it is finished.
    let jobs: Vec<String> = match &work {
        Work::Job { .. } => vec![id.clone()],
        Work::Digest { jobs, .. } => jobs.clone(),
    };
    let q = &inner.queue;
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
        .notify_channel()
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
        let slot = slot_of(&inner, &work);
        let permit = match ticket
            .take()
            .unwrap_or_default()
            .permit(slot, &inner.shutdown)
            .await
        {
            Ok(p) => p,
            // Left in flight: shutdown hands it back.
            Err(()) => return,
        };
        // Acknowledged through the queue's writer, which waits for it while it is under way.
        let attempting = (window.is_none() && !jobs.is_empty()).then(|| q.attempting());
        let (outcome, retry_at) = attempt(&inner, &work, n, &mut failing_since).await;
        drop(attempting);
        // The permit is held until the outcome is recorded in Redis, not just until the answer
        // came: a kill can send again only what holds one, so it doubles at most the slot's
        // width however far acknowledgements lag (docs/reliability.md#guarantees). Given back
        // on return, or before a wait in memory.
        match outcome {
            Outcome::Sent(_) | Outcome::Skipped(_) | Outcome::Failed(_) => {
                match &outcome {
                    Outcome::Failed(reason) => dead_letter(&inner, &work, reason),
                    _ => crate::drill::pass(crate::drill::Step::Sent),
                }
                acknowledge(&inner, window.as_ref(), &jobs).await;
                finish(&inner);
                drop(permit);
                return;
            }
            Outcome::Again { after, .. } => {
                crate::drill::pass(crate::drill::Step::Sent);
                let now = now_ms();
                let at = now + i64::try_from(after.as_millis()).unwrap_or(i64::MAX / 2);
                n = 0;
                failing_since = None;
                if let Work::Job { firing, action } = &work {
                    let job = Job::first(firing.clone(), action.clone());
                    finish(&inner);
                    match q.reschedule(&job, at).await {
                        Ok(true) => return,
                        Ok(false) => {
                            tracing::info!(id = %id, "The job left the queue while this instance lost its lease: another instance finished it.");
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, id = %id, "Cannot requeue the job; running it again from memory.")
                        }
                    }
                }
                drop(permit);
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(after) => {}
                }
            }
            Outcome::Retry { .. } => {
                let now = now_ms();
                n += 1;
                // `attempt` decided: a retry always comes with its time.
                let at = retry_at.unwrap_or(now);
                let wait = Duration::from_millis(u64::try_from(at - now).unwrap_or(0));
                if let Work::Job { firing, action } = &work {
                    let job = Job {
                        firing: firing.clone(),
                        action: action.clone(),
                        attempt: n,
                        failing_since,
                    };
                    // Out of the in-flight set first, so a lease renewal cannot push the retry back.
                    finish(&inner);
                    match q.reschedule(&job, at).await {
                        Ok(true) => return,
                        Ok(false) => {
                            tracing::info!(id = %id, "The job left the queue while this instance lost its lease: another instance finished it.");
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, id = %id, "Cannot requeue the job; retrying from memory.")
                        }
                    }
                }
                // A window's digest leaves for its window: any instance attempts it next.
                if let (
                    Some(w),
                    Work::Digest {
                        firings,
                        channel,
                        jobs,
                        sizes,
                        ..
                    },
                ) = (&window, &work)
                {
                    let again =
                        by_member(jobs, sizes, window_jobs(firings, channel, n, failing_since));
                    finish(&inner);
                    match q.window_retry(w, &again, at).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(error = %e, rule = %w.rule, "Cannot requeue the digest; retrying from memory.")
                        }
                    }
                }
                drop(permit);
                tokio::select! {
                    biased;
                    _ = inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// A window digest's notifications (`again`, in order) with the members (`ids`) they came
/// from, `sizes[i]` of them each.
fn by_member(ids: &[String], sizes: &[usize], again: Vec<Job>) -> Vec<(String, Vec<Job>)> {
    let mut rest = again.into_iter();
    ids.iter()
        .zip(sizes)
        .map(|(id, n)| (id.clone(), rest.by_ref().take(*n).collect()))
        .collect()
}

/// The slot `work`'s requests are counted in, under the rules in force now.
fn slot_of(inner: &Inner, work: &Work) -> Option<Arc<Slot>> {
    let config = inner.actions.live.current();
    match work {
        Work::Job { firing, action } => inner.slots.of(&config, &firing.rule, action),
        Work::Digest { channel, .. } => {
            inner.slots.get(&config, &SlotKey::Channel(channel.clone()))
        }
    }
}

/// Sends jobs this instance has no room for to wait for their targets in Redis, as (target,
/// job id): out of the in-flight set first, so that a lease renewal cannot touch them.
pub(super) async fn park(inner: &Inner, jobs: Vec<(String, String)>) {
    if jobs.is_empty() {
        return;
    }
    let mut by_target: HashMap<String, Vec<String>> = HashMap::new();
    {
        let mut set = inflight(inner);
        for (target, id) in jobs {
            set.remove(&id);
            by_target.entry(target).or_default().push(id);
        }
    }
    let q = &inner.queue;
    let config = inner.actions.live.current();
    for (target, ids) in by_target {
        if let Some(slot) = SlotKey::from_target(&target).and_then(|k| inner.slots.get(&config, &k))
        {
            slot.set_parked(true);
        }
        if let Err(e) = q.park(&target, &ids).await {
            tracing::warn!(error = %e, jobs = ids.len(), %target, "Cannot send jobs to wait for their target in Redis; they come due again when their lease ends.");
        }
    }
}

/// Removes finished jobs from the queue, or from their window (one round trip for all).
pub(super) async fn acknowledge(inner: &Inner, window: Option<&Window>, jobs: &[String]) {
    let q = &inner.queue;
    if let Some(w) = window {
        // A drill's state Redis too loaded to take acknowledgements, see
        // docs/development.md#drills-killing-keywatch-at-an-exact-step-and-a-host-clock-that-is-off
        if let Some(delay) = crate::drill::ack_delay() {
            tokio::time::sleep(delay).await;
        }
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

/// What a notification's wait in its channel's line came to.
pub(super) enum Turned {
    /// Send this: the notification, or a digest of it and the backlog of its rule.
    Go(Work),
    /// Nothing more to do here (merged into another's digest, or shutdown).
    Gone,
    /// The line is full: wait for the channel in Redis.
    Wait,
}

/// Waits for the channel's token, giving `room` back meanwhile (the line is bounded on its own).
pub(super) async fn take_turn(
    inner: &Arc<Inner>,
    lane: &Arc<Lane>,
    work: Work,
    id: &str,
    room: &mut Option<Room>,
) -> Turned {
    let Work::Job { firing, action } = &work else {
        return Turned::Go(work);
    };
    if !lane.has_room(0) {
        return Turned::Wait;
    }
    drop(room.take());
    let waiting = Waiting {
        firing: firing.clone(),
        job: id.to_string(),
    };
    let others = match lane.wait(waiting, &inner.tracker, &inner.shutdown).await {
        None | Some(Turn::Merged) => return Turned::Gone,
        Some(Turn::Alone) => return Turned::Go(work),
        Some(Turn::Lead(others)) => others,
    };
    let Action::Notify { channel } = action else {
        return Turned::Go(work);
    };
    let mut firings = vec![firing.clone()];
    let mut jobs = vec![id.to_string()];
    for w in others {
        firings.push(w.firing);
        jobs.push(w.job);
    }
    match compose_digest_now(inner, &firing.rule, channel, &firings) {
        Ok(message) => Turned::Go(Work::Digest {
            rule: firing.rule.clone(),
            channel: channel.clone(),
            message: Arc::new(message),
            firings,
            jobs,
            sizes: Vec::new(),
            window: None,
        }),
        Err(e) => {
            // Sent alone, then; the others go back to the queue for their own turns.
            tracing::error!(rule = %firing.rule, %channel, reason = %e, "Cannot merge the channel's backlog into a digest; sending one by one.");
            let back = jobs.split_off(1);
            if let Err(e) = inner.queue.hand_back(&back).await {
                tracing::warn!(error = %e, "Cannot hand jobs back; they come due again when their lease ends.");
            }
            let mut set = inflight(inner);
            for j in &back {
                set.remove(j);
            }
            Turned::Go(work)
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
        (None, _) => Err(format!("rule `{rule}` no longer exists")),
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
    tracing::error!(rule = %work.rule(), key = %work.subject_shown(), action = work.action_name(), channel = work.channel().unwrap_or(""), id = %work.id(), %reason, "Dead letter: the action will not be retried.");
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

/// What a dead letter names as its action when none can be told: a job of a kind this version
/// does not know, or a firing whose rule was removed before its jobs were made.
fn unknown_action(what: String) -> Action {
    Action::Notify { channel: what }
}

/// Dead-letters a firing whose rule a reload removed between matching and storing its jobs
/// (README: nothing is dropped silently). Its action is unknown: the rule that listed them is
/// gone; the firing is kept whole in the letter.
pub(super) fn rule_gone(inner: &Inner, firing: &Firing) {
    let reason = format!("rule `{}` no longer exists", firing.rule);
    tracing::error!(rule = %firing.rule, key = %crate::event::printable(&firing.key), id = %firing.id, %reason, "Dead letter: the firing's rule was removed by a reload.");
    keep_dead_letter(
        inner,
        DeadLetter::new(
            &firing.rule,
            String::from_utf8_lossy(&firing.key).into_owned(),
            unknown_action("? (the rule's actions)".to_string()),
            &reason,
            vec![firing.clone()],
            false,
        ),
    );
}

/// Dead-letters stored jobs this version cannot read, once: the queue has already set them
/// aside (their payloads kept in `{prefix}queue:unreadable`), so they are never taken again.
pub(super) fn dead_letter_unreadable(inner: &Inner, unreadable: Vec<Unreadable>) {
    for u in unreadable {
        let rule = u.rule.as_deref().unwrap_or("?");
        let reason = format!(
            "the stored job cannot be read by this version of keywatch ({}); its payload is kept in `{}queue:unreadable`",
            u.error, inner.actions.config.state.prefix
        );
        tracing::error!(%rule, id = %u.id, %reason, "Dead letter: a stored job cannot be read.");
        // An action of a kind this version does not know is listed under the id it came with.
        let action = u
            .action
            .unwrap_or_else(|| unknown_action(format!("? (job {})", u.id)));
        keep_dead_letter(
            inner,
            DeadLetter::new(
                rule,
                format!("job {}", u.id),
                action,
                &reason,
                Vec::new(),
                false,
            ),
        );
    }
}

/// Counts a dead letter, shows it on the status page and keeps it in Redis.
pub(super) fn keep_dead_letter(inner: &Inner, letter: DeadLetter) {
    inner.metrics.dead_letters.inc();
    if let Some(s) = inner.status.get() {
        s.record_dead_letter(&letter);
    }
    let store = inner.dead.clone();
    tokio::spawn(async move {
        if let Err(e) = store.store(&letter).await {
            tracing::error!(id = %letter.id, error = %e, "Cannot store the dead letter in Redis; it is only in this log.");
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::channel::Integration;
    use crate::outcome::Outcome;
    use crate::status::RuleCounts;

    use super::super::RetryPolicy;
    use super::super::testkit::{
        self, EARLY, LATE, Receiver, Recorder, assert_about, firing, ms, replace_integration,
        response, secs, stage, wait_until,
    };

    /// A target that never recovers, ten notifications failing together: each one's first
    /// attempt at once, each next one a backoff later (equal jitter: within [d/2, d] for d = min(max, min·2ⁿ⁻¹)
    /// after the n-th failure), its last one when its retry window ends; then one dead letter
    /// each, counted and shown, not before the window ended, and no attempt more. Ten schedules
    /// of up to 20 jittered waits each: a wait outside the bounds cannot go unnoticed for long.
    /// (The policy is scaled down tenfold from seconds, so the schedule runs in real time.)
    #[tokio::test]
    async fn retries_back_off_and_give_up_when_the_retry_window_ends() {
        let policy = RetryPolicy {
            min: ms(100),
            max: ms(400),
            give_up_after: secs(1),
        };
        let mut config = testkit::config(
            "channels:\n  hook: { type: log }\nrules:\n  - name: flaky\n    match: 'k:*'\n    notify: { to: [hook] }\n",
        );
        let rec = Recorder::answering(|_| Outcome::Retry {
            reason: "HTTP 503: down".into(),
            after: None,
        });
        let r = rec.clone();
        replace_integration(&mut config, "hook", move |_| r as Arc<dyn Integration>);
        let s = stage(config, policy.clone()).await;
        let keys: Vec<String> = (0..10).map(|i| format!("k:{i}")).collect();
        let started = chrono::Utc::now();
        rec.count_from_now();
        s.delivery
            .accept(keys.iter().map(|k| firing("flaky", k)).collect())
            .await;

        // Given up means given up: once nothing of them is left in the queue or in flight, no
        // attempt more can come.
        s.settled().await;
        let received = rec.received();
        assert_eq!(s.metrics.dead_letters.get(), 10);
        for key in &keys {
            let attempts: Vec<Duration> = received
                .iter()
                .filter(|r| r.keys == [key.clone()])
                .map(|r| r.at)
                .collect();
            assert!(
                attempts.first().is_some_and(|a| *a <= LATE),
                "{key}: the first attempt comes at once: {attempts:?}"
            );
            let last = *attempts.last().unwrap();
            assert_about(
                last,
                policy.give_up_after,
                &format!("{key}: the last attempt comes when the window ends: {attempts:?}"),
            );
            // Waits of 50–100, 100–200, then 200–400 ms: 4 to 21 attempts in 1 s.
            assert!((4..=21).contains(&attempts.len()), "{key}: {attempts:?}");
            for (i, pair) in attempts.windows(2).enumerate() {
                let failure = u32::try_from(i + 1).unwrap();
                let gap = pair[1] - pair[0];
                let cap = crate::backoff::Backoff::new(policy.min, policy.max).ceiling(failure);
                assert!(
                    gap <= cap + LATE,
                    "{key}: wait {i} of {gap:?} over {cap:?}: {attempts:?}"
                );
                // Only the last wait is cut short, by the window's end.
                if i + 2 < attempts.len() {
                    assert!(
                        gap + EARLY >= cap / 2,
                        "{key}: wait {i} of {gap:?} under half of {cap:?}: {attempts:?}"
                    );
                }
            }
        }
        // The last attempt of each is the one that gave up: counted as failed, not as a retry
        // (before, it was counted and logged as a retry right before its dead letter).
        assert_eq!(
            s.status.counts("flaky"),
            RuleCounts {
                retried: received.len() as u64 - 10,
                failed: 10,
                dead: 10,
                ..RuleCounts::default()
            }
        );
        let dead = s.status.dead_letters();
        assert_eq!(dead.len(), 10);
        assert!(
            dead.iter().all(|d| d.reason.contains("retry window")),
            "{dead:?}"
        );
        // Never before the window ended: it opened at the first failure, after `started`.
        let window = chrono::Duration::from_std(policy.give_up_after - EARLY).unwrap();
        assert!(
            dead.iter().all(|d| d.at >= started + window),
            "dead-lettered before the window ended: {dead:?} (started {started})"
        );
    }

    /// HTTP 429 with `Retry-After: 1` from a real webhook receiver: the next attempt comes a
    /// second later (not the policy's backoff of 5–20 ms), and then the notification is sent.
    #[tokio::test]
    async fn a_429_with_retry_after_is_attempted_again_after_that_long() {
        let receiver = Receiver::start(|n| match n {
            0 => response("429 Too Many Requests", "Retry-After: 1\r\n"),
            _ => response("200 OK", ""),
        })
        .await;
        let config = testkit::config(&format!(
            "channels:\n  hook:\n    type: webhook\n    url: \"{}\"\n    timeout: 10s\nrules:\n  - name: throttled\n    match: 'k:*'\n    notify: {{ to: [hook] }}\n",
            receiver.url
        ));
        // A backoff far shorter than the answer's wait: a retry a second later is the answer's.
        let policy = RetryPolicy {
            min: ms(10),
            max: ms(40),
            give_up_after: secs(60),
        };
        let s = stage(config, policy).await;
        receiver.count_from_now();
        s.delivery.accept(vec![firing("throttled", "k:1")]).await;

        wait_until("the first attempt counted", || {
            s.status.counts("throttled").retried == 1
        })
        .await;
        assert_eq!(receiver.arrived().len(), 1);
        assert_eq!(
            s.status.counts("throttled"),
            RuleCounts {
                retried: 1,
                ..RuleCounts::default()
            }
        );
        let arrived = receiver.wait_for(2).await;
        assert!(arrived[0] <= LATE, "{arrived:?}");
        assert_about(
            arrived[1] - arrived[0],
            secs(1),
            &format!("the attempt after `Retry-After: 1`: {arrived:?}"),
        );
        s.settled().await;
        assert_eq!(
            s.status.counts("throttled"),
            RuleCounts {
                sent: 1,
                retried: 1,
                ..RuleCounts::default()
            }
        );
        // Sent means done: no attempt more.
        assert_eq!(receiver.arrived().len(), 2);
        assert_eq!(s.metrics.dead_letters.get(), 0);
    }
}
