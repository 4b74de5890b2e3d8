//! The keyevent subscriber of one Redis node: `expired`, `evicted` and `del` as they happen.
//!
//! It runs on a dedicated connection (a subscribed connection counts as "pubsub" for Redis's
//! output-buffer limit, so command replies must not share it), pings it every second so a dead
//! connection is noticed within seconds even when no event flows, and reconnects with backoff
//! (500 ms doubling to 30 s, reset only after a minute of health, as Vector's Redis source does).
//! Pub/sub is at-most-once: every `Down` tells downstream that events may have been lost.
//!
//! Before each subscription, and every [`ROLE_EVERY`] while subscribed, it asks the node's
//! `ROLE` on a command connection of its own: a replica (say, an old master after a failover)
//! is never watched as if it were the master, and is reported as [`Signal::NotMaster`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::event::{EventKind, KeyEvent};
use crate::keyspace::clock::now_ms;
use crate::keyspace::role;
use crate::metrics::Metrics;
use crate::source::ledger::Note;
use crate::source::places::{self, Places};
use crate::source::{Signal, flushes};

/// The keyevent channels for `kinds` in `dbs` (`__keyevent@0__:expired`, …), plus, when
/// `ledger` is on, those that change deadlines and keywatch's marker channel.
pub fn channels(dbs: &[u32], kinds: &[EventKind], ledger: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    for db in dbs {
        let mut names: Vec<&str> = kinds.iter().filter_map(|k| k.redis_event()).collect();
        if kinds.contains(&EventKind::Hexpired) {
            names.extend(crate::source::fields::CHANNELS);
        }
        if ledger.is_some() {
            names.extend([
                "expire",
                "persist",
                "rename_from",
                "rename_to",
                "move_from",
                "move_to",
                "del",
                "evicted",
            ]);
        }
        let mut seen = Vec::new();
        for ev in names {
            if !seen.contains(&ev) {
                seen.push(ev);
                out.push(format!("__keyevent@{db}__:{ev}"));
            }
        }
    }
    if let Some(marker) = ledger {
        out.push(marker.to_string());
    }
    out
}

/// What a keyevent channel feeds the engine: events of rules, deadline notes, hash changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    Event(EventKind),
    Deadline(Note),
    Hash(crate::source::Change),
}

/// `__keyevent@3__:expired` → (3, Event(Expired)); `__keyevent@0__:expire` → (0, Deadline(Expire)).
pub fn parse_channel(channel: &str) -> Option<(u32, Feed)> {
    let rest = channel.strip_prefix("__keyevent@")?;
    let (db, ev) = rest.split_once("__:")?;
    let what = match ev {
        "expired" => Feed::Event(EventKind::Expired),
        "evicted" => Feed::Event(EventKind::Evicted),
        "del" => Feed::Event(EventKind::Deleted),
        "expire" => Feed::Deadline(Note::Expire),
        // A key `MOVE`d in brings its TTL, as a renamed one does; one moved out takes its
        // deadline along (docs/how-it-works.md#the-deadline-ledger).
        "rename_to" | "move_to" => Feed::Deadline(Note::RenameTo),
        "persist" | "rename_from" | "move_from" => Feed::Deadline(Note::Forget),
        other => Feed::Hash(crate::source::fields::change_of(other)?),
    };
    // As Redis writes it (`%d`): `u32::from_str` would also take `+0` and `007`.
    let canonical = db == "0" || (!db.starts_with('0') && !db.is_empty());
    if !canonical || !db.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((db.parse().ok()?, what))
}

/// What one pub/sub message means, or `None` for a keyevent keywatch does not act on.
///
/// Every message on a channel that is not a keyevent channel is a marker: the subscriber is
/// subscribed to nothing else.
pub fn decode(msg: &redis::Msg, node: &str, now: DateTime<Utc>) -> Option<Signal> {
    decode_owned(
        msg.get_channel_name(),
        payload_of(msg.get_channel_name(), msg.get_payload_bytes().to_vec()),
        node,
        now,
    )
}

