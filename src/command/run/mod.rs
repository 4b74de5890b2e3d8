//! `keywatch run`: wiring sources → engine → delivery, and owning shutdown.
//!
//! Shutdown goes one way, as in mini-redis: SIGTERM cancels the subscribers, whose dropped
//! senders let the engine drain and stop, after which delivery gets what is left of the
//! [`SHUTDOWN_GRACE`] budget to finish attempts in flight.

pub(crate) mod access;
pub(crate) mod connections;
pub(crate) mod endpoint;
pub(crate) mod grants;
pub(crate) mod links_page;
pub(crate) mod open_files;
pub(crate) mod reload;
pub(crate) mod status_page;
pub(crate) mod throttled_log;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::action::ActionContext;
use crate::config::{self, Config, LiveConfig, Mode};
use crate::delivery::{self, Delivery, RetryPolicy};
use crate::engine::Engine;
use crate::engine::intake::Intake;
use crate::engine::silences;
use crate::event::EventKind;
use crate::keyspace::Keyspace;
use crate::keyspace::connect;
use crate::metrics::Metrics;
use crate::source::cluster;
use crate::source::flags;
use crate::source::ledger::{self, Ledger};
use crate::source::notifications;
use crate::source::scanner::Scanner;
use crate::source::sentinel;
use crate::status::Status;
use reload::{Cause, ReloadHandle, Reloader};

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
    /// Listening beyond loopback without `server.token` or `server.open`.
    #[error("{0}")]
    Unprotected(String),
}

pub struct RunOptions {
    pub redis: Option<String>,
    pub listen: SocketAddr,
    /// Stop after this long (demo and tests); `None` runs until a signal.
    pub stop_after: Option<Duration>,
    /// The `-r` paths, read again on every reload and watched for changes; empty when the rules
    /// came from elsewhere (the demo, examples): then there is nothing to reload.
    pub rules: Vec<PathBuf>,
    /// `--shadow`: the rules are a shadow's ([`Config::into_shadow`]), and so is every reload.
    pub shadow: bool,
}

