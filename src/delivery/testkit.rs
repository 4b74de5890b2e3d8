//! What the delivery stage's tests share: a real [`Delivery`] on a throwaway `redis-server` of
//! its own (the queue, digest windows, shared rate buckets and dead letters all in it, as under
//! `keywatch run`) built from rule text, and a channel integration that records when each message
//! reached it.
//!
//! Tests run in real time: the queue's due times and a rate bucket's tokens follow Redis's clock,
//! which tokio's paused clock does not move. So the stage runs at a short [`Pace`] (the queue read
//! every few ms; a test of a rate lane shortens its `MAX_WAIT` with the rate), tests scale their
//! timers down (a retry policy of 100 ms, a `group` window of half a second), and a time is
//! checked as "not before it is due, and at most [`LATE`] after". A test waits for what it looks
//! for ([`Recorder::wait_for`], [`Stage::settled`]), never for a fixed time to let "nothing more"
//! happen.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::action::ActionContext;
use crate::channel::{Channel, Dispatch, Integration, Message};
use crate::config::{Config, LiveConfig};
use crate::firing::Firing;
use crate::keyspace::{Conn, Keyspace};
use crate::local_redis::LocalRedis;
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::status::Status;
use crate::template::Escape;
use crate::yaml::Secret;

use super::pace::MAX_WAIT;
use super::{Delivery, Parts, RetryPolicy};

/// The longest any wait of a test may take before it fails: far beyond what a passing test
/// needs, so that a loaded machine does not fail it.
pub(super) const PATIENCE: Duration = Duration::from_secs(30);

/// How late a message may reach its channel after it was due: the queue loop's tick, a few
/// Redis round trips and a loaded machine's scheduling. Only the upper side of a time has it: a
/// message never comes before it is due ([`EARLY`] aside).
pub(super) const LATE: Duration = Duration::from_millis(100);

/// Redis's clock counts whole milliseconds: a token or a due time may look this much early to
/// tokio's clock.
pub(super) const EARLY: Duration = Duration::from_millis(5);

/// The rules of `yaml`, validated as `keywatch run` validates them.
pub(super) fn config(yaml: &str) -> Config {
    crate::config::of_yaml(yaml, crate::config::Mode::Run)
}

/// Puts `with(original)` in place of channel `name`'s integration.
pub(super) fn replace_integration(
    config: &mut Config,
    name: &str,
    with: impl FnOnce(Arc<dyn Integration>) -> Arc<dyn Integration>,
) {
    let ch = config
        .channels
        .iter_mut()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no channel `{name}` in the test's rules"));
    ch.integration = with(ch.integration.clone());
}

/// A delivery stage on a Redis of its own, its counters, and its status page.
pub(super) struct Stage {
    pub(super) delivery: Delivery,
    pub(super) metrics: Arc<Metrics>,
    pub(super) status: Arc<Status>,
    /// A connection to the stage's Redis.
    pub(super) state: Conn,
    /// Stopped (and its folder removed) when the stage is dropped.
    _redis: LocalRedis,
}

/// The delivery stage of `config` on a throwaway Redis, its queue loop started, as `keywatch
/// run` starts it. The rules of these tests read no detail and clean up nothing.
pub(super) async fn stage(config: Config, policy: RetryPolicy) -> Stage {
    stage_merging_within(config, policy, MAX_WAIT).await
}

/// [`stage`] whose rate lanes merge what their channel's rate cannot send within `max_wait`
/// (instead of [`MAX_WAIT`]), so that a test of a lane runs in a second rather than minutes.
pub(super) async fn stage_merging_within(
    config: Config,
    policy: RetryPolicy,
    max_wait: Duration,
) -> Stage {
    let (redis, state) = crate::local_redis::throwaway().await;
    on(redis, state, config, policy, max_wait, Box::new(|| false)).await
}