/// A message's payload as `Bytes`. A long key that an event or a hash's change names shares
/// the copy already in memory ([`crate::long_key::shared`]); a deadline's note and a marker are
/// moved as they are, since their signals hold a `Vec` that a shared copy would be copied into.
fn payload_of(channel: &str, payload: Vec<u8>) -> bytes::Bytes {
    let shares = crate::long_key::is_long(&payload)
        && matches!(
            parse_channel(channel),
            Some((_, Feed::Event(_) | Feed::Hash(_)))
        );
    match shares {
        true => crate::long_key::shared(payload),
        false => payload.into(),
    }
}

/// [`decode`] of a message's channel and payload, the payload taken as it was read: a RESP3
/// push hands it over, where redis-rs's RESP2 message can only lend it, and a key of megabytes
/// is then not copied; a long one that an event or a hash names comes shared with the copy
/// already in memory ([`payload_of`], docs/reliability.md#bounded-whatever-the-key).
pub fn decode_owned(
    channel: &str,
    key: bytes::Bytes,
    node: &str,
    now: DateTime<Utc>,
) -> Option<Signal> {
    Some(match parse_channel(channel) {
        Some((db, Feed::Event(kind))) => Signal::Event(KeyEvent {
            kind,
            db,
            key,
            field: None,
            observed_at: now,
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: node.to_string(),
            place: None,
        }),
        Some((db, Feed::Deadline(note))) => Signal::Deadline {
            db,
            key: key.into(),
            note,
        },
        Some((db, Feed::Hash(change))) => Signal::Hash { db, key, change },
        None if !channel.starts_with("__keyevent@") => Signal::Marker {
            node: node.to_string(),
            payload: key.into(),
        },
        None => return None,
    })
}

/// How a subscriber waits between sessions: from half a second, doubling to 30 s.
pub const RECONNECT: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));

/// Connected this long without trouble, the next failure waits as the first did.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);

/// How much a subscriber holds when the engine is slower than Redis publishes (a storm of
/// expiries at one instant), counted as [`weight`]s. redis-rs reads a subscribed socket into an
/// unbounded buffer, so without this limit a storm's backlog would sit in keywatch's memory
/// however big it grew (306 MiB for a million events). Past it the subscriber lets go of the
/// connection, as Redis itself does at its pub/sub output-buffer limit: what it holds is still
/// handed on, and what is published meanwhile is recovered from the deadline ledger after the
/// resubscription (or lost, for the events no ledger knows, as after any disconnect).
pub const BACKLOG_LIMIT: usize = 16 << 20;

/// The engine channel's capacity: a storm's first signals wait there, then in the subscribers.
pub const ENGINE_CHANNEL: usize = 64 * 1024;

/// [`ENGINE_CHANNEL`] and [`BACKLOG_LIMIT`], unless a drill changes them ([`crate::drill`]).
pub fn backlog() -> (usize, usize) {
    crate::drill::backlog((ENGINE_CHANNEL, BACKLOG_LIMIT))
}

/// What one held signal counts against [`BACKLOG_LIMIT`]: its key plus the allocations and
/// bookkeeping around it (measured at about 200 bytes with the node's name).
fn weight(signal: &Signal) -> usize {
    const AROUND: usize = 192;
    AROUND
        + match signal {
            Signal::Event(e) => e.key.len() + e.source.len(),
            Signal::Deadline { key, .. } => key.len(),
            Signal::Marker { payload, .. } => payload.len(),
            _ => 0,
        }
}

const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a subscribed node's role is asked again: a master demoted without dropping its
/// clients (`REPLICAOF` by hand) would otherwise be watched as one until the next reconnect.
const ROLE_EVERY: Duration = Duration::from_secs(5);

/// Why a session ended, when shutdown did not end it.
enum Ended {
    /// The connection failed or was closed: events published until the next `Up` are lost.
    Lost(String),
    /// The node is not a master (the text says what it is and what to do).
    NotMaster(String),
}

