//! Following a Sentinel-managed master: one keyevent subscriber on whichever node the sentinels
//! name, moved to the new master after a failover.
//!
//! A failover is followed from its start: when the leading sentinel picks the replica to
//! promote (`+selected-slave`), keywatch stops acting on the old master at once, points its
//! state connection at the replica, and subscribes there as soon as the replica answers `ROLE`
//! as master (or `+switch-master` names it). Stopping early matters: the old master goes on
//! taking writes until the sentinels reconfigure it, and what keywatch wrote there after the
//! promotion (a claim, a deadline taken out of the ledger) never reaches the new master; an
//! expiry acted on there would be recovered a second time on the new one. Meanwhile keywatch's
//! own commands wait ([`Keyspace::promoting`]): the replica refuses writes until it is
//! promoted, and a refused one was lost (a sent job's acknowledgement, so the job ran again when
//! its lease ended).
//!
//! Besides, the sentinels are asked again ([`Keyspace::locate`], checked with `ROLE`) on a
//! `+switch-master` heard from any sentinel (each is subscribed to, so one that is down does
//! not make keywatch deaf), when a subscriber lost its node or found it no master (the engine
//! calls [`Keyspace::suspect`]), and every [`REASK_EVERY`] in case all of that was missed. The
//! move itself is the cluster's: the new node is expected (readiness waits for it), the old
//! subscriber stops and is reported [`Signal::Gone`], and the new one's `Up` makes the engine
//! check the flags there and refill the ledger, whose marker recovers the expiries missed in
//! between.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::internal_events::{SentinelSwitch, SwitchStep};
use crate::keyspace::Keyspace;
use crate::keyspace::sentinel::{Sentinels, selected, switched_to};
use crate::metrics::Metrics;
use crate::source::Signal;
use crate::source::notifications::Watcher;

/// The sentinels' channels keywatch listens to: the start of a failover, and its end.
pub const CHANNELS: [&str; 2] = ["+selected-slave", "+switch-master"];

/// How often the sentinels are asked when nothing happened.
pub const REASK_EVERY: Duration = Duration::from_secs(5);
/// After a subscriber lost its node, the sentinels need a moment to agree on a new master.
const AFTER_SUSPECT: Duration = Duration::from_millis(250);
/// How often a replica being promoted is asked whether it is master yet.
const PROMOTION_POLL: Duration = Duration::from_millis(100);
/// How long a promotion may take before the sentinels are asked again (they give up after
/// their `failover-timeout`, 3 min by default, but usually promote within seconds).
const PROMOTION_WAIT: Duration = Duration::from_secs(10);
/// Pause before subscribing again to a sentinel that could not be reached.
const SENTINEL_RETRY: Duration = Duration::from_secs(1);
const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(3);

