//! What the delivery stage's tests share: a real [`Delivery`] without Redis (`state: None`: local
//! token buckets, retries and `group` windows held in memory) built from rule text, run in tokio's
//! paused time, and a channel integration that records when each message reached it.
//!
//! Tests run under `#[tokio::test(start_paused = true)]`: every wait of the stage (backoff,
//! `Retry-After`, a window's close, a rate lane's next token) passes in virtual time, and a test
//! looks at what was sent by sleeping until a virtual instant (`Recorder::at`), never for real.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::action::ActionContext;
use crate::channel::{Channel, Dispatch, Integration, Message};
use crate::config::{Config, LiveConfig};
use crate::event::{EventKind, KeyEvent};
use crate::firing::Firing;
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::status::Status;
use crate::template::Escape;
use crate::yaml::Secret;

use super::state::Clock;
use super::{Delivery, RetryPolicy};

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

/// A delivery stage without Redis, its counters, and its status page.
pub(super) struct Stage {
    pub(super) delivery: Delivery,
    pub(super) metrics: Arc<Metrics>,
    pub(super) status: Arc<Status>,
}

/// The delivery stage of `config` with no Redis at all. The watched Redis is a client for a port
/// nothing listens on, never connected: the rules of these tests read no detail and clean up
/// nothing. The retry window is read from tokio's clock, so it passes in virtual time.
pub(super) fn stage(config: Config, policy: RetryPolicy) -> Stage {
    let keyspace = Keyspace::new(Secret::new("redis://127.0.0.1:1"), config.redis.clone())
        .expect("a Redis URL that is never connected");
    let actions = ActionContext::new(
        LiveConfig::fixed(config),
        crate::channel::http::client(),
        keyspace,
    );
    let metrics = Arc::new(Metrics::new());
    let clock = Clock::Tokio {
        start_ms: super::queue::now_ms(),
        start: Instant::now(),
    };
    let delivery = Delivery::with_clock(
        actions,
        metrics.clone(),
        policy,
        None,
        CancellationToken::new(),
        clock,
    );
    let status = Arc::new(Status::default());
    delivery.report_to(status.clone());
    Stage {
        delivery,
        metrics,
        status,
    }
}

/// An expiry of `key` matched by `rule` (no captures, no detail).
pub(super) fn firing(rule: &str, key: &str) -> Firing {
    let event = KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: key.as_bytes().to_vec(),
        field: None,
        observed_at: "2026-01-01T00:00:00Z".parse().unwrap(),
        deadline: None,
        ttl_ms: None,
        recovered: false,
        source: "127.0.0.1:1".into(),
    };
    Firing::new(rule, &event, &[], vec![], None)
}

/// Firings of `rule` for each of `keys`.
pub(super) fn firings(rule: &str, keys: &[&str]) -> Vec<Firing> {
    keys.iter().map(|k| firing(rule, k)).collect()
}

/// One message as it reached the channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Received {
    /// Virtual time since the recorder was made.
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

/// A channel integration that records every message it is given, at the virtual time it is given
/// it, and answers as told (or as the integration it wraps does).
pub(super) struct Recorder {
    start: Instant,
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
    /// Answers each attempt with `answer(n)`; its zero is now.
    pub(super) fn answering(
        answer: impl Fn(usize) -> Outcome + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Recorder {
            start: Instant::now(),
            wrapped: None,
            answer: Some(Box::new(answer)),
            received: Mutex::new(Vec::new()),
        })
    }

    /// Hands every message on to `wrapped` (the channel's own integration) and answers as it does.
    pub(super) fn wrapping(wrapped: Arc<dyn Integration>) -> Arc<Self> {
        Arc::new(Recorder {
            start: Instant::now(),
            wrapped: Some(wrapped),
            answer: None,
            received: Mutex::new(Vec::new()),
        })
    }

    /// The virtual instant `after` the recorder's zero.
    pub(super) fn at(&self, after: Duration) -> Instant {
        self.start + after
    }

    /// Lets virtual time run to `after` the recorder's zero (every task due before it has run),
    /// then says what has reached the channel so far.
    pub(super) async fn until(&self, after: Duration) -> Vec<Received> {
        tokio::time::sleep_until(self.at(after)).await;
        self.received()
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
            received.push(Received {
                at: self.start.elapsed(),
                rule: msg.rule.clone(),
                keys: msg
                    .items
                    .iter()
                    .map(|i| i.event["key"].as_str().unwrap_or_default().to_string())
                    .collect(),
                digest: msg.digest,
            });
            // A loop that attempts again without waiting would hold virtual time still and hang
            // the test: fail it instead.
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
/// with `answers(n)` (a whole HTTP/1.1 response, sent with `Connection: close`, so no pooled
/// connection keeps an idle timer) and records the virtual time each request arrived, from its
/// zero (now).
///
/// Paused time moves on whenever the runtime waits with nothing ready, also while a request is
/// in flight. On loopback the other end's bytes are ready by the time the runtime looks, so no
/// virtual time passes during an exchange; a test gives its channel a long `timeout`, so that if
/// one ever did wait, the request would time out and the test fail instead of passing by chance.
pub(super) struct Receiver {
    pub(super) url: String,
    start: Instant,
    times: Arc<Mutex<Vec<Duration>>>,
}

impl Receiver {
    pub(super) async fn start(
        answers: impl Fn(usize) -> String + Send + Sync + 'static,
    ) -> Receiver {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let start = Instant::now();
        let times: Arc<Mutex<Vec<Duration>>> = Arc::default();
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
                    .push(start.elapsed());
                let _ = sock.write_all(answers(n).as_bytes()).await;
                let _ = sock.shutdown().await;
                n += 1;
            }
        });
        Receiver { url, start, times }
    }

    /// Lets virtual time run to `after` the receiver's zero, then says when requests arrived.
    pub(super) async fn until(&self, after: Duration) -> Vec<Duration> {
        tokio::time::sleep_until(self.start + after).await;
        self.times.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A local HTTP target that answers every request `200 OK` after `delay` of virtual time, any
/// number at once (a task per connection), and counts the requests it holds at once: what a
/// storm looks like from the receiving end.
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

    /// Lets virtual time run until it has answered `n` requests (at most `within`); how many it
    /// answered.
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
