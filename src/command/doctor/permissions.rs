//! Every command `keywatch run` sends, on which keys and channels, and whether the connected
//! user may send it.
//!
//! The list mirrors the modules that talk to Redis (ledger, scanner, notifications, flags,
//! detail, cleanup, claims, queue, dead letters, silences, rate limits), including the commands
//! inside their Lua scripts: Redis checks those against the caller's ACL when the script runs,
//! so permission to `EVALSHA` alone proves nothing. A command that is added there belongs here.
//!
//! How a permission is checked, best first:
//! - `ACL DRYRUN user …` (Redis ≥ 7.0, Valkey): nothing runs, nothing is logged;
//! - `MULTI` … `DISCARD`: Redis checks the ACL when it queues a command, and the discard means
//!   nothing runs (a refusal lands in `ACL LOG`);
//! - neither allowed: only commands without any effect (reads of keys that do not exist, `PING`,
//!   `SCAN`) are run for real; the others are reported unchecked.

use redis::Value;
use redis::aio::MultiplexedConnection;

use crate::config::{Config, DetailSource, Notifications};
use crate::event::{EventKind, KeyEvent};
use crate::source::flags;
use crate::source::ledger::Ledger;
use crate::source::notifications;
use crate::template::Context;

/// What stands in for a capture (and for a glob's `*`) in the sample keys checked.
const SAMPLE: &str = "keywatch-doctor";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    /// The ACL key-permission selector that grants it.
    fn selector(self) -> &'static str {
        match self {
            Access::Read => "%R~",
            Access::Write => "%W~",
            Access::ReadWrite => "~",
        }
    }
}

/// Which connection a command goes to: the watched Redis, or the one keeping keywatch's state
/// (`state.url`, else the watched one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conn {
    Watched,
    State,
}

/// One command keywatch sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Need {
    /// Why keywatch sends it, for the operator.
    pub purpose: String,
    pub conn: Conn,
    /// The ACL name (`config|get`, `pexpiretime`), for the `+command` of a fix.
    pub command: String,
    /// The whole command as sent, name first.
    pub args: Vec<Vec<u8>>,
    /// The key glob a fix grants and the access the command needs on it.
    pub key: Option<(String, Access)>,
    pub channel: Option<String>,
    /// Running it for real has no effect (it reads, or touches nothing that exists).
    pub harmless: bool,
}

impl Need {
    fn new(purpose: &str, conn: Conn, command: &str, args: &[&[u8]]) -> Need {
        Need {
            purpose: purpose.to_string(),
            conn,
            command: command.to_string(),
            args: args.iter().map(|a| a.to_vec()).collect(),
            key: None,
            channel: None,
            harmless: false,
        }
    }

    fn key(mut self, glob: &[u8], access: Access) -> Need {
        self.key = Some((String::from_utf8_lossy(glob).into_owned(), access));
        self
    }

    fn channel(mut self, channel: &str) -> Need {
        self.channel = Some(channel.to_string());
        self
    }

    fn harmless(mut self) -> Need {
        self.harmless = true;
        self
    }

