//! The record stage: what an attempt came to, written where it belongs — the job acknowledged
//! (removed from the queue), rescheduled for its next attempt, or kept as a dead letter in the
//! same transaction that removes it — and shown in history and on the status page.
//!
//! Redis is the only truth: a write it refuses leaves the job where it is, leased to this
//! instance, and the lease brings it back when it ends (docs/reliability.md#guarantees). Nothing
//! waits in this instance's memory for a retry.

use std::sync::Arc;

use crate::firing::{Action, DeadLetter, Firing, Job};
use crate::internal_events::{DeadLettered, StateError};
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::status::Status;
use crate::store::dead::DeadStore;
use crate::store::queue::{Queue, now_ms};

use super::attempt::Tried;
use super::take::{Held, NextLook};
use super::work::{Work, window_jobs};

pub(super) struct Record {
    pub(super) queue: Queue,
    pub(super) dead: DeadStore,
    pub(super) status: Option<Arc<Status>>,
    pub(super) metrics: Arc<Metrics>,
    /// What this instance holds of the queue: a job recorded is no longer held.
    pub(super) held: Arc<Held>,
    /// A retry this instance schedules is a due time the take stage should know of.
    pub(super) next: Arc<NextLook>,
}

impl Record {
    /// Records what the `n + 1`-th attempt of `work` came to.
    pub(super) async fn outcome(&self, work: &Work, n: u32, tried: Tried) {
        self.shown(work, n, &tried.outcome);
        match tried.outcome {
            Outcome::Sent(_) | Outcome::Skipped(_) | Outcome::Shadow(_) => {
                crate::drill::pass(crate::drill::Step::Sent);
                self.done(work, &[]).await;
            }
            Outcome::Failed(reason) => {
                let letter = self.dead_letter(work, &reason);
                let keep = self.dead.store_cmds(&letter);
                self.done(work, &keep).await;
                if let Err(e) = self.dead.trim().await {
                    tracing::debug!(error = %e, "Cannot trim the dead letters; the next one does.");
                }
            }
            Outcome::Again { after, .. } => {
                crate::drill::pass(crate::drill::Step::Sent);
                let at = now_ms() + i64::try_from(after.as_millis()).unwrap_or(i64::MAX / 2);
                // A new round: its attempts count from the first again.
                self.again(work, at, 0, None).await;
            }
            Outcome::Retry { .. } => {
                // `attempt` decided: a retry always comes with its time.
                let at = tried.retry_at.unwrap_or_else(now_ms);
                self.again(work, at, n + 1, tried.failing_since).await;
            }
        }
    }

    /// Shows the attempt on the status page and in history.
    pub(super) fn shown(&self, work: &Work, n: u32, outcome: &Outcome) {
        let Some(s) = &self.status else { return };
        s.record_outcome(
            work.rule(),
            work.firing_id(),
            &work.status_label(),
            outcome.label(),
            &outcome.text(),
        );
        if let Some(h) = s.history() {
            let action = work.action();
            for f in work.firings() {
                h.attempt(f, &action, outcome, n + 1);
            }
        }
    }

    /// Removes what `work` stands for from the queue (or its window), with `also` in the same
    /// transaction.
    async fn done(&self, work: &Work, also: &[redis::Cmd]) {
        let jobs = work.queued();
        // Held (its lease renewed) until the acknowledgement is written: one written again
        // while Redis restarts must not find the job taken over meanwhile.
        if let Some(w) = work.window() {
            // A drill's state Redis too loaded to take acknowledgements, see
            // docs/development.md#drills-killing-keywatch-at-an-exact-step-and-a-host-clock-that-is-off
            if let Some(delay) = crate::drill::ack_delay() {
                tokio::time::sleep(delay).await;
            }
            let done = self
                .queue
                .window_done_with(w, &jobs, also, &|e| self.written_again(e, jobs.len()))
                .await;
            self.held.release_window(w, &jobs);
            if let Err(e) = done {
                self.refused(
                    "acknowledge",
                    &e,
                    jobs.len(),
                    "the digest may be sent again when its lease ends",
                );
            }
            return;
        }
        let q = &self.queue;
        // The first job carries `also`: one transaction keeps the letter exactly when a job of
        // it leaves the queue (a digest's letter names all of its jobs).
        let refused = &|e: &dyn std::fmt::Display| self.written_again(e, 1);
        let acks = futures_util::future::join_all(
            jobs.iter()
                .enumerate()
                .map(|(i, j)| q.done_with(j, if i == 0 { also } else { &[] }, refused)),
        )
        .await;
        self.held.release(&jobs);
        if let Some(Err(e)) = acks.into_iter().find(|r| r.is_err()) {
            self.refused(
                "acknowledge",
                &e,
                jobs.len(),
                "the jobs may run again when their lease ends",
            );
        }
    }