/// Subscribes to `channels` on the master until `shutdown`, following it through failovers;
/// what the subscriber hears goes to `tx`, plus [`Signal::Gone`] for a node left behind.
/// `watching` is told of each new master before its subscriber starts, so that readiness
/// waits for it. The master was located at start-up (`command::run::run`).
pub async fn follow(
    keyspace: Keyspace,
    channels: watch::Receiver<Vec<String>>,
    tx: mpsc::Sender<Signal>,
    watching: impl Fn(&str),
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let Some(sentinels) = keyspace.sentinels().cloned() else {
        return;
    };
    let (heard_tx, mut heard) = mpsc::channel::<Heard>(16);
    for addr in &sentinels.settings.nodes {
        tokio::spawn(listen(
            sentinels.clone(),
            addr.clone(),
            heard_tx.clone(),
            shutdown.clone(),
        ));
    }
    drop(heard_tx);
    let start = |node: &str| -> Option<Watcher> {
        match keyspace.client(0) {
            Ok(c) => Some(Watcher::spawn(
                c,
                node,
                channels.clone(),
                tx.clone(),
                metrics.clone(),
                &shutdown,
            )),
            Err(e) => {
                tracing::error!(%node, error = %e, "Sentinel: cannot make a client for the master.");
                None
            }
        }
    };
    // Expected before it is subscribed, so that readiness waits for it.
    let expect = |node: &str| {
        watching(node);
        metrics.subscriber(node, false);
    };
    let first = keyspace.node();
    expect(&first);
    let mut current = start(&first);
    // Nodes left behind whose `Gone` is not told yet (see `Heard::Selected` below).
    let mut left: Vec<String> = Vec::new();
    // A failover under way: the replica being promoted, since when.
    let mut promoting: Option<(String, Instant)> = None;
    let mut tick = tokio::time::interval_at(Instant::now() + REASK_EVERY, REASK_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut poll = tokio::time::interval(PROMOTION_POLL);
    poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let event = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(h) = heard.recv() => Some(h),
            _ = poll.tick(), if promoting.is_some() => None,
            _ = keyspace.suspected(), if promoting.is_none() => {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(AFTER_SUSPECT) => {}
                }
                None
            }
            _ = tick.tick(), if promoting.is_none() => None,
        };
        if let Some(Heard::Selected(to)) = &event {
            if current.as_ref().is_some_and(|w| &w.node == to)
                || promoting.as_ref().is_some_and(|(p, _)| p == to)
            {
                continue;
            }
            // From now on whatever keywatch writes to the old master may never reach the new
            // one (replication is asynchronous, and the old master takes writes until the
            // sentinels reconfigure it): stop acting on its events now. What expires meanwhile
            // stays in the ledger, which the new master has, and is recovered there once.
            // keywatch's own commands (a job's acknowledgement, a take) wait for the promotion:
            // the replica would refuse them (`Keyspace::promoting`).
            let old = current.take();
            SentinelSwitch {
                master: sentinels.name(),
                step: SwitchStep::Selected,
                from: old.as_ref().map_or("", |w| w.node.as_str()),
                to,
            }
            .emit();
            keyspace.promoting(to).await;
            expect(to);
            promoting = Some((to.clone(), Instant::now()));
            // Its `Gone` is told once the commands go again: the engine may be waiting for
            // one of them, and would not take the signal meanwhile.
            if let Some(w) = old {
                metrics.subscriber(&w.node, false);
                left.push(w.node.clone());
                w.end().await;
            }
            continue;
        }
        if let Some((to, since)) = promoting.clone() {
            let announced = matches!(&event, Some(Heard::Switched(a)) if *a == to);
            if announced || sentinels.is_master(&to).await {
                tracing::info!(to = %to, took_ms = since.elapsed().as_millis() as u64, "Sentinel: the promotion took this long.");
                SentinelSwitch {
                    master: sentinels.name(),
                    step: SwitchStep::Promoted,
                    from: "",
                    to: &to,
                }
                .emit();
                promoting = None;
                keyspace.promoted();
                if !tell_gone(&mut left, &tx).await {
                    break;
                }
                current = start(&to);
                continue;
            }
            let elsewhere = matches!(&event, Some(Heard::Switched(a)) if *a != to);
            if !elsewhere && since.elapsed() < PROMOTION_WAIT {
                continue;
            }
            // Promoted elsewhere, aborted or taking too long: ask the sentinels. Held commands
            // wait for their answer, which moves them to the master they name. The replica is
            // no longer expected (readiness waited for it), unless they name it.
            SentinelSwitch {
                master: sentinels.name(),
                step: SwitchStep::NotPromoted,
                from: "",
                to: &to,
            }
            .emit();
            promoting = None;
            left.push(to);
        }
        let located = keyspace.locate().await;
        if located.is_err() {
            // Held commands go to the node named last rather than wait on sentinels that
            // may not answer.
            keyspace.promoted();
        }
        if !tell_gone(&mut left, &tx).await {
            break;
        }
        let found = match located {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "Sentinel: cannot locate the master; keeping the subscriber.");
                continue;
            }
        };
        if let Some(Heard::Switched(to)) = &event
            && *to != found.addr
        {
            tracing::info!(announced = %to, located = %found.addr, "Sentinel: a switch was announced; following the master the sentinels name now.");
        }
        if current.as_ref().is_some_and(|w| w.node == found.addr) {
            continue;
        }
        let old = current.take();
        tracing::info!(to = %found.addr, by = %found.by, confirmed = found.confirmed, "Sentinel: the master as the sentinels name it.");
        SentinelSwitch {
            master: sentinels.name(),
            step: SwitchStep::Moved,
            from: old.as_ref().map_or("", |w| w.node.as_str()),
            to: &found.addr,
        }
        .emit();
        expect(&found.addr);
        current = start(&found.addr);
        if let Some(w) = old
            && w.node != found.addr
            && !end(w, &tx).await
        {
            break;
        }
    }
    // Whatever waits for a promotion goes now (shutdown hands work back).
    keyspace.promoted();
    if let Some(w) = current {
        w.end().await;
    }
}

