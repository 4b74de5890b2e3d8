//! The firing stage of one batch of taken events: silences, `recover`, details, and the hand-over
//! to delivery, each event's intake record moving on with it.
//!
//! The order is what keeps every event somewhere in Redis: its jobs are stored in the same
//! transaction that rewrites its record to "details to remove" (or clears it); only then are the
//! details removed, and only then is the record cleared. A crash at any point leaves the record
//! to whoever takes it next, who picks up where it stopped.
//!
//! A detail that cannot be read (an error, not an absent detail) holds back its event only: the
//! event's record waits for a retry with backoff, and after the retry window its actions become
//! dead letters that say why. No action runs with a detail keywatch failed to read.

use std::sync::Arc;

use crate::config::{Config, Recover};
use crate::delivery::{self, Delivery, RetryPolicy};
use crate::engine::detail::{self, Request};
use crate::engine::intake::{Intake, Next, Taken};
use crate::firing::{Detail, Firing};
use crate::keyspace::{Keyspace, clock};
use crate::metrics::Metrics;
use crate::status::Status;
use crate::template::Context;

/// Why an expiry found afterwards is too late for `rule` to fire (`recover.max_late`), if it is:
/// an expiry found hours after its deadline (keywatch was down) is noise for a lock alert or a
/// cache pre-warm (docs/rules.md#recover-expiries-found-afterwards).
fn too_late(rule: &crate::config::Rule, e: &crate::event::KeyEvent) -> Option<String> {
    let max = rule.max_late?;
    let late = e.late_ms().filter(|_| e.recovered)?;
    let max_ms = i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
    (late > max_ms).then(|| {
        format!(
            "found {} after its deadline, later than `recover.max_late` ({})",
            crate::template::human_duration(late),
            crate::template::human_duration(max_ms)
        )
    })
}

/// Why `rule` does not fire `e`, an expiry found afterwards, whatever its detail: found later than
/// `recover.max_late`, or the rule says `recover: never`. `keywatch test` asks the same.
pub(crate) fn recovery_skipped(
    rule: &crate::config::Rule,
    e: &crate::event::KeyEvent,
) -> Option<String> {
    if let Some(why) = too_late(rule, e) {
        return Some(why);
    }
    (e.recovered && rule.recover == Recover::Never)
        .then(|| "the rule says `recover: never`".to_string())
}

/// Why `rule` does not fire `e` when its detail is absent, if it does not: an expiry found
/// afterwards under `recover: if_detail` whose detail is gone was likely a delete.
pub(crate) fn skipped_without_detail(
    rule: &crate::config::Rule,
    e: &crate::event::KeyEvent,
) -> Option<&'static str> {
    (e.recovered && rule.recover == Recover::IfDetail).then_some(
        "its detail is gone (`recover: if_detail`): the key was likely deleted while nobody listened",
    )
}

/// A rule's index in the config and the captures of its pattern.
pub type RuleMatch = (usize, Vec<bytes::Bytes>);

/// A taken event and the rules it fires.
pub struct Item {
    pub taken: Taken,
    pub rules: Vec<RuleMatch>,
}

/// What the firing stage of one batch needs, owned, so that it can run beside the next batch.
pub struct FiringStage {
    pub config: Arc<Config>,
    pub keyspace: Keyspace,
    pub status: Arc<Status>,
    pub delivery: Delivery,
    pub metrics: Arc<Metrics>,
    pub intake: Intake,
    pub silenced: Arc<crate::engine::silences::Active>,
}

/// One rule of one item that fires (not silenced), with its detail request if it has one.
struct Fires {
    rule: usize,
    captures: Vec<bytes::Bytes>,
    /// Index into the stage's detail requests.
    detail: Option<usize>,
}