/// A subscriber in a task of its own, as the followers of a topology ([`crate::source::cluster`],
/// [`crate::source::sentinel`]) keep one per node they watch.
pub struct Watcher {
    pub node: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    /// Starts [`subscribe`] on `node` with the default backoff, stopped with `shutdown` or
    /// [`Watcher::end`].
    pub fn spawn(
        client: redis::Client,
        node: &str,
        channels: watch::Receiver<Vec<String>>,
        tx: mpsc::Sender<Signal>,
        metrics: Arc<Metrics>,
        shutdown: &CancellationToken,
    ) -> Watcher {
        let stop = shutdown.child_token();
        let task = tokio::spawn(subscribe(
            client,
            node.to_string(),
            channels,
            tx,
            RECONNECT,
            metrics,
            stop.clone(),
        ));
        Watcher {
            node: node.to_string(),
            stop,
            task,
        }
    }

    /// Stops the subscriber and waits for it.
    pub async fn end(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Subscribes to `channels` on `client`'s node until `shutdown`, sending what happens to `tx`.
/// A change of `channels` (a reload) is followed on the same connection: new channels are
/// subscribed before old ones are left, so nothing published meanwhile is missed.
pub async fn subscribe(
    client: redis::Client,
    node: String,
    mut channels: watch::Receiver<Vec<String>>,
    tx: mpsc::Sender<Signal>,
    backoff: Backoff,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let mut waits = backoff.waits();
    // A refusal repeats at every attempt; it is logged as an error when its text changes.
    let mut refused_for = String::new();
    // The same for client-side tracking's, logged as a warning.
    let mut tracking_refused = String::new();
    loop {
        let started = Instant::now();
        let ended = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            r = session(&client, &node, &mut channels, &tx, &mut tracking_refused, &shutdown) => r,
        };
        let signal = match ended {
            None => return,
            Some(Ended::Lost(reason)) => {
                refused_for.clear();
                crate::internal_events::SubscriptionLost {
                    node: &node,
                    reason: &reason,
                }
                .emit(&metrics);
                Signal::Down {
                    node: node.clone(),
                    reason,
                }
            }
            Some(Ended::NotMaster(reason)) => {
                if reason != refused_for {
                    crate::internal_events::NodeRefused {
                        node: &node,
                        reason: &reason,
                    }
                    .emit();
                    refused_for = reason.clone();
                }
                Signal::NotMaster {
                    node: node.clone(),
                    reason,
                }
            }
        };
        // Cancellable: a follower ending this subscriber (a failover) must not wait for an
        // engine that may itself wait for the promotion (`Keyspace::promoting`).
        let sent = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            sent = tx.send(signal) => sent,
        };
        if sent.is_err() {
            return;
        }
        if started.elapsed() >= HEALTHY_AFTER {
            waits.reset();
        }
        // Jittered: several instances do not reconnect in lockstep after a restart.
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(waits.next()) => {}
        }
    }
}

/// Asks the node's role on `conn`: `Err` when it cannot be asked or the node is no master.
async fn check_role(conn: &mut redis::aio::MultiplexedConnection, node: &str) -> Result<(), Ended> {
    match tokio::time::timeout(PING_TIMEOUT, role::read(conn)).await {
        Ok(Ok(r)) => match role::refusal(node, &r) {
            None => Ok(()),
            Some(why) => Err(Ended::NotMaster(why)),
        },
        Ok(Err(e)) => Err(Ended::Lost(format!("ROLE failed: {e}"))),
        Err(_) => Err(Ended::Lost(format!(
            "no answer to ROLE within {}s",
            PING_TIMEOUT.as_secs()
        ))),
    }
}

