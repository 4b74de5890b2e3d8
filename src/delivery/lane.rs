//! A rate-limited channel's waiting line, and what happens when it grows longer than the rate
//! can serve: the waiting notifications of one rule merge into one digest (docs/rules.md#event-json digest form:
//! `count`, the first items, "… and N more") instead of trickling out for hours.
//!
//! Every notification for a channel with a `rate` waits here for a token. One task per channel
//! takes the tokens and hands each to the oldest waiting message. While tokens are in hand (the
//! bucket's burst), every message goes on its own: three alerts on a fresh `2/min` channel are
//! two messages at once and one 30 s later, never one digest. Once a token had to be waited for,
//! and more are still waiting behind its message than the channel may send in [`MAX_WAIT`]
//! (DingTalk's 20/min: more than 20), the oldest message takes the waiting messages of its rule
//! along as one digest. The merged messages' jobs stay stored in the queue and leased to this
//! instance until that digest is sent (then they are all acknowledged), so a crash before then
//! delivers them again — at most a duplicate, never a loss.
//!
//! The line itself is bounded ([`line_cap`]): a notification that finds it full goes back to the
//! queue in Redis, to wait for its channel there (taken back as the line shortens), so a storm on
//! a throttled channel holds a fixed amount of memory, and none of the room other channels share.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Rate;
use std::collections::HashMap;

use crate::delivery::ratelimit::SharedBucket;
use crate::firing::Firing;

/// The longest a notification should wait for its channel's rate before it is merged.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// The fewest notifications a rate-limited line holds before the rest wait in the queue: what one
/// token's digest can take at once when the channel is far behind.
pub const LINE_MIN: usize = 1000;

/// How many notifications a channel of `rate` keeps waiting in memory: twice what merges within
/// `max_wait` ([`MAX_WAIT`]), and at least [`LINE_MIN`], so that a backlog still merges into few
/// digests.
pub fn line_cap(rate: Rate, max_wait: Duration) -> usize {
    merge_threshold(rate, max_wait)
        .saturating_mul(2)
        .max(LINE_MIN)
}

/// What a waiting notification is told when its channel's turn comes.
#[derive(Debug)]
pub enum Turn {
    /// A token is taken for this message: send it as it is.
    Alone,
    /// A token is taken for a digest of this message and these (same rule, oldest first), whose
    /// jobs are now this message's to acknowledge.
    Lead(Vec<Waiting>),
    /// Taken into another message's digest; that message acknowledges this job.
    Merged,
}

/// A notification waiting for a token.
#[derive(Debug)]
pub struct Waiting {
    pub firing: Arc<Firing>,
    /// Its job in the durable queue.
    pub job: String,
}

struct Entry {
    waiting: Waiting,
    turn: oneshot::Sender<Turn>,
}

/// One rate-limited channel's line.
pub struct Lane {
    limiter: Arc<SharedBucket>,
    /// Messages waiting beyond this many merge.
    merge_over: usize,
    /// Messages waiting beyond this many wait in the queue instead.
    cap: usize,
    line: Mutex<VecDeque<Entry>>,
    arrived: Notify,
    started: AtomicBool,
}

/// How many messages `rate` lets through in `max_wait` ([`MAX_WAIT`]; at least one).
pub fn merge_threshold(rate: Rate, max_wait: Duration) -> usize {
    let per_message = rate.per.as_secs_f64() / f64::from(rate.burst.max(1));
    ((max_wait.as_secs_f64() / per_message).floor() as usize).max(1)
}

impl Lane {
    /// `merges`: whether the channel takes digests (PagerDuty does not: one event, one alert).
    /// `max_wait`: [`MAX_WAIT`] (shorter in the tests of the delivery stage).
    pub fn new(limiter: Arc<SharedBucket>, rate: Rate, merges: bool, max_wait: Duration) -> Lane {
        Lane {
            limiter,
            merge_over: if merges {
                merge_threshold(rate, max_wait)
            } else {
                usize::MAX
            },
            cap: line_cap(rate, max_wait),
            line: Mutex::new(VecDeque::new()),
            arrived: Notify::new(),
            started: AtomicBool::new(false),
        }
    }

