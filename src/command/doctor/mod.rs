//! `keywatch doctor`: is this Redis ready for keywatch, and if not, what exactly to do.
//!
//! Each check prints a verdict (ok / warn / FAIL) and, where something is wrong, the exact fix:
//! reachability, server and version, replication role, cluster masters, `notify-keyspace-events`
//! against what the rules need, the permission of every command keywatch sends, the keys with a
//! TTL and the expiry backlog, and a sample count of each rule's keys. It connects the way `run`
//! does ([`crate::keyspace::connect`]) and changes nothing; secrets never reach its output (nodes are named
//! `host:port`).
//!
//! - [`report`]: verdicts and their rendering (table or JSON).
//! - [`info`]: the `INFO` reply: server, version, role, expiry statistics.
//! - [`permissions`]: the commands keywatch sends and how each permission is checked.
//! - [`cluster`]: the masters of a Redis Cluster, from `CLUSTER NODES`.
//! - [`sentinel`]: the sentinels of `redis.sentinel` and the master they name.

#[cfg(test)]
mod acl;
mod closest;
pub(crate) mod cluster;
#[cfg(test)]
mod guard;
pub(crate) mod info;
pub(crate) mod permissions;
pub(crate) mod report;
pub(crate) mod sentinel;
pub(crate) mod state_writers;

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;

use crate::config::{Config, Notifications, Secret};
use crate::keyspace::connect;
use crate::source::flags;

use info::Info;
use report::Report;

/// SCAN calls per rule pattern for the sample count: at `COUNT 1000`, up to 10,000 keys walked,
/// a few milliseconds of Redis time.
const SAMPLE_CALLS: usize = 10;
const SAMPLE_COUNT: usize = 1000;

/// Above this share of expired-but-not-yet-deleted keys Redis's expiry cycle is behind (its own
/// target is 10%, `ACTIVE_EXPIRE_CYCLE_ACCEPTABLE_STALE`).
const STALE_WARN_PERC: f64 = 10.0;

pub struct Options {
    /// `--redis`; else `KEYWATCH_REDIS_URL`, `redis.url`, the default.
    pub redis: Option<String>,
    pub json: bool,
}

/// Runs the checks and prints the report; exit 0 ready, 1 not ready, 2 a URL that does not
/// parse.
pub fn main(config: &Config, opts: &Options, rt: &tokio::runtime::Runtime) -> ExitCode {
    let url = connect::pick_url(
        opts.redis.as_deref(),
        std::env::var("KEYWATCH_REDIS_URL").ok(),
        &config.redis,
    );
    if let Err(e) = connect::client(&url, &config.redis, 0) {
        eprintln!("keywatch doctor: {e}");
        return ExitCode::from(2);
    }
    let report = rt.block_on(diagnose(config, &url));
    let out = if opts.json {
        format!("{}\n", report.json())
    } else {
        report.text()
    };
    // `keywatch doctor | head` must end quietly, not panic on the closed pipe.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    if report.ready() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// A connection with doctor's timeouts (also `run`'s check of its grants).
pub(crate) async fn open(client: &redis::Client) -> redis::RedisResult<MultiplexedConnection> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

/// Every check against the Redis at `url`.
pub async fn diagnose(config: &Config, url: &Secret) -> Report {
    // With Sentinel, the node to check is the master the sentinels name, reached with the
    // URL's credentials and TLS.
    let mut report = Report::new("?");
    let master = match &config.redis.sentinel {
        Some(_) => match sentinel::check(&mut report, config, url).await {
            Some(m) => Some(m),
            None => return report,
        },
        None => None,
    };
    let at = master
        .as_deref()
        .and_then(crate::keyspace::cluster::host_port);
    let (client, node) = match connect::client_at(url, &config.redis, 0, at) {
        Ok(c) => c,
        Err(e) => {
            report.fail("reachable", e.to_string(), None);
            return report;
        }
    };
    report.node = node.clone();
    let Some(mut conn) = reachable(&mut report, &client, url, &node).await else {
        return report;
    };
    let info = match redis::cmd("INFO").query_async::<String>(&mut conn).await {
        Ok(text) => Some(Info::parse(&text)),
        Err(e) => {
            report.warn(
                "info",
                format!("INFO was refused ({}): server, version, role and expiry statistics are unknown", short(&e)),
                Some(format!("ACL SETUSER {} +info", user_hint(&client))),
            );
            None
        }
    };
    if let Some(info) = &info {
        server(&mut report, config, info);
        role(&mut report, info, &node);
    }
    if config.watches_fields() {
        hash_fields(&mut report, &mut conn, &node).await;
    }
    let cluster = config.redis.cluster || info.as_ref().is_some_and(Info::cluster_enabled);
    if cluster {
        cluster::check(&mut report, config, url, &mut conn, info.as_ref()).await;
    } else {
        notifications(&mut report, config, &mut conn, &node, "notifications").await;
    }
    permissions(&mut report, config, &client, &mut conn).await;
    state_writers::check(&mut report, config, &client, &mut conn).await;
    if let Some(info) = &info {
        keyspace(&mut report, config, info);
        backlog(&mut report, info);
    }
    rule_samples(&mut report, config, url, at, cluster).await;
    report
}

async fn reachable(
    report: &mut Report,
    client: &redis::Client,
    url: &Secret,
    node: &str,
) -> Option<MultiplexedConnection> {
    let started = Instant::now();
    let conn = open(client).await;
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) => {
            report.fail(
                "reachable",
                match connect::not_redis(url, &e) {
                    Some(not_redis) => format!("cannot connect to {node}: {not_redis}"),
                    None => format!(
                        "cannot connect to {node}: {}{}",
                        short(&e),
                        connect::tls_hint(url, &e)
                    ),
                },
                Some("check the address (--redis, KEYWATCH_REDIS_URL or redis.url), the credentials (user and password in the URL, or redis.username/redis.password), TLS (rediss://) and the firewall".into()),
            );
            return None;
        }
    };
    match redis::cmd("PING").query_async::<String>(&mut conn).await {
        Ok(_) => {
            report.ok(
                "reachable",
                format!(
                    "{node} answered PING ({:.1} ms with connecting)",
                    started.elapsed().as_secs_f64() * 1000.0
                ),
            );
            Some(conn)
        }
        Err(e) => {
            report.fail(
                "reachable",
                format!("{node} refused PING: {}", short(&e)),
                Some(format!("ACL SETUSER {} +ping", user_hint(client))),
            );
            None
        }
    }
}