/// One connection's life. `None` when shutdown asked to stop, else why it ended.
async fn session(
    client: &redis::Client,
    node: &str,
    channels: &mut watch::Receiver<Vec<String>>,
    tx: &mpsc::Sender<Signal>,
    tracking_refused: &mut String,
    shutdown: &CancellationToken,
) -> Option<Ended> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(PING_TIMEOUT));
    // Also hears of flushes, where the node lets it track ([`flushes`]).
    let flushes::Commands {
        conn: mut commands,
        mut pushes,
        refused,
    } = match flushes::connect(client, &config).await {
        Ok(c) => c,
        Err(e) => return Some(Ended::Lost(format!("cannot connect: {e}"))),
    };
    match refused {
        Some(reason) if *tracking_refused != reason => {
            crate::internal_events::FlushTrackingRefused {
                node,
                reason: &reason,
            }
            .emit();
            *tracking_refused = reason;
        }
        Some(_) => {}
        None => tracking_refused.clear(),
    }
    if let Err(ended) = check_role(&mut commands, node).await {
        return Some(ended);
    }
    let mut sub = match Subscription::open(client, &config).await {
        Ok(sub) => sub,
        Err(e) => return Some(Ended::Lost(e)),
    };
    let mut subscribed: Vec<String> = Vec::new();
    let wanted = channels.borrow_and_update().clone();
    if let Err(e) = follow(&mut sub, &mut subscribed, wanted).await {
        return Some(Ended::Lost(e));
    }
    // The role again, now that the subscription is in place: a failover between the first
    // check and the SUBSCRIBE would otherwise go unnoticed until the next periodic check.
    if let Err(ended) = check_role(&mut commands, node).await {
        return Some(ended);
    }
    // Up once a mark is heard, so that every event from then on has its place (unless marks
    // cannot be published: then events are claimed by name, as without places).
    let mut places = Places::default();
    let marker = marker_channel(&subscribed);
    let mut up = false;
    if !publish_mark(&mut commands, marker.as_deref(), node).await
        && !announce(node, &subscribed, tx, &mut up).await
    {
        return None;
    }
    let marked_within = tokio::time::sleep(PING_TIMEOUT);
    tokio::pin!(marked_within);
    let mut following = true;
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut role_check = tokio::time::interval_at(Instant::now() + ROLE_EVERY, ROLE_EVERY);
    role_check.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The calls of the commands that empty databases, and when they were read: a change says
    // one ran since (a swap; a flush where tracking is refused).
    let mut stats =
        tokio::time::interval_at(Instant::now() + flushes::STATS_EVERY, flushes::STATS_EVERY);
    stats.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut calls: Option<(flushes::Calls, i64)> = None;
    if keeps_ledger(&subscribed) {
        calls = read_calls(&mut commands, node).await;
    }
    // Signals read while the engine's channel is full, oldest first: the socket keeps being
    // read (redis-rs would buffer it anyway), but into a buffer that has a limit.
    let mut held = Held::default();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            permit = tx.reserve(), if !held.is_empty() => {
                let Ok(permit) = permit else { return None };
                if let Some(signal) = held.pop() {
                    permit.send(signal);
                }
            }
            msg = sub.next() => {
                let Some((channel, payload)) = msg else {
                    return held.hand_on(tx).await.then(|| Ended::Lost("connection closed by the server".into()));
                };
                let Some(mut signal) = decode_owned(&channel, payload, node, crate::keyspace::clock::now()) else { continue };
                match &mut signal {
                    Signal::Marker { payload, .. } => {
                        // The first mark after subscribing: from here on every event has its place.
                        let first = places.heard(payload) && !up;
                        if first && !announce(node, &subscribed, tx, &mut up).await {
                            return None;
                        }
                    }
                    Signal::Event(e) => {
                        places.place(&channel, e);
                        if places.ask() {
                            publish_mark(&mut commands, marker.as_deref(), node).await;
                        }
                    }
                    _ => {}
                }
                let signal = if held.is_empty() {
                    match tx.try_send(signal) {
                        Ok(()) => continue,
                        Err(mpsc::error::TrySendError::Full(s)) => s,
                        Err(mpsc::error::TrySendError::Closed(_)) => return None,
                    }
                } else {
                    signal
                };
                held.push(signal);
                if held.weight > backlog().1 {
                    crate::internal_events::FellBehind {
                        node,
                        waiting: held.signals.len(),
                        mib: held.weight >> 20,
                    }
                    .emit();
                    let reason = format!(
                        "keywatch fell behind Redis's events ({} waiting, {} MiB): let go of the subscription as Redis does at its output-buffer limit; the deadline ledger recovers expiries published meanwhile",
                        held.signals.len(),
                        held.weight >> 20
                    );
                    drop(sub);
                    return held.hand_on(tx).await.then_some(Ended::Lost(reason));
                }
            }
            changed = channels.changed(), if following => {
                if changed.is_err() {
                    // Nobody reloads any more (tests, examples): keep what we have.
                    following = false;
                    continue;
                }
                let wanted = channels.borrow_and_update().clone();
                let before = subscribed.clone();
                if let Err(e) = follow(&mut sub, &mut subscribed, wanted).await {
                    return Some(Ended::Lost(e));
                }
                places.subscribed(subscribed.iter().filter(|c| !before.contains(c)).cloned());
                if places.ask() {
                    publish_mark(&mut commands, marker.as_deref(), node).await;
                }
                crate::internal_events::SubscriptionsChanged {
                    node,
                    channels: subscribed.len(),
                }
                .emit();
            }
            push = next_push(&mut pushes) => {
                let signal = match push.as_ref().map(flushes::push) {
                    Some(flushes::Push::Flush) => Signal::Emptied {
                        node: node.to_string(),
                        swapped: false,
                        since_ms: now_ms() - flushes::HEARD_WITHIN_MS,
                    },
                    Some(flushes::Push::Other) => continue,
                    None | Some(flushes::Push::Closed) => {
                        return held.hand_on(tx).await.then(|| Ended::Lost("the command connection closed".into()));
                    }
                };
                if !offer(&mut held, tx, node, signal) {
                    return None;
                }
            }
            _ = stats.tick(), if keeps_ledger(&subscribed) => {
                let Some((now, at)) = read_calls(&mut commands, node).await else { continue };
                let before = calls.replace((now, at));
                let Some((before, read_at)) = before else { continue };
                let swapped = now.swaps != before.swaps;
                // With tracking on, the push told of the flush already.
                let flushed = pushes.is_none() && now.flushes != before.flushes;
                if swapped || flushed {
                    let signal = Signal::Emptied {
                        node: node.to_string(),
                        swapped,
                        since_ms: read_at - flushes::HEARD_WITHIN_MS,
                    };
                    if !offer(&mut held, tx, node, signal) {
                        return None;
                    }
                }
            }
            _ = &mut marked_within, if !up => {
                return Some(Ended::Lost(format!(
                    "keywatch's own mark, published after subscribing, did not come back within {}s",
                    PING_TIMEOUT.as_secs()
                )));
            }
            _ = role_check.tick() => {
                if let Err(ended) = check_role(&mut commands, node).await {
                    return Some(ended);
                }
            }
            _ = ping.tick() => {
                match tokio::time::timeout(PING_TIMEOUT, sub.ping()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Some(Ended::Lost(format!("PING failed: {e}"))),
                    Err(_) => return Some(Ended::Lost(format!("no answer to PING within {}s", PING_TIMEOUT.as_secs()))),
                }
            }
        }
    }
}