/// How long in-flight work may take after SIGTERM. docs/reliability.md#guarantees allows 10 s from the signal to the
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
    let open_files = open_files::raise();
    let env_url = std::env::var("KEYWATCH_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let url_override = opts.redis.is_some() || env_url.is_some();
    let url = connect::pick_url(opts.redis.as_deref(), env_url, &config.redis);
    let keyspace = Keyspace::new(url, config.redis.clone())?;

    // The nodes that publish events: the URL's, every master of the cluster, or the master the
    // sentinels name.
    let watched: Vec<String> = if keyspace.is_cluster() {
        let masters = keyspace
            .discover()
            .await
            .map_err(|e| StartError::Redis(format!("`redis.cluster` is on, but {e}")))?;
        masters.into_iter().map(|m| m.addr).collect()
    } else if keyspace.sentinels().is_some() {
        let found = keyspace
            .locate()
            .await
            .map_err(|e| StartError::Redis(format!("`redis.sentinel`: {e}")))?;
        tracing::info!(master = %found.addr, by = %found.by, confirmed = found.confirmed, "Sentinel: located the master.");
        vec![found.addr]
    } else {
        vec![keyspace.node()]
    };
    let node = keyspace.node();
    for n in &watched {
        let mut conn = keyspace.node_conn(n).await.map_err(|e| {
            let e = connect::explain(keyspace.url(), &e);
            StartError::Redis(format!("cannot connect to Redis at {n}: {e}"))
        })?;
        flags::ensure(&mut conn, &config, n)
            .await
            .map_err(StartError::Notifications)?;
        if config.watches_fields() {
            crate::source::fields::support(&mut conn, n)
                .await
                .map_err(StartError::Redis)?;
        }
    }

    let metrics = Arc::new(Metrics::new());
    metrics.rules_loaded.set(config.rules.len() as i64);
    metrics.reload_succeeded(chrono::Utc::now().timestamp());
    let (live, publisher) = LiveConfig::new(config);
    let config = live.current();
    let status = Arc::new(Status::default());
    for n in &watched {
        status.expect_node(n);
    }
    status.set_config(config.clone());

    if let Some(why) = config.server.unprotected(opts.listen) {
        return Err(StartError::Unprotected(why));
    }
    let listener = endpoint::bind(opts.listen)
        .await
        .map_err(|error| StartError::Listen {
            addr: opts.listen,
            error,
        })?;
    let bound = connections::bound_for(open_files);
    if let Ok(addr) = listener.local_addr() {
        crate::internal_events::Listening {
            addr,
            open_files,
            connections: bound,
            // Only `server.open: true` gets this far (docs/operations.md#exposing-the-endpoint).
            open: !opts.listen.ip().is_loopback() && config.server.token.is_none(),
        }
        .emit();
    }

    let subscribers = CancellationToken::new();
    // Not ready until every grant the rules need is there (docs/redis.md#least-privilege-acl).
    tokio::spawn(grants::keep(
        live.clone(),
        keyspace.clone(),
        status.clone(),
        subscribers.clone(),
    ));
    let delivery_stop = CancellationToken::new();
    let http_stop = CancellationToken::new();

    let state = state_connection(&config, &keyspace).await?;
    let history_stop = CancellationToken::new();
    let (recorder, history_writer) = crate::store::history::Recorder::spawn(
        state.clone(),
        &config.state.prefix,
        config.history.keep,
        history_stop.clone(),
    );
    status.record_to(recorder);
    // Kept whether or not the rules in force need it: a reload may add the first rule on
    // expiries. It costs nothing until then.
    let ledger = Ledger::new(
        state.clone(),
        keyspace.clone(),
        &config.state.prefix,
        metrics.clone(),
    );
    let instance = format!("{}:{}", hostname(), std::process::id());
    // The takes on a connection of their own: the engine waits for each before the next batch
    // (docs/performance.md#connections-of-their-own-42).
    let intake = Intake::new(
        state
            .apart()
            .await
            .map_err(|e| StartError::Redis(format!("cannot connect to the state Redis: {e}")))?,
        &config.state.prefix,
        &instance,
    );
    let silenced = Arc::new(silences::Active::default());
    let (tx, rx) = mpsc::channel(crate::source::notifications::backlog().0);
    let fields = crate::source::fields::FieldLedger::new(
        state.clone(),
        keyspace.clone(),
        &config.state.prefix,
    );
    tokio::spawn(
        fields
            .clone()
            .run(live.clone(), tx.clone(), subscribers.clone()),
    );
    let scanner = tokio::spawn(keep_scanner(
        live.clone(),
        Scanner::new(
            config.clone(),
            keyspace.clone(),
            state_connection(&config, &keyspace).await?,
            Some(ledger.clone()),
            metrics.clone(),
            tx.clone(),
        ),
        subscribers.clone(),
    ));
    let (subscriptions, wanted) = watch::channel(reload::subscriptions(&config));
    let subscriber = if keyspace.is_cluster() || keyspace.sentinels().is_some() {
        let expecting = status.clone();
        let watching = move |node: &str| expecting.expect_node(node);
        let (k, m, stop) = (keyspace.clone(), metrics.clone(), subscribers.clone());
        if keyspace.is_cluster() {
            tokio::spawn(cluster::follow(k, wanted, tx, watching, m, stop))
        } else {
            tokio::spawn(sentinel::follow(k, wanted, tx, watching, m, stop))
        }
    } else {
        tokio::spawn(notifications::subscribe(
            keyspace.client(0)?,
            node.clone(),
            wanted,
            tx,
            notifications::RECONNECT,
            metrics.clone(),
            subscribers.clone(),
        ))
    };

    let actions = ActionContext::new(
        live.clone(),
        crate::channel::http::client(),
        keyspace.clone(),
    )
    .with_state(state.clone());
    let waiting = metrics.clone();
    let delivery = Delivery::start(delivery::Parts {
        actions,
        state: state.clone(),
        metrics: metrics.clone(),
        status: Some(status.clone()),
        intake_behind: Box::new(move || {
            waiting.events_waiting.get() >= crate::engine::BATCH as i64
        }),
        policy: RetryPolicy::default(),
        shutdown: delivery_stop.clone(),
    });
    let poker_stop = CancellationToken::new();
    tokio::spawn(silences::follow(
        state.clone(),
        config.state.prefix.clone(),
        silenced.clone(),
        poker_stop.clone(),
    ));
    // Deadlines, leases and due times are compared against the watched Redis's clock.
    tokio::spawn(crate::keyspace::clock::follow(
        keyspace
            .conn(0)
            .await
            .map_err(|e| StartError::Redis(format!("cannot connect to Redis at {node}: {e}")))?,
        poker_stop.clone(),
    ));
    let waiting = metrics.clone();
    tokio::spawn(ledger::run_poker(
        ledger.clone(),
        live.clone(),
        move || waiting.events_waiting.get() >= crate::engine::BATCH as i64,
        poker_stop.clone(),
    ));

    let (reload_handle, reload_requests) = Reloader::channel();
    let reloader = Reloader {
        listen: opts.listen,
        paths: opts.rules.clone(),
        publisher,
        url_override,
        keyspace: keyspace.clone(),
        metrics: metrics.clone(),
        status: status.clone(),
        ledger: ledger.clone(),
        subscriptions,
        shadow: opts.shadow,
    };
    tokio::spawn(reloader.run(reload_requests, poker_stop.clone()));
    let _watcher = if opts.rules.is_empty() {
        None
    } else {
        match reload::watch_files(&opts.rules, reload_handle.clone()) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot watch the rule files for changes; reload with SIGHUP or POST /-/reload.");
                None
            }
        }
    };

    let watched = keyspace.conn(0).await.ok();
    let engine = Engine {
        config: config.clone(),
        live: live.clone(),
        keyspace,
        delivery: delivery.clone(),
        metrics: metrics.clone(),
        status: status.clone(),
        ledger: Some(ledger.clone()),
        intake,
        silenced: silenced.clone(),
        fields: Some(fields),
        markers: Default::default(),
        refreshing: Default::default(),
    };
    let engine = tokio::spawn(engine.run(rx));
    let http = tokio::spawn(endpoint::serve(
        listener,
        endpoint::Shared {
            metrics,
            status,
            ledger: Some(ledger),
            reload: Some(reload_handle.clone()),
            silences: Some(silenced.clone()),
            history: Some((state.clone(), config.state.prefix.clone())),
            queue: Some(crate::store::queue::Queue::new(
                state.clone(),
                &config.state.prefix,
            )),
            held: Some(crate::store::held::HeldStore::new(
                state.clone(),
                &config.state.prefix,
            )),
            watched,
        },
        bound,
        http_stop.clone(),
    ));

    tracing::info!(rules = config.rules.len(), channels = config.channels.len(), redis = %node, "keywatch is running.");
    wait_for_stop(&shutdown, opts.stop_after, signals, &reload_handle).await;

    let started = Instant::now();
    tracing::info!("Stopping: no new events are taken; finishing work in flight.");
    subscribers.cancel();
    poker_stop.cancel();
    let _ = subscriber.await;
    let _ = scanner.await;
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, engine).await;
    let left = SHUTDOWN_GRACE.saturating_sub(started.elapsed());
    if !delivery.shutdown(left).await {
        tracing::warn!("Some actions were still running at the end of the shutdown budget.");
    }
    history_stop.cancel();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), history_writer).await;
    http_stop.cancel();
    let _ = http.await;
    tracing::info!(took_ms = started.elapsed().as_millis() as u64, "Stopped.");
    Ok(())
}

