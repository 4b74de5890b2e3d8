//! Every command `keywatch run` sends, on which keys and channels, and whether the connected
//! user may send it.
//!
//! The list is derived from the declarations of the modules that talk to Redis ([`REGISTRY`],
//! see [`crate::keyspace::commands`]), the commands inside their Lua scripts included: Redis
//! checks those against the caller's ACL when the script runs, so permission to `EVALSHA` alone
//! proves nothing.
//!
//! How a permission is checked, best first:
//! - `ACL DRYRUN user …` (Redis ≥ 7.0, Valkey): nothing runs, nothing is logged;
//! - `MULTI` … `DISCARD`: Redis checks the ACL when it queues a command, and the discard means
//!   nothing runs (a refusal lands in `ACL LOG`);
//! - neither allowed: only commands without any effect (reads of keys that do not exist, `PING`,
//!   `SCAN`) are run for real; the others are reported unchecked.

use redis::Value;
use redis::aio::MultiplexedConnection;

use crate::config::{Config, DetailSource, Notifications, Rule};
use crate::event::{EventKind, KeyEvent};
pub use crate::keyspace::commands::{Access, Server};
use crate::keyspace::commands::{Keys, PubSub, Use, Uses, When};
use crate::source::flags;
use crate::source::ledger::Ledger;
use crate::source::notifications;
use crate::template::Context;

/// What stands in for a capture (and for a glob's `*`) in the sample keys checked.
const SAMPLE: &str = "keywatch-doctor";

/// One command keywatch sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Need {
    /// Why keywatch sends it, for the operator.
    pub purpose: String,
    pub server: Server,
    /// The ACL name (`config|get`, `pexpiretime`), for the `+command` of a fix.
    pub command: String,
    /// The whole command as sent, name first.
    pub args: Vec<Vec<u8>>,
    /// The key glob a fix grants and the access the command needs on it.
    pub key: Option<(String, Access)>,
    pub channel: Option<String>,
    /// Running it for real has no effect (it reads, or touches nothing that exists).
    pub harmless: bool,
    /// `run` does without it when refused ([`Use::optional`]).
    pub optional: bool,
}