/// [`stage`] whose intake says it is behind while `behind` holds (a mass expiry being taken).
pub(super) async fn stage_behind(
    config: Config,
    behind: Arc<std::sync::atomic::AtomicBool>,
) -> Stage {
    let (redis, state) = crate::local_redis::throwaway().await;
    let behind = move || behind.load(std::sync::atomic::Ordering::Relaxed);
    on(
        redis,
        state,
        config,
        RetryPolicy::default(),
        MAX_WAIT,
        Box::new(behind),
    )
    .await
}

/// [`stage`] whose state connection is that of a Redis user with only the grants `acl` gives
/// (an `ACL SETUSER` rule list, e.g. `~keywatch:queue* +@all`): what a least-privilege user, or
/// one lacking a grant, does to delivery. [`Stage::state`] stays the default user's.
pub(super) async fn stage_as_user(config: Config, policy: RetryPolicy, acl: &str) -> Stage {
    let (redis, state) = crate::local_redis::throwaway().await;
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("kw").arg("on").arg(">kw-pass");
    for rule in acl.split_whitespace() {
        setuser.arg(rule);
    }
    setuser
        .exec_async(&mut state.clone())
        .await
        .expect("ACL SETUSER");
    let url = redis.url().replacen("redis://", "redis://kw:kw-pass@", 1);
    let client = redis::Client::open(url).unwrap();
    let as_user = Conn::Node(
        redis::aio::ConnectionManager::new(client.clone())
            .await
            .unwrap(),
        Some(std::sync::Arc::new(client)),
    );
    let mut s = on(redis, as_user, config, policy, MAX_WAIT, Box::new(|| false)).await;
    s.state = state;
    s
}

/// A stage whose delivery keeps its state through `state`, on `redis`.
async fn on(
    redis: LocalRedis,
    state: Conn,
    config: Config,
    policy: RetryPolicy,
    max_wait: Duration,
    intake_behind: Box<dyn Fn() -> bool + Send + Sync>,
) -> Stage {
    let keyspace = Keyspace::new(Secret::new(redis.url()), config.redis.clone())
        .expect("the throwaway Redis's URL");
    let actions = ActionContext::new(
        LiveConfig::fixed(config),
        crate::channel::http::client(),
        keyspace,
    )
    .with_state(state.clone());
    let metrics = Arc::new(Metrics::new());
    let status = Arc::new(Status::default());
    let delivery = Delivery::start_pacing_within(
        Parts {
            actions,
            state: state.clone(),
            metrics: metrics.clone(),
            status: Some(status.clone()),
            intake_behind,
            policy,
            shutdown: CancellationToken::new(),
        },
        max_wait,
    );
    Stage {
        delivery,
        metrics,
        status,
        state,
        _redis: redis,
    }
}

