//! Digests: the notifications of a rule with `group` wait in a window shared by every instance
//! (or, when Redis cannot hold it, in this instance's memory) and go out as one message.

use std::sync::Arc;

use crate::action::notify;
use crate::channel::Message;
use crate::config::Group;
use crate::firing::{Action, DeadLetter, Firing};

use super::attempt::{
    compose_digest_now, dead_letter, dead_letter_unreadable, deliver, keep_dead_letter,
};
use super::state::Inner;
use super::work::{Work, window_jobs};
use crate::store::queue::{Queue, Window};

/// Most jobs of one window taken into one digest: a storm's window of 100,000 becomes a few
/// digests of this many, and no Lua call holds Redis for long.
pub(super) const WINDOW_TAKE_MAX: usize = 5000;

/// Stores the firings' notifications in their shared window (before the caller removes their
/// details); held in this instance's memory only when Redis refused.
pub(super) async fn put_in_window(
    inner: &Arc<Inner>,
    w: Window,
    group: Group,
    firings: Vec<Arc<Firing>>,
) {
    let jobs = window_jobs(&firings, &w.channel, 0, None);
    match inner.queue.window_put(&w, group.window, &jobs).await {
        Ok(_) => return,
        Err(e) => {
            tracing::warn!(error = %e, rule = %w.rule, channel = %w.channel, "Cannot store notifications in their digest window; collecting them in this instance's memory.");
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
        let members = match queue.window_take(&w, WINDOW_TAKE_MAX).await {
            Ok(t) => {
                dead_letter_unreadable(inner, t.unreadable);
                if t.members.is_empty() {
                    continue;
                }
                t.members
            }
            Err(e) => {
                tracing::warn!(error = %e, rule = %w.rule, "Cannot take a digest window; retrying.");
                continue;
            }
        };
        let jobs = || members.iter().flat_map(|m| &m.jobs);
        let attempt = jobs().map(|j| j.attempt).max().unwrap_or(0);
        let failing_since = jobs().filter_map(|j| j.failing_since).min();
        let ids: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
        let sizes: Vec<usize> = members.iter().map(|m| m.jobs.len()).collect();
        let firings: Vec<Arc<Firing>> = jobs().map(|j| j.firing.clone()).collect();
        if firings.is_empty() {
            // Nothing readable left in them (set aside above, or all seen twice).
            if let Err(e) = queue.window_done(&w, &ids).await {
                tracing::warn!(error = %e, rule = %w.rule, "Cannot remove emptied members of a digest window; they are taken again when their lease ends.");
            }
            continue;
        }
        match compose_digest_now(inner, &w.rule, &w.channel, &firings) {
            Ok(message) => {
                let work = Work::Digest {
                    rule: w.rule.clone(),
                    channel: w.channel.clone(),
                    message: Arc::new(message),
                    firings,
                    jobs: ids,
                    sizes,
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
                    sizes,
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
                let work = Work::Digest { rule, channel, message: Arc::new(message), firings: batch, jobs: Vec::new(), sizes: Vec::new(), window: None };
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::channel::Integration;
    use crate::status::RuleCounts;

    use super::super::RetryPolicy;
    use super::super::testkit::{
        self, Received, Recorder, assert_about, firings, ms, replace_integration, stage,
    };

    /// A `group` window opens with its first notification, takes every one that comes while it
    /// is open, and at its end (half a second after it opened, however many came later) goes
    /// out as one digest; the next notification opens a new window. In Redis, or in this
    /// instance's memory when Redis refuses to store the notifications (`refused`).
    async fn a_window_goes_out_as_one_digest_when_it_ends(refused: bool) {
        let window = ms(500);
        let mut config = testkit::config(
            "channels:\n  log: { type: log }\nrules:\n  - name: batch\n    match: 'job:*'\n    notify:\n      to: [log]\n      group: { window: 500ms, max_items: 10 }\n",
        );
        let mut rec = None;
        replace_integration(&mut config, "log", |log| {
            let r = Recorder::wrapping(log);
            rec = Some(r.clone());
            r as Arc<dyn Integration>
        });
        let rec = rec.unwrap();
        let s = stage(config, RetryPolicy::default()).await;
        if refused {
            // Out of memory, Redis refuses every write: what it does when it is full.
            set_maxmemory(&s, 1).await;
        }

        rec.count_from_now();
        s.delivery
            .accept(firings("batch", &["job:1", "job:2", "job:3"]))
            .await;
        // Part of the scenario, not a wait for something: later, while the window is open.
        tokio::time::sleep(ms(100)).await;
        s.delivery
            .accept(firings("batch", &["job:4", "job:5"]))
            .await;
        assert_eq!(rec.received(), vec![]);
        assert_eq!(s.status.counts("batch"), RuleCounts::default());
        let in_memory = s
            .delivery
            .inner
            .digests
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>();
        let in_redis = s.delivery.inner.queue.len().await.unwrap();
        if refused {
            assert_eq!((in_memory, in_redis), (5, 0));
        } else {
            assert_eq!((in_memory, in_redis), (0, 5));
        }

        let got = rec.wait_for(1).await;
        assert_eq!(got.len(), 1, "{got:?}");
        assert_about(got[0].at, window, &format!("the digest: {got:?}"));
        assert_digest(&got[0], &["job:1", "job:2", "job:3", "job:4", "job:5"]);
        assert_eq!(
            s.status.counts("batch"),
            RuleCounts {
                sent: 1,
                ..RuleCounts::default()
            }
        );

        // The window is closed (in Redis: its end has expired): the next notification opens
        // one of its own, as long.
        window_closed(&s).await;
        let opened = rec.elapsed();
        s.delivery.accept(firings("batch", &["job:6"])).await;
        let got = rec.wait_for(2).await;
        assert_eq!(got.len(), 2, "{got:?}");
        assert_about(got[1].at - opened, window, &format!("{got:?}"));
        assert_digest(&got[1], &["job:6"]);
        if refused {
            set_maxmemory(&s, 0).await;
        }
        s.settled().await;
        assert_eq!(rec.received().len(), 2);
        assert_eq!(s.status.counts("batch").sent, 2);
        assert_eq!(s.metrics.dead_letters.get(), 0);
    }

    /// A digest of rule `batch` listing `keys` (in any order: a shared window lists its members
    /// by their names, not by when they came).
    #[track_caller]
    fn assert_digest(got: &Received, keys: &[&str]) {
        let mut listed = got.keys.clone();
        listed.sort();
        assert_eq!(listed, keys, "{got:?}");
        assert_eq!(got.rule, "batch");
        assert!(got.digest, "{got:?}");
    }

    /// Waits until Redis holds no open window of `batch` for `log` (it never held one when it
    /// refused them).
    async fn window_closed(s: &testkit::Stage) {
        use crate::store::queue::keys;
        let prefix = &s.delivery.inner.actions.config.state.prefix;
        let end = keys::window_end(&keys::window(prefix, "batch", "log"));
        tokio::time::timeout(testkit::PATIENCE, async {
            loop {
                let open: bool = redis::cmd("EXISTS")
                    .arg(&end)
                    .query_async(&mut s.state.clone())
                    .await
                    .unwrap();
                if !open {
                    return;
                }
                tokio::time::sleep(ms(2)).await;
            }
        })
        .await
        .expect("the window's end expires");
    }

    async fn set_maxmemory(s: &testkit::Stage, bytes: u64) {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query_async::<()>(&mut s.state.clone())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_window_in_redis_goes_out_as_one_digest_when_it_ends() {
        a_window_goes_out_as_one_digest_when_it_ends(false).await;
    }

    #[tokio::test]
    async fn a_window_redis_refused_is_held_in_memory_and_goes_out_as_one_digest_when_it_ends() {
        a_window_goes_out_as_one_digest_when_it_ends(true).await;
    }
}