    /// The command as an operator would type it.
    pub fn shown(&self) -> String {
        self.args
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn is_subscribe(&self) -> bool {
        self.args
            .first()
            .is_some_and(|a| a.eq_ignore_ascii_case(b"SUBSCRIBE"))
    }

    /// The ACL rule that grants what `reason` says is missing (`+config|get`, `~keywatch:*`,
    /// `&__keyevent@0__:expired`).
    pub fn grant(&self, reason: &str) -> Option<String> {
        let r = reason.to_ascii_lowercase();
        if r.contains("command") {
            Some(format!("+{}", self.command))
        } else if r.contains("channel") {
            Some(format!("&{}", self.channel.as_deref()?))
        } else if r.contains("key") {
            let (glob, access) = self.key.as_ref()?;
            Some(format!("{}{glob}", access.selector()))
        } else {
            None
        }
    }
}

/// A key `glob` matches: escapes resolved, `*` and `?` filled in, a `[...]` class by its first
/// member.
pub fn sample_of(glob: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(glob.len() + SAMPLE.len());
    let mut i = 0;
    while i < glob.len() {
        match glob[i] {
            b'\\' if i + 1 < glob.len() => {
                out.push(glob[i + 1]);
                i += 2;
                continue;
            }
            b'*' | b'?' => out.extend_from_slice(SAMPLE.as_bytes()),
            b'[' => {
                let mut j = i + 1;
                if glob.get(j) == Some(&b'^') {
                    j += 1;
                }
                let end = glob[j..].iter().position(|&b| b == b']').map(|p| j + p);
                match end {
                    Some(end) if end > j && glob[i + 1] != b'^' => {
                        out.push(glob[j]);
                        i = end + 1;
                        continue;
                    }
                    Some(end) => {
                        out.push(b'_');
                        i = end + 1;
                        continue;
                    }
                    None => out.push(b'['),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Every command `keywatch run` would send with these rules, deduplicated, in a stable order.
pub fn needs(config: &Config) -> Vec<Need> {
    let mut out = Vec::new();
    watched_needs(config, &mut out);
    for rule in &config.rules {
        rule_needs(config, rule, &mut out);
    }
    state_needs(config, &mut out);
    let mut seen = std::collections::HashSet::new();
    out.retain(|n| seen.insert((n.conn as u8, n.args.clone())));
    out
}

fn watched_needs(config: &Config, out: &mut Vec<Need>) {
    use Conn::Watched as W;
    out.push(Need::new("health checks", W, "ping", &[b"PING"]).harmless());
    out.push(
        Need::new(
            "reads notify-keyspace-events at start and after reconnects",
            W,
            "config|get",
            &[b"CONFIG", b"GET", b"notify-keyspace-events"],
        )
        .harmless(),
    );
    if config.redis.notifications == Notifications::Enable {
        let merged = flags::merged("", &config.needed_notify_flags());
        out.push(Need::new(
            "adds missing flags (`notifications: enable`)",
            W,
            "config|set",
            &[
                b"CONFIG",
                b"SET",
                b"notify-keyspace-events",
                merged.as_bytes(),
            ],
        ));
    }
    for &db in &config.redis.databases {
        if db != 0 {
            let n = db.to_string();
            out.push(Need::new(
                "connections to the watched databases other than 0",
                W,
                "select",
                &[b"SELECT", n.as_bytes()],
            ));
        }
    }
    let marker = Ledger::marker_channel(&config.state.prefix);
    let ledger = config.uses_ledger().then_some(marker.as_str());
    for ch in notifications::channels(&config.redis.databases, &config.event_kinds(), ledger) {
        let purpose = if ch == marker {
            "ledger: marker subscription"
        } else {
            "keyevent subscription"
        };
        out.push(
            Need::new(purpose, W, "subscribe", &[b"SUBSCRIBE", ch.as_bytes()])
                .channel(&ch)
                .harmless(),
        );
    }
    if config.uses_ledger() {
        out.push(
            Need::new(
                "ledger: hears evictions under an evicting maxmemory-policy",
                W,
                "config|get",
                &[b"CONFIG", b"GET", b"maxmemory-policy"],
            )
            .harmless(),
        );
        out.push(
            Need::new(
                "ledger: marker after a poke",
                W,
                "publish",
                &[b"PUBLISH", marker.as_bytes(), b"keywatch-doctor"],
            )
            .channel(&marker),
        );
    }
}

fn rule_needs(config: &Config, rule: &crate::config::Rule, out: &mut Vec<Need>) {
    use Conn::Watched as W;
    let glob = rule.pattern.scan_glob();
    let sample = sample_of(glob);
    let scan = |purpose: &str, glob: &[u8]| {
        Need::new(
            purpose,
            W,
            "scan",
            &[b"SCAN", b"0", b"MATCH", glob, b"COUNT", b"10"],
        )
        .harmless()
    };
    let name = &rule.name;
    if rule.on.contains(&EventKind::Expired) || rule.on.contains(&EventKind::Expiring) {
        out.push(scan(
            &format!("ledger: learns deadlines of rule {name}'s keys"),
            glob,
        ));
        let why = format!("ledger: reads (and pokes) deadlines of rule {name}'s keys");
        out.push(keyed(&why, &[b"PEXPIRETIME", &sample], glob, Access::Read));
        let why = format!("ledger: drops deadlines of deleted keys of rule {name}");
        out.push(keyed(&why, &[b"EXISTS", &sample], glob, Access::Read));
    }
    // Templates are rendered with a stand-in for every capture, so the glob of each key an
    // action touches comes out with `*` where the key's own text goes.
    let names = rule.pattern.capture_names();
    let values = vec![SAMPLE.as_bytes().to_vec(); names.len()];
    let event = KeyEvent {
        kind: rule.on.first().copied().unwrap_or(EventKind::Expired),
        db: 0,
        key: sample.clone(),
        observed_at: chrono::Utc::now(),
        deadline: None,
        ttl_ms: None,
        recovered: false,
        source: "doctor".into(),
    };
    let ctx = Context::for_event(name, &event, names, &values, None).with_sample_detail();
    let t = &config.templates;
    let render = |id| t.render(id, &ctx).ok();
    let glob_of = |rendered: &[u8]| -> Vec<u8> {
        String::from_utf8_lossy(rendered)
            .replace(SAMPLE, "*")
            .into_bytes()
    };
    if let Some(d) = &rule.detail {
        // HMGET/HDEL of a hash field (HDEL reads as it writes), or GET/UNLINK of a key.
        let (read, remove, access, parts): (&[u8], &[u8], Access, Vec<_>) = match &d.source {
            DetailSource::Hash { key, field } => (
                b"HMGET",
                b"HDEL",
                Access::ReadWrite,
                vec![render(*key), render(*field)],
            ),
            DetailSource::Key { key } => (b"GET", b"UNLINK", Access::Write, vec![render(*key)]),
        };
        if let Some(parts) = parts.into_iter().collect::<Option<Vec<Vec<u8>>>>() {
            let glob = glob_of(&parts[0]);
            let with = |command: &'static [u8]| -> Vec<&[u8]> {
                std::iter::once(command)
                    .chain(parts.iter().map(Vec::as_slice))
                    .collect()
            };
            let why = format!("detail of rule {name}");
            out.push(keyed(&why, &with(read), &glob, Access::Read));
            if d.remove {
                let why = format!("detail removal of rule {name}");
                out.push(keyed(&why, &with(remove), &glob, access));
            }
        }
    }
    if let Some(c) = &rule.cleanup {
        let why = format!("cleanup of rule {name}");
        for &id in &c.delete {
            let Some(pattern) = render(id) else { continue };
            let key = sample_of(&pattern);
            if key != pattern {
                out.push(scan(&why, &pattern));
            }
            out.push(keyed(
                &why,
                &[b"UNLINK", &key],
                &glob_of(&pattern),
                Access::Write,
            ));
        }
        for h in &c.hdel {
            let (Some(k), Some(f)) = (render(h.key), render(h.field)) else {
                continue;
            };
            out.push(keyed(
                &why,
                &[b"HDEL", &k, &f],
                &glob_of(&k),
                Access::ReadWrite,
            ));
        }
    }
}

/// A command on a watched key; its ACL name is the command's. Reads are harmless to run.
fn keyed(purpose: &str, args: &[&[u8]], glob: &[u8], access: Access) -> Need {
    let command = String::from_utf8_lossy(args[0]).to_ascii_lowercase();
    let need = Need::new(purpose, Conn::Watched, &command, args).key(glob, access);
    match access {
        Access::Read => need.harmless(),
        _ => need,
    }
}

/// keywatch's own keys, by the names the modules give them; the commands of their Lua scripts
/// are listed one by one.
fn state_needs(config: &Config, out: &mut Vec<Need>) {
    let p = &config.state.prefix;
    let all = format!("{p}*");
    let mut add = |purpose: &str, command: &str, args: &[&str], harmless: bool| {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        let mut n =
            Need::new(purpose, Conn::State, command, &args).key(all.as_bytes(), Access::ReadWrite);
        n.harmless = harmless;
        out.push(n);
    };
    let sha = "0000000000000000000000000000000000000000";
    add(
        "Lua scripts",
        "script|load",
        &["SCRIPT", "LOAD", "return 1"],
        false,
    );

    let claim = format!("{p}claim:keywatch-doctor");
    add(
        "claims: one firing per event",
        "set",
        &["SET", &claim, "1", "NX", "PX", "1000"],
        false,
    );
    let claims = format!("{p}claims:0");
    add(
        "claims: one firing per event",
        "hsetnx",
        &["HSETNX", &claims, "id", "1"],
        false,
    );
    add(
        "claims: one firing per event",
        "pexpiretime",
        &["PEXPIRETIME", &claims],
        true,
    );
    add(
        "claims: one firing per event",
        "pexpireat",
        &["PEXPIREAT", &claims, "1000"],
        false,
    );

    let (queue, jobs) = (format!("{p}queue"), format!("{p}queue:jobs"));
    add("job queue", "hset", &["HSET", &jobs, "id", "job"], false);
    add("job queue", "zadd", &["ZADD", &queue, "0", "id"], false);
    add(
        "job queue",
        "zadd",
        &["ZADD", &queue, "XX", "0", "id"],
        false,
    );
    add("job queue", "zrem", &["ZREM", &queue, "id"], false);
    add("job queue", "hdel", &["HDEL", &jobs, "id"], false);
    add("job queue", "zcard", &["ZCARD", &queue], true);
    add(
        "job queue: take",
        "evalsha",
        &["EVALSHA", sha, "2", &queue, &jobs],
        false,
    );
    add(
        "job queue: take (script)",
        "zrange",
        &["ZRANGE", &queue, "-inf", "0", "BYSCORE", "LIMIT", "0", "1"],
        true,
    );
    add(
        "job queue: take (script)",
        "hmget",
        &["HMGET", &jobs, "id"],
        true,
    );

    let (windows, window) = (format!("{p}groups"), format!("{p}group:doctor:doctor"));
    add(
        "digest windows",
        "set",
        &["SET", &format!("{window}:window"), "0", "PX", "1000"],
        false,
    );
    add(
        "digest windows",
        "get",
        &["GET", &format!("{window}:window")],
        true,
    );
    add("digest windows", "sadd", &["SADD", &windows, "w"], false);
    add("digest windows", "smembers", &["SMEMBERS", &windows], true);
    add("digest windows", "srem", &["SREM", &windows, "w"], false);
    add(
        "digest windows",
        "zadd",
        &["ZADD", &window, "NX", "0", "id"],
        false,
    );
    add("digest windows", "zcard", &["ZCARD", &window], true);

    let (dead, index, redrive) = (
        format!("{p}dead"),
        format!("{p}dead:index"),
        format!("{p}dead:redrive"),
    );
    add(
        "dead letters",
        "hset",
        &["HSET", &dead, "id", "letter"],
        false,
    );
    add("dead letters", "zadd", &["ZADD", &index, "0", "id"], false);
    add("dead letters", "zcard", &["ZCARD", &index], true);
    add("dead letters", "zpopmin", &["ZPOPMIN", &index, "1"], false);
    add("dead letters", "hdel", &["HDEL", &dead, "id"], false);
    add(
        "dead letters",
        "zrange",
        &["ZRANGE", &index, "0", "0", "REV"],
        true,
    );
    add("dead letters", "hmget", &["HMGET", &dead, "id"], true);
    add("dead letters", "zrem", &["ZREM", &index, "id"], false);
    add(
        "dead letters: retry",
        "lpush",
        &["LPUSH", &redrive, "letter"],
        false,
    );
    add(
        "dead letters: retry",
        "rpop",
        &["RPOP", &redrive, "1"],
        false,
    );

    let silences = format!("{p}silences");
    add("silences", "hgetall", &["HGETALL", &silences], true);
    add(
        "silences",
        "hset",
        &["HSET", &silences, "id", "silence"],
        false,
    );
    add("silences", "hdel", &["HDEL", &silences, "id"], false);

    for c in config.channels.iter().filter(|c| c.rate.is_some()) {
        let bucket = format!("{p}rate:{}", c.name);
        let why = format!("rate limit of channel {}", c.name);
        add(
            &why,
            "evalsha",
            &["EVALSHA", sha, "1", &bucket, "1", "1000"],
            false,
        );
        add(&format!("{why} (script)"), "time", &["TIME"], true);
        add(
            &format!("{why} (script)"),
            "hmget",
            &["HMGET", &bucket, "tokens", "ts"],
            true,
        );
        add(
            &format!("{why} (script)"),
            "hset",
            &["HSET", &bucket, "tokens", "1", "ts", "0"],
            false,
        );
        add(
            &format!("{why} (script)"),
            "pexpire",
            &["PEXPIRE", &bucket, "1000"],
            false,
        );
    }

    if config.uses_ledger() {
        for &db in &config.redis.databases {
            let z = format!("{p}ledger:{db}");
            let (poked, at, handled) = (
                format!("{z}:poked"),
                format!("{z}:poked-deadline"),
                format!("{z}:handled"),
            );
            add("ledger", "zadd", &["ZADD", &z, "0", "k"], false);
            add("ledger", "zrem", &["ZREM", &z, "k"], false);
            add(
                "ledger",
                "zrange",
                &[
                    "ZRANGE",
                    &z,
                    "-inf",
                    "0",
                    "BYSCORE",
                    "LIMIT",
                    "0",
                    "1",
                    "WITHSCORES",
                ],
                true,
            );
            add("ledger", "zscore", &["ZSCORE", &z, "k"], true);
            add("ledger", "zcard", &["ZCARD", &z], true);
            add(
                "ledger: scripts",
                "evalsha",
                &["EVALSHA", sha, "4", &z, &poked, &at, &handled],
                false,
            );
            add(
                "ledger (script)",
                "zremrangebyscore",
                &["ZREMRANGEBYSCORE", &handled, "-inf", "0"],
                false,
            );
            add(
                "ledger (script)",
                "zrangebyscore",
                &["ZRANGEBYSCORE", &poked, "-inf", "0", "LIMIT", "0", "1"],
                true,
            );
            add("ledger (script)", "hget", &["HGET", &at, "k"], true);
            add("ledger (script)", "hset", &["HSET", &at, "k", "0"], false);
            add("ledger (script)", "hdel", &["HDEL", &at, "k"], false);
            let seq = format!("{z}:seq");
            add("ledger: marker sequence", "incr", &["INCR", &seq], false);
        }
    }
    if config.event_kinds().contains(&EventKind::Expiring) {
        let last = format!("{p}scanner:last");
        add("scanner", "get", &["GET", &last], true);
        add("scanner", "set", &["SET", &last, "0"], false);
        let warned = format!("{p}warned:0:rule:0:keywatch-doctor");
        add(
            "scanner: warned once",
            "set",
            &["SET", &warned, "1", "NX", "PXAT", "1"],
            false,
        );
    }
}

/// How permissions are checked on one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Method {
    DryRun(String),
    Multi,
    Direct,
}

impl Method {
    pub fn describe(&self) -> String {
        match self {
            Method::DryRun(user) => format!("ACL DRYRUN for user {user:?}"),
            Method::Multi => "commands queued in MULTI and discarded".into(),
            Method::Direct => {
                "harmless commands run for real (the user may run neither ACL DRYRUN nor MULTI)"
                    .into()
            }
        }
    }
}

/// The best method `conn` allows for `user`.
pub async fn method(conn: &mut MultiplexedConnection, user: &str) -> Method {
    let dry: redis::RedisResult<Value> = redis::cmd("ACL")
        .arg("DRYRUN")
        .arg(user)
        .arg("PING")
        .query_async(conn)
        .await;
    if dry.is_ok() {
        return Method::DryRun(user.to_string());
    }
    // PING is what runs if MULTI is refused: harmless either way.
    let multi: redis::RedisResult<Vec<redis::RedisResult<Value>>> = redis::pipe()
        .cmd("MULTI")
        .cmd("PING")
        .cmd("DISCARD")
        .ignore_errors()
        .query_async(conn)
        .await;
    match multi {
        Ok(r) if r.first().is_some_and(|m| m.is_ok()) => Method::Multi,
        _ => Method::Direct,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    /// The server refused it; `noperm` when the ACL did (else e.g. an unknown, renamed command).
    Refused {
        reason: String,
        noperm: bool,
    },
    /// Could not be checked without running it.
    Unchecked(String),
}

fn refused(e: &redis::RedisError) -> Outcome {
    // Redis checks the ACL before it redirects: a key owned by another node (MOVED, CROSSSLOT
    // between keywatch's own keys) passed it; which node serves it is not a permission matter.
    if e.is_cluster_error() || e.code() == Some("CROSSSLOT") {
        return Outcome::Allowed;
    }
    let reason = match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => e.to_string(),
    };
    Outcome::Refused {
        noperm: e.code() == Some("NOPERM"),
        reason,
    }
}

/// Whether the user may send `need` on `conn` (`client` opens subscriber connections).
pub async fn check(
    method: &Method,
    conn: &mut MultiplexedConnection,
    client: &redis::Client,
    need: &Need,
) -> Outcome {
    if let Method::DryRun(user) = method {
        let answer: redis::RedisResult<Value> = redis::cmd("ACL")
            .arg("DRYRUN")
            .arg(user)
            .arg(&need.args)
            .query_async(conn)
            .await;
        return match answer {
            Ok(Value::Okay) => Outcome::Allowed,
            Ok(Value::SimpleString(s)) if s == "OK" => Outcome::Allowed,
            Ok(Value::BulkString(b)) => Outcome::Refused {
                reason: String::from_utf8_lossy(&b).into_owned(),
                noperm: true,
            },
            Ok(other) => Outcome::Unchecked(format!("ACL DRYRUN answered {other:?}")),
            Err(e) => refused(&e),
        };
    }
    if need.is_subscribe() {
        return subscribe(client, need).await;
    }
    match method {
        Method::Multi => {
            let r: redis::RedisResult<Vec<redis::RedisResult<Value>>> = redis::pipe()
                .cmd("MULTI")
                .add_command(command(need))
                .cmd("DISCARD")
                .ignore_errors()
                .query_async(conn)
                .await;
            match r {
                Ok(v) => match v.get(1) {
                    Some(Ok(_)) => Outcome::Allowed,
                    Some(Err(e)) => refused(e),
                    None => Outcome::Unchecked("MULTI gave no answer".into()),
                },
                Err(e) => Outcome::Unchecked(e.to_string()),
            }
        }
        _ if need.harmless => match command(need).query_async::<Value>(conn).await {
            Ok(_) => Outcome::Allowed,
            Err(e) if e.code().is_some() => refused(&e),
            Err(e) => Outcome::Unchecked(e.to_string()),
        },
        _ => {
            Outcome::Unchecked("it has effects, and neither ACL DRYRUN nor MULTI is allowed".into())
        }
    }
}

fn command(need: &Need) -> redis::Cmd {
    let mut c = redis::Cmd::new();
    for a in &need.args {
        c.arg(a);
    }
    c
}

/// A subscription is checked on a subscriber connection of its own, as keywatch subscribes.
async fn subscribe(client: &redis::Client, need: &Need) -> Outcome {
    let Some(ch) = &need.channel else {
        return Outcome::Unchecked("no channel".into());
    };
    let mut pubsub = match client.get_async_pubsub().await {
        Ok(p) => p,
        Err(e) => return Outcome::Unchecked(format!("cannot open a subscriber connection: {e}")),
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), pubsub.subscribe(ch)).await {
        Ok(Ok(())) => Outcome::Allowed,
        Ok(Err(e)) if e.code().is_some() => refused(&e),
        Ok(Err(e)) => Outcome::Unchecked(e.to_string()),
        Err(_) => Outcome::Unchecked("SUBSCRIBE got no answer within 10 s".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_match_their_globs() {
        assert_eq!(sample_of(b"order_lock:*"), b"order_lock:keywatch-doctor");
        assert_eq!(sample_of(br"a\*b:?"), b"a*b:keywatch-doctor");
        assert_eq!(sample_of(b"x[abc]y"), b"xay");
        assert_eq!(sample_of(b"x[^abc]y"), b"x_y");
    }

    #[test]
    fn fixes_grant_what_the_refusal_names() {
        let n = Need::new(
            "t",
            Conn::State,
            "zadd",
            &[b"ZADD", b"keywatch:queue", b"0", b"id"],
        )
        .key(b"keywatch:*", Access::ReadWrite);
        assert_eq!(
            n.grant("This user has no permissions to run the 'zadd' command")
                .as_deref(),
            Some("+zadd")
        );
        assert_eq!(
            n.grant(
                "NOPERM this user has no permissions to access one of the keys used as arguments"
            )
            .as_deref(),
            Some("~keywatch:*")
        );
        let s = Need::new("t", Conn::Watched, "subscribe", &[b"SUBSCRIBE", b"c"]).channel("c");
        assert_eq!(
            s.grant("This user has no permissions to access the 'c' channel")
                .as_deref(),
            Some("&c")
        );
    }
}