impl Need {
    /// The command as an operator would type it.
    pub fn shown(&self) -> String {
        self.args
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `SUBSCRIBE` or `UNSUBSCRIBE`: checked on a subscriber connection of their own.
    fn is_pubsub(&self) -> bool {
        self.args.first().is_some_and(|a| {
            a.eq_ignore_ascii_case(b"SUBSCRIBE") || a.eq_ignore_ascii_case(b"UNSUBSCRIBE")
        })
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

/// Every module's declarations: what the doctor checks and the documented ACL grants. State
/// modules come first among keywatch's own keys: a refusal lists a dozen commands, and those
/// of the queue and claims are what every setup has.
pub const REGISTRY: &[&Uses] = &[
    &crate::engine::REDIS,
    &crate::source::flags::REDIS,
    &crate::source::notifications::REDIS,
    &crate::source::flushes::REDIS,
    &crate::keyspace::REDIS,
    &crate::keyspace::connect::REDIS,
    &crate::keyspace::direct::REDIS,
    &crate::keyspace::role::REDIS,
    &crate::keyspace::sentinel::REDIS,
    &crate::source::sentinel::REDIS,
    &crate::keyspace::cluster::REDIS,
    &crate::engine::detail::REDIS,
    &crate::action::cleanup::REDIS,
    &crate::store::intake::REDIS,
    &crate::keyspace::clock::REDIS,
    &crate::store::queue::REDIS,
    &crate::store::dead::REDIS,
    &crate::store::history::REDIS,
    &crate::action::followup::REDIS,
    &crate::action::release::REDIS,
    &crate::store::alert_ends::REDIS,
    &crate::store::followups::REDIS,
    &crate::store::silences::REDIS,
    &crate::store::notices::REDIS,
    &crate::store::links::REDIS,
    &crate::store::long_keys::REDIS,
    &crate::store::rate::REDIS,
    &crate::source::ledger::REDIS,
    &crate::store::ledger::REDIS,
    &crate::store::handled::REDIS,
    &crate::source::fields::REDIS,
    &crate::store::fields::REDIS,
    &crate::source::scanner::REDIS,
    &crate::store::scanner::REDIS,
    &crate::store::held::REDIS,
    &crate::command::doctor::REDIS,
    &crate::command::doctor::cluster::REDIS,
    &crate::command::doctor::sentinel::REDIS,
    &crate::command::doctor::state_writers::REDIS,
    &REDIS,
];

/// Stands in for a script's SHA-1: `ACL DRYRUN` checks the keys, not that the script exists.
const SHA: &str = "0000000000000000000000000000000000000000";

/// What fills one declaration's placeholders, for one rule, channel or database.
#[derive(Clone, Default)]
struct Fill {
    key: Vec<u8>,
    glob: Vec<u8>,
    field: Vec<u8>,
    channel: String,
    db: String,
    /// The key glob a fix grants, and with which access.
    grant: Option<(Vec<u8>, Access)>,
    /// The rule it is sent for.
    rule: Option<String>,
}

/// Every command `keywatch run` would send with these rules, deduplicated, in a stable order.
pub fn needs(config: &Config) -> Vec<Need> {
    let mut out = Vec::new();
    for u in REGISTRY.iter().flat_map(|d| d.uses) {
        if applies(config, u.when) {
            out.extend(fills(config, u).iter().map(|f| need(config, u, f)));
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|n| seen.insert((n.server, n.args.clone())));
    out
}

/// Whether a `run` with `config` sends what is declared with `when` (rules are looked at in
/// [`rule_fills`]).
fn applies(config: &Config, when: When) -> bool {
    match when {
        When::Always | When::DetailRemoved | When::Cleanup => true,
        When::Ledger => config.uses_ledger(),
        When::Fields => config.watches_fields(),
        When::Expiring => config.event_kinds().contains(&EventKind::Expiring),
        When::EnableNotifications => config.redis.notifications == Notifications::Enable,
        When::OtherDatabase => config.redis.databases.iter().any(|&db| db != 0),
        When::Cluster => config.redis.cluster,
        // Checked against the sentinels by `doctor::sentinel`, under their own ACL.
        When::Sentinel => false,
        When::RateLimit => config.channels.iter().any(|c| c.rate.is_some()),
        When::Doctor | When::DoctorOptional | When::ForCallers => false,
    }
}

fn fills(config: &Config, u: &Use) -> Vec<Fill> {
    let p = &config.state.prefix;
    let mut fill = Fill::default();
    match u.keys {
        Keys::None => {}
        // One grant covers all of keywatch's own keys: the ACL stays the same as keys come.
        Keys::State(glob) => {
            fill.key = [p.as_bytes(), &sample_of(glob.as_bytes())].concat();
            fill.grant = Some((format!("{p}*").into_bytes(), Access::ReadWrite));
        }
        _ => {
            return config
                .rules
                .iter()
                .flat_map(|r| rule_fills(config, r, u))
                .collect();
        }
    }
    let marker = Ledger::marker_channel(p);
    match u.channel {
        Some(PubSub::Keyevent) => {
            let ledger = config.uses_ledger().then_some(marker.as_str());
            notifications::channels(&config.redis.databases, &config.event_kinds(), ledger)
                .into_iter()
                .filter(|ch| *ch != marker)
                .map(|channel| Fill {
                    channel,
                    ..fill.clone()
                })
                .collect()
        }
        Some(PubSub::Marker) => vec![Fill {
            channel: marker,
            ..fill
        }],
        None if u.when == When::OtherDatabase => config
            .redis
            .databases
            .iter()
            .filter(|&&db| db != 0)
            .map(|db| Fill {
                db: db.to_string(),
                ..fill.clone()
            })
            .collect(),
        None => vec![fill],
    }
}

/// The fills of a declaration on keys of `rule` (none where the rule has no such keys).
fn rule_fills(config: &Config, rule: &Rule, u: &Use) -> Vec<Fill> {
    let glob = rule.pattern.scan_glob();
    let of = |key: &[u8], glob: &[u8], grant: &[u8], field: &[u8]| Fill {
        key: key.to_vec(),
        glob: glob.to_vec(),
        field: field.to_vec(),
        grant: Some((grant.to_vec(), u.access)),
        rule: Some(rule.name.clone()),
        ..Fill::default()
    };
    if u.keys == Keys::Watched {
        let follows = match u.when {
            When::Ledger => [EventKind::Expired, EventKind::Expiring]
                .iter()
                .any(|k| rule.on.contains(k)),
            When::Expiring => rule.on.contains(&EventKind::Expiring),
            When::Fields => rule.watches_fields(),
            _ => true,
        };
        return match follows {
            true => vec![of(&sample_of(glob), glob, glob, b"")],
            false => Vec::new(),
        };
    }
    // Templates are rendered with a stand-in for every capture, so the glob of each key an
    // action touches comes out with `*` where the key's own text goes.
    let names = rule.capture_names();
    let values = vec![bytes::Bytes::from_static(SAMPLE.as_bytes()); names.len()];
    let event = KeyEvent {
        kind: rule.on.first().copied().unwrap_or(EventKind::Expired),
        db: 0,
        key: sample_of(glob).into(),
        field: rule.watches_fields().then(|| SAMPLE.as_bytes().to_vec()),
        observed_at: chrono::Utc::now(),
        deadline: None,
        ttl_ms: None,
        recovered: false,
        source: "doctor".into(),
        place: None,
    };
    let ctx = Context::for_event(&rule.name, &event, names, &values, None).with_sample_detail();
    let render = |id| config.templates.render(id, &ctx).ok();
    let glob_of = |rendered: &[u8]| -> Vec<u8> {
        String::from_utf8_lossy(rendered)
            .replace(SAMPLE, "*")
            .into_bytes()
    };
    let mut out = Vec::new();
    match u.keys {
        Keys::DetailHash | Keys::DetailKey => {
            let Some(d) = &rule.detail else {
                return out;
            };
            if u.when == When::DetailRemoved && !d.remove {
                return out;
            }
            let (key, field) = match (&d.source, u.keys) {
                (DetailSource::Hash { key, field }, Keys::DetailHash) => {
                    (render(*key), render(*field))
                }
                (DetailSource::Key { key }, Keys::DetailKey) => (render(*key), Some(Vec::new())),
                _ => return out,
            };
            if let (Some(k), Some(f)) = (key, field) {
                out.push(of(&k, b"", &glob_of(&k), &f));
            }
        }
        Keys::CleanupDelete => {
            for &id in rule.cleanup.iter().flat_map(|c| &c.delete) {
                let Some(pattern) = render(id) else { continue };
                let key = sample_of(&pattern);
                // A literal key is unlinked as it is, without a SCAN for it.
                if key == pattern && u.args.contains("{glob}") {
                    continue;
                }
                out.push(of(&key, &pattern, &glob_of(&pattern), b""));
            }
        }
        Keys::CleanupHash => {
            for h in rule.cleanup.iter().flat_map(|c| &c.hdel) {
                if let (Some(k), Some(f)) = (render(h.key), render(h.field)) {
                    out.push(of(&k, b"", &glob_of(&k), &f));
                }
            }
        }
        Keys::None | Keys::State(_) | Keys::Watched => {}
    }
    out
}

/// The placeholders a declaration's sample arguments may use.
const PLACEHOLDERS: &[&str] = &[
    "key", "glob", "field", "channel", "db", "prefix", "flags", "sha",
];

fn need(config: &Config, u: &Use, fill: &Fill) -> Need {
    let flags = flags::merged("", &config.needed_notify_flags());
    let value = |name: &str| -> Vec<u8> {
        match name {
            "key" => fill.key.clone(),
            "glob" => fill.glob.clone(),
            "field" => fill.field.clone(),
            "channel" => fill.channel.clone().into_bytes(),
            "db" => fill.db.clone().into_bytes(),
            "prefix" => config.state.prefix.clone().into_bytes(),
            "flags" => flags.clone().into_bytes(),
            _ => SHA.into(),
        }
    };
    let mut args: Vec<Vec<u8>> = u.words().into_iter().map(String::into_bytes).collect();
    args.extend(u.args.split_whitespace().map(|w| fill_in(w, &value)));
    Need {
        purpose: match &fill.rule {
            Some(rule) => format!("{} of rule {rule}", u.why),
            None => u.why.to_string(),
        },
        server: u.server,
        command: u.command.to_string(),
        args,
        key: fill
            .grant
            .as_ref()
            .map(|(g, a)| (String::from_utf8_lossy(g).into_owned(), *a)),
        channel: u.channel.map(|_| fill.channel.clone()),
        harmless: u.access == Access::Read,
        optional: u.optional,
    }
}

/// `word` with each `{placeholder}` replaced, in one pass: what replaces one is never read
/// again (a state prefix may hold braces, as a cluster hash tag).
fn fill_in(word: &str, value: &dyn Fn(&str) -> Vec<u8>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = word;
    while let Some(open) = rest.find('{') {
        out.extend_from_slice(&rest.as_bytes()[..open]);
        let after = &rest[open + 1..];
        match after.find('}').map(|close| &after[..close]) {
            Some(name) if PLACEHOLDERS.contains(&name) => {
                out.extend(value(name));
                rest = &after[name.len() + 1..];
            }
            _ => {
                out.push(b'{');
                rest = after;
            }
        }
    }
    out.extend_from_slice(rest.as_bytes());
    out
}

crate::keyspace::commands::declare! {
    /// The commands the permission check sends itself ([`crate::keyspace::commands`]).
    [
        Use::new(
            Server::Watched,
            "acl|dryrun",
            "doctor: checks without running anything",
        )
        .args("keywatch PING")
        .when(When::DoctorOptional),
        Use::new(
            Server::Watched,
            "multi",
            "doctor: checks without running anything",
        )
        .when(When::Doctor),
        Use::new(
            Server::Watched,
            "discard",
            "doctor: checks without running anything",
        )
        .when(When::Doctor),
        Use::new(
            Server::Watched,
            "ping",
            "doctor: checks without running anything",
        )
        .when(When::Doctor),
        Use::new(
            Server::Watched,
            "subscribe",
            "doctor: checks a subscription as keywatch subscribes",
        )
        .channel(PubSub::Keyevent)
        .args("{channel}")
        .when(When::Doctor),
        Use::new(
            Server::Watched,
            "unsubscribe",
            "doctor: checks leaving a channel as keywatch leaves",
        )
        .access(Access::Write)
        .args("__keyevent@0__:keywatch-doctor")
        .when(When::Doctor),
    ]
}

/// A command the server refused, and what grants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The ACL rule that grants it (`+select`), when the ACL refused it.
    pub grant: Option<String>,
    pub user: String,
    /// The command as sent, and why keywatch sends it.
    pub what: String,
    /// `command`, `key`, `channel` (refused by the ACL) or `other` (by the server).
    pub kind: &'static str,
    /// `run` does without it ([`Need::optional`]): readiness does not wait for it.
    pub optional: bool,
}

impl Refusal {
    /// Refused by the ACL: a grant is missing (not a renamed or unknown command).
    pub fn by_acl(&self) -> bool {
        self.kind != "other"
    }
}

/// What checking every command `run` sends found.
#[derive(Clone, Debug, Default)]
pub struct Grants {
    /// How many commands were checked.
    pub needs: usize,
    /// The user on the watched Redis.
    pub user: String,
    /// How they were checked (`ACL DRYRUN for user "keywatch"`), the state Redis's too.
    pub how: String,
    pub refused: Vec<Refusal>,
    /// Commands that could not be checked without running them, and why.
    pub unchecked: Vec<String>,
}

/// The `ACL SETUSER` lines that grant what `refused` lacks, one per user.
pub fn fixes(refused: &[&Refusal]) -> Option<String> {
    let mut fixes: Vec<(String, Vec<String>)> = Vec::new();
    for r in refused {
        let Some(g) = &r.grant else { continue };
        match fixes.iter_mut().find(|(u, _)| *u == r.user) {
            Some((_, gs)) if gs.contains(g) => {}
            Some((_, gs)) => gs.push(g.clone()),
            None => fixes.push((r.user.clone(), vec![g.clone()])),
        }
    }
    (!fixes.is_empty()).then(|| {
        fixes
            .iter()
            .map(|(u, gs)| format!("ACL SETUSER {u} {}", gs.join(" ")))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Checks whether the users keywatch connects as may send every command `run` sends with
/// `config`: on the watched Redis (`client`, `conn`) and on the state Redis (`state.url`), each
/// the best way its server allows ([`method`]). `Err`: the state Redis cannot be reached.
///
/// `quiet` (what `run` asks for) leaves out `ACL WHOAMI` and `ACL DRYRUN`: the least-privilege
/// user may run neither, and each refusal would be an entry in the server's `ACL LOG`, which
/// operators watch, every time `run` checks. The user is then the one the URL names, and the
/// commands are checked queued in `MULTI`, where only a real refusal is logged.
pub async fn grants(
    config: &Config,
    client: &redis::Client,
    conn: &mut MultiplexedConnection,
    quiet: bool,
) -> Result<Grants, String> {
    use crate::command::doctor::{open, short, user_hint, whoami};
    use crate::keyspace::connect;
    let needs = needs(config);
    let identify = async |c: &redis::Client, sc: &mut MultiplexedConnection| match quiet {
        true => {
            let u = user_hint(c);
            (u, transaction_method(sc).await)
        }
        false => {
            let u = whoami(c, sc).await;
            let m = method(sc, &u).await;
            (u, m)
        }
    };
    let (user, method) = identify(client, conn).await;
    // keywatch's own state may live in another Redis (`state.url`), as another user.
    let state = match &config.state.url {
        None => None,
        Some(url) => match connect::client(url, &config.redis, 0) {
            Ok((c, n)) => match open(&c).await {
                Ok(mut sc) => {
                    let (u, m) = identify(&c, &mut sc).await;
                    Some((c, sc, u, m))
                }
                Err(e) => {
                    return Err(format!(
                        "cannot connect to the state Redis at {n} (state.url): {}",
                        short(&e)
                    ));
                }
            },
            Err(e) => return Err(format!("state.url: {e}")),
        },
    };
    let mut refused: Vec<Refusal> = Vec::new();
    let mut unchecked = Vec::new();
    for need in &needs {
        let (c, sc, u, m) = match (&need.server, &state) {
            (Server::State, Some((c, sc, u, m))) => (c, sc.clone(), u, m),
            _ => (client, conn.clone(), &user, &method),
        };
        let mut sc = sc;
        match check(m, &mut sc, c, need).await {
            Outcome::Allowed => {}
            Outcome::Refused { reason, noperm } => {
                let kind = refusal_kind(&reason, noperm);
                refused.push(Refusal {
                    grant: if noperm { need.grant(&reason) } else { None },
                    user: u.clone(),
                    what: match kind {
                        "other" => format!("{} ({}): {reason}", need.shown(), need.purpose),
                        _ => format!("{} ({})", need.shown(), need.purpose),
                    },
                    kind,
                    optional: need.optional,
                })
            }
            Outcome::Unchecked(why) => unchecked.push(format!("{}: {why}", need.shown())),
        }
    }
    let how = match &state {
        Some((_, _, u, m)) => format!(
            "{}; state Redis: {}, user {u:?}",
            method.describe(),
            m.describe()
        ),
        None => method.describe(),
    };
    Ok(Grants {
        needs: needs.len(),
        user,
        how,
        refused,
        unchecked,
    })
}

fn refusal_kind(reason: &str, noperm: bool) -> &'static str {
    let r = reason.to_ascii_lowercase();
    match () {
        _ if !noperm => "other",
        _ if r.contains("command") => "command",
        _ if r.contains("channel") => "channel",
        _ if r.contains("key") => "key",
        _ => "other",
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
    transaction_method(conn).await
}

/// The best method `conn` allows without `ACL DRYRUN`.
async fn transaction_method(conn: &mut MultiplexedConnection) -> Method {
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

/// `MULTI`, `EXEC` and `DISCARD` cannot be queued in a transaction to be checked: an empty one
/// checks them (`MULTI` then `EXEC` runs nothing; `MULTI` then `DISCARD` neither).
async fn transaction(conn: &mut MultiplexedConnection, command: &str) -> Outcome {
    let closing = if command == "exec" { "EXEC" } else { "DISCARD" };
    let r: redis::RedisResult<Vec<redis::RedisResult<Value>>> = redis::pipe()
        .cmd("MULTI")
        .cmd(closing)
        .ignore_errors()
        .query_async(conn)
        .await;
    let which = usize::from(command != "multi");
    match r {
        // EXEC or DISCARD without a MULTI says nothing of its own grant.
        Ok(v) if which == 1 && v.first().is_some_and(|m| m.is_err()) => {
            Outcome::Unchecked(format!("MULTI is refused, so {closing} cannot be checked"))
        }
        Ok(v) => match v.get(which) {
            Some(Ok(_)) => Outcome::Allowed,
            Some(Err(e)) => refused(e),
            None => Outcome::Unchecked(format!("{} gave no answer", command.to_uppercase())),
        },
        Err(e) => Outcome::Unchecked(e.to_string()),
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
    if need.is_pubsub() {
        return pubsub(client, need).await;
    }
    if matches!(need.command.as_str(), "multi" | "exec" | "discard") {
        return transaction(conn, &need.command).await;
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

/// A subscription is checked on a subscriber connection of its own, as keywatch subscribes; so
/// is leaving a channel (which it was never on: nothing changes).
async fn pubsub(client: &redis::Client, need: &Need) -> Outcome {
    let Some(ch) = need.args.get(1) else {
        return Outcome::Unchecked("no channel".into());
    };
    let mut pubsub = match client.get_async_pubsub().await {
        Ok(p) => p,
        Err(e) => return Outcome::Unchecked(format!("cannot open a subscriber connection: {e}")),
    };
    let leave = need.args[0].eq_ignore_ascii_case(b"UNSUBSCRIBE");
    let sent = async {
        match leave {
            true => pubsub.unsubscribe(ch).await,
            false => pubsub.subscribe(ch).await,
        }
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), sent).await {
        Ok(Ok(())) => Outcome::Allowed,
        Ok(Err(e)) if e.code().is_some() => refused(&e),
        Ok(Err(e)) => Outcome::Unchecked(e.to_string()),
        Err(_) => Outcome::Unchecked(format!(
            "{} got no answer within 10 s",
            String::from_utf8_lossy(&need.args[0])
        )),
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

    fn need(
        command: &str,
        args: &[&str],
        key: Option<(&str, Access)>,
        channel: Option<&str>,
    ) -> Need {
        Need {
            purpose: "t".into(),
            server: Server::State,
            command: command.into(),
            args: args.iter().map(|a| a.as_bytes().to_vec()).collect(),
            key: key.map(|(g, a)| (g.to_string(), a)),
            channel: channel.map(str::to_string),
            optional: false,
            harmless: false,
        }
    }

    #[test]
    fn fixes_grant_what_the_refusal_names() {
        let n = need(
            "zadd",
            &["ZADD", "keywatch:queue", "0", "id"],
            Some(("keywatch:*", Access::ReadWrite)),
            None,
        );
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
        let s = need("subscribe", &["SUBSCRIBE", "c"], None, Some("c"));
        assert_eq!(
            s.grant("This user has no permissions to access the 'c' channel")
                .as_deref(),
            Some("&c")
        );
    }

    /// docs/redis.md's least-privilege lines are a copy of what the declarations grant: the
    /// base line for the default prefix, and what the example rules in rules/ add.
    #[test]
    fn declarations_use_known_placeholders_only() {
        for u in REGISTRY.iter().flat_map(|d| d.uses) {
            let mut rest = u.args;
            while let Some(open) = rest.find('{') {
                let name = &rest[open + 1..];
                let name = &name[..name.find('}').unwrap_or(name.len())];
                assert!(
                    PLACEHOLDERS.contains(&name),
                    "{}: unknown {{{name}}}",
                    u.command
                );
                rest = &rest[open + 1..];
            }
        }
    }
}
