//! The watched Redis as actions and matching see it: one node, or every node of a cluster.
//!
//! On one node, each database gets its own `ConnectionManager` (a connection is bound to one
//! database), made on first use. With `redis.sentinel` that node is whichever master the
//! sentinels last named ([`Keyspace::locate`]): the connections handed out follow it
//! ([`Conn::Master`]), so keywatch's state moves with the master too. On a cluster (only database 0 exists there) one
//! `ClusterConnection` sends each per-key command to the master that owns the key, and SCAN
//! and configuration checks, which concern one node, go to each master by direct connection.

pub(crate) mod clock;
pub(crate) mod cluster;
pub(crate) mod commands;
pub(crate) mod connect;
pub(crate) mod direct;
pub(crate) mod role;
pub(crate) mod sentinel;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use futures_util::{StreamExt, TryStreamExt};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::{Mutex, Notify, OnceCell, watch};

use crate::config::{RedisSettings, Secret};
use crate::keyspace::cluster::{DiscoverError, Master, Slots};
use connect::ConnectError;
use sentinel::{Found, SentinelError, Sentinels};

/// Per-key commands in flight at once on a cluster (see [`Conn::each`]).
const CLUSTER_IN_FLIGHT: usize = 128;

/// A connection to one node or to a whole cluster: keywatch's state and the watched keys go
/// through it alike. Cheap to clone; reconnects by itself.
#[derive(Clone)]
pub enum Conn {
    /// One node, and (where known) the client it was opened with, for [`Conn::direct`].
    Node(ConnectionManager, Option<Arc<redis::Client>>),
    /// The cluster's connection, and the keyspace that knows which master serves which slot
    /// (for [`Conn::direct`]).
    Cluster(ClusterConnection, Keyspace),
    /// Database `db` of whichever node the sentinels last named master: each command goes to
    /// the connection in force when it is sent, and waits while a replica is being promoted
    /// ([`Keyspace::promoting`]). A `ConnectionManager` alone would reconnect to the old
    /// master, now a replica refusing every write.
    Master(Keyspace, u32),
}

impl Conn {
    /// Sends `args` (the command's name first), which carry a long value, on a connection of
    /// their own ([`direct`]): on a cluster, to the master of the slot of the command's key
    /// ([`routing_key`]); where no node is known (a connection made without its client, a
    /// cluster whose slots are not read yet), through this connection as any command.
    pub async fn direct(&self, args: &[&[u8]]) -> RedisResult<Value> {
        let client = match self {
            Conn::Node(_, Some(client)) => Some(redis::Client::clone(client)),
            // The master in force, once the promotion under way is over, as for every command.
            Conn::Master(k, db) => Some(k.db_conn(*db).await?.1),
            Conn::Cluster(_, k) => {
                if let Some(answer) = k.direct_to_slot(args).await {
                    return answer;
                }
                None
            }
            Conn::Node(_, None) => None,
        };
        match client {
            Some(client) => direct::send(client, args, false).await,
            None => {
                let mut cmd = redis::cmd(std::str::from_utf8(args[0]).unwrap_or_default());
                for a in &args[1..] {
                    cmd.arg(*a);
                }
                cmd.query_async(&mut self.clone()).await
            }
        }
    }

    /// The same node and database on a connection of its own, where one can be opened (a
    /// single node whose client is known); otherwise this one. Redis answers a connection's
    /// commands in the order they came, so a command that others wait on (a take, a batch of
    /// jobs) sent on a shared connection queues behind every pipeline sent before it; on its
    /// own it is read in Redis's next round (docs/performance.md#connections-of-their-own-42).
    pub async fn apart(&self) -> RedisResult<Conn> {
        match self {
            Conn::Node(_, Some(client)) => connect::manager(client)
                .await
                .map(|c| Conn::Node(c, Some(client.clone()))),
            _ => Ok(self.clone()),
        }
    }

