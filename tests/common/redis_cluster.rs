//! A Redis Cluster of throwaway `redis-server` children.
//!
//! Formed by hand (ADDSLOTS, SET-CONFIG-EPOCH, MEET, REPLICATE) rather than with
//! `redis-cli --cluster create`: it works for any number of masters (redis-cli insists on three),
//! needs no `redis-cli`, and decides which node is which, so tests can say "node 3 is the replica of
//! node 0". Nodes `0..masters` start as masters; the replicas of master `i` are nodes
//! `masters + i * replicas_per_master ..`. Each node's cluster bus gets its own free port
//! (`cluster-port`), so `port + 10000` need not be free.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::redis_server::{ClusterMode, RedisServer, RedisServerBuilder};

/// Upper bound for forming the cluster or for it to settle after a change.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
const SLOTS: u16 = 16384;

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    pub id: String,
    /// `127.0.0.1:PORT`, without the bus port.
    pub addr: String,
    pub flags: Vec<String>,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    pub link_state: String,
    /// Slot ranges, inclusive; importing/migrating markers are left out.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    pub fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    /// Flagged `fail` or `fail?` by the node that reported this line.
    pub fn is_failing(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?")
    }

    pub fn port(&self) -> u16 {
        self.addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in cluster node address {:?}", self.addr))
    }
}

/// Parses the output of `CLUSTER NODES`.
pub fn parse_cluster_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert!(fields.len() >= 8, "unexpected CLUSTER NODES line: {line:?}");
            // `ip:port@cport[,hostname]`
            let addr = fields[1]
                .split(['@', ','])
                .next()
                .unwrap_or_default()
                .to_owned();
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .map(|s| match s.split_once('-') {
                    Some((a, b)) => (a.parse().expect("slot"), b.parse().expect("slot")),
                    None => {
                        let slot = s.parse().expect("slot");
                        (slot, slot)
                    }
                })
                .collect();
            ClusterNode {
                id: fields[0].to_owned(),
                addr,
                flags: fields[2].split(',').map(str::to_owned).collect(),
                master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
                link_state: fields[7].to_owned(),
                slots,
            }
        })
        .collect()
}

/// How to start a [`RedisCluster`]; see [`RedisCluster::builder`].
#[derive(Clone, Debug)]
pub struct RedisClusterBuilder {
    masters: usize,
    replicas_per_master: usize,
    node_timeout: Duration,
    node: RedisServerBuilder,
}

impl RedisClusterBuilder {
    pub fn masters(mut self, masters: usize) -> Self {
        self.masters = masters;
        self
    }

    pub fn replicas_per_master(mut self, replicas: usize) -> Self {
        self.replicas_per_master = replicas;
        self
    }

    /// `notify-keyspace-events` on every node.
    pub fn notify_keyspace_events(mut self, flags: &str) -> Self {
        self.node = self.node.notify_keyspace_events(flags);
        self
    }

    /// `CONFIG SET name value` on every node at start.
    pub fn config(mut self, name: &str, value: &str) -> Self {
        self.node = self.node.config(name, value);
        self
    }

    pub fn start(self) -> RedisCluster {
        assert!(self.masters >= 1, "a cluster needs at least one master");
        let mode = ClusterMode {
            node_timeout_ms: self.node_timeout.as_millis() as u64,
        };
        let total = self.masters * (1 + self.replicas_per_master);
        let nodes: Vec<RedisServer> = (0..total)
            .map(|_| self.node.clone().cluster_mode(mode).start())
            .collect();
        let cluster = RedisCluster {
            nodes,
            masters: self.masters,
            replicas_per_master: self.replicas_per_master,
        };
        cluster.form();
        cluster
    }
}

/// A running Redis Cluster; see the module docs for which node is which at start.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    masters: usize,
    replicas_per_master: usize,
}

impl RedisCluster {
    /// `masters` masters with `replicas_per_master` replicas each, formed and settled.
    pub fn start(masters: usize, replicas_per_master: usize) -> RedisCluster {
        Self::builder()
            .masters(masters)
            .replicas_per_master(replicas_per_master)
            .start()
    }

