//! The `INFO` reply, read once: which server (Redis or Valkey) and version, the replication
//! role, and the expiry statistics doctor judges the backlog by.

use std::collections::HashMap;

/// `field:value` lines of every section; section headers and blank lines are skipped.
#[derive(Clone, Debug, Default)]
pub struct Info(HashMap<String, String>);

impl Info {
    pub fn parse(text: &str) -> Info {
        Info(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect(),
        )
    }

    pub fn get(&self, field: &str) -> Option<&str> {
        self.0.get(field).map(String::as_str)
    }

    pub fn number(&self, field: &str) -> Option<f64> {
        self.get(field)?.parse().ok()
    }

    /// The server and its own version. Valkey keeps `redis_version` at 7.2.4 for clients that
    /// test it, and says what it really is in `valkey_version` / `server_name`.
    pub fn server(&self) -> Option<Server> {
        let valkey = self.get("valkey_version");
        let is_valkey = valkey.is_some() || self.get("server_name") == Some("valkey");
        let text = valkey.or_else(|| self.get("redis_version"))?;
        Some(Server {
            kind: if is_valkey {
                ServerKind::Valkey
            } else {
                ServerKind::Redis
            },
            version: version(text),
            version_text: text.to_string(),
        })
    }

    /// `(master_host, master_port)` when this node is a replica.
    pub fn master_of_replica(&self) -> Option<(String, String)> {
        if !matches!(self.get("role"), Some("slave" | "replica")) {
            return None;
        }
        Some((
            self.get("master_host").unwrap_or("?").to_string(),
            self.get("master_port").unwrap_or("?").to_string(),
        ))
    }

    pub fn cluster_enabled(&self) -> bool {
        self.get("cluster_enabled") == Some("1")
    }

    /// `dbN:keys=…,expires=…` of the keyspace section: (db, keys, keys with a TTL).
    pub fn keyspace(&self) -> Vec<(u32, u64, u64)> {
        let mut out: Vec<(u32, u64, u64)> = self
            .0
            .iter()
            .filter_map(|(k, v)| {
                let db = k.strip_prefix("db")?.parse().ok()?;
                let field = |name: &str| -> u64 {
                    v.split(',')
                        .filter_map(|kv| kv.split_once('='))
                        .find(|(n, _)| *n == name)
                        .and_then(|(_, x)| x.parse().ok())
                        .unwrap_or(0)
                };
                Some((db, field("keys"), field("expires")))
            })
            .collect();
        out.sort();
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    Redis,
    Valkey,
}

impl ServerKind {
    pub fn name(self) -> &'static str {
        match self {
            ServerKind::Redis => "Redis",
            ServerKind::Valkey => "Valkey",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    pub kind: ServerKind,
    pub version: (u32, u32, u32),
    pub version_text: String,
}

impl Server {
    /// `PEXPIRETIME`, which the ledger and the scanner read deadlines with: Redis 7.0, and every
    /// Valkey (forked from 7.2).
    pub fn has_pexpiretime(&self) -> bool {
        self.kind == ServerKind::Valkey || self.version >= (7, 0, 0)
    }
}

fn version(text: &str) -> (u32, u32, u32) {
    let mut parts = text.split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or(0)
    });
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_redis_from_valkey_and_reads_versions() {
        let redis = Info::parse("# Server\r\nredis_version:7.0.15\r\nrole:master\r\n");
        let s = redis.server().unwrap();
        assert_eq!((s.kind, s.version), (ServerKind::Redis, (7, 0, 15)));
        assert!(s.has_pexpiretime());
        let valkey =
            Info::parse("redis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.0.0\r\n");
        let s = valkey.server().unwrap();
        assert_eq!((s.kind, s.version), (ServerKind::Valkey, (9, 0, 0)));
        let old = Info::parse("redis_version:6.2.14\r\n").server().unwrap();
        assert!(!old.has_pexpiretime());
    }

    #[test]
    fn reads_replication_and_keyspace() {
        let info = Info::parse(
            "# Replication\r\nrole:slave\r\nmaster_host:10.0.0.1\r\nmaster_port:6380\r\n\r\n# Keyspace\r\ndb0:keys=10,expires=4,avg_ttl=100\r\ndb3:keys=2,expires=0,avg_ttl=0\r\n",
        );
        assert_eq!(
            info.master_of_replica(),
            Some(("10.0.0.1".into(), "6380".into()))
        );
        assert_eq!(info.keyspace(), vec![(0, 10, 4), (3, 2, 0)]);
    }
}