    /// The connection a command goes to now: the one of a followed master in force.
    async fn current(keyspace: &Keyspace, db: u32) -> RedisResult<ConnectionManager> {
        keyspace.db_conn(db).await.map(|(c, _)| c)
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(c, _) => c.req_packed_command(cmd),
            Conn::Cluster(c, _) => c.req_packed_command(cmd),
            Conn::Master(k, db) => Box::pin(async move {
                let mut c = Conn::current(k, *db).await?;
                c.req_packed_command(cmd).await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(c, _) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c, _) => c.req_packed_commands(pipeline, offset, count),
            Conn::Master(k, db) => Box::pin(async move {
                let mut c = Conn::current(k, *db).await?;
                c.req_packed_commands(pipeline, offset, count).await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c, _) => c.get_db(),
            Conn::Cluster(c, _) => c.get_db(),
            Conn::Master(_, db) => i64::from(*db),
        }
    }
}

impl Conn {
    /// Runs one command per key and returns the answers in order: one pipeline on a node; on a
    /// cluster, where a pipeline must stay within one slot, each command on its own (the
    /// cluster connection still writes them back to back to each node).
    pub async fn each<T: FromRedisValue + Send + 'static>(
        &self,
        cmds: Vec<Cmd>,
    ) -> RedisResult<Vec<T>> {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Conn::Node(..) | Conn::Master(..) => {
                let mut pipe = redis::pipe();
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                pipe.query_async(&mut self.clone()).await
            }
            Conn::Cluster(c, _) => {
                futures_util::stream::iter(cmds)
                    .map(|cmd| {
                        let mut c = c.clone();
                        async move { cmd.query_async::<T>(&mut c).await }
                    })
                    .buffered(CLUSTER_IN_FLIGHT)
                    .try_collect()
                    .await
            }
        }
    }
}

impl Conn {
    /// [`Conn::each`], each answer on its own: one key of the wrong type or one command that
    /// fails does not fail the others. The outer error is the connection's.
    pub async fn each_isolated(&self, cmds: Vec<Cmd>) -> RedisResult<Vec<RedisResult<Value>>> {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Conn::Node(..) | Conn::Master(..) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                pipe.query_async(&mut self.clone()).await
            }
            Conn::Cluster(c, _) => Ok(futures_util::stream::iter(cmds)
                .map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<Value>(&mut c).await }
                })
                .buffered(CLUSTER_IN_FLIGHT)
                .collect()
                .await),
        }
    }
}

#[derive(Clone)]
pub struct Keyspace {
    inner: Arc<Inner>,
}

struct Inner {
    url: Secret,
    settings: RedisSettings,
    node: String,
    /// Each database's connection, and the client it was opened with ([`Conn::direct`]).
    conns: Mutex<HashMap<u32, (ConnectionManager, redis::Client)>>,
    cluster: Option<Cluster>,
    sentinel: Option<Followed>,
}

/// What a keyspace behind Sentinel knows besides the URL.
struct Followed {
    sentinels: Sentinels,
    /// The master as last located (`host:port`), empty before the first [`Keyspace::locate`].
    master: RwLock<String>,
    /// A subscriber lost its node or found it no master: ask the sentinels again now.
    suspect: Notify,
    /// Whether commands may go to `master`: false while it is a replica being promoted, from
    /// [`Keyspace::promoting`] until [`Keyspace::promoted`] or [`Keyspace::move_to`].
    open: watch::Sender<bool>,
}

/// What a keyspace on a cluster knows besides the URL.
struct Cluster {
    client: redis::cluster::ClusterClient,
    conn: OnceCell<ClusterConnection>,
    /// The masters as last discovered ([`crate::source::cluster`] keeps this current).
    masters: RwLock<Vec<Master>>,
    /// Which master serves which slots, as last discovered.
    slots: RwLock<Vec<Slots>>,
    /// Every node address seen in the last discovery: asked after the seed, which may be gone.
    known: RwLock<Vec<String>>,
    /// Direct connections to single nodes, by `host:port`.
    nodes: Mutex<HashMap<String, ConnectionManager>>,
    /// Something went wrong on a node: the topology is re-read now rather than at its next tick.
    suspect: Notify,
}

fn settings_error(e: ConnectError) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "bad Redis settings",
        e.to_string(),
    ))
}

