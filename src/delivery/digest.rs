//! Digests: the notifications of a rule with `group` wait in a window shared by every instance
//! and go out as one message.

use std::sync::Arc;

use crate::channel::Message;
use crate::firing::Firing;

use super::attempt::{compose_digest_now, dead_letter, dead_letter_unreadable, deliver};
use super::state::Inner;
use super::work::Work;
use crate::store::queue::Queue;

/// Most jobs of one window taken into one digest: a storm's window of 100,000 becomes a few
/// digests of this many, and no Lua call holds Redis for long.
pub(super) const WINDOW_TAKE_MAX: usize = 5000;

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
    /// out as one digest; the next notification opens a new window.
    #[tokio::test]
    async fn a_window_goes_out_as_one_digest_when_it_ends() {
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
        assert_eq!(s.delivery.inner.queue.len().await.unwrap(), 5);

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

    /// Waits until Redis holds no open window of `batch` for `log`.
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

    /// Redis refuses the window (the state's user may not write it, as when a grant is
    /// missing; a failover between two round trips refuses one and takes the next alike):
    /// `accept_with` fails and nothing of what it was to store with the notifications takes
    /// effect, so the caller's record of the events stays in Redis and a crash loses nothing.
    /// Before, the notifications were kept in this instance's memory and the record moved on:
    /// a crash lost them. Once Redis takes the window, the events go out as one digest.
    #[tokio::test]
    async fn a_window_redis_refuses_is_not_accepted_and_the_record_stays() {
        let mut config = testkit::config(
            "channels:\n  log: { type: log }\nrules:\n  - name: batch\n    match: 'job:*'\n    notify:\n      to: [log]\n      group: { window: 200ms, max_items: 10 }\n",
        );
        let mut rec = None;
        replace_integration(&mut config, "log", |log| {
            let r = Recorder::wrapping(log);
            rec = Some(r.clone());
            r as Arc<dyn Integration>
        });
        let rec = rec.unwrap();
        // Every key but the digest windows' (`keywatch:group*`, `keywatch:groups`).
        let s = testkit::stage_as_user(
            config,
            RetryPolicy::default(),
            "~test:* ~keywatch:queue* ~keywatch:dead* ~keywatch:rate* &* +@all",
        )
        .await;
        let mut c = s.state.clone();
        // The caller's record of the events moves on with their jobs, or not at all.
        let record = || {
            let mut set = redis::cmd("SET");
            set.arg("test:record").arg("moved on");
            set
        };
        let refused = s
            .delivery
            .accept_with(firings("batch", &["job:1", "job:2"]), vec![record()])
            .await;
        assert!(refused.is_err(), "a refused window was accepted");
        let moved: bool = redis::cmd("EXISTS")
            .arg("test:record")
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(!moved, "the record moved on without the notifications");

        // The instance dies here: what it held in memory is gone. Redis takes windows again,
        // and the events (taken again from their records) go out once.
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("kw")
            .arg("~keywatch:group*")
            .exec_async(&mut c)
            .await
            .unwrap();
        rec.count_from_now();
        s.delivery
            .accept_with(firings("batch", &["job:1", "job:2"]), vec![record()])
            .await
            .expect("accepted once Redis takes the window");
        let got = rec.wait_for(1).await;
        assert_digest(&got[0], &["job:1", "job:2"]);
        s.settled().await;
        assert_eq!(rec.received().len(), 1);
    }
}
