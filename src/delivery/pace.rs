//! The pace stage: a notification of a channel with a `rate` waits here for the channel's token
//! (docs/rules.md#channels), and a backlog longer than the rate can serve merges into digests.
//!
//! The tokens come from a bucket: up to `burst` messages at once, refilled evenly over `per`
//! (`20/min`: a burst of 20, then one every 3 s). The bucket lives in Redis ([`SharedBucket`], kept
//! by [`crate::store::rate`]), so every instance draws from the same one: three instances together
//! never exceed a DingTalk robot's 20 a minute. If Redis cannot be asked, the instance falls back
//! to a bucket of its own rather than stop sending.
//!
//! Every notification of a paced channel waits in its channel's *backlog* for a token. One task
//! per channel takes the tokens and hands each to the oldest waiting message. While tokens are in
//! hand (the bucket's burst), every message goes on its own: three alerts on a fresh `2/min`
//! channel are two messages at once and one 30 s later, never one digest. Once a token had to be
//! waited for, and more are still waiting behind its message than the channel may send in
//! [`MAX_WAIT`] (DingTalk's 20/min: more than 20), the oldest message takes the waiting messages
//! of its rule along as one digest (docs/rules.md#event-json digest form: `count`, the first
//! items, "… and N more") instead of trickling out for hours. The merged messages' jobs stay
//! stored in the queue and leased to this instance until that digest is sent (then they are all
//! acknowledged), so a crash before then delivers them again — at most a duplicate, never a loss.
//!
//! The backlog itself is bounded ([`backlog_cap`]): a notification that finds it full waits for
//! its channel in Redis (taken back as the backlog shortens), so a storm on a throttled channel
//! holds a fixed amount of memory, and none of the capacity other channels share.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Rate;
use std::collections::HashMap;

use crate::firing::Firing;
use crate::store::rate::Bucket;
use tokio::time::Instant;

/// The longest a notification should wait for its channel's rate before it is merged.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(60);

/// The fewest notifications a backlog holds before the rest wait in Redis: what one token's
/// digest can take at once when the channel is far behind.
pub(super) const BACKLOG_MIN: usize = 1000;

/// How many notifications a channel of `rate` keeps waiting in memory: twice what merges within
/// `max_wait` ([`MAX_WAIT`]), and at least [`BACKLOG_MIN`], so that a backlog still merges into
/// few digests.
pub(super) fn backlog_cap(rate: Rate, max_wait: Duration) -> usize {
    merge_threshold(rate, max_wait)
        .saturating_mul(2)
        .max(BACKLOG_MIN)
}

/// What a waiting notification is told when its channel's turn comes.
#[derive(Debug)]
pub(super) enum Turn {
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
pub(super) struct Waiting {
    pub(super) firing: Arc<Firing>,
    /// Its job in the durable queue.
    pub(super) job: String,
}

struct Entry {
    waiting: Waiting,
    turn: oneshot::Sender<Turn>,
}

/// One paced channel: its bucket and its backlog.
pub(super) struct Pace {
    bucket: SharedBucket,
    /// Messages waiting beyond this many merge.
    merge_over: usize,
    /// Messages waiting beyond this many wait in Redis instead.
    cap: usize,
    backlog: Mutex<VecDeque<Entry>>,
    arrived: Notify,
    started: AtomicBool,
}

/// How many messages `rate` lets through in `max_wait` ([`MAX_WAIT`]; at least one).
pub(super) fn merge_threshold(rate: Rate, max_wait: Duration) -> usize {
    let per_message = rate.per.as_secs_f64() / f64::from(rate.burst.max(1));
    ((max_wait.as_secs_f64() / per_message).floor() as usize).max(1)
}

impl Pace {
    /// `merges`: whether the channel takes digests (PagerDuty does not: one event, one alert).
    /// `max_wait`: [`MAX_WAIT`] (shorter in the tests of the delivery stage).
    fn new(bucket: SharedBucket, rate: Rate, merges: bool, max_wait: Duration) -> Pace {
        Pace {
            bucket,
            merge_over: if merges {
                merge_threshold(rate, max_wait)
            } else {
                usize::MAX
            },
            cap: backlog_cap(rate, max_wait),
            backlog: Mutex::new(VecDeque::new()),
            arrived: Notify::new(),
            started: AtomicBool::new(false),
        }
    }