impl Keyspace {
    /// Checks the URL now (so a bad one fails at start-up); connects on first use. With
    /// `redis.cluster`, the URL is one node of the cluster (the seed).
    pub fn new(url: Secret, settings: RedisSettings) -> Result<Keyspace, ConnectError> {
        let (_, node) = connect::client(&url, &settings, 0)?;
        if settings.tls.is_some() && !connect::is_tls(&url) {
            // Not an error: `--redis redis://…` may deliberately point rules written for a TLS
            // server at a local plain one. But the operator should know nothing is encrypted.
            tracing::warn!(redis = %node, "`redis.tls` is set but the Redis URL is not `rediss://`: the connection is not encrypted and the TLS files are not used.");
        }
        let cluster = if settings.cluster {
            Some(Cluster {
                client: connect::cluster_client(&url, &settings)?,
                conn: OnceCell::new(),
                masters: RwLock::new(Vec::new()),
                slots: RwLock::new(Vec::new()),
                known: RwLock::new(Vec::new()),
                nodes: Mutex::new(HashMap::new()),
                suspect: Notify::new(),
            })
        } else {
            None
        };
        let sentinel = settings.sentinel.clone().map(|s| Followed {
            sentinels: Sentinels::new(s, url.clone(), settings.clone()),
            master: RwLock::new(String::new()),
            suspect: Notify::new(),
            open: watch::Sender::new(true),
        });
        Ok(Keyspace {
            inner: Arc::new(Inner {
                url,
                settings,
                node,
                conns: Mutex::new(HashMap::new()),
                cluster,
                sentinel,
            }),
        })
    }

    /// The sentinels, with `redis.sentinel`.
    pub fn sentinels(&self) -> Option<&Sentinels> {
        self.inner.sentinel.as_ref().map(|f| &f.sentinels)
    }

    /// Asks the sentinels where the master is and, when it moved, follows it: the connections
    /// handed out ([`Conn::Master`]) go there from their next command on.
    pub async fn locate(&self) -> Result<Found, SentinelError> {
        let Some(f) = &self.inner.sentinel else {
            return Ok(Found {
                addr: self.node(),
                confirmed: true,
                by: String::new(),
            });
        };
        let found = f.sentinels.locate().await?;
        self.move_to(&found.addr).await;
        Ok(found)
    }

    /// The URL, credentials included: for [`connect::explain`], never for printing.
    pub fn url(&self) -> &Secret {
        &self.inner.url
    }

    /// Takes `addr` as the master from now on (with Sentinel; nothing otherwise): connections
    /// handed out ([`Conn::Master`]) go there from their next command on, and commands held
    /// for a promotion ([`Keyspace::promoting`]) go.
    pub async fn move_to(&self, addr: &str) {
        let Some(f) = &self.inner.sentinel else {
            return;
        };
        if *f.master.read().unwrap_or_else(|p| p.into_inner()) == addr && *f.open.borrow() {
            return;
        }
        // Under the lock `db_conn` makes connections under: none to the old master is made
        // after this.
        let mut conns = self.inner.conns.lock().await;
        let mut master = f.master.write().unwrap_or_else(|p| p.into_inner());
        if *master != addr {
            *master = addr.to_string();
            conns.clear();
        }
        f.open.send_replace(true);
    }

    /// A failover picked the replica at `addr` to be promoted (with Sentinel; nothing
    /// otherwise): from now on commands go neither to the old master nor, until
    /// [`Keyspace::promoted`], to `addr`: they wait. The old master takes writes until the
    /// sentinels reconfigure it, but what is written there now may never reach the new one; the
    /// replica refuses every write (`READONLY`) until it is promoted, and a refused write is
    /// lost once its retries run out (a sent job's acknowledgement: the job ran again when its
    /// lease ended, see docs/how-it-works.md#following-the-master). A promotion takes well under a second; the
    /// follower gives up on one after 10 s.
    pub async fn promoting(&self, addr: &str) {
        let Some(f) = &self.inner.sentinel else {
            return;
        };
        let mut conns = self.inner.conns.lock().await;
        f.open.send_replace(false);
        let mut master = f.master.write().unwrap_or_else(|p| p.into_inner());
        if *master != addr {
            *master = addr.to_string();
            conns.clear();
        }
    }

    /// The promotion [`Keyspace::promoting`] waited for is over (the replica is master, or
    /// the follower gave up on it and asks the sentinels): held commands go to the master
    /// named now.
    pub fn promoted(&self) {
        if let Some(f) = &self.inner.sentinel {
            f.open.send_replace(true);
        }
    }

    /// `host:port` of the node of the URL (the seed, on a cluster; the master last located,
    /// with Sentinel), safe to print.
    pub fn node(&self) -> String {
        match &self.inner.sentinel {
            Some(f) => f.master.read().unwrap_or_else(|p| p.into_inner()).clone(),
            None => self.inner.node.clone(),
        }
    }

