//! Reloading the rules of a running keywatch (docs/reliability.md#guarantees): on SIGHUP, on `POST /-/reload`, and when
//! a rule file changes.
//!
//! A reload is all or nothing. The files are read and validated as `keywatch check` would, the
//! notification flags the new rules need are checked (or added, with `notifications: enable`)
//! on Redis, and only then is the new [`Config`] published; anything that fails on the way leaves
//! the old rules in force, logged and counted. Readers pick the new rules up at their next unit of
//! work ([`LiveConfig`]); the subscriber subscribes to new channels before it leaves old ones, so
//! no event falls between two rule sets.
//!
//! Settings that name where keywatch connects (`redis.url`, `redis.cluster`, `redis.tls`, the
//! credentials, `state.*`) are fixed for the life of the process: a reload that changes them is
//! refused with the reason, instead of half-applied.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Config, ConfigPublisher, LoadError, Mode, Severity};
use crate::event::EventKind;
use crate::internal_events::{ReloadApplied, ReloadFailed};
use crate::keyspace::Keyspace;
use crate::keyspace::connect;
use crate::metrics::Metrics;
use crate::source::flags;
use crate::source::ledger::{self, Ledger};
use crate::source::notifications;
use crate::status::Status;

/// File events closer together than this are one change: an editor's save is often several
/// writes and renames. Well under the 2 s in which docs/reliability.md#guarantees wants a change picked up.
pub const DEBOUNCE: Duration = Duration::from_millis(400);

/// Why a reload left the old rules in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("keywatch was started without rule files, so there is nothing to reload")]
    NoFiles,
    #[error("{0}")]
    Unreadable(String),
    #[error("{count} error(s) in the rule files:\n{diagnostics}")]
    Invalid { count: usize, diagnostics: String },
    #[error(
        "the new rules change {0}, which keywatch reads only at start; restart keywatch to apply it"
    )]
    NeedsRestart(String),
    #[error("{0}")]
    Notifications(String),
    /// The new rules would leave the endpoint open beyond loopback.
    #[error("{0}")]
    Unprotected(String),
    #[error("keywatch is stopping")]
    Stopping,
}

/// What asked for a reload; file changes are skipped when the files did not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    Signal,
    Http,
    Files,
}

impl Cause {
    fn as_str(self) -> &'static str {
        match self {
            Cause::Signal => "SIGHUP",
            Cause::Http => "POST /-/reload",
            Cause::Files => "a rule file changed",
        }
    }
}

struct Request {
    cause: Cause,
    reply: Option<oneshot::Sender<Result<String, String>>>,
}

/// Asks the [`Reloader`] for a reload; cheap to clone into the signal loop, the HTTP endpoint
/// and the file watcher.
#[derive(Clone)]
pub struct ReloadHandle {
    tx: mpsc::Sender<Request>,
}

impl ReloadHandle {
    /// Reloads and waits for the outcome: a summary, or why the old rules stay.
    pub async fn reload(&self, cause: Cause) -> Result<String, String> {
        let (reply, rx) = oneshot::channel();
        let stopping = || ReloadError::Stopping.to_string();
        self.tx
            .send(Request {
                cause,
                reply: Some(reply),
            })
            .await
            .map_err(|_| stopping())?;
        rx.await.map_err(|_| stopping())?
    }

    /// Asks for a reload without waiting (from a signal or a file watcher thread). A request
    /// already waiting covers this one.
    pub fn request(&self, cause: Cause) {
        let _ = self.tx.try_send(Request { cause, reply: None });
    }
}

/// Everything a reload touches.
pub struct Reloader {
    /// The `--listen` address: new rules must still protect it as `run` requires at start.
    pub listen: std::net::SocketAddr,
    /// The `-r` paths `run` was started with.
    pub paths: Vec<PathBuf>,
    pub publisher: ConfigPublisher,
    /// `--redis` or `KEYWATCH_REDIS_URL` as given at start: with one, `redis.url` in the files
    /// does not matter.
    pub url_override: bool,
    /// `run --shadow`: every reload's rules are a shadow's too.
    pub shadow: bool,
    pub keyspace: Keyspace,
    pub metrics: Arc<Metrics>,
    pub status: Arc<Status>,
    pub ledger: Ledger,
    /// The channels the subscriber is to be subscribed to.
    pub subscriptions: watch::Sender<Vec<String>>,
}