    pub fn builder() -> RedisClusterBuilder {
        RedisClusterBuilder {
            masters: 3,
            replicas_per_master: 0,
            node_timeout: Duration::from_secs(5),
            // Replicas sync at once instead of after the default 5 s wait for more replicas.
            node: RedisServer::builder().config("repl-diskless-sync-delay", "0"),
        }
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// The URL of node 0, for clients that discover the rest.
    pub fn seed_url(&self) -> String {
        self.nodes[0].url()
    }

    /// Every node's URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `CLUSTER NODES` as seen by node `i`; `None` if it does not answer.
    pub fn view_of(&self, i: usize) -> Option<Vec<ClusterNode>> {
        let text: String = query(&self.nodes[i], redis::cmd("CLUSTER").arg("NODES"))?;
        Some(parse_cluster_nodes(&text))
    }

    /// `CLUSTER NODES` as seen by the first node that answers.
    pub fn cluster_nodes(&self) -> Vec<ClusterNode> {
        (0..self.nodes.len())
            .find_map(|i| self.view_of(i))
            .expect("no cluster node answers CLUSTER NODES")
    }

    /// Indices (into [`Self::nodes`]) of the current masters that serve slots and are not
    /// failing, according to the first node that answers.
    pub fn masters(&self) -> Vec<usize> {
        self.cluster_nodes()
            .iter()
            .filter(|n| n.is_master() && !n.is_failing() && !n.slots.is_empty())
            .map(|n| self.index_of_port(n.port()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// Indices of the current replicas of node `master`.
    pub fn replicas_of(&self, master: usize) -> Vec<usize> {
        let view = self.cluster_nodes();
        let port = self.nodes[master].port();
        let Some(master_id) = view.iter().find(|n| n.port() == port).map(|n| n.id.clone()) else {
            return Vec::new();
        };
        let mut replicas: Vec<usize> = view
            .iter()
            .filter(|n| n.master_id.as_deref() == Some(&master_id))
            .map(|n| self.index_of_port(n.port()))
            .collect();
        replicas.sort_unstable();
        replicas
    }

    /// Index of the node serving `key`'s slot, per the current view.
    pub fn master_for_key(&self, key: &str) -> usize {
        let slot = self.slot_of(key);
        self.cluster_nodes()
            .iter()
            .filter(|n| n.is_master() && !n.is_failing())
            .find(|n| n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|n| self.index_of_port(n.port()))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
    }

    /// `CLUSTER KEYSLOT key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        (0..self.nodes.len())
            .find_map(|i| {
                query(
                    &self.nodes[i],
                    redis::cmd("CLUSTER").arg("KEYSLOT").arg(key),
                )
            })
            .expect("no cluster node answers CLUSTER KEYSLOT")
    }

    /// A key `PREFIX<n>` that lives on node `master` (which must serve slots).
    pub fn key_on(&self, master: usize, prefix: &str) -> String {
        (0..10_000)
            .map(|n| format!("{prefix}{n}"))
            .find(|key| self.master_for_key(key) == master)
            .unwrap_or_else(|| panic!("no key {prefix}<n> found on node {master}"))
    }

    /// A cluster client seeded with every node.
    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::new(self.urls()).expect("build a cluster client")
    }

    /// `CLUSTER FAILOVER TAKEOVER` on replica `replica`; returns once every reachable node agrees
    /// that it is a master and the cluster is ok.
    pub fn failover_takeover(&self, replica: usize) {
        let mut conn = self.nodes[replica].conn();
        let () = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .arg("TAKEOVER")
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("CLUSTER FAILOVER TAKEOVER on node {replica}: {e}"));
        let port = self.nodes[replica].port();
        self.wait_until_settled(&format!("node {replica} is a master everywhere"), |views| {
            views.iter().all(|view| {
                view.iter()
                    .any(|n| n.port() == port && n.is_master() && !n.slots.is_empty())
            })
        });
    }

    /// Waits until every reachable node reports `cluster_state:ok` and they all agree on who
    /// serves which slots, plus `extra` over their views. Panics with every view on timeout.
    pub fn wait_until_settled(&self, what: &str, extra: impl FnMut(&[Vec<ClusterNode>]) -> bool) {
        self.wait_for_views(what, true, extra);
    }

    /// Polls every node's view until `extra` holds and, if `settled`, the cluster is ok and
    /// agrees on its slot map.
    fn wait_for_views(
        &self,
        what: &str,
        settled: bool,
        mut extra: impl FnMut(&[Vec<ClusterNode>]) -> bool,
    ) {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let views: Vec<Vec<ClusterNode>> = (0..self.nodes.len())
                .filter_map(|i| self.view_of(i))
                .collect();
            let is_settled = || {
                let states_ok = (0..self.nodes.len()).all(|i| match self.cluster_info(i) {
                    Some(info) => info.contains("cluster_state:ok"),
                    None => true, // a stopped node has no say
                });
                let slot_maps: BTreeSet<_> = views.iter().map(|v| slot_map(v)).collect();
                states_ok
                    && slot_maps.len() == 1
                    && slot_maps
                        .iter()
                        .next()
                        .is_some_and(|m| covered(m) == usize::from(SLOTS))
            };
            if !views.is_empty() && extra(&views) && (!settled || is_settled()) {
                return;
            }
            if Instant::now() >= deadline {
                let described: Vec<String> = (0..self.nodes.len())
                    .map(|i| {
                        format!(
                            "node {i} ({}): {:?}\n{}",
                            self.nodes[i].addr(),
                            self.cluster_info(i)
                                .and_then(|s| s.lines().next().map(str::to_owned)),
                            query::<String>(&self.nodes[i], redis::cmd("CLUSTER").arg("NODES"))
                                .unwrap_or_else(|| "(no answer)".into())
                        )
                    })
                    .collect();
                panic!(
                    "cluster did not settle within {SETTLE_TIMEOUT:?} ({what})\n{}",
                    described.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn cluster_info(&self, i: usize) -> Option<String> {
        query(&self.nodes[i], redis::cmd("CLUSTER").arg("INFO"))
    }

    fn index_of_port(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .unwrap_or_else(|| panic!("port {port} is not a node of this cluster"))
    }

    fn form(&self) {
        let ids: Vec<String> = self
            .nodes
            .iter()
            .map(|node| {
                let mut conn = node.conn();
                redis::cmd("CLUSTER")
                    .arg("MYID")
                    .query(&mut conn)
                    .unwrap_or_else(|e| panic!("CLUSTER MYID on {}: {e}", node.addr()))
            })
            .collect();
        for (i, node) in self.nodes.iter().enumerate() {
            let mut conn = node.conn();
            // Distinct epochs up front, as redis-cli does, so no epoch collision has to be
            // resolved (slowly) by the cluster itself.
            run(
                &mut conn,
                redis::cmd("CLUSTER").arg("SET-CONFIG-EPOCH").arg(i + 1),
                node,
            );
            if i < self.masters {
                let first = i * usize::from(SLOTS) / self.masters;
                let last = (i + 1) * usize::from(SLOTS) / self.masters - 1;
                let mut addslots = redis::cmd("CLUSTER");
                addslots
                    .arg("ADDSLOTS")
                    .arg((first..=last).collect::<Vec<_>>());
                run(&mut conn, &addslots, node);
            }
        }
        // Every node meets every later one: a full mesh at once, instead of waiting ~2 s for
        // gossip to spread the news from one seed.
        for (i, from) in self.nodes.iter().enumerate() {
            let mut conn = from.conn();
            for to in &self.nodes[i + 1..] {
                let bus = to.cluster_port().expect("cluster node has a bus port");
                run(
                    &mut conn,
                    redis::cmd("CLUSTER")
                        .arg("MEET")
                        .arg("127.0.0.1")
                        .arg(to.port())
                        .arg(bus),
                    from,
                );
            }
        }
        let total = self.nodes.len();
        let all_met = |views: &[Vec<ClusterNode>]| {
            views.len() == total
                && views.iter().all(|v| {
                    v.len() == total
                        && v.iter().all(|n| {
                            !n.flags.iter().any(|f| f == "handshake" || f == "noaddr")
                                && n.link_state == "connected"
                        })
                })
        };
        // Not "settled" yet: a master reports cluster_state:ok only 2 s after it started, time
        // that the replicas' initial sync below can overlap.
        self.wait_for_views("every node knows every other", false, all_met);

        for (m, master_id) in ids.iter().enumerate().take(self.masters) {
            for r in 0..self.replicas_per_master {
                let i = self.masters + m * self.replicas_per_master + r;
                let mut conn = self.nodes[i].conn();
                run(
                    &mut conn,
                    redis::cmd("CLUSTER").arg("REPLICATE").arg(master_id),
                    &self.nodes[i],
                );
            }
        }
        let replicas = self.nodes.len() - self.masters;
        self.wait_until_settled("every replica is attached and in sync", |views| {
            all_met(views)
                && views
                    .iter()
                    .all(|v| v.iter().filter(|n| n.master_id.is_some()).count() == replicas)
                && (self.masters..total).all(|i| {
                    query::<redis::InfoDict>(&self.nodes[i], redis::cmd("INFO").arg("replication"))
                        .and_then(|info| info.get::<String>("master_link_status"))
                        .is_some_and(|s| s == "up")
                })
        });
    }
}

/// slot range → address of the master serving it, as one node sees it.
fn slot_map(view: &[ClusterNode]) -> BTreeMap<(u16, u16), String> {
    view.iter()
        .filter(|n| n.is_master() && !n.is_failing())
        .flat_map(|n| n.slots.iter().map(move |&r| (r, n.addr.clone())))
        .collect()
}

fn covered(map: &BTreeMap<(u16, u16), String>) -> usize {
    map.keys().map(|&(a, b)| usize::from(b - a) + 1).sum()
}

/// Runs `cmd` on `node`; `None` if it cannot connect or the command fails.
fn query<T: redis::FromRedisValue>(node: &RedisServer, cmd: &redis::Cmd) -> Option<T> {
    let client = node.client();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    cmd.query(&mut conn).ok()
}

fn run(conn: &mut redis::Connection, cmd: &redis::Cmd, node: &RedisServer) {
    let () = cmd
        .query(conn)
        .unwrap_or_else(|e| panic!("{:?} on {}: {e}", cmd_name(cmd), node.addr()));
}

fn cmd_name(cmd: &redis::Cmd) -> String {
    cmd.args_iter()
        .take(2)
        .map(|a| match a {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => "<arg>".to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}