impl FiringStage {
    pub async fn fire(&self, items: Vec<Item>) {
        // Records whose jobs were stored by a taker that stopped before removing the details.
        let (leftover, items): (Vec<Item>, Vec<Item>) = items
            .into_iter()
            .partition(|i| i.taken.record.remove.is_some());
        if !leftover.is_empty() {
            self.finish_removal(leftover).await;
        }
        if items.is_empty() {
            return;
        }
        let config = &self.config;
        let mut requests: Vec<Request> = Vec::new();
        let mut plans: Vec<Vec<Fires>> = Vec::with_capacity(items.len());
        // Each item's event, rebuilt from its record once for both passes below.
        let events: Vec<crate::event::KeyEvent> =
            items.iter().map(|i| i.taken.record.event()).collect();
        let mut matched = crate::metrics::Tally::default();
        for (item, e) in items.iter().zip(&events) {
            if item.rules.is_empty() {
                // Taken over after a reload removed every rule that took it.
                tracing::error!(key = %e.key_lossy(), event = %e.kind, "A taken event matches no rule in force any more (a reload removed it); nothing fires for it.");
            }
            let first = item.taken.record.attempt == 0;
            if first {
                if e.recovered {
                    for (rule, _) in &item.rules {
                        self.metrics.recovered_for(&config.rules[*rule].name);
                    }
                } else if let Some(late) = e.late_ms() {
                    self.metrics.expiry_lateness.observe(late as f64 / 1000.0);
                }
            }
            let mut fires = Vec::new();
            for (rule, captures) in &item.rules {
                let r = &config.rules[*rule];
                if first {
                    matched.add((*rule, e.kind));
                }
                if self.silenced.mutes(&r.name, &e.key) {
                    if first {
                        crate::internal_events::Silenced {
                            rule: &r.name,
                            key: &e.key_lossy(),
                        }
                        .emit(&self.metrics);
                        self.keep_skipped(r, e, captures, "silenced");
                    }
                    continue;
                }
                if let Some(why) = recovery_skipped(r, e) {
                    self.skip_recovery(&r.name, e, &why);
                    self.keep_skipped(r, e, captures, &format!("recovered: {why}"));
                    continue;
                }
                let context = || Context::for_event(&r.name, e, r.capture_names(), captures, None);
                let vars = detail::Vars {
                    key: &e.key,
                    capture_names: r.capture_names(),
                    capture_values: captures,
                    context: &context,
                };
                let detail = match detail::request(
                    &config.templates,
                    r,
                    e.db,
                    &vars,
                    config.state.prefix.as_bytes(),
                ) {
                    None => None,
                    Some(Ok(req)) => {
                        requests.push(req);
                        Some(requests.len() - 1)
                    }
                    Some(Err(err)) => {
                        tracing::error!(rule = %r.name, key = %e.key_lossy(), error = %config.secrets.mask(&err), "Cannot render the detail location; the actions run without it.");
                        None
                    }
                };
                fires.push(Fires {
                    rule: *rule,
                    captures: captures.clone(),
                    detail,
                });
            }
            plans.push(fires);
        }
        for ((rule, kind), n) in matched.0 {
            self.metrics
                .matched_by(&config.rules[rule].name, kind.as_str(), n);
        }
        let details = if requests.is_empty() {
            Vec::new()
        } else {
            detail::fetch(&self.keyspace, &requests).await
        };

        let mut firings = Vec::new();
        // What each firing may record an outcome for, to keep it in history in the transaction
        // that stores its jobs.
        let mut actions = Vec::new();
        // Per stored item: the details it will remove.
        let mut stored: Vec<(&Taken, Option<Vec<Request>>)> = Vec::new();
        let mut failed: Vec<(&Item, String)> = Vec::new();
        for ((item, fires), e) in items.iter().zip(plans).zip(&events) {
            if let Some(err) = fires
                .iter()
                .filter_map(|f| f.detail.and_then(|i| details[i].as_ref().err()))
                .next()
            {
                failed.push((item, err.clone()));
                continue;
            }
            let mut remove = Vec::new();
            for f in fires {
                let r = &config.rules[f.rule];
                let value = match f.detail {
                    None => None,
                    Some(i) => match &details[i] {
                        Ok(Some(bytes)) => {
                            if requests[i].remove {
                                remove.push(requests[i].clone());
                            }
                            Some(Detail::read(bytes))
                        }
                        Ok(None) => match skipped_without_detail(r, e) {
                            Some(why) => {
                                self.skip_recovery(&r.name, e, why);
                                self.keep_skipped(r, e, &f.captures, why);
                                continue;
                            }
                            None => {
                                tracing::warn!(rule = %r.name, key = %e.key_lossy(), "No detail found beside the key; the actions run with `detail` = none.");
                                Some(serde_json::Value::Null.into())
                            }
                        },
                        Err(_) => unreachable!("items with a failed read were set aside above"),
                    },
                };
                let firing = Firing::new(&r.name, e, r.capture_names(), f.captures, value);
                if self.status.history().is_some() {
                    actions.push(crate::action::every_action_of(r));
                }
                self.status.record_firing(&firing);
                firings.push(firing);
            }
            remove.dedup();
            stored.push((&item.taken, (!remove.is_empty()).then_some(remove)));
        }

        // Where every event goes next, in the transaction that stores the jobs: its record
        // cleared or rewritten, a failed read split off to wait for its retry.
        let mut next: Vec<(&Taken, Next)> = stored
            .into_iter()
            .map(|(t, remove)| (t, Next::Stored(remove)))
            .collect();
        for (item, reason) in failed {
            next.push((&item.taken, self.read_failed(item, &reason)));
        }
        let stores = next.iter().any(|(_, n)| matches!(n, Next::Stored(_)));
        let mut also = self.intake.moved_on(&next);
        if let Some(h) = self.status.history() {
            also.extend(h.firing_cmds(firings.iter().zip(actions)));
        }
        // The exact bytes of a long key (kept at its take: renewed) or field, kept once for all
        // the jobs and dead letters that name them by their hash
        // (docs/reliability.md#bounded-whatever-the-key).
        let records: Vec<&crate::engine::intake::Record> =
            items.iter().map(|i| &i.taken.record).collect();
        let kept = self.intake.keep_long_values(&records).await;
        let written = if let Err(e) = kept {
            tracing::warn!(error = %e, "Cannot keep a long key's exact bytes; its event is taken again.");
            false
        } else if stores {
            self.delivery.accept_with(firings, also).await.is_ok()
        } else {
            match self.intake.apply(also).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot put events whose detail read failed back for their retry; they come due again in a second.");
                    false
                }
            }
        };
        if !written {
            // Nothing was stored: the records come back to whoever takes them next.
            let events: Vec<&Taken> = next.iter().map(|(t, _)| *t).collect();
            if let Err(e) = self.intake.put_back(&events, clock::now_ms() + 1000).await {
                tracing::warn!(error = %e, "Cannot put taken events back; they come due when their lease ends.");
            }
            return;
        }
        if stores {
            crate::drill::pass(crate::drill::Step::Stored);
            if let Some(h) = self.status.history() {
                h.indexed();
            }
        }
        let removals: Vec<(String, Vec<Request>)> = next
            .into_iter()
            .filter_map(|(t, n)| match n {
                Next::Stored(Some(r)) => Some((t.id.clone(), r)),
                _ => None,
            })
            .collect();
        self.remove(removals).await;
    }

    /// Keeps in history an event of `rule` that runs none of its actions, and why.
    fn keep_skipped(
        &self,
        rule: &crate::config::Rule,
        e: &crate::event::KeyEvent,
        captures: &[bytes::Bytes],
        why: &str,
    ) {
        if let Some(h) = self.status.history() {
            let f = Firing::new(
                &rule.name,
                e,
                rule.pattern.capture_names(),
                captures.to_vec(),
                None,
            );
            h.skipped(&f, &crate::action::actions_of(rule), why);
        }
    }

    /// Counts and logs an expiry found afterwards that the rule does not fire.
    fn skip_recovery(&self, rule: &str, e: &crate::event::KeyEvent, why: &str) {
        crate::internal_events::RecoverySkipped {
            rule,
            key: &e.key_lossy(),
            deadline: &e.deadline.map(|d| d.to_rfc3339()).unwrap_or_default(),
            reason: why,
        }
        .emit(&self.metrics);
    }

    /// Removes details (the events' jobs are stored), then clears the records that held them.
    async fn remove(&self, removals: Vec<(String, Vec<Request>)>) {
        if removals.is_empty() {
            return;
        }
        let reqs: Vec<&Request> = removals.iter().flat_map(|(_, r)| r).collect();
        // A shadow removes nothing (`detail.remove` is the application's data): it only lets
        // the events' records go.
        let removed = match self.config.state.is_shadow() {
            true => Ok(()),
            false => detail::remove(&self.keyspace, &reqs).await,
        };
        if let Err(e) = removed {
            // The records still say what to remove: whoever takes them next does it.
            tracing::error!(error = %e, "Cannot remove details; they are removed when the events are taken again.");
            let ids: Vec<String> = removals.into_iter().map(|(id, _)| id).collect();
            self.intake.release(&ids);
            return;
        }
        crate::drill::pass(crate::drill::Step::Removed);
        let mut ids: Vec<String> = removals.into_iter().map(|(id, _)| id).collect();
        ids.sort_unstable();
        ids.dedup();
        if let Err(e) = self.intake.clear(&ids).await {
            tracing::warn!(error = %e, "Cannot clear taken events whose work is done; their details are removed again when they come due (nothing fires twice).");
        }
    }

    /// Records taken over after their jobs were stored: only the details remain to be removed.
    async fn finish_removal(&self, items: Vec<Item>) {
        let removals = items
            .into_iter()
            .filter_map(|i| i.taken.record.remove.map(|r| (i.taken.id, r)))
            .collect();
        self.remove(removals).await;
    }

    /// An event whose detail could not be read: retried with backoff; after the retry window,
    /// its actions are dead letters that say why.
    fn read_failed(&self, item: &Item, reason: &str) -> Next {
        self.metrics.detail_read_failures.inc();
        let mut record = item.taken.record.clone();
        let now = clock::now_ms();
        let since = *record.failing_since.get_or_insert(now);
        record.attempt += 1;
        let e = record.event();
        match RetryPolicy::default().after_failure(record.attempt, since, now, None) {
            delivery::Next::RetryAt(at) => {
                tracing::warn!(key = %e.key_lossy(), attempt = record.attempt, error = %reason, "Cannot read the detail; the event waits for a retry (its actions never run without it).");
                Next::RetryAt(at, Box::new(record))
            }
            delivery::Next::GiveUp => {
                let firings = item
                    .rules
                    .iter()
                    .map(|(rule, captures)| {
                        let r = &self.config.rules[*rule];
                        Firing::new(&r.name, &e, r.capture_names(), captures.clone(), None)
                    })
                    .collect();
                let keep = self.delivery.give_up(
                    firings,
                    &format!("the detail could not be read for the whole retry window: {reason}"),
                );
                Next::GivenUp(keep)
            }
        }
    }
}
