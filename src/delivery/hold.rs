//! The hold stage: a message to a channel in its quiet hours (docs/rules.md#quiet-hours) leaves
//! the queue for the channel's held messages in Redis (`store::held`), in the transaction that
//! takes it out of the queue, and goes out once when the quiet period ends: as one digest, one
//! line of counts, or each on its own (back in the queue, marked released, paced by the
//! channel's rate). Held escalations and resolved notices go back to the queue as themselves.
//!
//! Releasing is leased as the queue's jobs are, so one instance of several releases a quiet
//! period, and one that dies in the middle leaves it to another: a digest sent by an instance
//! that died before recording it may be sent again, as any job may
//! (docs/reliability.md#guarantees). Each group taken is released in a task of its own that
//! renews its lease from the moment it is taken: released one after the other by the take loop,
//! a group waiting behind a slow digest lost its lease to another instance and went out twice,
//! and the loop renewed none of the instance's other leases meanwhile
//! (docs/how-it-works.md#held-messages).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::action::ActionContext;
use crate::action::release::{self as compose, Release};
use crate::config::Config;
use crate::config::quiet::Hold;
use crate::firing::{Action, DeadLetter, Job, Released};
use crate::internal_events::{HeldMessage, StateError};
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::quiet_hours::Release as Mode;
use crate::store::held::{Entry, Group, HeldStore, Lease, Released as Recorded};
use crate::store::queue::{Queue, keys as queue_keys, now_ms};

use super::attempt::Attempt;
use super::record::Record;
use super::retry::Next;
use super::work::Work;

/// Groups one instance releases at once (each renews its own lease while it is sent).
pub(super) const RELEASING_MAX: usize = 16;

/// Where `work` is held now, if its channel is in its quiet hours: a message to people (a
/// notification, an escalation, a resolved notice, or a window's digest) not released already,
/// of a rule that does not say `notify.quiet: ignore`.
pub(super) fn hold_of<'c>(config: &'c Config, work: &Work, now: DateTime<Utc>) -> Option<Hold<'c>> {
    // A drill's clock for quiet hours (src/drill.rs); the end is kept in real time.
    let ahead = crate::drill::quiet_ahead();
    let mut hold = quiet_hold(config, work, now + ahead)?;
    hold.until -= ahead;
    Some(hold)
}

fn quiet_hold<'c>(config: &'c Config, work: &Work, now: DateTime<Utc>) -> Option<Hold<'c>> {
    match work {
        Work::Job {
            released: Some(_), ..
        } => None,
        Work::Job { firing, action, .. } => config.hold(&firing.rule, action, now),
        Work::Digest {
            rule,
            channel,
            window: Some(_),
            ..
        } => config.hold(
            rule,
            &Action::Notify {
                channel: channel.clone(),
            },
            now,
        ),
        // A pace's merged backlog: held before it reached the pace.
        Work::Digest { window: None, .. } => None,
    }
}

pub(super) struct HoldStage {
    pub(super) store: HeldStore,
    pub(super) queue: Queue,
    pub(super) prefix: String,
    pub(super) metrics: Arc<Metrics>,
    /// A permit per group this instance is releasing ([`RELEASING_MAX`]).
    pub(super) releasing: Arc<Semaphore>,
}

/// A group taken for release, with its place among this instance's releases.
pub(super) struct Taken {
    lease: Lease,
    _permit: OwnedSemaphorePermit,
}

impl HoldStage {
    /// Holds `work` (its jobs, as `jobs`): out of the queue (or its window) and into its
    /// channel's held messages, in one transaction; shown in history as `held`. `Err`: Redis did
    /// not take it, and the work is where it was (its lease brings it back).
    pub(super) async fn hold(
        &self,
        record: &Record,
        work: &Work,
        jobs: &[Job],
        hold: &Hold<'_>,
    ) -> Result<(), ()> {
        let Some(channel) = work.notify_channel().or_else(|| work.channel()) else {
            return Err(());
        };
        let group = Group::new(channel, hold.until);
        let cmds: Vec<redis::Cmd> = jobs
            .iter()
            .flat_map(|j| self.store.hold_cmds(&group, j))
            .collect();
        let queued = work.queued();
        let moved = match work.window() {
            Some(w) => self
                .queue
                .window_done_with(w, &queued, &cmds, &|e| self.written_again(e))
                .await
                .map_err(|e| e.to_string()),
            None => self
                .queue
                .done_with(&queued[0], &cmds, &|e| self.written_again(e))
                .await
                .map_err(|e| e.to_string()),
        };
        if let Err(e) = moved {
            StateError {
                operation: "hold",
                error: &e,
                items: jobs.len(),
                then: "the message comes due again when its lease ends",
            }
            .emit(&self.metrics);
            return Err(());
        }
        HeldMessage {
            rule: work.rule(),
            key: &work.subject_shown(),
            channel,
            window: &hold.window.name,
            until: hold.until,
            messages: jobs.len(),
        }
        .emit();
        if let Some(h) = record.status.as_ref().and_then(|s| s.history()) {
            for j in jobs {
                h.held(&j.firing, &j.action, &hold.window.name, hold.until);
            }
        }
        Ok(())
    }