    pub fn is_cluster(&self) -> bool {
        self.inner.cluster.is_some()
    }

    /// A client for database `db` of the URL's node (of the master, with Sentinel).
    pub fn client(&self, db: u32) -> Result<redis::Client, ConnectError> {
        if self.inner.sentinel.is_some() {
            let master = self.node();
            let at = crate::keyspace::cluster::host_port(&master).ok_or_else(|| {
                ConnectError::BadUrl(format!("the sentinels named `{master}`, not host:port"))
            })?;
            return connect::client_at(&self.inner.url, &self.inner.settings, db, Some(at))
                .map(|(c, _)| c);
        }
        connect::client(&self.inner.url, &self.inner.settings, db).map(|(c, _)| c)
    }

    /// A client for the node at `addr` (`host:port`), with the URL's credentials and TLS.
    pub fn client_for(&self, addr: &str) -> Result<redis::Client, ConnectError> {
        let at = crate::keyspace::cluster::host_port(addr)
            .ok_or_else(|| ConnectError::BadUrl(format!("`{addr}` is not host:port")))?;
        connect::client_at(&self.inner.url, &self.inner.settings, 0, Some(at)).map(|(c, _)| c)
    }

    /// A connection for the keys of database `db` (cheap to clone; reconnects by itself).
    pub async fn conn(&self, db: u32) -> RedisResult<Conn> {
        if let Some(cluster) = &self.inner.cluster {
            let c = cluster
                .conn
                .get_or_try_init(|| cluster.client.get_async_connection())
                .await?;
            return Ok(Conn::Cluster(c.clone(), self.clone()));
        }
        if self.inner.sentinel.is_some() {
            // Connects now, so that a master that cannot be reached fails here as on one node.
            self.db_conn(db).await?;
            return Ok(Conn::Master(self.clone(), db));
        }
        self.db_conn(db)
            .await
            .map(|(c, client)| Conn::Node(c, Some(Arc::new(client))))
    }

    /// The URL node's connection for database `db`; with Sentinel, once the master named is
    /// no replica being promoted ([`Keyspace::promoting`]).
    async fn db_conn(&self, db: u32) -> RedisResult<(ConnectionManager, redis::Client)> {
        loop {
            self.until_open().await;
            let mut conns = self.inner.conns.lock().await;
            // Closed again between the wait and the lock (a second promotion): wait again.
            if self
                .inner
                .sentinel
                .as_ref()
                .is_some_and(|f| !*f.open.borrow())
            {
                continue;
            }
            if let Some(c) = conns.get(&db) {
                return Ok(c.clone());
            }
            let client = self.client(db).map_err(settings_error)?;
            let c = connect::manager(&client).await?;
            conns.insert(db, (c.clone(), client.clone()));
            return Ok((c, client));
        }
    }

    /// Resolves at once, or once the promotion under way is over ([`Keyspace::promoting`]).
    async fn until_open(&self) {
        if let Some(f) = &self.inner.sentinel {
            // The sender lives as long as `self`: this ends when the gate opens.
            let _ = f.open.subscribe().wait_for(|open| *open).await;
        }
    }

