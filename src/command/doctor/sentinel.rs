//! The sentinels of `redis.sentinel`: each reachable, all naming the same master, enough of
//! them for a failover (`SENTINEL CKQUORUM`). The master they name is then checked like any
//! node (role, flags, permissions).

use crate::config::{Config, Secret};
use crate::keyspace::sentinel::Sentinels;

use super::report::Report;

/// Checks the sentinels; returns the master the first answering sentinel names, if any.
pub async fn check(report: &mut Report, config: &Config, url: &Secret) -> Option<String> {
    let settings = config.redis.sentinel.clone()?;
    let sentinels = Sentinels::new(settings, url.clone(), config.redis.clone());
    let name = sentinels.name().to_string();
    let mut named: Vec<(String, String)> = Vec::new();
    let mut first_conn = None;
    for addr in &sentinels.settings.nodes {
        let conn = match sentinels.connect(addr).await {
            Ok(c) => c,
            Err(e) => {
                report.fail(
                    "sentinel",
                    format!("cannot connect to the sentinel at {addr}: {e}"),
                    Some("check `redis.sentinel.nodes`, `redis.sentinel.password` and the firewall; a failover needs a majority of the sentinels".into()),
                );
                continue;
            }
        };
        match sentinels.ask(addr).await {
            Ok(master) => {
                report.ok(
                    "sentinel",
                    format!("{addr} names {master} master of `{name}`"),
                );
                named.push((addr.clone(), master));
                first_conn.get_or_insert(conn);
            }
            Err(e) => {
                let fix = if e.contains("NOPERM") || e.contains("NOAUTH") || e.contains("WRONGPASS")
                {
                    "grant the sentinels' user `+sentinel|get-master-addr-by-name +subscribe +ping` and `&+switch-master` (README, Sentinel)".to_string()
                } else {
                    format!("is `{name}` the name in the sentinels' `sentinel monitor` line?")
                };
                report.fail("sentinel", format!("{addr}: {e}"), Some(fix));
            }
        }
    }
    let first = named.first()?.1.clone();
    if named.iter().all(|(_, m)| *m == first) {
        report.ok(
            "sentinels agree",
            format!(
                "{} of {} sentinels name {first}",
                named.len(),
                sentinels.settings.nodes.len()
            ),
        );
    } else {
        let views: Vec<String> = named.iter().map(|(s, m)| format!("{s} → {m}")).collect();
        report.warn(
            "sentinels agree",
            format!(
                "the sentinels disagree on the master: {} (a failover under way, or a split)",
                views.join(", ")
            ),
            Some(
                "run doctor again in a few seconds; if it stays so, check the sentinels' logs"
                    .into(),
            ),
        );
    }
    if let Some(mut conn) = first_conn {
        let quorum: redis::RedisResult<String> = redis::cmd("SENTINEL")
            .arg("CKQUORUM")
            .arg(&name)
            .query_async(&mut conn)
            .await;
        match quorum {
            Ok(text) => report.ok("quorum", text),
            Err(e) => report.fail(
                "quorum",
                format!("SENTINEL CKQUORUM {name}: {e}"),
                Some("a failover needs the quorum of sentinels to agree and a majority to authorize it: start the missing sentinels or lower the quorum in `sentinel monitor`".into()),
            ),
        }
    }
    Some(first)
}

crate::keyspace::commands::declare! {
    /// What the doctor asks the sentinels besides the master's address
    /// ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Sentinel, "sentinel|ckquorum", "doctor: enough sentinels for a failover")
            .args("mymaster")
            .when(When::Sentinel),
    ]
}
