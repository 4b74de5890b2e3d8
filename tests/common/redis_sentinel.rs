//! A Sentinel-managed Redis of throwaway children: a master, a replica and three sentinels,
//! each a [`RedisServer`] on its own free port, for tests of failovers.

use std::time::{Duration, Instant};

use super::redis_server::RedisServer;
use super::wait::{PATIENCE, wait_until};

/// The name the sentinels monitor the master by.
pub const MASTER_NAME: &str = "mymaster";

/// A master, its replica and three sentinels (quorum 2). The replica starts without keyspace
/// notifications, as a replica set up before keywatch came along would.
pub struct RedisSentinels {
    /// Index 0 is the first master; after a failover [`Self::master`] says which one is.
    pub data: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
}

impl RedisSentinels {
    /// Starts the data nodes (the master with `flags` as its `notify-keyspace-events`) and the
    /// sentinels, and waits until every sentinel knows the replica and the other sentinels, so
    /// that a failover can be started at once.
    pub fn start(flags: &str) -> RedisSentinels {
        let master = RedisServer::builder().notify_keyspace_events(flags).start();
        let replica = RedisServer::builder().replica_of(&master.addr()).start();
        let sentinels = (0..3)
            .map(|_| {
                RedisServer::builder()
                    .sentinel(MASTER_NAME, &master.addr(), 2)
                    .start()
            })
            .collect();
        let set = RedisSentinels {
            data: vec![master, replica],
            sentinels,
        };
        set.wait_settled();
        set
    }

    /// `["127.0.0.1:P1", "127.0.0.1:P2", "127.0.0.1:P3"]`, for `redis.sentinel.nodes`.
    pub fn nodes_yaml(&self) -> String {
        let nodes: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("\"{}\"", s.addr()))
            .collect();
        format!("[{}]", nodes.join(", "))
    }

    /// What sentinel `i` says the master is (`host:port`).
    pub fn master_addr_by(&self, i: usize) -> Option<String> {
        let reply: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER_NAME)
            .query(&mut self.sentinels[i].conn())
            .ok()?;
        reply.map(|(h, p)| format!("{h}:{p}"))
    }

    /// Every sentinel knows a replica in good state and the two other sentinels.
    pub fn wait_settled(&self) {
        wait_until(
            "the sentinels know each other and the replica",
            PATIENCE,
            || {
                self.sentinels.iter().all(|s| {
                    let mut c = s.conn();
                    let replicas: Vec<Vec<String>> = redis::cmd("SENTINEL")
                        .arg("REPLICAS")
                        .arg(MASTER_NAME)
                        .query(&mut c)
                        .unwrap_or_default();
                    let good = replicas.iter().any(|r| {
                        field(r, "flags").is_some_and(|f| f == "slave")
                            && field(r, "master-link-status").is_some_and(|l| l == "ok")
                    });
                    let others: Vec<Vec<String>> = redis::cmd("SENTINEL")
                        .arg("SENTINELS")
                        .arg(MASTER_NAME)
                        .query(&mut c)
                        .unwrap_or_default();
                    good && others.len() == self.sentinels.len() - 1
                })
            },
        );
    }

    /// `SENTINEL FAILOVER` on the first sentinel (again while it answers that a failover is in
    /// progress or no replica is fit yet); returns when it was accepted.
    pub fn failover(&self) -> Instant {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let started = Instant::now();
            let r: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(MASTER_NAME)
                .query(&mut self.sentinels[0].conn());
            match r {
                Ok(_) => return started,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("SENTINEL FAILOVER: {e}; trying again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!(
                    "SENTINEL FAILOVER was refused: {e}\n{}",
                    self.sentinels[0].log_tail()
                ),
            }
        }
    }
}

/// A field of a `SENTINEL REPLICAS` entry (a flat list of names and values).
fn field<'a>(entry: &'a [String], name: &str) -> Option<&'a str> {
    entry
        .chunks(2)
        .find(|kv| kv[0] == name)
        .and_then(|kv| kv.get(1))
        .map(String::as_str)
}