fn server(report: &mut Report, config: &Config, info: &Info) {
    let Some(s) = info.server() else {
        report.warn("server", "INFO does not say the server's version", None);
        return;
    };
    report.ok(
        "server",
        format!(
            "{} {}{}",
            s.kind.name(),
            s.version_text,
            if info.cluster_enabled() {
                " (cluster mode)"
            } else {
                ""
            }
        ),
    );
    let needs_deadlines = config.uses_ledger();
    match (needs_deadlines, s.has_pexpiretime()) {
        (false, _) => {}
        (true, true) => report.ok(
            "deadlines",
            "PEXPIRETIME is there: the deadline ledger keeps expiries on time and recovers missed ones",
        ),
        (true, false) => report.fail(
            "deadlines",
            format!(
                "{} {} has no PEXPIRETIME: the deadline ledger and the scanner cannot read deadlines",
                s.kind.name(),
                s.version_text
            ),
            Some("upgrade to Redis 7.0 or later, or Valkey".into()),
        ),
    }
}

/// `hexpired` rules need hash-field expiry (Valkey says `redis_version:7.2.4`: see
/// [`crate::source::fields::support`]).
async fn hash_fields(report: &mut Report, conn: &mut MultiplexedConnection, node: &str) {
    match crate::source::fields::support(conn, node).await {
        Ok(()) => report.ok(
            "hash-fields",
            format!("{node} expires hash fields: `hexpired` rules can be watched"),
        ),
        Err(why) => report.fail(
            "hash-fields",
            why,
            Some("upgrade to Redis 7.4 or later, or Valkey 9.0 or later".into()),
        ),
    }
}

fn role(report: &mut Report, info: &Info, node: &str) {
    // The same words `run` logs when it refuses a replica (`keyspace::role`).
    match info.master_of_replica() {
        None => report.ok("role", format!("{node} is a master")),
        Some((host, port)) => {
            let master = format!("{host}:{port}");
            report.fail(
                "role",
                crate::keyspace::role::replica_problem(node, &master),
                Some(crate::keyspace::role::replica_fix(&master)),
            )
        }
    }
}

