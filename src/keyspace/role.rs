//! What a node says it is (`ROLE`), and why only a master may be watched.
//!
//! Keyspace events of expiring keys are published only where keys expire: on a master. A replica
//! applies its master's deletions, so a subscriber there hears `del` where `expired` was meant,
//! and the ledger's reads cannot make it expire anything. `run` asks `ROLE` before every
//! subscription (and while subscribed) and `doctor` checks the same, in the same words.

use redis::Value;
use redis::aio::ConnectionLike;

/// A node's answer to `ROLE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Master,
    /// A replica, and the master it follows (`host:port` as the replica was told it).
    Replica {
        master: String,
    },
    Sentinel,
    Other(String),
}

/// Asks the node behind `conn` what it is.
pub async fn read(conn: &mut impl ConnectionLike) -> redis::RedisResult<Role> {
    let reply: Value = redis::cmd("ROLE").query_async(conn).await?;
    Ok(parse(&reply))
}

fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn parse(reply: &Value) -> Role {
    let Value::Array(items) = reply else {
        return Role::Other(format!("{reply:?}"));
    };
    match text(items.first()).as_deref() {
        Some("master") => Role::Master,
        Some("slave" | "replica") => {
            let host = text(items.get(1)).unwrap_or_else(|| "?".into());
            let port = text(items.get(2)).unwrap_or_else(|| "?".into());
            Role::Replica {
                master: format!("{host}:{port}"),
            }
        }
        Some("sentinel") => Role::Sentinel,
        other => Role::Other(other.unwrap_or("?").to_string()),
    }
}

/// Why `node`, a replica of `master`, is not watched: the words `run` logs and `doctor` prints.
pub fn replica_problem(node: &str, master: &str) -> String {
    format!(
        "{node} is a replica of {master}: replicas never publish `expired` (they apply the master's deletions, heard as `del`), and the ledger cannot make them expire keys"
    )
}

/// What to point keywatch at instead of a replica of `master`.
pub fn replica_fix(master: &str) -> String {
    format!(
        "point keywatch at the master: --redis redis://{master} (with the same credentials), or let it follow the master with `redis.sentinel`"
    )
}

/// Why `node` is not watched, or `None` for a master.
pub fn refusal(node: &str, role: &Role) -> Option<String> {
    match role {
        Role::Master => None,
        Role::Replica { master } => Some(format!(
            "{}; {}",
            replica_problem(node, master),
            replica_fix(master)
        )),
        Role::Sentinel => Some(format!(
            "{node} is a Sentinel, not a data node: list it under `redis.sentinel.nodes` and point `redis.url` at the data nodes' credentials"
        )),
        Role::Other(what) => Some(format!(
            "{node} answers ROLE with `{what}`, not `master`: only a master publishes the expiries keywatch watches"
        )),
    }
}

crate::keyspace::commands::declare! {
    /// The commands the role check sends ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "role", "never watch a replica as if it were the master"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn roles_are_read_from_the_reply() {
        let master = Value::Array(vec![bulk("master"), Value::Int(0), Value::Array(vec![])]);
        assert_eq!(parse(&master), Role::Master);
        let replica = Value::Array(vec![
            bulk("slave"),
            bulk("10.0.0.1"),
            Value::Int(6380),
            bulk("connected"),
            Value::Int(14),
        ]);
        assert_eq!(
            parse(&replica),
            Role::Replica {
                master: "10.0.0.1:6380".into()
            }
        );
        let sentinel = Value::Array(vec![bulk("sentinel"), Value::Array(vec![bulk("m")])]);
        assert_eq!(parse(&sentinel), Role::Sentinel);
    }

    #[test]
    fn a_replica_is_refused_with_its_master_to_point_at() {
        let why = refusal(
            "127.0.0.1:6381",
            &Role::Replica {
                master: "127.0.0.1:6380".into(),
            },
        )
        .unwrap();
        assert!(
            why.contains("127.0.0.1:6381 is a replica of 127.0.0.1:6380"),
            "{why}"
        );
        assert!(why.contains("--redis redis://127.0.0.1:6380"), "{why}");
        assert_eq!(refusal("n", &Role::Master), None);
    }
}