    /// Waits for this message's turn. `None`: shutdown came first (the job stays in flight and
    /// is handed back).
    pub async fn wait(
        self: &Arc<Self>,
        waiting: Waiting,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
    ) -> Option<Turn> {
        if !self.started.swap(true, Ordering::AcqRel) {
            tracker.spawn(self.clone().serve(shutdown.clone()));
        }
        let (turn, rx) = oneshot::channel();
        self.lock().push_back(Entry { waiting, turn });
        self.arrived.notify_one();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            t = rx => t.ok(),
        }
    }

    /// How many more messages fit in the line.
    pub fn room(&self) -> usize {
        self.cap.saturating_sub(self.lock().len())
    }

    /// How many messages the line holds at most.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Whether `more` messages still fit in the line.
    pub fn has_room(&self, more: usize) -> bool {
        self.room() > more
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Entry>> {
        // A std Mutex: the guard never lives across an await.
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands out tokens, oldest message first, until shutdown.
    async fn serve(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            while self.lock().is_empty() {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = self.arrived.notified() => {}
                }
            }
            let in_hand = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                in_hand = self.limiter.take() => in_hand,
            };
            let Some((lead, merged)) = self.next_turn(in_hand) else {
                continue;
            };
            if merged.is_empty() {
                let _ = lead.turn.send(Turn::Alone);
                continue;
            }
            let mut others = Vec::with_capacity(merged.len());
            for e in merged {
                let _ = e.turn.send(Turn::Merged);
                others.push(e.waiting);
            }
            tracing::info!(
                rule = %lead.waiting.firing.rule,
                merged = others.len() + 1,
                "Channel backlog longer than its rate allows: merging waiting notifications into one digest."
            );
            if let Err(Turn::Lead(back)) = lead.turn.send(Turn::Lead(others)) {
                // The lead's task is gone (shutdown): the merged ones are still in flight here
                // and are handed back with it.
                tracing::debug!(jobs = back.len(), "Digest lead gone at shutdown.");
            }
        }
    }

    /// The oldest message, and the waiting messages of its rule when the line is longer than
    /// the rate serves in [`MAX_WAIT`]. `in_hand`: its token came without a wait, so the bucket
    /// still serves the line as fast as it fills, and nothing merges.
    fn next_turn(&self, in_hand: bool) -> Option<(Entry, Vec<Entry>)> {
        let mut line = self.lock();
        let lead = line.pop_front()?;
        // "More waiting than the rate lets through in a minute" (docs/rules.md#channels):
        // exactly that many still go one by one.
        if in_hand || line.len() <= self.merge_over {
            return Some((lead, Vec::new()));
        }
        let (same, rest): (VecDeque<Entry>, VecDeque<Entry>) = line
            .drain(..)
            .partition(|e| e.waiting.firing.rule == lead.waiting.firing.rule);
        *line = rest;
        Some((lead, same.into_iter().collect()))
    }
}

/// The limiter and waiting line of each channel in force: made on first use, and made anew when a
/// reload changes a channel's rate.
pub(super) struct Limiters {
    pub(super) state: crate::keyspace::Conn,
    pub(super) prefix: String,
    /// The `max_wait` of each lane ([`MAX_WAIT`]; see `state::Pace`).
    pub(super) max_wait: Duration,
    pub(super) by_channel: Mutex<HashMap<String, Limited>>,
}

/// A rate-limited channel's limiter and waiting line, at the rate they were made for.
#[derive(Clone)]
pub(super) struct Limited {
    pub(super) rate: Rate,
    pub(super) limiter: Arc<SharedBucket>,
    pub(super) lane: Arc<Lane>,
}