/// keywatch's own channel among the subscribed ones (marks, ledger markers, notices).
fn marker_channel(subscribed: &[String]) -> Option<String> {
    subscribed
        .iter()
        .find(|c| !c.starts_with("__keyevent@"))
        .cloned()
}

/// Publishes a mark on the marker channel ([`places`]); `false` when none went out (no such
/// channel, or the node refused: the places ask again later).
async fn publish_mark(
    commands: &mut redis::aio::MultiplexedConnection,
    marker: Option<&str>,
    node: &str,
) -> bool {
    let Some(marker) = marker else {
        return false;
    };
    let published = tokio::time::timeout(
        PING_TIMEOUT,
        redis::cmd("PUBLISH")
            .arg(marker)
            .arg(places::mark_payload(node))
            .query_async::<i64>(commands),
    )
    .await;
    match published {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::warn!(%node, error = %e, "Cannot publish a mark: events without a deadline are told apart for 5 s only (docs/how-it-works.md#events-without-a-deadline).");
            false
        }
        Err(_) => false,
    }
}

/// Tells that the subscription is in place: logged, and `Up` to the engine. `false` when nobody
/// listens any more.
async fn announce(
    node: &str,
    subscribed: &[String],
    tx: &mpsc::Sender<Signal>,
    up: &mut bool,
) -> bool {
    *up = true;
    crate::internal_events::Subscribed {
        node,
        channels: subscribed.len(),
    }
    .emit();
    tx.send(Signal::Up {
        node: node.to_string(),
    })
    .await
    .is_ok()
}