impl Reloader {
    /// The handle, and the receiving end that [`Reloader::run`] serves.
    pub fn channel() -> (ReloadHandle, ReloadRequests) {
        // Room for one waiting request per cause is plenty: each reload reads the files anew.
        let (tx, rx) = mpsc::channel(8);
        (ReloadHandle { tx }, ReloadRequests { rx })
    }

    /// Serves reload requests one at a time until `shutdown`.
    pub async fn run(self, mut requests: ReloadRequests, shutdown: CancellationToken) {
        let mut last_files = self.fingerprint().await;
        loop {
            let req = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                r = requests.rx.recv() => match r { Some(r) => r, None => return },
            };
            if req.cause == Cause::Files {
                let now = self.settled_fingerprint().await;
                if now.is_some() && now == last_files {
                    tracing::debug!("Rule files touched but unchanged; nothing to reload.");
                    continue;
                }
                last_files = now;
            }
            let outcome = self.reload().await;
            let cause = req.cause.as_str();
            let reply = match outcome {
                Ok((rules, channels)) => {
                    ReloadApplied {
                        cause,
                        rules,
                        channels,
                    }
                    .emit(&self.metrics);
                    Ok(format!(
                        "Rules reloaded ({cause}): {rules} rule(s), {channels} channel(s)."
                    ))
                }
                Err(e) => {
                    ReloadFailed { cause, error: &e }.emit(&self.metrics);
                    Err(e.to_string())
                }
            };
            if let Some(r) = req.reply {
                let _ = r.send(reply);
            }
        }
    }

    /// Loads the rule files and puts them in force: how many rules and channels they have.
    async fn reload(&self) -> Result<(usize, usize), ReloadError> {
        if self.paths.is_empty() {
            return Err(ReloadError::NoFiles);
        }
        let paths = self.paths.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            let env = |name: &str| std::env::var(name).ok();
            config::load(&paths, Mode::Run, &env)
        })
        .await
        .map_err(|e| ReloadError::Unreadable(format!("reading the rule files failed: {e}")))?;
        let loaded = match loaded {
            Ok(l) => l,
            Err(LoadError::Unreadable(msg)) => return Err(ReloadError::Unreadable(msg)),
            Err(LoadError::Invalid(diags)) => {
                let count = diags
                    .iter()
                    .filter(|d| d.severity == Severity::Error)
                    .count();
                let diagnostics = diags
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(ReloadError::Invalid { count, diagnostics });
            }
        };
        for w in &loaded.warnings {
            tracing::warn!("{w}");
        }
        let new = match self.shadow {
            true => loaded.config.into_shadow(),
            false => loaded.config,
        };
        let old = self.publisher.current();
        let fixed = fixed_settings_changed(&old, &new, self.url_override);
        if !fixed.is_empty() {
            return Err(ReloadError::NeedsRestart(fixed.join(", ")));
        }
        // As at start: a reload must not take the token off an endpoint open to the network.
        if let Some(why) = new.server.unprotected(self.listen) {
            return Err(ReloadError::Unprotected(why));
        }
        // Every node that publishes events: the URL's, or each master of a cluster (as last
        // discovered: a master found later is checked when its subscriber comes up).
        let nodes: Vec<String> = if self.keyspace.is_cluster() {
            self.keyspace
                .masters()
                .into_iter()
                .map(|m| m.addr)
                .collect()
        } else {
            vec![self.keyspace.node()]
        };
        for node in &nodes {
            let mut conn = self.keyspace.node_conn(node).await.map_err(|e| {
                ReloadError::Notifications(format!(
                    "cannot reach Redis at {node} to check notify-keyspace-events: {}",
                    connect::explain(self.keyspace.url(), &e)
                ))
            })?;
            flags::ensure(&mut conn, &new, node)
                .await
                .map_err(ReloadError::Notifications)?;
        }

        let refill = new.uses_ledger() && ledger_scope(&old) != ledger_scope(&new);
        let new = self.publisher.publish(new);
        self.metrics.rules_loaded.set(new.rules.len() as i64);
        self.status.set_config(new.clone());
        let channels = subscriptions(&new);
        self.subscriptions.send_if_modified(|current| {
            let changed = *current != channels;
            if changed {
                *current = channels;
            }
            changed
        });
        if refill {
            // Keys that the new rules care about were not ledgered so far: learn their deadlines
            // with the same paced scan as after a (re)subscription.
            let l = self.ledger.clone();
            let config = new.clone();
            tokio::spawn(async move { ledger::fill_all(&l, &config, None).await });
        }
        Ok((new.rules.len(), new.channels.len()))
    }

    /// The fingerprint once the files have stopped changing: a file written in place is
    /// truncated before it is written, and a reload that read it in between would load an
    /// empty file — valid, with no rules — and drop every rule until the next change.
    async fn settled_fingerprint(&self) -> Option<u64> {
        let mut last = self.fingerprint().await;
        for _ in 0..SETTLE_TRIES {
            tokio::time::sleep(SETTLE).await;
            let now = self.fingerprint().await;
            if now == last {
                return now;
            }
            last = now;
        }
        last
    }

    /// A hash of the rule files' names and contents; `None` when they cannot be read (the
    /// reload then says why).
    async fn fingerprint(&self) -> Option<u64> {
        let paths = self.paths.clone();
        tokio::task::spawn_blocking(move || {
            let (files, texts) = config::read_rule_files(&paths).ok()?;
            let mut h = DefaultHasher::new();
            files.hash(&mut h);
            texts.hash(&mut h);
            Some(h.finish())
        })
        .await
        .ok()
        .flatten()
    }
}