impl Limiters {
    pub(super) fn get(&self, config: &crate::config::Config, channel: &str) -> Option<Limited> {
        let ch = config.channel(channel)?;
        let rate = ch.rate?;
        let mut map = self.by_channel.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = map.get(channel)
            && l.rate == rate
        {
            return Some(l.clone());
        }
        let limiter = Arc::new(SharedBucket::new(
            self.state.clone(),
            &self.prefix,
            channel,
            rate,
        ));
        let limited = Limited {
            rate,
            lane: Arc::new(Lane::new(
                limiter.clone(),
                rate,
                ch.integration.takes_digests(),
                self.max_wait,
            )),
            limiter,
        };
        map.insert(channel.to_string(), limited.clone());
        Some(limited)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_what_the_rate_sends_in_a_minute() {
        let rate = |burst, secs| Rate {
            burst,
            per: Duration::from_secs(secs),
        };
        assert_eq!(merge_threshold(rate(20, 60), MAX_WAIT), 20);
        assert_eq!(merge_threshold(rate(1, 1), MAX_WAIT), 60);
        assert_eq!(merge_threshold(rate(5, 1), MAX_WAIT), 300);
        assert_eq!(merge_threshold(rate(1, 3600), MAX_WAIT), 1);
        assert_eq!(line_cap(rate(20, 60), MAX_WAIT), LINE_MIN);
        assert_eq!(line_cap(rate(50, 1), MAX_WAIT), 6000);
    }

    use crate::channel::Integration;
    use crate::status::RuleCounts;

    use super::super::RetryPolicy;
    use super::super::testkit::{
        self, LATE, Received, Recorder, Stage, assert_about, firings, replace_integration,
        stage_merging_within,
    };

    /// `MAX_WAIT` and the rates of these tests, scaled down from a minute so that they run in
    /// real time: `2/800ms` merging within 800 ms is `2/min` merging within a minute (a merge
    /// threshold of 2), a token every 400 ms instead of every 30 s.
    const PERIOD: Duration = Duration::from_millis(800);
    const TOKEN: Duration = Duration::from_millis(400);

    /// Two rules notifying `chat`, a channel of `2/800ms`: a burst of 2, then one every 400 ms.
    async fn chat() -> (Stage, Arc<Recorder>) {
        let mut config = testkit::config(
            "channels:\n  chat: { type: log, rate: 2/800ms }\nrules:\n  - name: a\n    match: 'a:*'\n    notify: { to: [chat] }\n  - name: b\n    match: 'b:*'\n    notify: { to: [chat] }\n",
        );
        let rec = Recorder::answering(|_| crate::outcome::Outcome::Sent("ok".into()));
        let r = rec.clone();
        replace_integration(&mut config, "chat", move |_| r as Arc<dyn Integration>);
        let s = stage_merging_within(config, RetryPolicy::default(), PERIOD).await;
        rec.count_from_now();
        (s, rec)
    }

    /// The messages `got`, checked against `want`: the same keys (several for a digest) in the
    /// same order, each when its token came (the `n`-th token after the burst).
    #[track_caller]
    fn assert_sent(got: &[Received], want: &[(u32, &[&str])]) {
        let keys: Vec<Vec<String>> = got.iter().map(|r| r.keys.clone()).collect();
        let want_keys: Vec<Vec<String>> = want
            .iter()
            .map(|(_, k)| k.iter().map(|k| k.to_string()).collect())
            .collect();
        assert_eq!(keys, want_keys, "{got:?}");
        for (r, (token, keys)) in got.iter().zip(want) {
            assert_about(r.at, TOKEN * *token, &format!("{keys:?}: {got:?}"));
            assert_eq!(r.digest, keys.len() > 1, "{got:?}");
        }
    }

    #[tokio::test]
    async fn a_rate_lane_sends_a_burst_then_one_per_period_in_order() {
        let (s, rec) = chat().await;
        s.delivery.accept(firings("a", &["a:1", "a:2"])).await;
        assert_sent(&rec.wait_for(2).await, &[(0, &["a:1"]), (0, &["a:2"])]);
        // Never more than one waiting behind the next to go: nothing merges.
        s.delivery.accept(firings("a", &["a:3", "a:4"])).await;
        rec.wait_for(4).await;
        // The token that came was a:4's: a:5 waits for the next.
        s.delivery.accept(firings("a", &["a:5"])).await;
        rec.wait_for(5).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[
                (0, &["a:1"]),
                (0, &["a:2"]),
                (1, &["a:3"]),
                (2, &["a:4"]),
                (3, &["a:5"]),
            ],
        );
        assert_eq!(
            s.status.counts("a"),
            RuleCounts {
                sent: 5,
                ..RuleCounts::default()
            }
        );
    }

    /// Three alerts at once on a fresh `2/min` channel: two tokens are in hand, so two go at
    /// once, singly, and the third gets the next token 30 s later. Before, the first token's
    /// message found two waiting behind it (not fewer than the threshold of 2) and took them
    /// along: one digest of three, though two tokens were in hand.
    ///
    /// Four at once: three wait behind the first, more than the threshold even counted right,
    /// yet two tokens are in hand; the first two still go singly, and by the time a token has to
    /// be waited for only one waits behind the third (the threshold alone merged all four).
    #[tokio::test]
    async fn alerts_with_tokens_in_hand_are_sent_singly() {
        let (s, rec) = chat().await;
        s.delivery
            .accept(firings("a", &["a:1", "a:2", "a:3"]))
            .await;
        rec.wait_for(3).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[(0, &["a:1"]), (0, &["a:2"]), (1, &["a:3"])],
        );
        assert_eq!(s.status.counts("a").sent, 3);