/// Tells the engine of the nodes `left` behind; false when the engine is gone.
async fn tell_gone(left: &mut Vec<String>, tx: &mpsc::Sender<Signal>) -> bool {
    for node in left.drain(..) {
        if tx.send(Signal::Gone { node }).await.is_err() {
            return false;
        }
    }
    true
}

/// Stops watching `w`'s node and reports it [`Signal::Gone`]; false when the engine is gone.
async fn end(w: Watcher, tx: &mpsc::Sender<Signal>) -> bool {
    let node = w.node.clone();
    w.end().await;
    tx.send(Signal::Gone { node }).await.is_ok()
}

/// What a sentinel said about our master.
#[derive(Debug)]
enum Heard {
    /// `+selected-slave`: the replica at this address is being promoted.
    Selected(String),
    /// `+switch-master`: this address is the master now.
    Switched(String),
}

/// Listens to `+selected-slave` and `+switch-master` on the sentinel at `addr` until
/// `shutdown`, passing on what concerns our master; reconnects after a pause when the sentinel
/// goes away.
async fn listen(
    sentinels: Sentinels,
    addr: String,
    switches: mpsc::Sender<Heard>,
    shutdown: CancellationToken,
) {
    let mut failing = String::new();
    loop {
        let ended = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            e = listen_once(&sentinels, &addr, &switches) => e,
        };
        if ended != failing {
            tracing::warn!(sentinel = %addr, reason = %ended, "Sentinel: not listening to this sentinel's failovers; trying again.");
            failing = ended;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SENTINEL_RETRY) => {}
        }
    }
}

/// One subscription to a sentinel's failover messages: why it ended.
async fn listen_once(sentinels: &Sentinels, addr: &str, switches: &mpsc::Sender<Heard>) -> String {
    let client = match sentinels.client(addr) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    let pubsub = match tokio::time::timeout(PING_TIMEOUT, client.get_async_pubsub()).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return format!("cannot connect: {e}"),
        Err(_) => return "cannot connect in time".into(),
    };
    let (mut sink, mut stream) = pubsub.split();
    for channel in CHANNELS {
        if let Err(e) = sink.subscribe(channel).await {
            return format!("SUBSCRIBE {channel} failed: {e}");
        }
    }
    tracing::debug!(sentinel = %addr, "Sentinel: listening for failovers.");
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else { return "connection closed".into() };
                let payload = String::from_utf8_lossy(msg.get_payload_bytes()).into_owned();
                let name = sentinels.name();
                let what = match msg.get_channel_name() {
                    "+selected-slave" => selected(&payload, name).map(Heard::Selected),
                    _ => switched_to(&payload, name).map(Heard::Switched),
                };
                if let Some(what) = what {
                    tracing::info!(sentinel = %addr, channel = msg.get_channel_name(), %payload, "Sentinel: heard of a failover.");
                    if switches.send(what).await.is_err() {
                        return "stopped".into();
                    }
                }
            }
            _ = ping.tick() => {
                match tokio::time::timeout(PING_TIMEOUT, sink.ping::<()>()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return format!("PING failed: {e}"),
                    Err(_) => return "no answer to PING".into(),
                }
            }
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands sent to the sentinels to hear of failovers ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Sentinel, "subscribe", "hears of failovers (`+selected-slave`, `+switch-master`)")
            .args("+switch-master")
            .when(When::Sentinel),
        Use::new(Server::Sentinel, "ping", "health of the failover subscription")
            .when(When::Sentinel),
    ]
}