    /// Waits for this message's turn. `None`: shutdown came first (the job stays in flight and
    /// is handed back).
    pub(super) async fn wait(
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

    /// How many more messages fit in the backlog.
    pub(super) fn free(&self) -> usize {
        self.cap.saturating_sub(self.lock().len())
    }

    /// How many messages the backlog holds at most.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Whether `more` messages still fit in the backlog.
    pub(super) fn has_room(&self, more: usize) -> bool {
        self.free() > more
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Entry>> {
        // A std Mutex: the guard never lives across an await.
        self.backlog.lock().unwrap_or_else(|p| p.into_inner())
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
                in_hand = self.bucket.take() => in_hand,
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

    /// The oldest message, and the waiting messages of its rule when the backlog is longer than
    /// the rate serves in [`MAX_WAIT`]. `in_hand`: its token came without a wait, so the bucket
    /// still serves the backlog as fast as it fills, and nothing merges.
    fn next_turn(&self, in_hand: bool) -> Option<(Entry, Vec<Entry>)> {
        let mut backlog = self.lock();
        let lead = backlog.pop_front()?;
        // "More waiting than the rate lets through in a minute" (docs/rules.md#channels):
        // exactly that many still go one by one.
        if in_hand || backlog.len() <= self.merge_over {
            return Some((lead, Vec::new()));
        }
        let (same, rest): (VecDeque<Entry>, VecDeque<Entry>) = backlog
            .drain(..)
            .partition(|e| e.waiting.firing.rule == lead.waiting.firing.rule);
        *backlog = rest;
        Some((lead, same.into_iter().collect()))
    }
}

/// Waits for a token from the channel's bucket (see [`SharedBucket::take`]), for work that
/// waits in no backlog (a digest of a window).
impl Pace {
    pub(super) async fn token(&self) -> bool {
        self.bucket.take().await
    }
}

/// The pace of each channel with a `rate` in force: made on first use, made anew when a reload
/// changes a channel's rate.
pub(super) struct Paces {
    state: crate::keyspace::Conn,
    prefix: String,
    /// The `max_wait` of each pace ([`MAX_WAIT`]; shorter in the tests of the delivery stage).
    max_wait: Duration,
    by_channel: Mutex<HashMap<String, (Rate, Arc<Pace>)>>,
}

impl Paces {
    pub(super) fn new(state: crate::keyspace::Conn, prefix: &str, max_wait: Duration) -> Paces {
        Paces {
            state,
            prefix: prefix.to_string(),
            max_wait,
            by_channel: Mutex::new(HashMap::new()),
        }
    }

    /// The pace of `channel` under `config`; `None` when it has no `rate` (or is gone).
    pub(super) fn get(&self, config: &crate::config::Config, channel: &str) -> Option<Arc<Pace>> {
        let ch = config.channel(channel)?;
        let rate = ch.rate?;
        let mut map = self.by_channel.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((r, p)) = map.get(channel)
            && *r == rate
        {
            return Some(p.clone());
        }
        let pace = Arc::new(Pace::new(
            SharedBucket::new(self.state.clone(), &self.prefix, channel, rate),
            rate,
            ch.integration.takes_digests(),
            self.max_wait,
        ));
        map.insert(channel.to_string(), (rate, pace.clone()));
        Some(pace)
    }
}

pub(super) struct TokenBucket {
    rate: Rate,
    state: Mutex<State>,
}

struct State {
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub(super) fn new(rate: Rate) -> TokenBucket {
        TokenBucket {
            rate,
            state: Mutex::new(State {
                tokens: f64::from(rate.burst),
                last: Instant::now(),
            }),
        }
    }

    fn per_token(&self) -> Duration {
        self.rate.per / self.rate.burst
    }

    /// Takes a token now, or says how long until one is there.
    pub(super) fn try_take(&self) -> Result<(), Duration> {
        // A std Mutex is right here: the guard never lives across an await.
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(s.last).as_secs_f64() / self.per_token().as_secs_f64();
        s.tokens = (s.tokens + refill).min(f64::from(self.rate.burst));
        s.last = now;
        if s.tokens >= 1.0 {
            s.tokens -= 1.0;
            Ok(())
        } else {
            Err(self.per_token().mul_f64(1.0 - s.tokens))
        }
    }

    /// Waits for a token; true when one was in hand.
    pub(super) async fn take(&self) -> bool {
        let mut in_hand = true;
        while let Err(wait) = self.try_take() {
            in_hand = false;
            tokio::time::sleep(wait).await;
        }
        in_hand
    }
}

/// A channel's bucket shared by every instance through Redis ([`crate::store::rate`]).
pub(super) struct SharedBucket {
    bucket: Bucket,
    /// Used while Redis cannot be asked.
    local: TokenBucket,
}

impl SharedBucket {
    pub(super) fn new(
        conn: crate::keyspace::Conn,
        prefix: &str,
        channel: &str,
        rate: Rate,
    ) -> SharedBucket {
        SharedBucket {
            bucket: Bucket::new(conn, prefix, channel, rate),
            local: TokenBucket::new(rate),
        }
    }

    /// Waits for a token from the shared bucket; true when one was in hand.
    pub(super) async fn take(&self) -> bool {
        let mut in_hand = true;
        loop {
            match self.bucket.take().await {
                Ok(0) => return in_hand,
                Ok(ms) => {
                    in_hand = false;
                    tokio::time::sleep(Duration::from_millis(ms)).await
                }
                Err(e) => {
                    tracing::warn!(key = %self.bucket.key(), error = %e, "Cannot reach the shared rate limit; limiting this instance alone.");
                    return self.local.take().await && in_hand;
                }
            }
        }
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
        assert_eq!(backlog_cap(rate(20, 60), MAX_WAIT), BACKLOG_MIN);
        assert_eq!(backlog_cap(rate(50, 1), MAX_WAIT), 6000);
    }

    use crate::channel::Integration;
    use crate::status::RuleCounts;

    use super::super::RetryPolicy;
    use super::super::testkit::{
        self, EARLY, Received, Recorder, Stage, assert_about, firings, replace_integration,
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
    async fn a_paced_channel_sends_a_burst_then_one_per_period_in_order() {
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
            // At once: before the first token, which a message waiting for one could not be.
            // Twenty sends one after the other took over 100 ms (`testkit::LATE`) in a debug build under load.
            assert_eq!(
                got.iter().filter(|r| r.at + EARLY < token).count(),
                20,
                "{got:?}"
            );
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

    #[tokio::test(start_paused = true)]
    async fn bursts_then_refills_evenly() {
        let b = TokenBucket::new(Rate {
            burst: 20,
            per: Duration::from_secs(60),
        });
        for _ in 0..20 {
            assert!(b.try_take().is_ok());
        }
        let wait = b.try_take().unwrap_err();
        assert!(
            wait <= Duration::from_secs(3) && wait > Duration::from_millis(2900),
            "{wait:?}"
        );
        let start = Instant::now();
        b.take().await;
        b.take().await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(5900) && took <= Duration::from_millis(6100),
            "{took:?}"
        );
    }

    /// A pace merges nothing while tokens are in hand (docs/rules.md#channels), and with a
    /// state every instance draws from the shared bucket: it must say which tokens came without
    /// a wait, or a fresh channel's burst merges as if it were a backlog. 1 token per 2 s, so
    /// the burst is taken well before a token comes back.
    #[tokio::test]
    async fn a_shared_bucket_says_whether_its_token_was_in_hand() {
        let (_server, conn) = crate::local_redis::throwaway().await;
        let b = SharedBucket::new(
            conn,
            "keywatch:",
            "robot",
            Rate {
                burst: 3,
                per: Duration::from_secs(6),
            },
        );
        for i in 1..=3 {
            assert!(b.take().await, "token {i} of the burst is in hand");
        }
        assert!(!b.take().await, "the fourth is waited for");
    }
}
