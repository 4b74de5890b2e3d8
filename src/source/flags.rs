//! `notify-keyspace-events`: what is set, what the rules need, and the fix that keeps both.
//!
//! `CONFIG SET notify-keyspace-events Ex` replaces the whole set, silently dropping flags another
//! application relies on; keywatch only ever adds letters to what is there.

use std::collections::BTreeSet;

use crate::config::{Config, Notifications};

/// The letters `A` stands for (redis `src/server.h`, NOTIFY_ALL); `m`, `n`, `o`, `c` are not in it.
const ALL: &str = "g$lshzxetd";

/// The set of class letters a `notify-keyspace-events` value enables, with `A` expanded.
pub fn parse(value: &str) -> BTreeSet<char> {
    let mut out = BTreeSet::new();
    for c in value.chars() {
        if c == 'A' {
            out.extend(ALL.chars());
        } else if !c.is_whitespace() {
            out.insert(c);
        }
    }
    out
}

/// The letters of `needed` that `current` lacks, in the order of `needed`.
pub fn missing(current: &str, needed: &str) -> String {
    let have = parse(current);
    needed.chars().filter(|c| !have.contains(c)).collect()
}

/// `current` plus `needed`, written compactly (`A` when all its letters are there) so a human
/// reading the fix recognises their old value in it.
pub fn merged(current: &str, needed: &str) -> String {
    let mut set = parse(current);
    set.extend(needed.chars());
    let mut out = String::new();
    for c in ['K', 'E'] {
        if set.remove(&c) {
            out.push(c);
        }
    }
    if ALL.chars().all(|c| set.contains(&c)) {
        out.push('A');
        for c in ALL.chars() {
            set.remove(&c);
        }
    }
    out.extend(set);
    out
}

/// The letters the rules need on this server, and its `notify-keyspace-events` (`CONFIG GET`).
pub async fn read(
    conn: &mut impl redis::aio::ConnectionLike,
    config: &Config,
) -> (String, redis::RedisResult<String>) {
    let mut needed = config.needed_notify_flags();
    if config.uses_ledger() && evicts(conn).await {
        // Under an evicting maxmemory-policy the ledger must hear evictions, or an evicted key
        // would look like a missed expiry when its deadline comes.
        if !needed.contains('e') {
            needed.push('e');
        }
    }
    let current: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query_async(conn)
        .await;
    (
        needed,
        current.map(|v| v.get(1).cloned().unwrap_or_default()),
    )
}

/// Checks (or fixes, with `notifications: enable`) `notify-keyspace-events` against what the
/// rules need. Never overwrites flags another application set. `Ok(false)`: flags are missing
/// and `notifications: ignore` lets keywatch go on without them (`keywatch_notify_flags_ok`
/// says 0, so the alert on it fires); `Ok(true)`: the node has them (or, under `ignore`, they
/// cannot be read: a managed Redis that refuses `CONFIG`).
pub async fn ensure(
    conn: &mut impl redis::aio::ConnectionLike,
    config: &Config,
    node: &str,
) -> Result<bool, String> {
    let (needed, current) = read(conn, config).await;
    let current = match current {
        Ok(v) => v,
        Err(e) => {
            let msg = format!(
                "cannot read notify-keyspace-events on {node} ({e}). Managed Redis services often refuse CONFIG: set notify-keyspace-events to include `{needed}` in the service's settings (e.g. the ElastiCache parameter group), then set `redis.notifications: ignore` in the rules."
            );
            return match config.redis.notifications {
                Notifications::Ignore => {
                    tracing::warn!("{msg}");
                    Ok(true)
                }
                _ => Err(msg),
            };
        }
    };
    let missing = missing(&current, &needed);
    if missing.is_empty() {
        tracing::debug!(%node, flags = %current, "notify-keyspace-events has what the rules need.");
        return Ok(true);
    }
    let merged = merged(&current, &needed);
    let fix = fix(node, &merged).replace('\n', "\n  ");
    match config.redis.notifications {
        Notifications::Check => Err(format!(
            "Redis at {node} has notify-keyspace-events \"{current}\", which lacks `{missing}`: keywatch would miss events. This adds them and keeps the flags already set:\n  {fix}\nor set `redis.notifications: enable` to let keywatch add them at start-up."
        )),
        Notifications::Enable => {
            let set: Result<(), redis::RedisError> = redis::cmd("CONFIG")
                .arg("SET")
                .arg("notify-keyspace-events")
                .arg(&merged)
                .query_async(conn)
                .await;
            match set {
                Ok(()) => {
                    crate::internal_events::NotifyFlagsAdded {
                        node,
                        from: &current,
                        to: &merged,
                    }
                    .emit();
                    Ok(true)
                }
                Err(e) => Err(format!(
                    "cannot add `{missing}` to notify-keyspace-events on {node} ({e}). Do it by hand:\n  {fix}"
                )),
            }
        }
        Notifications::Ignore => {
            crate::internal_events::NotifyFlagsMissing {
                node,
                flags: &current,
                missing: &missing,
            }
            .emit();
            Ok(false)
        }
    }
}

/// The commands that set `merged` on `node` (`host:port`), now and across restarts.
pub fn fix(node: &str, merged: &str) -> String {
    let (host, port) = node.rsplit_once(':').unwrap_or((node, "6379"));
    format!(
        "redis-cli -h {host} -p {port} CONFIG SET notify-keyspace-events {merged}\n(and in redis.conf, to survive a restart: notify-keyspace-events {merged})"
    )
}

/// Whether the server may evict keys (`maxmemory-policy` other than `noeviction`).
async fn evicts(conn: &mut impl redis::aio::ConnectionLike) -> bool {
    let policy: Result<Vec<String>, redis::RedisError> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    policy
        .ok()
        .and_then(|v| v.get(1).cloned())
        .is_some_and(|p| p != "noeviction")
}

crate::keyspace::commands::declare! {
    /// The commands the check of `notify-keyspace-events` sends ([`crate::keyspace::commands`]).
    [
        Use::new(
            Server::Watched,
            "config|get",
            "reads notify-keyspace-events at start and after reconnects",
        )
        .args("notify-keyspace-events"),
        Use::new(
            Server::Watched,
            "config|get",
            "ledger: hears evictions under an evicting maxmemory-policy",
        )
        .args("maxmemory-policy")
        .when(When::Ledger),
        Use::new(
            Server::Watched,
            "config|set",
            "adds missing flags (`notifications: enable`)",
        )
        .access(Access::Write)
        .args("notify-keyspace-events {flags}")
        .when(When::EnableNotifications),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_missing_flags() {
        assert_eq!(missing("", "Exg"), "Exg");
        assert_eq!(missing("xE", "Ex"), "");
        assert_eq!(missing("AKE", "Exeg"), "");
        assert_eq!(missing("Kx", "Ex"), "E");
        assert_eq!(missing("El", "Exg"), "xg");
    }

    #[test]
    fn merging_keeps_what_was_there() {
        assert_eq!(merged("", "Ex"), "Ex");
        assert_eq!(merged("Kl", "Ex"), "KElx");
        assert_eq!(merged("AK", "Ex"), "KEA");
        let m = merged("Kls", "Exg");
        for c in "KlsExg".chars() {
            assert!(m.contains(c), "{m}");
        }
        assert!(parse(&merged("KEA", "Exegm")).contains(&'m'));
    }
}