    /// A connection to the one node `addr`, for what concerns that node alone (its
    /// `notify-keyspace-events`). On a single node, its database 0.
    pub async fn node_conn(&self, addr: &str) -> RedisResult<ConnectionManager> {
        let Some(cluster) = &self.inner.cluster else {
            return self.db_conn(0).await.map(|(c, _)| c);
        };
        let mut nodes = cluster.nodes.lock().await;
        if let Some(c) = nodes.get(addr) {
            return Ok(c.clone());
        }
        let client = self.client_for(addr).map_err(settings_error)?;
        let c = connect::manager(&client).await?;
        nodes.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Connections that together SCAN all of database `db`: the node's, or one straight to
    /// each master of a cluster (a node SCANs only the keys it owns).
    pub async fn scan_conns(&self, db: u32) -> RedisResult<Vec<Conn>> {
        if self.inner.cluster.is_none() {
            return Ok(vec![self.conn(db).await?]);
        }
        let mut out = Vec::new();
        for m in self.masters() {
            out.push(Conn::Node(self.node_conn(&m.addr).await?, None));
        }
        Ok(out)
    }

    /// Connections of their own that together SCAN database `db` (of the cluster master `only`,
    /// when given), for one walk: a page holding a key of megabytes grows a connection's read
    /// buffer to twice its length, which it keeps as long as it lives
    /// (docs/reliability.md#bounded-whatever-the-key), so the walk's go when it ends instead of
    /// staying with the connections every command shares.
    pub async fn walk_conns(&self, db: u32, only: Option<&str>) -> RedisResult<Vec<Conn>> {
        let clients = match (&self.inner.cluster, only) {
            (Some(_), Some(node)) => vec![self.client_for(node)],
            (Some(_), None) => self
                .masters()
                .iter()
                .map(|m| self.client_for(&m.addr))
                .collect(),
            (None, _) => {
                // With Sentinel, once the promotion under way is over, as for every command.
                self.until_open().await;
                vec![self.client(db)]
            }
        };
        let mut out = Vec::new();
        for client in clients {
            let client = client.map_err(settings_error)?;
            out.push(Conn::Node(connect::manager(&client).await?, None));
        }
        Ok(out)
    }

    /// The masters as last discovered (empty on a single node).
    pub fn masters(&self) -> Vec<Master> {
        match &self.inner.cluster {
            Some(c) => c.masters.read().unwrap_or_else(|p| p.into_inner()).clone(),
            None => Vec::new(),
        }
    }

    /// Reads the cluster's masters now, asking the seed and then every node seen before, and
    /// records them; drops direct connections to nodes that are no longer masters.
    pub async fn discover(&self) -> Result<Vec<Master>, DiscoverError> {
        let Some(cluster) = &self.inner.cluster else {
            return Ok(Vec::new());
        };
        let mut ask = vec![self.inner.node.clone()];
        ask.extend(
            cluster
                .known
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned(),
        );
        ask.dedup();
        let mut clients = Vec::new();
        for (i, addr) in ask.into_iter().enumerate() {
            let client = match i {
                0 => self.client(0),
                _ => self.client_for(&addr),
            };
            if let Ok(c) = client {
                clients.push((addr, c));
            }
        }
        let view = crate::keyspace::cluster::discover(&clients).await?;
        cluster
            .nodes
            .lock()
            .await
            .retain(|addr, _| view.masters.iter().any(|m| &m.addr == addr));
        *cluster.known.write().unwrap_or_else(|p| p.into_inner()) = view.known;
        *cluster.slots.write().unwrap_or_else(|p| p.into_inner()) = view.slots;
        *cluster.masters.write().unwrap_or_else(|p| p.into_inner()) = view.masters.clone();
        Ok(view.masters)
    }

    /// Asks for the topology to be read again soon (a subscriber lost its node).
    pub fn suspect(&self) {
        if let Some(c) = &self.inner.cluster {
            c.suspect.notify_one();
        }
        if let Some(f) = &self.inner.sentinel {
            f.suspect.notify_one();
        }
    }

    /// Resolves when [`Keyspace::suspect`] was called (never on a single node).
    pub async fn suspected(&self) {
        match (&self.inner.cluster, &self.inner.sentinel) {
            (Some(c), _) => c.suspect.notified().await,
            (_, Some(f)) => f.suspect.notified().await,
            _ => std::future::pending().await,
        }
    }
}

impl Keyspace {
    /// [`Conn::direct`] on a cluster: `args` sent on a connection of their own to the master
    /// of their key's slot, following `MOVED` and `ASK` (a slot moved since the last
    /// discovery) a few times; `None` when no master is known for the slot yet.
    async fn direct_to_slot(&self, args: &[&[u8]]) -> Option<RedisResult<Value>> {
        let cluster = self.inner.cluster.as_ref()?;
        let slot = crate::keyspace::cluster::slot(routing_key(args));
        let mut addr = {
            let slots = cluster.slots.read().unwrap_or_else(|p| p.into_inner());
            crate::keyspace::cluster::master_of(&slots, slot)?.to_string()
        };
        let mut asking = false;
        let mut redirects = 0;
        loop {
            let client = match self.client_for(&addr) {
                Ok(c) => c,
                Err(e) => return Some(Err(settings_error(e))),
            };
            let answer = direct::send(client, args, asking).await;
            let Err(e) = &answer else {
                return Some(answer);
            };
            let Some((to, _)) = e.redirect_node() else {
                return Some(answer);
            };
            if redirects == REDIRECTS {
                return Some(answer);
            }
            redirects += 1;
            // `MOVED`: the slot has a new master for good, which the next discovery records;
            // `ASK`: this one key is already on the node the slot is moving to.
            asking = e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask);
            if !asking {
                cluster.suspect.notify_one();
            }
            addr = to.to_string();
        }
    }
}