/// `notify-keyspace-events` of one node against what the rules need.
pub(crate) async fn notifications(
    report: &mut Report,
    config: &Config,
    conn: &mut MultiplexedConnection,
    node: &str,
    name: &str,
) {
    let (needed, current) = flags::read(conn, config).await;
    let current = match current {
        Ok(v) => v,
        Err(e) => {
            let detail = format!(
                "cannot read notify-keyspace-events on {node}: CONFIG GET was refused ({}). Managed Redis services often rename or forbid CONFIG",
                short(&e)
            );
            let provider = format!(
                "set notify-keyspace-events to include `{needed}` in the service's settings (ElastiCache: the parameter group; Heroku: heroku redis:keyspace-notifications), then `redis.notifications: ignore` in the rules"
            );
            let fix = match e.code() {
                Some("NOPERM") => {
                    format!("grant +config|get (see the permissions line below), or {provider}")
                }
                _ => provider,
            };
            if config.redis.notifications == Notifications::Ignore {
                report.warn(
                    name,
                    format!("{detail}; `notifications: ignore` starts anyway"),
                    Some(fix),
                );
            } else {
                report.fail(name, detail, Some(fix));
            }
            return;
        }
    };
    let missing = flags::missing(&current, &needed);
    if missing.is_empty() {
        report.ok(
            name,
            format!("notify-keyspace-events on {node} is \"{current}\": it has the `{needed}` the rules need"),
        );
        return;
    }
    let merged = flags::merged(&current, &needed);
    let detail = format!(
        "notify-keyspace-events on {node} is \"{current}\", which lacks `{missing}` (the rules need `{needed}`): keywatch would miss events"
    );
    match config.redis.notifications {
        Notifications::Check => report.fail(name, detail, Some(flags::fix(node, &merged))),
        Notifications::Enable => report.ok(
            name,
            format!(
                "{detail}, but `notifications: enable` adds them at start (CONFIG SET notify-keyspace-events {merged}, keeping the flags set)"
            ),
        ),
        Notifications::Ignore => report.warn(
            name,
            format!("{detail}; `notifications: ignore` starts anyway"),
            Some(flags::fix(node, &merged)),
        ),
    }
}

/// The user the connection acts as: `ACL WHOAMI`, else the one in the settings, else `default`.
pub(crate) async fn whoami(client: &redis::Client, conn: &mut MultiplexedConnection) -> String {
    match redis::cmd("ACL")
        .arg("WHOAMI")
        .query_async::<String>(conn)
        .await
    {
        Ok(u) => u,
        Err(_) => user_hint(client),
    }
}

pub(crate) fn user_hint(client: &redis::Client) -> String {
    client
        .get_connection_info()
        .redis_settings()
        .username()
        .unwrap_or("default")
        .to_string()
}

async fn permissions(
    report: &mut Report,
    config: &Config,
    client: &redis::Client,
    conn: &mut MultiplexedConnection,
) {
    let g = match permissions::grants(config, client, conn, false).await {
        Ok(g) => g,
        Err(e) => {
            report.fail("state", e, None);
            return;
        }
    };
    let (user, how) = (&g.user, &g.how);
    if g.refused.iter().all(|r| r.optional) {
        report.ok(
            "permissions",
            format!(
                "user {user:?} may send the {} commands keywatch sends ({how})",
                g.needs - g.unchecked.len() - g.refused.len()
            ),
        );
    }
    // One line per kind of refusal, with one fix granting all of it: a missing `~prefix*`
    // refuses dozens of commands at once.
    for kind in ["command", "key", "channel", "other"] {
        let group: Vec<&permissions::Refusal> = g
            .refused
            .iter()
            .filter(|r| r.kind == kind && !r.optional)
            .collect();
        if group.is_empty() {
            continue;
        }
        let by = match kind {
            "other" => "by the server",
            _ => "by the ACL",
        };
        let mut detail = format!("{} command(s) refused {by} ({how}):", group.len());
        for r in group.iter().take(12) {
            detail.push('\n');
            detail.push_str(&r.what);
        }
        if group.len() > 12 {
            detail.push_str(&format!("\nand {} more", group.len() - 12));
        }
        report.fail(
            &format!("permissions ({kind})"),
            detail,
            permissions::fixes(&group),
        );
    }
    // What `run` does without, and says what that costs.
    let optional: Vec<&permissions::Refusal> = g.refused.iter().filter(|r| r.optional).collect();
    if !optional.is_empty() {
        let mut detail = format!(
            "{} optional command(s) refused ({how}); keywatch runs without them:",
            optional.len()
        );
        for r in &optional {
            detail.push('\n');
            detail.push_str(&r.what);
        }
        detail.push_str("\nwithout client-side tracking a FLUSHDB or FLUSHALL is noticed within a second (INFO commandstats), not at once, and a key it took away whose deadline fell in that second may be reported as a recovered expiry (docs/how-it-works.md#flushes-and-swaps)");
        report.warn(
            "permissions (optional)",
            detail,
            permissions::fixes(&optional),
        );
    }
    if !g.unchecked.is_empty() {
        report.warn(
            "permissions",
            format!(
                "{} command(s) could not be checked ({how}):\n{}",
                g.unchecked.len(),
                g.unchecked.join("\n")
            ),
            Some(format!(
                "run doctor as a user allowed ACL DRYRUN, or ACL SETUSER {user} +multi +discard"
            )),
        );
    }
}