/// How long rule files must stay unchanged before a change to them is loaded, checked at most
/// [`SETTLE_TRIES`] times (a file still changing after that is loaded as it is then).
const SETTLE: Duration = Duration::from_millis(150);
const SETTLE_TRIES: u32 = 20;

/// The receiving end of [`ReloadHandle`]s.
pub struct ReloadRequests {
    rx: mpsc::Receiver<Request>,
}

/// The channels the subscriber needs for `config`.
pub fn subscriptions(config: &Config) -> Vec<String> {
    let marker = Ledger::marker_channel(&config.state.prefix);
    let mut channels = notifications::channels(
        &config.redis.databases,
        &config.event_kinds(),
        config.uses_ledger().then_some(marker.as_str()),
    );
    // Notices come there too, whatever the rules (`store::notices`).
    if !channels.contains(&marker) {
        channels.push(marker);
    }
    channels
}

/// Databases, and (pattern, rule databases) of the rules that want deadlines.
type LedgerScope = (Vec<u32>, Vec<(String, Option<Vec<u32>>)>);

/// What decides which deadlines the ledger keeps: the databases and the patterns of the rules
/// that fire on expiry or warn before it.
fn ledger_scope(config: &Config) -> LedgerScope {
    let mut patterns: Vec<_> = config
        .rules
        .iter()
        .filter(|r| r.on.contains(&EventKind::Expired) || r.on.contains(&EventKind::Expiring))
        .map(|r| (r.pattern.source().to_string(), r.db.clone()))
        .collect();
    patterns.sort();
    (config.redis.databases.clone(), patterns)
}

/// The settings a reload cannot change, by name; never their values (they may hold secrets).
fn fixed_settings_changed(old: &Config, new: &Config, url_override: bool) -> Vec<&'static str> {
    let (o, n) = (&old.redis, &new.redis);
    let mut changed = Vec::new();
    if !url_override && o.url != n.url {
        changed.push("`redis.url`");
    }
    if o.cluster != n.cluster {
        changed.push("`redis.cluster`");
    }
    if o.tls != n.tls {
        changed.push("`redis.tls`");
    }
    if o.username != n.username || o.password != n.password {
        changed.push("the Redis credentials");
    }
    if old.state.prefix != new.state.prefix {
        changed.push("`state.prefix`");
    }
    if old.state.url != new.state.url {
        changed.push("`state.url`");
    }
    changed
}