    /// Takes what is due for release, as far as this instance has places for releases: quiet
    /// periods that ended, and those whose window a reload edited or removed (`reloaded`: the
    /// rules changed since the last call). One command when nothing is due. The caller releases
    /// each group taken ([`HoldStage::release`]) in a task of its own, at once: its lease runs
    /// from now.
    pub(super) async fn take_due(&self, actions: &ActionContext, reloaded: bool) -> Vec<Taken> {
        if reloaded {
            let config = actions.refreshed().config;
            let now = crate::keyspace::clock::now();
            match self.store.groups().await {
                Ok(groups) => {
                    for g in groups.iter().filter(|g| !g.releasing) {
                        let ahead = crate::drill::quiet_ahead();
                        if config.release_due(&g.group.channel, g.group.end() + ahead, now + ahead)
                            && let Err(e) = self.store.release_now(&g.group, now_ms()).await
                        {
                            self.refused("release", &e);
                        }
                    }
                }
                Err(e) => self.refused("release", &e),
            }
        }
        let free = self.releasing.available_permits();
        if free == 0 {
            return Vec::new();
        }
        let leases = match self.store.take_due(now_ms(), free).await {
            Ok(l) => l,
            Err(e) => {
                self.refused("release", &e);
                return Vec::new();
            }
        };
        leases
            .into_iter()
            .filter_map(|lease| {
                // Only this loop takes permits, and it took no more groups than were free.
                let permit = self.releasing.clone().try_acquire_owned().ok()?;
                Some(Taken {
                    lease,
                    _permit: permit,
                })
            })
            .collect()
    }

    /// Releases the group `taken`, renewing its lease while it works: a digest to a target
    /// slower than the lease (a webhook's 30 s timeout) would otherwise let another instance
    /// take the group over and send it again. Returns whether jobs were written to the queue
    /// in the place of held messages (`each`, follow-ups): due now.
    pub(super) async fn release(
        &self,
        actions: &ActionContext,
        attempt: &Attempt,
        record: &Record,
        taken: Taken,
    ) -> bool {
        // One lease operation at a time: a renewal still on its way to Redis when the release
        // is recorded moved the score past the token the release named, so the release was
        // refused as if another instance had taken the group, and the renewal's lease, which
        // nobody held any more, brought the group back to be sent again (seen in CI under load).
        let current = tokio::sync::Mutex::new(taken.lease);
        let group = current.lock().await.group.clone();
        let renewing = async {
            loop {
                tokio::time::sleep(crate::store::renew_every()).await;
                let mut held = current.lock().await;
                match self.store.renew(&held, now_ms()).await {
                    Ok(Some(next)) => *held = next,
                    // Another instance's now: the release's end finds it so, and leaves it.
                    Ok(None) => {
                        drop(held);
                        std::future::pending::<()>().await
                    }
                    Err(e) => self.refused("renew", &e),
                }
            }
        };
        tokio::select! {
            queued = self.release_leased(actions, attempt, record, &group, &current) => queued,
            () = renewing => false,
        }
    }