/// Redirections one [`Conn::direct`] command follows on a cluster before its answer is the
/// last redirection's error: a slot moves once per reshard step.
const REDIRECTS: usize = 3;

/// The key whose slot a command is sent to: the first key of a script (`EVAL`, `EVALSHA`,
/// `FCALL`: after the script and the number of keys), else the first argument. Every key of
/// one command must share a slot on a cluster anyway.
fn routing_key<'a>(args: &[&'a [u8]]) -> &'a [u8] {
    let name = args.first().copied().unwrap_or_default();
    let script = [
        &b"EVALSHA"[..],
        b"EVAL",
        b"FCALL",
        b"EVALSHA_RO",
        b"EVAL_RO",
        b"FCALL_RO",
    ]
    .iter()
    .any(|n| name.eq_ignore_ascii_case(n));
    let at = if script { 3 } else { 1 };
    args.get(at).copied().unwrap_or_default()
}

/// Where keywatch keeps its own state: `state.url` (always a single node), or the watched Redis
/// (through the cluster connection on a cluster: the state keys share one hash tag, see
/// [`crate::config::sections::tagged_prefix`]). The error is worded for the operator.
pub async fn state_conn(
    state_url: Option<&Secret>,
    settings: &RedisSettings,
    watched: &Keyspace,
) -> Result<Conn, String> {
    match state_url {
        Some(url) => {
            let (client, node) = connect::client(url, settings, 0).map_err(|e| e.to_string())?;
            connect::manager(&client)
                .await
                .map(|c| Conn::Node(c, Some(Arc::new(client))))
                .map_err(|e| {
                    let e = connect::explain(url, &e);
                    format!("cannot connect to the state Redis at {node}: {e}")
                })
        }
        None => watched.conn(0).await.map_err(|e| {
            // With Sentinel, the connection follows the master ([`Conn::Master`]).
            format!(
                "cannot connect to Redis at {}: {}",
                watched.node(),
                connect::explain(watched.url(), &e)
            )
        }),
    }
}

/// `name key` for each key (`PEXPIRETIME k`, `EXISTS k`…), for [`Conn::each`].
pub fn per_key(name: &str, keys: &[Vec<u8>]) -> Vec<Cmd> {
    keys.iter()
        .map(|k| {
            let mut c = redis::cmd(name);
            c.arg(k);
            c
        })
        .collect()
}

/// `command key` (`PEXPIRETIME`, `EXISTS`) for each of `keys`, answers in order: the short ones
/// in one pipeline, each key longer than [`crate::long_key::EXACT`] on a connection of its own,
/// written as it is ([`Conn::direct`], docs/reliability.md#bounded-whatever-the-key).
pub async fn each_key<K: AsRef<[u8]>>(
    conn: &Conn,
    command: &str,
    keys: &[K],
) -> redis::RedisResult<Vec<i64>> {
    let is_long = |k: &K| crate::long_key::is_long(k.as_ref());
    let short: Vec<redis::Cmd> = keys
        .iter()
        .filter(|k| !is_long(k))
        .map(|k| {
            let mut c = redis::cmd(command);
            c.arg(k.as_ref());
            c
        })
        .collect();
    let short = conn.each::<i64>(short).await?;
    if short.len() == keys.len() {
        return Ok(short);
    }
    let mut short = short.into_iter();
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        if is_long(k) {
            let t = conn.direct(&[command.as_bytes(), k.as_ref()]).await?;
            out.push(redis::from_redis_value(t)?);
        } else {
            out.push(short.next().unwrap_or(-2));
        }
    }
    Ok(out)
}

/// One page of `SCAN cursor MATCH glob COUNT count`: the next cursor (0 when done) and the keys.
pub async fn scan_page(
    conn: &mut impl redis::aio::ConnectionLike,
    cursor: u64,
    glob: &[u8],
    count: usize,
) -> redis::RedisResult<(u64, Vec<Vec<u8>>)> {
    redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(glob)
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await
}

