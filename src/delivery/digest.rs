//! Digests: one message for many notifications of one rule to one channel — a `group` window's
//! (shared by every instance in Redis, `store::queue` windows) or a paced channel's backlog
//! merged (`super::pace`) — composed under the rules in force when it goes out.

use std::sync::Arc;

use crate::action::{ActionContext, notify};
use crate::channel::Message;
use crate::firing::Firing;
use crate::store::queue::{Window, WindowMember};

use super::work::Work;

/// Most jobs of one window taken into one digest: a storm's window of 100,000 becomes a few
/// digests of this many, and no Lua call holds Redis for long.
pub(super) const WINDOW_TAKE_MAX: usize = 5000;

/// Items listed in a digest of a rule without `group.max_items` (a merged backlog).
pub(super) const DIGEST_ITEMS: usize = 20;

/// A digest of `firings` of `rule` for `channel` under the rules in force now, listing the rule's
/// `group.max_items` (or [`DIGEST_ITEMS`] for a merged backlog of a rule without `group`).
pub(super) fn compose(
    actions: &ActionContext,
    rule: &str,
    channel: &str,
    firings: &[Arc<Firing>],
) -> Result<Message, String> {
    let actions = actions.refreshed();
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

/// What a window's due members come to: the digest to send, with its attempt count and when it
/// first failed; or, when it cannot be composed, the digest to dead-letter and why.
pub(super) enum WindowDigest {
    Send {
        work: Work,
        attempt: u32,
        failing_since: Option<i64>,
    },
    Unsendable {
        work: Work,
        reason: String,
    },
}

/// The digest of `members` taken from window `w` (`None` when nothing readable is left in them:
/// they were set aside, or all seen twice).
pub(super) fn of_window(
    actions: &ActionContext,
    w: &Window,
    members: Vec<WindowMember>,
) -> Option<WindowDigest> {
    let jobs = || members.iter().flat_map(|m| &m.jobs);
    let attempt = jobs().map(|j| j.attempt).max().unwrap_or(0);
    let failing_since = jobs().filter_map(|j| j.failing_since).min();
    let ids: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
    let sizes: Vec<usize> = members.iter().map(|m| m.jobs.len()).collect();
    let firings: Vec<Arc<Firing>> = jobs().map(|j| j.firing.clone()).collect();
    if firings.is_empty() {
        return None;
    }
    let work = |message: Message, firings: Vec<Arc<Firing>>| Work::Digest {
        rule: w.rule.clone(),
        channel: w.channel.clone(),
        message: Arc::new(message),
        firings,
        jobs: ids.clone(),
        sizes: sizes.clone(),
        window: Some(w.clone()),
    };
    Some(match compose(actions, &w.rule, &w.channel, &firings) {
        Ok(message) => WindowDigest::Send {
            work: work(message, firings),
            attempt,
            failing_since,
        },
        Err(e) => {
            let placeholder = Message::uncomposed_digest(
                &w.rule,
                firings.first().map_or("", |f| f.id.as_str()),
                &w.channel,
                firings.len(),
            );
            WindowDigest::Unsendable {
                work: work(placeholder, firings),
                reason: format!("cannot compose the digest: {e}"),
            }
        }
    })
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
        assert_eq!(s.queue_len().await, 5);

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
        let end = keys::window_end(&keys::window("keywatch:", "batch", "log"));
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