    /// `work` comes due again at `at` (unix ms), on whichever instance takes it, as its
    /// `attempt`-th attempt failing since `since`: a job (or a merged digest's jobs) in the queue,
    /// a window's digest in its window, member by member.
    async fn again(&self, work: &Work, at: i64, attempt: u32, since: Option<i64>) {
        let jobs = work.queued();
        // Out of what is held first, so a lease renewal cannot push the retry back.
        self.held.release(&jobs);
        let moved = match work {
            Work::Digest {
                window: Some(w),
                firings,
                channel,
                sizes,
                ..
            } => {
                let again = by_member(&jobs, sizes, window_jobs(firings, channel, attempt, since));
                let moved = self.queue.window_retry(w, &again, at).await;
                self.held.release_window(w, &jobs);
                moved.map(|()| true)
            }
            _ => {
                let mut any = Ok(false);
                for job in work.jobs(attempt, since) {
                    match self.queue.reschedule(&job, at).await {
                        Ok(moved) => any = any.map(|a| a || moved),
                        Err(e) => any = Err(e),
                    }
                }
                any
            }
        };
        match moved {
            Ok(true) if work.window().is_some() => self.next.window_due_in(at - now_ms()),
            Ok(true) => self.next.job_due_in(at - now_ms()),
            Ok(false) => {
                tracing::info!(id = %work.id(), "The job left the queue while this instance lost its lease: another instance finished it.");
            }
            Err(e) => self.refused(
                "reschedule",
                &e,
                jobs.len(),
                "the job comes due again when its lease ends",
            ),
        }
    }

    /// The first refusal of an acknowledgement written again until Redis takes it.
    fn written_again(&self, error: &dyn std::fmt::Display, items: usize) {
        self.refused(
            "acknowledge",
            error,
            items,
            "written again until Redis takes it",
        );
    }

    fn refused(
        &self,
        operation: &'static str,
        error: &dyn std::fmt::Display,
        items: usize,
        then: &'static str,
    ) {
        StateError {
            operation,
            error,
            items,
            then,
        }
        .emit(&self.metrics);
    }

    /// The dead letter of `work` given up for `reason`, emitted (logged and counted) and shown.
    pub(super) fn dead_letter(&self, work: &Work, reason: &str) -> DeadLetter {
        let (action, firings, digest) = match work {
            Work::Job { firing, action, .. } => (action.clone(), vec![(**firing).clone()], false),
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
        let letter = DeadLetter::new(work.rule(), work.subject(), action, reason, firings, digest);
        DeadLettered {
            rule: work.rule(),
            key: &work.subject_shown(),
            action: work.action_name(),
            channel: work.channel().unwrap_or(""),
            id: work.id(),
            reason,
        }
        .emit(&self.metrics);
        if let Some(s) = &self.status {
            s.record_dead_letter(&letter);
        }
        letter
    }

    /// Keeps a letter [`Record::dead_letter`] made (emitted and shown already).
    pub(super) async fn keep_quietly(&self, letter: DeadLetter) {
        if let Err(e) = self.dead.store(&letter).await {
            self.refused("dead_letter", &e, 1, "the letter is only in this log");
        }
    }

    /// Keeps a dead letter for what never became a job (a firing whose rule a reload removed,
    /// a detail never read, a stored job this version cannot read): emitted, shown, and kept in
    /// Redis; one Redis refuses is in the log (its firing's intake record, or the unreadable
    /// job's payload, stays in Redis).
    pub(super) async fn keep(&self, letter: DeadLetter, shown_key: &str) {
        DeadLettered {
            rule: &letter.rule,
            key: shown_key,
            action: letter.action.name(),
            channel: letter.action.channel().unwrap_or(""),
            id: &letter.id,
            reason: &letter.reason,
        }
        .emit(&self.metrics);
        if let Some(s) = &self.status {
            s.record_dead_letter(&letter);
        }
        if let Err(e) = self.dead.store(&letter).await {
            self.refused("dead_letter", &e, 1, "the letter is only in this log");
        }
    }
}

/// A window digest's notifications (`again`, in order) with the members (`ids`) they came from,
/// `sizes[i]` of them each.
fn by_member(ids: &[String], sizes: &[usize], again: Vec<Job>) -> Vec<(String, Vec<Job>)> {
    let mut rest = again.into_iter();
    ids.iter()
        .zip(sizes)
        .map(|(id, n)| (id.clone(), rest.by_ref().take(*n).collect()))
        .collect()
}

/// The dead letter of a firing whose rule a reload removed between matching and storing its
/// jobs (nothing is dropped silently): its action is unknown, the firing kept whole.
pub(super) fn rule_gone(firing: &Firing) -> DeadLetter {
    DeadLetter::new(
        &firing.rule,
        String::from_utf8_lossy(&crate::long_key::view(
            &firing.key,
            crate::long_key::IN_TEXT,
        ))
        .into_owned(),
        Action::Notify {
            channel: "? (the rule's actions)".to_string(),
        },
        &format!("rule `{}` no longer exists", firing.rule),
        vec![firing.clone()],
        false,
    )
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
            // Ten first attempts at once on a loaded machine: the last of them was seen 105 ms
            // after, past `LATE`, at a load average of 10.
            assert!(
                attempts.first().is_some_and(|a| *a <= LATE * 3),
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