/// A command as text, its arguments joined by spaces (non-UTF-8 bytes lossily): what tests
/// compare built commands against.
#[cfg(test)]
pub(crate) fn command_text(c: &Cmd) -> String {
    c.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
            _ => "<other>".into(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

crate::keyspace::commands::declare! {
    /// The commands this plumbing sends ([`commands`]).
    [
        Use::new(Server::Watched, "scan", "pages of SCAN (see the callers)")
            .args("0 MATCH keywatch-doctor COUNT 10")
            .when(When::ForCallers),
    ]
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;
    use crate::config::{Notifications, SentinelSettings};

    fn settings(sentinel: bool) -> RedisSettings {
        RedisSettings {
            url: None,
            cluster: false,
            databases: vec![0],
            notifications: Notifications::Check,
            tls: None,
            username: None,
            password: None,
            sentinel: sentinel.then(|| SentinelSettings {
                master: "mymaster".into(),
                nodes: vec!["127.0.0.1:26379".into()],
                password: None,
            }),
        }
    }

    fn keyspace(sentinel: bool) -> Keyspace {
        Keyspace::new(Secret::new("redis://127.0.0.1:6379"), settings(sentinel)).unwrap()
    }

    /// A connection apart is another client of the same server: what waits on the shared one
    /// (here a blocked `BLPOP`) does not hold it back, and it is what wakes the waiter.
    #[tokio::test]
    async fn a_connection_apart_is_not_held_back_by_the_shared_one() {
        let (_server, shared) = crate::local_redis::throwaway().await;
        let apart = shared.apart().await.unwrap();
        let id = |c: Conn| async move {
            redis::cmd("CLIENT")
                .arg("ID")
                .query_async::<i64>(&mut c.clone())
                .await
                .unwrap()
        };
        assert_ne!(id(shared.clone()).await, id(apart.clone()).await);
        let mut blocked = shared.clone();
        let waiter = tokio::spawn(async move {
            redis::cmd("BLPOP")
                .arg("wake")
                .arg(0)
                .query_async::<(String, String)>(&mut blocked)
                .await
        });
        // The waiter is blocked once Redis counts it (a signal, not a sleep).
        loop {
            let info: String = redis::cmd("INFO")
                .arg("clients")
                .query_async(&mut apart.clone())
                .await
                .unwrap();
            if info.lines().any(|l| l == "blocked_clients:1") {
                break;
            }
            tokio::task::yield_now().await;
        }
        // On the shared connection this would wait behind the BLPOP for ever; a hang fails here.
        let pushed = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            redis::cmd("LPUSH")
                .arg("wake")
                .arg("up")
                .query_async::<i64>(&mut apart.clone()),
        )
        .await;
        assert_eq!(pushed.unwrap().unwrap(), 1);
        assert_eq!(
            waiter.await.unwrap().unwrap(),
            ("wake".to_string(), "up".to_string())
        );
    }

    #[tokio::test]
    async fn commands_wait_while_the_replica_is_promoted_then_go_there() {
        let k = keyspace(true);
        k.move_to("127.0.0.1:6379").await;
        assert!(k.until_open().now_or_never().is_some());
        k.promoting("127.0.0.1:6380").await;
        assert_eq!(k.node(), "127.0.0.1:6380");
        let mut waiting = Box::pin(k.until_open());
        assert!((&mut waiting).now_or_never().is_none());
        k.promoted();
        assert!(waiting.now_or_never().is_some());
        assert_eq!(k.node(), "127.0.0.1:6380");
    }

    #[tokio::test]
    async fn a_promotion_given_up_on_ends_where_the_sentinels_say() {
        let k = keyspace(true);
        k.move_to("127.0.0.1:6379").await;
        k.promoting("127.0.0.1:6380").await;
        assert!(k.until_open().now_or_never().is_none());
        // The sentinels still name the old master: commands go back there.
        k.move_to("127.0.0.1:6379").await;
        assert!(k.until_open().now_or_never().is_some());
        assert_eq!(k.node(), "127.0.0.1:6379");
    }

    /// Two nodes started in cluster mode, each serving half of the slots, once each sees the
    /// other and says the cluster is up; and each one's node id.
    fn two_node_cluster() -> [(crate::local_redis::LocalRedis, String); 2] {
        let start = || {
            crate::local_redis::LocalRedis::start(&["--cluster-enabled", "yes"])
                .expect("a redis-server in cluster mode")
        };
        let (a, b) = (start(), start());
        let conn = |s: &crate::local_redis::LocalRedis| {
            redis::Client::open(s.url())
                .unwrap()
                .get_connection()
                .unwrap()
        };
        let id = |s: &crate::local_redis::LocalRedis| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut conn(s))
                .unwrap()
        };
        for (s, (first, last)) in [(&a, (0, 8191)), (&b, (8192, 16383))] {
            let () = redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(first)
                .arg(last)
                .query(&mut conn(s))
                .unwrap();
        }
        let () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(b.port())
            .query(&mut conn(&a))
            .unwrap();
        for _ in 0..400 {
            let known = |s| -> usize {
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(&mut conn(s))
                    .unwrap();
                cluster::parse_nodes(&nodes).masters.len()
            };
            let ok = |s| {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut conn(s))
                    .unwrap();
                info.contains("cluster_state:ok")
            };
            if known(&a) == 2 && known(&b) == 2 && ok(&a) && ok(&b) {
                let (ia, ib) = (id(&a), id(&b));
                return [(a, ia), (b, ib)];
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        panic!("the two nodes never saw each other");
    }

    /// A long key's command on a cluster goes to its slot's master, and follows the slot when
    /// it is moving (`ASK`) and once it has moved (`MOVED`) since the slots were last read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_command_follows_its_slot_on_a_cluster() {
        let [(a, a_id), (b, b_id)] = tokio::task::spawn_blocking(two_node_cluster).await.unwrap();
        let mut set = settings(false);
        set.cluster = true;
        let k = Keyspace::new(Secret::new(a.url()), set).unwrap();
        k.discover().await.unwrap();
        let conn = k.conn(0).await.unwrap();
        // A key of the first half (A's), and one of its slot's neighbours for later.
        let key = (0..)
            .map(|n| format!("long:{n}"))
            .find(|k| cluster::slot(k.as_bytes()) < 8192)
            .unwrap();
        let slot = cluster::slot(key.as_bytes());
        let on = |s: &crate::local_redis::LocalRedis, cmd: &mut redis::Cmd| -> redis::Value {
            let mut c = redis::Client::open(s.url())
                .unwrap()
                .get_connection()
                .unwrap();
            cmd.query(&mut c).unwrap()
        };
        let keys_in =
            |s| -> redis::Value { on(s, redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot)) };
        // Where the slots say.
        let got = conn.direct(&[b"SET", key.as_bytes(), b"1"]).await.unwrap();
        assert_eq!(got, Value::Okay);
        assert_eq!(keys_in(&a), Value::Int(1));
        let _ = conn.direct(&[b"DEL", key.as_bytes()]).await.unwrap();
        // Moving from A to B, the key not on A: A answers `ASK`.
        on(
            &b,
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("IMPORTING")
                .arg(&a_id),
        );
        on(
            &a,
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("MIGRATING")
                .arg(&b_id),
        );
        let got = conn.direct(&[b"SET", key.as_bytes(), b"2"]).await.unwrap();
        assert_eq!(got, Value::Okay);
        assert_eq!(keys_in(&b), Value::Int(1));
        assert_eq!(keys_in(&a), Value::Int(0));
        // Moved: A answers `MOVED`, the slots as read say A still.
        for s in [&a, &b] {
            on(
                s,
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&b_id),
            );
        }
        let got = conn
            .direct(&[b"GETSET", key.as_bytes(), b"3"])
            .await
            .unwrap();
        assert_eq!(got, Value::BulkString(b"2".to_vec()));
        // A script's key is its routing key.
        let got = conn
            .direct(&[
                b"EVAL",
                b"return redis.call('GET', KEYS[1])",
                b"1",
                key.as_bytes(),
            ])
            .await
            .unwrap();
        assert_eq!(got, Value::BulkString(b"3".to_vec()));
    }

    #[tokio::test]
    async fn without_sentinel_nothing_waits() {
        let k = keyspace(false);
        k.promoting("127.0.0.1:6380").await;
        assert!(k.until_open().now_or_never().is_some());
        assert_eq!(k.node(), "127.0.0.1:6379");
    }
}