        let (s, rec) = chat().await;
        s.delivery
            .accept(firings("a", &["a:1", "a:2", "a:3", "a:4"]))
            .await;
        rec.wait_for(4).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[(0, &["a:1"]), (0, &["a:2"]), (1, &["a:3"]), (2, &["a:4"])],
        );
        assert_eq!(s.status.counts("a").sent, 4);
    }

    /// DingTalk's `20/min`: 21 alerts at once are 20 messages at once and one a token later, not
    /// one digest of 21; 22 are 20 at once and one each token after (21 wait behind the first,
    /// more than the threshold, but 20 tokens are in hand). Scaled as `chat`'s: `20/4s` merging
    /// within 4 s, a token every 200 ms.
    #[tokio::test]
    async fn twenty_one_alerts_on_a_fresh_twenty_a_minute_channel_are_not_merged() {
        let token = Duration::from_millis(200);
        for n in [21, 22] {
            let mut config = testkit::config(
                "channels:\n  robot: { type: log, rate: 20/4s }\nrules:\n  - name: a\n    match: 'a:*'\n    notify: { to: [robot] }\n",
            );
            let rec = Recorder::answering(|_| crate::outcome::Outcome::Sent("ok".into()));
            let r = rec.clone();
            replace_integration(&mut config, "robot", move |_| r as Arc<dyn Integration>);
            let s =
                stage_merging_within(config, RetryPolicy::default(), Duration::from_secs(4)).await;
            let keys: Vec<String> = (1..=n).map(|i| format!("a:{i}")).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            rec.count_from_now();
            s.delivery.accept(firings("a", &keys)).await;
            rec.wait_for(n).await;
            s.settled().await;
            let got = rec.received();
            assert_eq!(got.len(), n, "{got:?}");
            assert!(got.iter().all(|r| !r.digest), "{got:?}");
            assert_eq!(got.iter().filter(|r| r.at <= LATE).count(), 20, "{got:?}");
            assert_about(got[20].at, token, &format!("{got:?}"));
            if n == 22 {
                assert_about(got[21].at, token * 2, &format!("{got:?}"));
            }
        }
    }

    /// The threshold is "more waiting than the rate lets through in `MAX_WAIT`" (docs/rules.md):
    /// with the burst spent, a token's message with exactly 2 waiting behind it on a `2/min`
    /// channel sends singly (they go at the next tokens); a third behind it merges.
    #[tokio::test]
    async fn exactly_the_threshold_waiting_does_not_merge() {
        let (s, rec) = chat().await;
        s.delivery.accept(firings("a", &["a:1", "a:2"])).await;
        rec.wait_for(2).await;
        s.delivery
            .accept(firings("a", &["a:3", "a:4", "a:5"]))
            .await;
        rec.wait_for(5).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[
                (0, &["a:1"]),
                (0, &["a:2"]),
                (1, &["a:3"]),
                (2, &["a:4"]),
                (3, &["a:5"]),
            ],
        );
        let (s, rec) = chat().await;
        s.delivery.accept(firings("a", &["a:1", "a:2"])).await;
        rec.wait_for(2).await;
        s.delivery
            .accept(firings("a", &["a:3", "a:4", "a:5", "a:6"]))
            .await;
        rec.wait_for(3).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[
                (0, &["a:1"]),
                (0, &["a:2"]),
                (1, &["a:3", "a:4", "a:5", "a:6"]),
            ],
        );
    }

    /// When a token comes and more of a rule wait than the rate sends in `MAX_WAIT` (2/min: more
    /// than 2), the oldest takes the others of its rule along as one digest; another rule's
    /// message keeps its own place and turn.
    #[tokio::test]
    async fn a_backlog_longer_than_the_rate_serves_in_max_wait_merges_into_a_digest() {
        assert_eq!(MAX_WAIT, Duration::from_secs(60));
        assert_eq!(
            merge_threshold(
                Rate {
                    burst: 2,
                    per: PERIOD
                },
                PERIOD
            ),
            2
        );
        let (s, rec) = chat().await;
        s.delivery.accept(firings("a", &["a:1", "a:2"])).await;
        rec.wait_for(2).await;
        s.delivery
            .accept(firings("a", &["a:3", "a:4", "a:5", "a:6"]))
            .await;
        s.delivery.accept(firings("b", &["b:1"])).await;
        rec.wait_for(4).await;
        s.settled().await;
        assert_sent(
            &rec.received(),
            &[
                (0, &["a:1"]),
                (0, &["a:2"]),
                (1, &["a:3", "a:4", "a:5", "a:6"]),
                (2, &["b:1"]),
            ],
        );
        assert_eq!(s.status.counts("a").sent, 3);
        assert_eq!(s.status.counts("b").sent, 1);
        assert_eq!(s.metrics.dead_letters.get(), 0);
    }
}