/// Runs the scanner under the rules in force, anew after every reload, so that a new schedule
/// or new `expiring` rules apply at once. A run cut short by a reload counts as missed and runs
/// again under the new rules. Returns (dropping its event sender) at `shutdown`.
async fn keep_scanner(mut live: LiveConfig, scanner: Scanner, shutdown: CancellationToken) {
    let mut scanner = scanner;
    loop {
        let config = live.current();
        scanner.config = config.clone();
        let this_run = shutdown.child_token();
        let task = config
            .event_kinds()
            .contains(&EventKind::Expiring)
            .then(|| tokio::spawn(scanner.clone().run(this_run.clone())));
        let go_on = tokio::select! {
            _ = shutdown.cancelled() => false,
            changed = live.changed() => changed.is_some(),
        };
        this_run.cancel();
        if let Some(t) = task {
            let _ = t.await;
        }
        if !go_on {
            return;
        }
    }
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

/// Where keywatch keeps its own state: `state.url`, or database 0 of the watched Redis (the
/// cluster, on a cluster).
pub async fn state_connection(
    config: &Config,
    keyspace: &Keyspace,
) -> Result<crate::keyspace::Conn, StartError> {
    crate::keyspace::state_conn(config.state.url.as_ref(), &config.redis, keyspace)
        .await
        .map_err(StartError::Redis)
}

/// SIGTERM and SIGINT stop keywatch; SIGHUP reloads the rules. A signal that arrives before
/// [`wait_for_stop`] is kept.
struct StopSignals {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
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
    reload: &ReloadHandle,
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
                tracing::info!("SIGHUP received: reloading the rules.");
                reload.request(Cause::Signal);
            }
        }
    }
}

/// Loads the rules for `run`: unset variables and missing secret files are errors here.
pub fn load_for_run(paths: &[PathBuf]) -> Result<config::Loaded, config::LoadError> {
    let env = |name: &str| std::env::var(name).ok();
    config::load(paths, Mode::Run, &env)
}