fn keyspace(report: &mut Report, config: &Config, info: &Info) {
    let all = info.keyspace();
    let mut lines = Vec::new();
    for &db in &config.redis.databases {
        let (keys, expires) = all
            .iter()
            .find(|(d, _, _)| *d == db)
            .map_or((0, 0), |&(_, k, e)| (k, e));
        lines.push(format!("db{db}: {keys} keys, {expires} with a TTL"));
    }
    report.ok("keys", lines.join("; "));
}

fn backlog(report: &mut Report, info: &Info) {
    let Some(stale) = info.number("expired_stale_perc") else {
        return;
    };
    let expired = info.number("expired_keys").unwrap_or(0.0);
    let capped = info.number("expired_time_cap_reached_count").unwrap_or(0.0);
    let detail = format!(
        "expired_stale_perc {stale:.1}% (keys past their TTL not deleted yet), expired_keys {expired:.0}, expired_time_cap_reached_count {capped:.0}"
    );
    if stale > STALE_WARN_PERC {
        report.warn(
            "expiry backlog",
            format!(
                "{detail}: Redis's expiry cycle is behind, so it publishes `expired` late. keywatch's ledger pokes each watched key at its deadline, so its alerts stay on time anyway"
            ),
            None,
        );
    } else {
        report.ok("expiry backlog", detail);
    }
}

/// A bounded `SCAN MATCH` per rule: how many keys the rule would see, from a sample. A rule
/// no key matches although every key was walked warns, naming the keys that come closest to
/// its pattern (a typo in `match` passes `check`).
async fn rule_samples(
    report: &mut Report,
    config: &Config,
    url: &Secret,
    at: Option<(&str, u16)>,
    cluster: bool,
) {
    for &db in &config.redis.databases {
        let conn = match connect::client_at(url, &config.redis, db, at) {
            Ok((c, _)) => open(&c).await,
            Err(_) => continue,
        };
        let Ok(mut conn) = conn else { continue };
        // Every key of the database, read once and only for a rule that matched none.
        let mut every_key: Option<Vec<Vec<u8>>> = None;
        for rule in &config.rules {
            if rule.db.as_ref().is_some_and(|d| !d.contains(&db)) {
                continue;
            }
            let glob = rule.pattern.scan_glob();
            let mut cursor = 0u64;
            let (mut walked, mut found, mut complete) = (0usize, 0usize, false);
            let mut failed = None;
            for _ in 0..SAMPLE_CALLS {
                let step = crate::keyspace::scan_page(&mut conn, cursor, glob, SAMPLE_COUNT).await;
                let (next, keys) = match step {
                    Ok(s) => s,
                    Err(e) => {
                        failed = Some(short(&e));
                        break;
                    }
                };
                walked += SAMPLE_COUNT;
                found += keys
                    .iter()
                    .filter(|k| !k.starts_with(config.state.prefix.as_bytes()))
                    .filter(|k| rule.pattern.is_match(k))
                    .count();
                cursor = next;
                if next == 0 {
                    complete = true;
                    break;
                }
            }
            if let Some(e) = failed {
                report.warn(
                    &format!("rule {}", rule.name),
                    format!("cannot sample its keys: SCAN was refused ({e})"),
                    None,
                );
                continue;
            }
            let scope = if cluster { ", this node only" } else { "" };
            let how = if complete {
                format!("every key of db{db} walked{scope}")
            } else {
                format!("a sample: about {walked} keys of db{db} walked{scope}")
            };
            if complete && found == 0 {
                if every_key.is_none() {
                    every_key = Some(walk_all(&mut conn, config).await);
                }
                let seen = every_key.as_deref().unwrap_or_default();
                // An empty database shows no typo: nothing is written yet.
                if seen.is_empty() {
                    report.ok(
                        &format!("rule {}", rule.name),
                        format!(
                            "{} (SCAN MATCH {}): db{db} holds no key yet to compare it with",
                            rule.pattern.source(),
                            String::from_utf8_lossy(glob)
                        ),
                    );
                    continue;
                }
                let start = closest::literal_start(glob);
                let near = closest::closest(&start, seen);
                let seen = match near.is_empty() {
                    true => "no key seen comes close to it".to_string(),
                    false => format!("closest keys seen: {}", closest::describe(&near)),
                };
                report.warn(
                    &format!("rule {}", rule.name),
                    format!(
                        "{} (SCAN MATCH {}): no key matches ({how}); {seen}",
                        rule.pattern.source(),
                        String::from_utf8_lossy(glob)
                    ),
                    Some(
                        "a typo in `match`? `keywatch explain KEY` shows which rules a real key matches (no fix needed if the application does not write these keys yet)"
                            .into(),
                    ),
                );
                continue;
            }
            report.ok(
                &format!("rule {}", rule.name),
                format!(
                    "{} (SCAN MATCH {}): {found} matching key(s) ({how})",
                    rule.pattern.source(),
                    String::from_utf8_lossy(glob)
                ),
            );
        }
    }
}

