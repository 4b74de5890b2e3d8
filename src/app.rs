//! `keywatch run`: wiring sources → engine → delivery, and owning shutdown.
//!
//! Shutdown goes one way, as in mini-redis: SIGTERM cancels the subscribers, whose dropped
//! senders let the engine drain and stop, after which delivery gets what is left of the
//! [`SHUTDOWN_GRACE`] budget to finish attempts in flight.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::action::Actions;
use crate::claims::Claims;
use crate::config::{self, Config, Mode};
use crate::connect;
use crate::delivery::{Delivery, RetryPolicy};
use crate::engine::Engine;
use crate::event::EventKind;
use crate::keyspace::Keyspace;
use crate::metrics::Metrics;
use crate::server;
use crate::silences;
use crate::source::flags;
use crate::source::ledger::{self, Ledger};
use crate::source::notifications::{self, Backoff};
use crate::source::scanner::Scanner;
use crate::source::topology;
use crate::status::Status;

/// Why `run` could not start (exit code 1), already worded for the operator.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Redis(String),
    #[error("{0}")]
    Notifications(String),
    #[error("cannot listen on {addr}: {error} (pick another address with --listen)")]
    Listen {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error(transparent)]
    Connect(#[from] connect::ConnectError),
}

pub struct RunOptions {
    pub redis: Option<String>,
    pub listen: SocketAddr,
    /// Stop after this long (demo and tests); `None` runs until a signal.
    pub stop_after: Option<Duration>,
}

/// How long in-flight work may take after SIGTERM. SPEC §5 allows 10 s from the signal to the
/// exit; the last second is left for stopping the HTTP endpoint and the runtime, so a webhook
/// that hangs for the whole budget still does not push the exit past the 10 s.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(9);

/// Runs keywatch until SIGTERM/SIGINT (or `shutdown` is cancelled).
pub async fn run(
    config: Config,
    opts: RunOptions,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    // Taken over before anything else: until then SIGTERM's default action kills the process, and
    // a stop requested while keywatch starts (it already logs "Subscribed" by then) must still
    // end in a clean exit 0.
    let signals = StopSignals::install();
    let config = Arc::new(config);
    let url = connect::pick_url(
        opts.redis.as_deref(),
        std::env::var("KEYWATCH_REDIS_URL").ok(),
        &config.redis,
    );
    let keyspace = Keyspace::new(url, config.redis.clone())?;
    let node = keyspace.node().to_string();

    // The nodes that publish events: the URL's, or every master of the cluster.
    let watched: Vec<String> = if keyspace.is_cluster() {
        let masters = keyspace
            .discover()
            .await
            .map_err(|e| StartError::Redis(format!("`redis.cluster` is on, but {e}")))?;
        masters.into_iter().map(|m| m.addr).collect()
    } else {
        vec![node.clone()]
    };
    for n in &watched {
        let mut conn = keyspace
            .node_conn(n)
            .await
            .map_err(|e| StartError::Redis(format!("cannot connect to Redis at {n}: {e}")))?;
        flags::ensure(&mut conn, &config, n)
            .await
            .map_err(StartError::Notifications)?;
    }

    let metrics = Arc::new(Metrics::new());
    metrics.rules_loaded.set(config.rules.len() as i64);
    metrics.config_last_reload_successful.set(1);
    let status = Arc::new(Status::default());
    for n in &watched {
        status.expect_node(n);
    }
    status.set_config(config.clone());

    let listener = server::bind(opts.listen)
        .await
        .map_err(|error| StartError::Listen {
            addr: opts.listen,
            error,
        })?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "HTTP endpoint listening (/, /metrics, /healthz, /readyz).");
    }

    let subscribers = CancellationToken::new();
    let delivery_stop = CancellationToken::new();
    let http_stop = CancellationToken::new();

    let state = state_connection(&config, &keyspace).await?;
    let ledger = config.uses_ledger().then(|| {
        Ledger::new(
            state.clone(),
            keyspace.clone(),
            &config.state.prefix,
            metrics.clone(),
        )
    });
    let claims = Claims::new(state.clone(), &config.state.prefix);
    let silenced = Arc::new(silences::Active::default());
    status.set_silences(silenced.clone());
    let instance = format!("{}:{}", hostname(), std::process::id());
    let marker = Ledger::marker_channel(&config.state.prefix);
    let (tx, rx) = mpsc::channel(64 * 1024);
    let scanner = if config.event_kinds().contains(&EventKind::Expiring) {
        let state = state_connection(&config, &keyspace).await?;
        let s = Scanner::new(
            config.clone(),
            keyspace.clone(),
            state,
            ledger.clone(),
            metrics.clone(),
            tx.clone(),
        );
        Some(tokio::spawn(s.run(subscribers.clone())))
    } else {
        None
    };
    let channels = notifications::channels(
        &config.redis.databases,
        &config.event_kinds(),
        ledger.as_ref().map(|_| marker.as_str()),
    );
    let subscriber = if keyspace.is_cluster() {
        Some(tokio::spawn(topology::follow(
            keyspace.clone(),
            channels,
            tx,
            status.clone(),
            metrics.clone(),
            subscribers.clone(),
        )))
    } else if channels.is_empty() {
        // Only `expiring` rules: nothing to subscribe to; the scanner is the source.
        status.set_subscribed(&node, true);
        drop(tx);
        None
    } else {
        let client = keyspace.client(0)?;
        Some(tokio::spawn(notifications::subscribe(
            client,
            node.clone(),
            channels,
            tx,
            Backoff::default(),
            subscribers.clone(),
        )))
    };

    let actions = Actions {
        config: config.clone(),
        http: crate::action::http::client(),
        keyspace: keyspace.clone(),
    };
    let delivery = Delivery::new(
        actions,
        metrics.clone(),
        RetryPolicy::default(),
        Some(state.clone()),
        delivery_stop.clone(),
    );
    delivery.report_to(status.clone());
    delivery.start_redrive();
    delivery.start_queue();
    let poker_stop = CancellationToken::new();
    tokio::spawn(silences::follow(
        state.clone(),
        config.state.prefix.clone(),
        silenced.clone(),
        poker_stop.clone(),
    ));
    if let Some(l) = &ledger {
        tokio::spawn(ledger::run_poker(
            l.clone(),
            config.redis.databases.clone(),
            poker_stop.clone(),
        ));
    }
    let page_ledger = ledger.clone();
    let engine = Engine {
        config: config.clone(),
        keyspace,
        delivery: delivery.clone(),
        metrics: metrics.clone(),
        status: status.clone(),
        ledger,
        claims,
        instance,
        silenced,
        markers: Default::default(),
    };
    let engine = tokio::spawn(engine.run(rx));
    let http = tokio::spawn(server::serve(
        listener,
        server::Shared {
            metrics,
            status,
            ledger: page_ledger,
        },
        http_stop.clone(),
    ));

    tracing::info!(rules = config.rules.len(), channels = config.channels.len(), redis = %node, "keywatch is running.");
    wait_for_stop(&shutdown, opts.stop_after, signals).await;

    let started = Instant::now();
    tracing::info!("Stopping: no new events are taken; finishing work in flight.");
    subscribers.cancel();
    poker_stop.cancel();
    if let Some(s) = subscriber {
        let _ = s.await;
    }
    if let Some(s) = scanner {
        let _ = s.await;
    }
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, engine).await;
    let left = SHUTDOWN_GRACE.saturating_sub(started.elapsed());
    if !delivery.shutdown(left).await {
        tracing::warn!("Some actions were still running at the end of the shutdown budget.");
    }
    http_stop.cancel();
    let _ = http.await;
    tracing::info!(took_ms = started.elapsed().as_millis() as u64, "Stopped.");
    Ok(())
}