impl Stage {
    /// Waits until the stage has nothing left to do: no job in the queue, waiting for a target
    /// or in a digest window (each waits there until it is sent or dead-lettered), nothing held
    /// here. Nothing more is attempted after that.
    pub(super) async fn settled(&self) {
        let until = Instant::now() + PATIENCE;
        loop {
            let queued = self.queue_len().await;
            let busy = !self.delivery.chain.held.is_empty();
            if queued == 0 && !busy {
                return;
            }
            assert!(
                Instant::now() < until,
                "still {queued} jobs in the queue (held here: {busy}) after {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Jobs in the queue, waiting for their target, or in digest windows.
    pub(super) async fn queue_len(&self) -> i64 {
        self.delivery
            .chain
            .queue
            .len()
            .await
            .expect("the queue's length")
    }
}

/// Waits until `done` says so; fails after [`PATIENCE`] with `what`.
pub(super) async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < until, "not after {PATIENCE:?}: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Asserts that `at` is `want`: not before (but for [`EARLY`]), and at most [`LATE`] after.
#[track_caller]
pub(super) fn assert_about(at: Duration, want: Duration, what: &str) {
    assert!(
        at + EARLY >= want && at <= want + LATE,
        "{what}: at {at:?}, due at {want:?}"
    );
}

/// An expiry of `key` matched by `rule` (no captures, no detail).
pub(super) fn firing(rule: &str, key: &str) -> Firing {
    crate::firing::expiry(rule, key, "2026-01-01T00:00:00Z")
}

/// Firings of `rule` for each of `keys`.
pub(super) fn firings(rule: &str, keys: &[&str]) -> Vec<Firing> {
    keys.iter().map(|k| firing(rule, k)).collect()
}

/// One message as it reached the channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Received {
    /// Since the recorder's zero.
    pub(super) at: Duration,
    pub(super) rule: String,
    /// The keys the message is about (several for a digest).
    pub(super) keys: Vec<String>,
    pub(super) digest: bool,
}

/// More messages than any of these tests sends.
const MOST_ATTEMPTS: usize = 1000;

/// What an attempt answers: by attempt number (0 for the first message that reaches the channel).
type Answer = Box<dyn Fn(usize) -> Outcome + Send + Sync>;

/// A channel integration that records every message it is given, and when, and answers as told
/// (or as the integration it wraps does).
pub(super) struct Recorder {
    zero: Mutex<Instant>,
    wrapped: Option<Arc<dyn Integration>>,
    answer: Option<Answer>,
    received: Mutex<Vec<Received>>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Recorder")
    }
}

impl Recorder {
    /// Answers each attempt with `answer(n)`.
    pub(super) fn answering(
        answer: impl Fn(usize) -> Outcome + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Recorder {
            zero: Mutex::new(Instant::now()),
            wrapped: None,
            answer: Some(Box::new(answer)),
            received: Mutex::new(Vec::new()),
        })
    }

    /// Hands every message on to `wrapped` (the channel's own integration) and answers as it does.
    pub(super) fn wrapping(wrapped: Arc<dyn Integration>) -> Arc<Self> {
        Arc::new(Recorder {
            zero: Mutex::new(Instant::now()),
            wrapped: Some(wrapped),
            answer: None,
            received: Mutex::new(Vec::new()),
        })
    }