/// The keys of the connection's database outside keywatch's own, walked as far as the rule
/// samples walk (doctor only walks them all where that is cheap).
async fn walk_all(conn: &mut MultiplexedConnection, config: &Config) -> Vec<Vec<u8>> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    for _ in 0..SAMPLE_CALLS {
        let Ok((next, page)) = crate::keyspace::scan_page(conn, cursor, b"*", SAMPLE_COUNT).await
        else {
            break;
        };
        keys.extend(
            page.into_iter()
                .filter(|k| !k.starts_with(config.state.prefix.as_bytes())),
        );
        cursor = next;
        if next == 0 {
            break;
        }
    }
    keys
}

/// A Redis error in a few words, never with a URL.
pub(crate) fn short(e: &redis::RedisError) -> String {
    match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => e.to_string(),
    }
}

crate::keyspace::commands::declare! {
    /// The commands the doctor sends to look around ([`crate::keyspace::commands`]); its
    /// permission checks are in [`permissions::REDIS`].
    [
        Use::new(
            Server::Watched,
            "info",
            "doctor: version, role and expiry statistics",
        )
        .when(When::Doctor),
        Use::new(Server::Watched, "ping", "doctor: reachability").when(When::Doctor),
        Use::new(
            Server::Watched,
            "acl|whoami",
            "doctor: which user's permissions to check",
        )
        .when(When::DoctorOptional),
        Use::new(Server::Watched, "scan", "doctor: samples the rules' keys")
            .on(Keys::Watched, Access::Read)
            .args("0 MATCH {glob} COUNT 10")
            .when(When::Doctor),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use report::Verdict;

    #[test]
    fn a_stale_backlog_warns_and_says_the_ledger_keeps_time() {
        let mut r = Report::new("n:1");
        backlog(
            &mut r,
            &Info::parse(
                "expired_keys:100\r\nexpired_stale_perc:23.50\r\nexpired_time_cap_reached_count:7\r\n",
            ),
        );
        assert_eq!(r.checks[0].verdict, Verdict::Warn);
        assert!(r.checks[0].detail.contains("23.5%"), "{:?}", r.checks[0]);
        assert!(r.checks[0].detail.contains("ledger"), "{:?}", r.checks[0]);
        let mut r = Report::new("n:1");
        backlog(&mut r, &Info::parse("expired_stale_perc:0.40\r\n"));
        assert_eq!(r.checks[0].verdict, Verdict::Ok);
        // A server without the statistic (older Redis) gets no line rather than a guess.
        let mut r = Report::new("n:1");
        backlog(&mut r, &Info::parse("expired_keys:1\r\n"));
        assert!(r.checks.is_empty());
    }
}
