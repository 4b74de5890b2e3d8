//! The masters of a Redis Cluster, and the checks each of them needs.
//!
//! Keyspace events stay on the node that owns the key, so every master must publish them: its
//! `notify-keyspace-events` is checked one by one. Masters come from `CLUSTER NODES`, which
//! every version has; a master without slots holds no keys and is left out.

use redis::aio::MultiplexedConnection;

use crate::config::{Config, Secret};
use crate::keyspace::connect;

use super::info::Info;
use super::report::Report;
use super::{notifications, open, short};

/// `host:port` of every master that serves slots, from a `CLUSTER NODES` reply.
pub fn masters(nodes: &str) -> Vec<String> {
    let mut out: Vec<String> = nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            let is_master = flags.split(',').any(|f| f == "master");
            let failed = flags.split(',').any(|f| f == "fail" || f == "noaddr");
            if !is_master || failed || fields.len() < 9 {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let addr = fields[1].split(['@', ',']).next()?;
            Some(addr.to_string())
        })
        .collect();
    out.sort();
    out
}

/// The same URL (scheme, credentials, database) aimed at another node.
fn node_url(url: &Secret, addr: &str) -> Option<Secret> {
    let mut u = url::Url::parse(url.expose()).ok()?;
    let (host, port) = addr.rsplit_once(':')?;
    u.set_host(Some(host)).ok()?;
    u.set_port(Some(port.parse().ok()?)).ok()?;
    Some(Secret::new(u.to_string()))
}

pub async fn check(
    report: &mut Report,
    config: &Config,
    url: &Secret,
    conn: &mut MultiplexedConnection,
    info: Option<&Info>,
) {
    if info.is_some_and(|i| !i.cluster_enabled()) {
        report.fail(
            "cluster",
            "`redis.cluster: true`, but the server is not in cluster mode",
            Some("set `redis.cluster: false`, or point keywatch at a node of the cluster".into()),
        );
        return;
    }
    if !config.redis.cluster {
        report.fail(
            "cluster",
            "the server is a Redis Cluster node, but `redis.cluster` is false: keywatch would hear only the keys of this node",
            Some("set `redis.cluster: true` under `redis:` in the rules".into()),
        );
    }
    let nodes = match redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async::<String>(conn)
        .await
    {
        Ok(n) => n,
        Err(e) => {
            report.fail(
                "cluster",
                format!(
                    "CLUSTER NODES was refused ({}): the masters are unknown",
                    short(&e)
                ),
                Some("ACL SETUSER <user> +cluster|nodes".into()),
            );
            return;
        }
    };
    let masters = masters(&nodes);
    if masters.is_empty() {
        report.fail(
            "cluster",
            "CLUSTER NODES lists no master serving slots",
            Some(
                "finish setting up the cluster (CLUSTER ADDSLOTS / redis-cli --cluster create)"
                    .into(),
            ),
        );
        return;
    }
    report.ok(
        "cluster",
        format!(
            "{} master(s) serving slots: {}",
            masters.len(),
            masters.join(", ")
        ),
    );
    for addr in &masters {
        let name = format!("notifications {addr}");
        let client = node_url(url, addr).and_then(|u| connect::client(&u, &config.redis, 0).ok());
        let Some((client, node)) = client else {
            report.fail(&name, format!("cannot make a URL for {addr}"), None);
            continue;
        };
        match open(&client).await {
            Ok(mut c) => notifications(report, config, &mut c, &node, &name).await,
            Err(e) => report.fail(
                &name,
                format!("cannot connect to master {node}: {}", short(&e)),
                Some("keywatch must reach every master: check the address each node announces (cluster-announce-ip) and the firewall".into()),
            ),
        }
    }
}

crate::keyspace::commands::declare! {
    /// The commands the doctor's cluster check sends ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "cluster|nodes", "doctor: the cluster's masters")
            .when(When::Cluster),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masters_serving_slots_are_listed() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002,host-b master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7003@17003 master,fail - 0 0 3 connected 10923-16383
d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected
e5 127.0.0.1:7005@17005 master - 0 0 0 connected
";
        assert_eq!(masters(nodes), vec!["127.0.0.1:7001", "127.0.0.1:7002"]);
    }

    #[test]
    fn node_urls_keep_scheme_and_credentials() {
        let u = node_url(
            &Secret::new("rediss://kw:pw@10.0.0.1:6379/0"),
            "10.0.0.2:7000",
        )
        .unwrap();
        assert_eq!(u.expose(), "rediss://kw:pw@10.0.0.2:7000/0");
    }
}