    async fn release_leased(
        &self,
        actions: &ActionContext,
        attempt: &Attempt,
        record: &Record,
        group: &Group,
        lease: &tokio::sync::Mutex<Lease>,
    ) -> bool {
        let a = actions.refreshed();
        let mut held = match self.store.read(group).await {
            Ok(h) => h,
            Err(e) => {
                self.refused("release", &e);
                return false;
            }
        };
        for (id, _, why) in &held.unreadable {
            let letter = DeadLetter::new(
                "?",
                format!("held job {id}"),
                Action::Notify {
                    channel: group.channel.clone(),
                },
                &format!("a held message this version cannot read: {why}"),
                Vec::new(),
                false,
            );
            record.keep(letter, &format!("held job {id}")).await;
        }
        let all: Vec<&Job> = held.jobs.iter().collect();
        match compose::resolved_now(&a, &all).await {
            Ok(found) => held.resolved.extend(found),
            Err(e) => {
                tracing::warn!(channel = %group.channel, error = %e, "Cannot see which held keys exist again; the release marks only those seen while held.")
            }
        }
        let (window, mode) = match a.config.quiet_of(&group.channel) {
            Some((w, mode)) => (Some(w.name.clone()), mode),
            None => (None, Mode::Digest),
        };
        let channel = a.config.channel(&group.channel);
        // A channel that takes no digests (PagerDuty), or one a reload removed (its messages
        // then fail and are dead-lettered as any), releases each message.
        let mode = match channel {
            Some(ch) if ch.integration.takes_digests() => mode,
            _ => Mode::Each,
        };
        let (notifications, followups) = compose::split(&held);
        let released = |j: &Job| Released {
            window: window.clone(),
            until: group.end_ms,
            resolved: held.resolved.contains(&j.id()),
        };
        let requeued: Vec<&Job> = match mode {
            Mode::Each => held.jobs.iter().collect(),
            Mode::Digest | Mode::Count => followups,
        };
        let now = now_ms();
        let entries: Vec<Entry> = requeued
            .iter()
            .map(|j| {
                let job = Job {
                    released: Some(released(j)),
                    ..(*j).clone()
                };
                Entry {
                    zset: queue_keys::queue(&self.prefix),
                    hash: queue_keys::jobs(&self.prefix),
                    id: job.id(),
                    payload: job.payload(),
                    score: now,
                }
            })
            .collect();
        if let (Some(ch), Mode::Digest | Mode::Count, false) =
            (channel, mode, notifications.is_empty())
        {
            let release = Release {
                channel: ch,
                window: window.as_deref(),
                until: group.end(),
                held: &held,
            };
            let message = match mode {
                Mode::Count => release.count(&a, &notifications),
                _ => release.digest(&a, &notifications),
            };
            let firings = notifications.iter().map(|j| j.firing.clone()).collect();
            let work = Work::Digest {
                rule: message.rule.clone(),
                channel: ch.name.clone(),
                message: Arc::new(message),
                firings,
                jobs: Vec::new(),
                sizes: Vec::new(),
                window: None,
            };
            // Failing since the period ended: given up (a dead letter) a retry window later.
            let tried = attempt.run(&work, 0, Some(group.end_ms)).await;
            record.shown(&work, 0, &tried.outcome);
            match &tried.outcome {
                Outcome::Retry { after, .. } => {
                    // Held still, and due again when the retry policy says (a `Retry-After`
                    // obeyed), not when this lease ends: its attempts are not counted, so the
                    // wait follows how long it has been failing (`RetryPolicy::attempts_in`).
                    let policy = &attempt.policy;
                    let now = now_ms();
                    let failing = now - group.end_ms;
                    if let Next::RetryAt(at) =
                        policy.after_failure(policy.attempts_in(failing), group.end_ms, now, *after)
                    {
                        let lease = lease.lock().await;
                        if let Err(e) = self.store.postpone(&lease, at).await {
                            // The lease's end brings it back instead.
                            self.refused("retry", &e);
                        }
                    }
                    return false;
                }
                Outcome::Failed(reason) => {
                    let letter = record.dead_letter(&work, reason);
                    record.keep_quietly(letter).await;
                }
                _ => {}
            }
        }
        let ids = held.ids();
        // Held until the release is recorded: no renewal goes out beside it.
        let lease = lease.lock().await;
        match self.store.release(&lease, &ids, &entries, true, now).await {
            Ok(Recorded::Recorded { .. }) => !entries.is_empty(),
            Ok(Recorded::Lost) => {
                tracing::info!(channel = %group.channel, "A release's lease was taken over by another instance; it finishes the release.");
                false
            }
            Err(e) => {
                self.refused("release", &e);
                false
            }
        }
    }

    /// The first refusal of a message's move to its hold, written again until Redis takes it.
    fn written_again(&self, error: &dyn std::fmt::Display) {
        StateError {
            operation: "hold",
            error,
            items: 1,
            then: "written again until Redis takes it",
        }
        .emit(&self.metrics);
    }

    fn refused(&self, operation: &'static str, error: &dyn std::fmt::Display) {
        StateError {
            operation,
            error,
            items: 1,
            then: "held messages are released when this is tried again",
        }
        .emit(&self.metrics);
    }
}