/// Whether the subscription includes what only the ledgers listen to (`expire`, `hexpire`): the
/// key or the field ledger is kept, and flushes and swaps matter.
fn keeps_ledger(subscribed: &[String]) -> bool {
    subscribed
        .iter()
        .any(|c| c.ends_with("__:expire") || c.ends_with("__:hexpire"))
}

/// The next push of client-side tracking; never, where tracking is off. `None`: the connection
/// ended.
async fn next_push(
    pushes: &mut Option<mpsc::UnboundedReceiver<redis::PushInfo>>,
) -> Option<redis::PushInfo> {
    match pushes {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The calls of flushes and swaps, with when they were read (Redis's clock); `None` when they
/// cannot be read (the role check notices a dead connection).
async fn read_calls(
    commands: &mut redis::aio::MultiplexedConnection,
    node: &str,
) -> Option<(flushes::Calls, i64)> {
    match tokio::time::timeout(PING_TIMEOUT, flushes::Calls::read(commands)).await {
        Ok(Ok(calls)) => Some((calls, now_ms())),
        Ok(Err(e)) => {
            tracing::debug!(%node, error = %e, "Cannot read INFO commandstats: a SWAPDB goes unnoticed until the next fill.");
            None
        }
        Err(_) => None,
    }
}

/// Hands `signal` (a flush or a swap) on, or holds it behind what is held already; `false` when
/// nobody listens any more.
fn offer(held: &mut Held, tx: &mpsc::Sender<Signal>, node: &str, signal: Signal) -> bool {
    if let Signal::Emptied { swapped, .. } = &signal {
        crate::internal_events::KeysLeftUnannounced {
            node,
            how: if *swapped { "swap" } else { "flush" },
        }
        .emit();
    }
    if held.is_empty() {
        match tx.try_send(signal) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Full(s)) => held.push(s),
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
        }
    } else {
        held.push(signal);
    }
    true
}

/// The signals a subscriber read while the engine could take no more, with their [`weight`].
#[derive(Default)]
struct Held {
    signals: VecDeque<Signal>,
    weight: usize,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.signals.is_empty()
    }

    fn push(&mut self, signal: Signal) {
        self.weight += weight(&signal);
        self.signals.push_back(signal);
    }

    /// The oldest, if any.
    fn pop(&mut self) -> Option<Signal> {
        let signal = self.signals.pop_front()?;
        self.weight -= weight(&signal);
        Some(signal)
    }

    /// Hands every held signal on before the session ends: they were published and read, so
    /// the connection's end loses none of them. `false` when nobody listens any more.
    async fn hand_on(mut self, tx: &mpsc::Sender<Signal>) -> bool {
        while let Some(signal) = self.signals.pop_front() {
            if tx.send(signal).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// A push as the subscribed connection's task hands it on, as soon as redis-rs has read it.
/// redis-rs reads whatever waits on the socket at once, before the session looks at the first
/// message: a message naming a long key is made to share the copy already in memory there and
/// then ([`crate::long_key::shared`]), or twelve `hexpired` of one 16 MiB hash waiting together
/// were twelve copies (docs/reliability.md#bounded-whatever-the-key).
enum Push {
    Message {
        channel: String,
        payload: bytes::Bytes,
    },
    Disconnection,
    /// Confirmations of (un)subscriptions, which redis-rs awaits itself; a malformed message.
    Other,
}

impl Push {
    fn of(push: redis::PushInfo) -> Push {
        match push.kind {
            redis::PushKind::Message => {
                let mut data = push.data.into_iter();
                match (data.next(), data.next()) {
                    (
                        Some(redis::Value::BulkString(channel)),
                        Some(redis::Value::BulkString(payload)),
                    ) => {
                        let channel = String::from_utf8_lossy(&channel).into_owned();
                        let payload = payload_of(&channel, payload);
                        Push::Message { channel, payload }
                    }
                    _ => Push::Other,
                }
            }
            redis::PushKind::Disconnection => Push::Disconnection,
            _ => Push::Other,
        }
    }
}

/// The subscribed connection of a session. RESP3 where the node speaks it: a message comes as a
/// push whose payload redis-rs hands over as read, where the RESP2 connection's message only
/// lends it, to be copied (a 16 MiB key was held twice more at once,
/// docs/reliability.md#bounded-whatever-the-key). A connection of its own either way: a
/// subscribed one is of Redis's "pubsub" class, whose output-buffer limit command replies must
/// not count against.
enum Subscription {
    Resp3 {
        conn: redis::aio::MultiplexedConnection,
        pushes: mpsc::UnboundedReceiver<Push>,
    },
    Resp2 {
        sink: redis::aio::PubSubSink,
        stream: redis::aio::PubSubStream,
    },
}

impl Subscription {
    /// Connects to `client`'s node: RESP3, or RESP2 where `HELLO 3` is refused (a server
    /// before 6.0). The error is the reason a session ends.
    async fn open(
        client: &redis::Client,
        config: &redis::AsyncConnectionConfig,
    ) -> Result<Subscription, String> {
        let within = |e: String| format!("cannot connect: {e}");
        let late = || format!("cannot connect within {}s", CONNECT_TIMEOUT.as_secs());
        let (tx, pushes) = mpsc::unbounded_channel();
        let sender = move |push: redis::PushInfo| tx.send(Push::of(push));
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let resp3 = redis::Client::open(info.set_redis_settings(settings))
            .map_err(|e| within(e.to_string()))?;
        let opened = tokio::time::timeout(
            CONNECT_TIMEOUT,
            resp3.get_multiplexed_async_connection_with_config(
                &config.clone().set_push_sender(sender),
            ),
        )
        .await;
        match opened {
            Ok(Ok(conn)) => return Ok(Subscription::Resp3 { conn, pushes }),
            // The node cannot be reached: RESP2 would not fare better.
            Ok(Err(e)) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                return Err(within(e.to_string()));
            }
            Err(_) => return Err(late()),
            // `HELLO 3` refused: as before RESP3.
            Ok(Err(_)) => {}
        }
        match tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub()).await {
            Ok(Ok(p)) => {
                let (sink, stream) = p.split();
                Ok(Subscription::Resp2 { sink, stream })
            }
            Ok(Err(e)) => Err(within(e.to_string())),
            Err(_) => Err(late()),
        }
    }

    /// The next message's channel and payload; `None` once the connection is closed.
    async fn next(&mut self) -> Option<(String, bytes::Bytes)> {
        match self {
            Subscription::Resp2 { stream, .. } => {
                let msg = stream.next().await?;
                let channel = msg.get_channel_name().to_string();
                let payload = payload_of(&channel, msg.get_payload_bytes().to_vec());
                Some((channel, payload))
            }
            Subscription::Resp3 { pushes, .. } => loop {
                match pushes.recv().await? {
                    Push::Message { channel, payload } => return Some((channel, payload)),
                    Push::Disconnection => return None,
                    Push::Other => continue,
                }
            },
        }
    }

    async fn subscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Subscription::Resp3 { conn, .. } => conn.subscribe(channel).await,
            Subscription::Resp2 { sink, .. } => sink.subscribe(channel).await,
        }
    }

    async fn unsubscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Subscription::Resp3 { conn, .. } => conn.unsubscribe(channel).await,
            Subscription::Resp2 { sink, .. } => sink.unsubscribe(channel).await,
        }
    }

    async fn ping(&mut self) -> redis::RedisResult<()> {
        match self {
            Subscription::Resp3 { conn, .. } => redis::cmd("PING").query_async::<()>(conn).await,
            Subscription::Resp2 { sink, .. } => sink.ping::<()>().await,
        }
    }
}