    /// Times are counted from now on: call it right before the first `accept` (the recorder is
    /// made before its stage, whose Redis takes a moment to start).
    pub(super) fn count_from_now(&self) {
        *self.zero.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// How long since the recorder's zero.
    pub(super) fn elapsed(&self) -> Duration {
        self.zero
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Waits until `n` messages have reached the channel; all of them so far.
    pub(super) async fn wait_for(&self, n: usize) -> Vec<Received> {
        let until = Instant::now() + PATIENCE;
        loop {
            let got = self.received();
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < until,
                "{} of {n} messages after {PATIENCE:?}: {got:?}",
                got.len()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub(super) fn received(&self) -> Vec<Received> {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Integration for Recorder {
    fn escape(&self) -> Escape {
        Escape::Raw
    }

    fn target(&self) -> String {
        "a test recorder".into()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, now: DateTime<Utc>) -> Dispatch {
        let n = {
            let mut received = self.received.lock().unwrap_or_else(|p| p.into_inner());
            let zero = *self.zero.lock().unwrap_or_else(|p| p.into_inner());
            received.push(Received {
                at: zero.elapsed(),
                rule: msg.rule.clone(),
                keys: msg
                    .items
                    .iter()
                    .map(|i| i.event["key"].as_str().unwrap_or_default().to_string())
                    .collect(),
                digest: msg.digest,
            });
            // A loop that attempts again without waiting would flood the channel: fail it.
            assert!(
                received.len() <= MOST_ATTEMPTS,
                "more than {MOST_ATTEMPTS} messages: something attempts again without waiting"
            );
            received.len() - 1
        };
        match (&self.wrapped, &self.answer) {
            (Some(w), _) => w.dispatch(ch, msg, now),
            (None, Some(answer)) => Dispatch::Done(answer(n)),
            (None, None) => Dispatch::Done(Outcome::Sent("recorded".into())),
        }
    }
}

/// A local HTTP server on 127.0.0.1 in the test's runtime: answers the `n`-th request (from 0)
/// with `answers(n)` (a whole HTTP/1.1 response, sent with `Connection: close`) and records when
/// each request arrived.
pub(super) struct Receiver {
    pub(super) url: String,
    zero: Mutex<Instant>,
    times: Arc<Mutex<Vec<Instant>>>,
}

impl Receiver {
    pub(super) async fn start(
        answers: impl Fn(usize) -> String + Send + Sync + 'static,
    ) -> Receiver {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let times: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let recorded = times.clone();
        tokio::spawn(async move {
            let mut n = 0;
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                read_request(&mut sock).await;
                recorded
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Instant::now());
                let _ = sock.write_all(answers(n).as_bytes()).await;
                let _ = sock.shutdown().await;
                n += 1;
            }
        });
        Receiver {
            url,
            zero: Mutex::new(Instant::now()),
            times,
        }
    }

    /// Times are counted from now on (see [`Recorder::count_from_now`]).
    pub(super) fn count_from_now(&self) {
        *self.zero.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// When requests arrived so far, from the receiver's zero.
    pub(super) fn arrived(&self) -> Vec<Duration> {
        let zero = *self.zero.lock().unwrap_or_else(|p| p.into_inner());
        self.times
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|t| t.saturating_duration_since(zero))
            .collect()
    }

    /// Waits until `n` requests have arrived; when all of them so far did.
    pub(super) async fn wait_for(&self, n: usize) -> Vec<Duration> {
        let until = Instant::now() + PATIENCE;
        loop {
            let got = self.arrived();
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < until,
                "{} of {n} requests after {PATIENCE:?}: {got:?}",
                got.len()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// A local HTTP target that answers every request `200 OK` after `delay`, any number at once (a
/// task per connection), and counts the requests it holds at once: what a storm looks like from
/// the receiving end.
pub(super) struct SlowTarget {
    pub(super) url: String,
    holding: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
    served: Arc<std::sync::atomic::AtomicUsize>,
}

impl SlowTarget {
    pub(super) async fn start(delay: Duration) -> SlowTarget {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let (holding, most, served) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (h, m, s) = (holding.clone(), most.clone(), served.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let (h, m, s) = (h.clone(), m.clone(), s.clone());
                tokio::spawn(async move {
                    if !read_request(&mut sock).await {
                        return;
                    }
                    let now = h.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(delay).await;
                    h.fetch_sub(1, Ordering::SeqCst);
                    let _ = sock.write_all(response("200 OK", "").as_bytes()).await;
                    let _ = sock.shutdown().await;
                    s.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        SlowTarget {
            url,
            holding,
            most,
            served,
        }
    }

    /// The most requests it held at once so far.
    pub(super) fn most(&self) -> usize {
        self.most.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until it has answered `n` requests (at most `within`); how many it answered.
    pub(super) async fn served(&self, n: usize, within: Duration) -> usize {
        let until = Instant::now() + within;
        loop {
            let done = self.served.load(std::sync::atomic::Ordering::SeqCst);
            if done >= n || Instant::now() >= until {
                return done;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Requests it holds right now.
    pub(super) fn holding(&self) -> usize {
        self.holding.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Reads one whole request: headers, then `Content-Length` bytes of body. `false` when the
/// connection ended first.
async fn read_request(sock: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(read) = sock.read(&mut chunk).await {
        if read == 0 {
            return false;
        }
        buf.extend_from_slice(&chunk[..read]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return true;
            }
        }
    }
    false
}

/// An HTTP/1.1 response with `status` (code and reason) and extra `headers` lines.
pub(super) fn response(status: &str, headers: &str) -> String {
    format!("HTTP/1.1 {status}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n")
}

/// `ms` milliseconds.
pub(super) fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// `s` seconds.
pub(super) fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}