/// Watches the rule files and asks for a reload when they change. Keep the returned watcher:
/// dropping it stops the watching.
pub fn watch_files(paths: &[PathBuf], handle: ReloadHandle) -> notify::Result<FileWatcher> {
    use notify::RecursiveMode;
    use notify_debouncer_full::{DebounceEventResult, new_debouncer};

    let targets: Vec<PathBuf> = paths.iter().map(|p| absolute(p)).collect();
    let wanted = targets.clone();
    let mut debouncer = new_debouncer(DEBOUNCE, None, move |result: DebounceEventResult| {
        let Ok(events) = result else { return };
        let relevant = events.iter().any(|e| {
            !matches!(e.event.kind, notify::EventKind::Access(_))
                && e.event.paths.iter().any(|p| concerns(&wanted, p))
        });
        if relevant {
            handle.request(Cause::Files);
        }
    })?;
    for t in &targets {
        if t.is_dir() {
            debouncer.watch(t, RecursiveMode::Recursive)?;
        } else {
            // A file is watched through its folder: editors and `git checkout` replace files
            // by renaming over them, which a watch on the file itself would not survive.
            let dir = t.parent().unwrap_or(Path::new("/"));
            debouncer.watch(dir, RecursiveMode::NonRecursive)?;
        }
    }
    Ok(FileWatcher {
        _debouncer: Box::new(debouncer),
    })
}

/// Keeps the file watching alive.
pub struct FileWatcher {
    _debouncer: Box<dyn Send>,
}

/// Whether a change at `path` may change the rules loaded from `targets`. Anything inside a
/// watched folder counts (a Kubernetes ConfigMap swaps a `..data` symlink, not the `.yaml`
/// files); unchanged contents are filtered later by their fingerprint.
fn concerns(targets: &[PathBuf], path: &Path) -> bool {
    targets
        .iter()
        .any(|t| path == t || (t.is_dir() && path.starts_with(t)))
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LiveConfig;

    fn load(text: &str) -> Config {
        config::of_yaml(text, Mode::Check)
    }

    const BASE: &str = "
channels:
  log: { type: log }
rules:
  - name: locks
    match: 'lock:*'
    on: [expired]
    notify: { to: [log], message: 'x' }
";

    #[test]
    fn connection_settings_are_fixed_and_named_without_values() {
        let old = load(BASE);
        let moved = load(&format!(
            "redis: {{ url: 'redis://:hunter2@10.0.0.9:6379' }}\nstate: {{ prefix: 'kw2:' }}\n{BASE}"
        ));
        let changed = fixed_settings_changed(&old, &moved, false);
        assert_eq!(changed, vec!["`redis.url`", "`state.prefix`"]);
        let msg = ReloadError::NeedsRestart(changed.join(", ")).to_string();
        assert!(!msg.contains("hunter2"), "{msg}");
        // With --redis given, the URL in the files is not what keywatch uses.
        assert_eq!(
            fixed_settings_changed(&old, &moved, true),
            vec!["`state.prefix`"]
        );
        assert!(fixed_settings_changed(&old, &load(BASE), false).is_empty());
    }

    #[test]
    fn ledger_scope_follows_expiry_patterns_and_databases() {
        let old = load(BASE);
        assert_eq!(ledger_scope(&old), ledger_scope(&load(BASE)));
        let renamed_channel_only = BASE.replace("message: 'x'", "message: 'y'");
        assert_eq!(
            ledger_scope(&old),
            ledger_scope(&load(&renamed_channel_only))
        );
        let wider = BASE.replace("'lock:*'", "'lock:**'");
        assert_ne!(ledger_scope(&old), ledger_scope(&load(&wider)));
        let dbs = format!("redis: {{ databases: [0, 1] }}\n{BASE}");
        assert_ne!(ledger_scope(&old), ledger_scope(&load(&dbs)));
    }

    #[tokio::test]
    async fn live_config_readers_see_a_publish_whole() {
        let (mut live, publisher) = LiveConfig::new(load(BASE));
        assert_eq!(live.current().rules[0].name, "locks");
        let next = BASE.replace("name: locks", "name: leases");
        publisher.publish(load(&next));
        let seen = live.changed().await.expect("a publish");
        assert_eq!(seen.rules[0].name, "leases");
        assert_eq!(live.current().rules[0].name, "leases");
        drop(publisher);
        assert!(live.changed().await.is_none());
    }

    #[test]
    fn file_changes_inside_watched_folders_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("a.yaml");
        std::fs::write(&file, "").expect("write");
        let targets = vec![dir.path().to_path_buf()];
        assert!(concerns(&targets, &dir.path().join("..data")));
        assert!(concerns(&targets, &file));
        assert!(!concerns(&targets, Path::new("/elsewhere/a.yaml")));
        let only_file = vec![file.clone()];
        assert!(concerns(&only_file, &file));
        assert!(!concerns(&only_file, &dir.path().join("b.yaml")));
    }
}