/// Brings the subscriptions of one connection from `subscribed` to `wanted`: subscribes first,
/// then leaves, so a channel kept by both sets is never dropped in between.
async fn follow(
    sink: &mut Subscription,
    subscribed: &mut Vec<String>,
    wanted: Vec<String>,
) -> Result<(), String> {
    for ch in wanted.iter().filter(|c| !subscribed.contains(c)) {
        match tokio::time::timeout(CONNECT_TIMEOUT, sink.subscribe(ch)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("SUBSCRIBE {ch} failed: {e}")),
            Err(_) => return Err(format!("SUBSCRIBE {ch} timed out")),
        }
    }
    for ch in subscribed.iter().filter(|c| !wanted.contains(c)) {
        match tokio::time::timeout(CONNECT_TIMEOUT, sink.unsubscribe(ch)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("UNSUBSCRIBE {ch} failed: {e}")),
            Err(_) => return Err(format!("UNSUBSCRIBE {ch} timed out")),
        }
    }
    *subscribed = wanted;
    Ok(())
}

crate::keyspace::commands::declare! {
    /// The commands the keyevent subscriber sends ([`crate::keyspace::commands`]). A reload that
    /// drops a rule leaves its channels: `UNSUBSCRIBE` is sent in an ordinary run too.
    [
        Use::new(Server::Watched, "subscribe", "keyevent subscription")
            .channel(PubSub::Keyevent)
            .args("{channel}"),
        Use::new(Server::Watched, "subscribe", "keywatch's own channel: ledger markers, notices")
            .channel(PubSub::Marker)
            .args("{channel}"),
        // Redis checks no channel permission on leaving one.
        Use::new(
            Server::Watched,
            "unsubscribe",
            "reload: leaves channels the rules no longer need",
        )
        .access(Access::Write)
        .args("__keyevent@0__:keywatch-doctor"),
        Use::new(Server::Watched, "ping", "subscriber: health checks"),
        Use::new(Server::Watched, "publish", "subscriber: marks, which place events without a deadline")
            .access(Access::Write)
            .channel(PubSub::Marker)
            .args("{channel} keywatch-doctor"),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_round_trip() {
        let ch = channels(
            &[0, 3],
            &[EventKind::Expired, EventKind::Deleted, EventKind::Expiring],
            None,
        );
        assert_eq!(
            ch,
            [
                "__keyevent@0__:expired",
                "__keyevent@0__:del",
                "__keyevent@3__:expired",
                "__keyevent@3__:del"
            ]
        );
        let ch = channels(&[0], &[EventKind::Expired], Some("keywatch:poke"));
        assert_eq!(
            ch,
            [
                "__keyevent@0__:expired",
                "__keyevent@0__:expire",
                "__keyevent@0__:persist",
                "__keyevent@0__:rename_from",
                "__keyevent@0__:rename_to",
                "__keyevent@0__:move_from",
                "__keyevent@0__:move_to",
                "__keyevent@0__:del",
                "__keyevent@0__:evicted",
                "keywatch:poke"
            ]
        );
        assert_eq!(
            parse_channel("__keyevent@3__:del"),
            Some((3, Feed::Event(EventKind::Deleted)))
        );
        assert_eq!(
            parse_channel("__keyevent@0__:evicted"),
            Some((0, Feed::Event(EventKind::Evicted)))
        );
        assert_eq!(
            parse_channel("__keyevent@0__:expire"),
            Some((0, Feed::Deadline(Note::Expire)))
        );
        assert_eq!(
            parse_channel("__keyevent@0__:rename_from"),
            Some((0, Feed::Deadline(Note::Forget)))
        );
        assert_eq!(
            parse_channel("__keyevent@2__:move_from"),
            Some((2, Feed::Deadline(Note::Forget)))
        );
        assert_eq!(
            parse_channel("__keyevent@1__:move_to"),
            Some((1, Feed::Deadline(Note::RenameTo)))
        );
        assert_eq!(parse_channel("__keyevent@0__:set"), None);
        // Found by `fuzz/fuzz_targets/event_decode.rs`: databases not written as Redis writes them.
        for db in ["+0", "00", "07", "", " 1", "4294967296"] {
            assert_eq!(
                parse_channel(&format!("__keyevent@{db}__:expired")),
                None,
                "{db:?}"
            );
        }
        assert_eq!(
            parse_channel("__keyevent@4294967295__:expired"),
            Some((u32::MAX, Feed::Event(EventKind::Expired)))
        );
        assert_eq!(parse_channel("other"), None);
    }
}