/// This machine's name, for telling instances apart in Redis.
fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "keywatch".into())
}

/// Where keywatch keeps its own state: `state.url`, or database 0 of the watched Redis.
pub async fn state_connection(
    config: &Config,
    keyspace: &Keyspace,
) -> Result<crate::keyspace::Conn, StartError> {
    crate::keyspace::state_conn(config.state.url.as_ref(), &config.redis, keyspace)
        .await
        .map_err(StartError::Redis)
}

/// SIGTERM and SIGINT listeners; a signal that arrives before [`wait_for_stop`] is kept.
struct StopSignals {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
    /// SIGHUP would end the process by default; until rule reload exists it is logged and ignored.
    hup: Option<tokio::signal::unix::Signal>,
}

impl StopSignals {
    fn install() -> StopSignals {
        use tokio::signal::unix::{SignalKind, signal};
        StopSignals {
            term: signal(SignalKind::terminate()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
            hup: signal(SignalKind::hangup()).ok(),
        }
    }
}

async fn wait_for_stop(
    shutdown: &CancellationToken,
    stop_after: Option<Duration>,
    signals: StopSignals,
) {
    let StopSignals {
        mut term,
        mut int,
        mut hup,
    } = signals;
    let timer = tokio::time::sleep(stop_after.unwrap_or(Duration::from_secs(u32::MAX as u64)));
    tokio::pin!(timer);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = &mut timer, if stop_after.is_some() => return,
            _ = async { match term.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
                tracing::info!("SIGTERM received.");
                return;
            }
            _ = async { match int.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
                tracing::info!("SIGINT received.");
                return;
            }
            _ = async { match hup.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
                tracing::warn!("SIGHUP received: reloading rules is not supported yet; restart keywatch to load new rules. Still running.");
            }
        }
    }
}

/// Loads the rules for `run`: unset variables and missing secret files are errors here.
pub fn load_for_run(paths: &[PathBuf]) -> Result<config::Loaded, config::LoadError> {
    let env = |name: &str| std::env::var(name).ok();
    config::load(paths, Mode::Run, &env)
}
