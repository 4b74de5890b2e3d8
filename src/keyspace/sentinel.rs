//! Asking Redis Sentinel where the master is.
//!
//! The sentinels are asked in the order `redis.sentinel.nodes` lists them, the first that
//! answers wins; an answer is checked with the node's own `ROLE`, since a sentinel may still
//! name the old master for a moment after a failover. Sentinels have their own password
//! (`redis.sentinel.password`) and no database; TLS and its files follow `redis.url`.
//!
//! Not redis-rs's `sentinel` feature: its lookup sends `SENTINEL MASTERS` (every master's
//! details, a wider ACL than `SENTINEL GET-MASTER-ADDR-BY-NAME`), reports only the last
//! sentinel's error, and hands back a client where keywatch needs the address (for the
//! subscriber, the flag checks and the state connection, which all follow the master).

use std::time::Duration;

use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;

use crate::config::{RedisSettings, Secret, SentinelSettings};
use crate::keyspace::connect::{self, ConnectError};
use crate::keyspace::role::{self, Role};

/// How long one sentinel may take to connect and answer before the next is asked.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// Why no sentinel named a master.
#[derive(Debug, thiserror::Error)]
pub enum SentinelError {
    #[error("no sentinel named the master `{name}` ({tried})")]
    NoAnswer { name: String, tried: String },
    #[error(transparent)]
    Settings(#[from] ConnectError),
}

/// What a lookup found: the master's `host:port`, and whether its `ROLE` confirmed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub addr: String,
    pub confirmed: bool,
    /// The sentinel that named it.
    pub by: String,
}

/// The sentinels of one master, with what it takes to reach them and the master.
#[derive(Clone, Debug)]
pub struct Sentinels {
    pub settings: SentinelSettings,
    url: Secret,
    redis: RedisSettings,
}

impl Sentinels {
    pub fn new(settings: SentinelSettings, url: Secret, redis: RedisSettings) -> Sentinels {
        Sentinels {
            settings,
            url,
            redis,
        }
    }

    /// The name the sentinels know the master by.
    pub fn name(&self) -> &str {
        &self.settings.master
    }

    /// A client for the sentinel at `addr`.
    pub fn client(&self, addr: &str) -> Result<redis::Client, ConnectError> {
        connect::sentinel_client(
            &self.url,
            &self.redis,
            addr,
            self.settings.password.as_ref(),
        )
    }

    /// A connection to the sentinel at `addr`, within [`ASK_TIMEOUT`].
    pub async fn connect(&self, addr: &str) -> Result<MultiplexedConnection, String> {
        let client = self.client(addr).map_err(|e| e.to_string())?;
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(ASK_TIMEOUT))
            .set_response_timeout(Some(ASK_TIMEOUT));
        client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .map_err(|e| e.to_string())
    }

    /// What the sentinel at `addr` says the master's address is.
    pub async fn ask(&self, addr: &str) -> Result<String, String> {
        let mut conn = self.connect(addr).await?;
        let reply: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(self.name())
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        match reply {
            Some((host, port)) => Ok(format!("{host}:{port}")),
            None => Err(format!("does not monitor a master named `{}`", self.name())),
        }
    }

    /// The master: the first sentinel's answer that the node confirms with `ROLE`; if none
    /// is confirmed (a failover under way), the first answer.
    pub async fn locate(&self) -> Result<Found, SentinelError> {
        let mut tried = Vec::new();
        let mut first: Option<Found> = None;
        for s in &self.settings.nodes {
            match self.ask(s).await {
                Ok(addr) => {
                    if self.is_master(&addr).await {
                        return Ok(Found {
                            addr,
                            confirmed: true,
                            by: s.clone(),
                        });
                    }
                    tried.push(format!("{s}: names {addr}, which is not a master"));
                    first.get_or_insert(Found {
                        addr,
                        confirmed: false,
                        by: s.clone(),
                    });
                }
                Err(e) => tried.push(format!("{s}: {e}")),
            }
        }
        first.ok_or_else(|| SentinelError::NoAnswer {
            name: self.name().to_string(),
            tried: tried.join("; "),
        })
    }

    /// Whether the node at `addr` answers `ROLE` as a master.
    pub async fn is_master(&self, addr: &str) -> bool {
        let Some((host, port)) = crate::keyspace::cluster::host_port(addr) else {
            return false;
        };
        let Ok((client, _)) = connect::client_at(&self.url, &self.redis, 0, Some((host, port)))
        else {
            return false;
        };
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(ASK_TIMEOUT))
            .set_response_timeout(Some(ASK_TIMEOUT));
        let Ok(mut conn) = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
        else {
            return false;
        };
        matches!(role::read(&mut conn).await, Ok(Role::Master))
    }
}

/// A `+selected-slave` message (`slave IP:PORT IP PORT @ NAME MASTERIP MASTERPORT`): the
/// replica the leading sentinel picked to promote, when it concerns `name`. From this moment on
/// the old master is on its way out, though it still takes writes until it is reconfigured.
pub fn selected(payload: &str, name: &str) -> Option<String> {
    let parts: Vec<&str> = payload.split_whitespace().collect();
    match parts.as_slice() {
        ["slave", _, host, port, "@", n, _, _] if *n == name => Some(format!("{host}:{port}")),
        _ => None,
    }
}

/// A `+switch-master` message: `NAME OLDHOST OLDPORT NEWHOST NEWPORT` → the new master's
/// `host:port`, when it concerns `name`.
pub fn switched_to(payload: &str, name: &str) -> Option<String> {
    let parts: Vec<&str> = payload.split_whitespace().collect();
    match parts.as_slice() {
        [n, _, _, host, port] if *n == name => Some(format!("{host}:{port}")),
        _ => None,
    }
}

crate::keyspace::commands::declare! {
    /// The commands sent to the sentinels ([`crate::keyspace::commands`]); the sentinels' ACL
    /// is their own (README, Sentinel).
    [
        Use::new(Server::Sentinel, "sentinel|get-master-addr-by-name", "where the master is")
            .args("mymaster")
            .when(When::Sentinel),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_names_the_new_master_of_its_own_name_only() {
        assert_eq!(
            switched_to("mymaster 127.0.0.1 6380 127.0.0.1 6381", "mymaster"),
            Some("127.0.0.1:6381".into())
        );
        assert_eq!(
            switched_to("other 127.0.0.1 6380 127.0.0.1 6381", "mymaster"),
            None
        );
        assert_eq!(switched_to("mymaster 1 2", "mymaster"), None);
    }

    #[test]
    fn a_selection_names_the_replica_to_be_promoted() {
        let msg = "slave 127.0.0.1:6381 127.0.0.1 6381 @ mymaster 127.0.0.1 6380";
        assert_eq!(selected(msg, "mymaster"), Some("127.0.0.1:6381".into()));
        assert_eq!(selected(msg, "other"), None);
        assert_eq!(selected("master mymaster 127.0.0.1 6380", "mymaster"), None);
    }
}
