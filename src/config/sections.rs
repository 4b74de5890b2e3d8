//! The singleton sections `redis`, `state` and `scanner`.
//!
//! Files merge: any file may set any field of these sections, but one field set in two places is
//! an error naming both, so no file silently overrides another.

use std::path::Path;
use std::time::Duration;

use super::model::{Notifications, Schedule, SentinelSettings, TlsFiles};
use crate::yaml::Node;
use crate::yaml::Secret;
use crate::yaml::decode::{Decoder, Text};
use crate::yaml::diagnostic::Loc;

/// One field of a singleton section, with where it was set.
#[derive(Clone, Debug)]
pub struct Field<T> {
    pub value: T,
    pub loc: Loc,
}

fn merge_field<T>(
    d: &mut Decoder<'_>,
    section: &str,
    name: &str,
    into: &mut Option<Field<T>>,
    from: Option<Field<T>>,
) {
    if let Some(f) = from {
        match into {
            Some(first) => d.error(
                &f.loc,
                format!("`{section}.{name}` is set twice: first at {}", first.loc),
            ),
            None => *into = Some(f),
        }
    }
}

#[derive(Default, Debug)]
pub struct RedisDraft {
    pub url: Option<Field<Text>>,
    pub cluster: Option<Field<bool>>,
    pub databases: Option<Field<Vec<u32>>>,
    pub notifications: Option<Field<Notifications>>,
    pub tls: Option<Field<TlsFiles>>,
    pub username: Option<Field<Text>>,
    pub password: Option<Field<Text>>,
    pub sentinel: Option<Field<SentinelSettings>>,
}

#[derive(Default, Debug)]
pub struct StateDraft {
    pub prefix: Option<Field<Text>>,
    pub url: Option<Field<Text>>,
}

#[derive(Default, Debug)]
pub struct ScannerDraft {
    pub loc: Option<Loc>,
    pub schedule: Option<Field<(String, Schedule)>>,
    pub timezone: Option<Field<chrono_tz::Tz>>,
    pub max_keys_per_second: Option<Field<u64>>,
}

fn field<T>(value: Option<T>, node: &Node) -> Option<Field<T>> {
    value.map(|value| Field {
        value,
        loc: node.loc.clone(),
    })
}

pub fn decode_redis(d: &mut Decoder<'_>, node: &Node, base: &Path, into: &mut RedisDraft) {
    let Some(mut m) = d.map(node, "the `redis` section") else {
        return;
    };
    let mut draft = RedisDraft::default();
    if let Some(n) = m.get("url") {
        draft.url = field(d.text(n, "`redis.url`"), n);
        if let Some(f) = &draft.url
            && !f.value.unresolved
            && !(f.value.value.starts_with("redis://")
                || f.value.value.starts_with("rediss://")
                || f.value.value.starts_with("redis+unix://")
                || f.value.value.starts_with("unix://"))
        {
            d.error(&n.loc, "`redis.url` must start with `redis://` or `rediss://` (TLS), e.g. `redis://127.0.0.1:6379`");
        }
    }
    if let Some(n) = m.get("cluster") {
        draft.cluster = field(d.bool(n, "`redis.cluster`"), n);
    }
    if let Some(n) = m.get("databases") {
        let mut dbs = Vec::new();
        for item in d.one_or_many(n, "`redis.databases`") {
            if let Some(v) = d.uint(item, "a database number", 0, 10_000) {
                dbs.push(v as u32);
            }
        }
        if dbs.is_empty() {
            d.error(
                &n.loc,
                "`redis.databases` must list at least one database, e.g. `[0]`",
            );
        }
        dbs.sort_unstable();
        dbs.dedup();
        draft.databases = Some(Field {
            value: dbs,
            loc: n.loc.clone(),
        });
    }
    if let Some(n) = m.get("notifications") {
        let v = d.text(n, "`redis.notifications`").and_then(|t| match t.value.as_str() {
            "check" => Some(Notifications::Check),
            "enable" => Some(Notifications::Enable),
            "ignore" => Some(Notifications::Ignore),
            other => {
                d.error(&n.loc, format!("`redis.notifications` must be `check`, `enable` or `ignore`, found `{other}`"));
                None
            }
        });
        draft.notifications = field(v, n);
    }
    if let Some(n) = m.get("tls") {
        draft.tls = field(decode_tls(d, n, base), n);
    }
    if let Some(n) = m.get("username") {
        draft.username = field(d.text(n, "`redis.username`"), n);
    }
    if let Some(t) = d.inline_or_file(&mut m, "password", "`redis`", base) {
        let loc = t.loc.clone();
        draft.password = Some(Field { value: t, loc });
    }
    if let Some(n) = m.get("sentinel") {
        draft.sentinel = field(decode_sentinel(d, n, base), n);
    }
    m.finish(
        d,
        &[
            "url",
            "cluster",
            "databases",
            "notifications",
            "tls",
            "username",
            "password",
            "password_file",
            "sentinel",
        ],
        &|_| None,
    );
    merge_field(d, "redis", "url", &mut into.url, draft.url);
    merge_field(d, "redis", "cluster", &mut into.cluster, draft.cluster);
    merge_field(
        d,
        "redis",
        "databases",
        &mut into.databases,
        draft.databases,
    );
    merge_field(
        d,
        "redis",
        "notifications",
        &mut into.notifications,
        draft.notifications,
    );
    merge_field(d, "redis", "tls", &mut into.tls, draft.tls);
    merge_field(d, "redis", "username", &mut into.username, draft.username);
    merge_field(d, "redis", "password", &mut into.password, draft.password);
    merge_field(d, "redis", "sentinel", &mut into.sentinel, draft.sentinel);
}

/// `redis.sentinel: { master, nodes, password }`.
fn decode_sentinel(d: &mut Decoder<'_>, node: &Node, base: &Path) -> Option<SentinelSettings> {
    let mut m = d.map(node, "`redis.sentinel`")?;
    let master = match m.get("master") {
        Some(n) => d.text(n, "`redis.sentinel.master`").map(|t| t.value),
        None => {
            d.error(
                &node.loc,
                "`redis.sentinel` needs `master`: the name the sentinels monitor it by (`sentinel monitor NAME …`), e.g. `master: mymaster`",
            );
            None
        }
    };
    let mut nodes = Vec::new();
    match m.get("nodes") {
        Some(n) => {
            for item in d.one_or_many(n, "`redis.sentinel.nodes`") {
                let Some(t) = d.text(item, "a sentinel's `host:port`") else {
                    continue;
                };
                if t.unresolved
                    || t.value.rsplit_once(':').is_some_and(|(h, p)| {
                        !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0)
                    })
                {
                    nodes.push(t.value);
                } else {
                    d.error(
                        &item.loc,
                        format!(
                            "`redis.sentinel.nodes`: `{}` is not `host:port`, e.g. `10.0.0.1:26379`",
                            t.value
                        ),
                    );
                }
            }
            if nodes.is_empty() {
                d.error(
                    &n.loc,
                    "`redis.sentinel.nodes` must list at least one sentinel, e.g. `[\"10.0.0.1:26379\"]`",
                );
            }
        }
        None => d.error(
            &node.loc,
            "`redis.sentinel` needs `nodes`: the sentinels' `host:port`, e.g. `nodes: [\"10.0.0.1:26379\", \"10.0.0.2:26379\"]`",
        ),
    }
    let password = d
        .inline_or_file(&mut m, "password", "`redis.sentinel`", base)
        .map(|t| Secret::new(t.value));
    m.finish(
        d,
        &["master", "nodes", "password", "password_file"],
        &|_| None,
    );
    if nodes.is_empty() {
        return None;
    }
    Some(SentinelSettings {
        master: master?,
        nodes,
        password,
    })
}

fn decode_tls(d: &mut Decoder<'_>, node: &Node, base: &Path) -> Option<TlsFiles> {
    let mut m = d.map(node, "`redis.tls`")?;
    let mut tls = TlsFiles::default();
    for (name, slot) in [
        ("ca_file", &mut tls.ca_file),
        ("cert_file", &mut tls.cert_file),
        ("key_file", &mut tls.key_file),
    ] {
        if let Some(n) = m.get(name)
            && let Some(t) = d.text(n, &format!("`redis.tls.{name}`"))
        {
            let path = base.join(&t.value);
            if !t.unresolved && !path.exists() {
                d.missing_at_run(
                    &t.loc,
                    format!("`redis.tls.{name}`: {} does not exist", path.display()),
                );
            }
            *slot = Some(path);
        }
    }
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        d.error(&node.loc, "`redis.tls` needs both `cert_file` and `key_file` for a client certificate, or neither");
    }
    m.finish(d, &["ca_file", "cert_file", "key_file"], &|_| None);
    Some(tls)
}

pub fn decode_state(d: &mut Decoder<'_>, node: &Node, into: &mut StateDraft) {
    let Some(mut m) = d.map(node, "the `state` section") else {
        return;
    };
    let mut draft = StateDraft::default();
    if let Some(n) = m.get("prefix") {
        draft.prefix = field(d.text(n, "`state.prefix`"), n);
        if let Some(f) = &draft.prefix
            && f.value.value.is_empty()
        {
            d.error(&n.loc, "`state.prefix` must not be empty: keywatch's own keys must be told apart from yours");
        }
    }
    if let Some(n) = m.get("url") {
        let t = d.text(n, "`state.url`");
        // An empty url (docs/rules.md's example writes `url: ""`) means "the watched Redis".
        draft.url = field(t.filter(|t| !t.value.is_empty()), n);
    }
    m.finish(d, &["prefix", "url"], &|_| None);
    merge_field(d, "state", "prefix", &mut into.prefix, draft.prefix);
    merge_field(d, "state", "url", &mut into.url, draft.url);
}

pub fn decode_scanner(d: &mut Decoder<'_>, node: &Node, into: &mut ScannerDraft) {
    let Some(mut m) = d.map(node, "the `scanner` section") else {
        return;
    };
    into.loc.get_or_insert(node.loc.clone());
    let mut draft = ScannerDraft::default();
    if let Some(n) = m.get("schedule")
        && let Some(t) = d.text(n, "`scanner.schedule`")
    {
        draft.schedule = field(parse_schedule(d, &t), n);
    }
    if let Some(n) = m.get("timezone") {
        let tz = super::quiet::time_zone(d, n, "`scanner.timezone`");
        draft.timezone = field(tz.map(|t| t.value), n);
    }
    if let Some(n) = m.get("max_keys_per_second") {
        draft.max_keys_per_second =
            field(d.uint(n, "`scanner.max_keys_per_second`", 1, 10_000_000), n);
    }
    m.finish(d, &["schedule", "timezone", "max_keys_per_second"], &|_| {
        None
    });
    merge_field(d, "scanner", "schedule", &mut into.schedule, draft.schedule);
    merge_field(d, "scanner", "timezone", &mut into.timezone, draft.timezone);
    merge_field(
        d,
        "scanner",
        "max_keys_per_second",
        &mut into.max_keys_per_second,
        draft.max_keys_per_second,
    );
}

/// `@every DUR` or a cron expression of 5 or 6 fields (seconds first when 6).
pub fn parse_schedule(d: &mut Decoder<'_>, t: &Text) -> Option<(String, Schedule)> {
    let s = t.value.trim();
    if let Some(rest) = s.strip_prefix("@every") {
        return match crate::yaml::decode::parse_duration(rest) {
            Some(every) if every >= Duration::from_secs(1) => {
                Some((s.to_string(), Schedule::Every(every)))
            }
            Some(_) => {
                d.error(&t.loc, "`scanner.schedule`: `@every` needs at least `1s`");
                None
            }
            None => {
                d.error(
                    &t.loc,
                    format!(
                        "`scanner.schedule`: `{s}` is not `@every` and a duration, e.g. `@every 1m`"
                    ),
                );
                None
            }
        };
    }
    let fields = s.split_whitespace().count();
    if !s.starts_with('@') && !(5..=6).contains(&fields) {
        d.error(&t.loc, format!("`scanner.schedule`: `{s}` has {fields} fields; a cron expression has 5 (`*/5 * * * *`) or 6 with seconds first, or use `@every 1m`"));
        return None;
    }
    let parser = croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build();
    match parser.parse(s) {
        Ok(cron) => Some((s.to_string(), Schedule::Cron(Box::new(cron)))),
        Err(e) => {
            d.error(
                &t.loc,
                format!("`scanner.schedule`: `{s}` is not a valid cron expression: {e}"),
            );
            None
        }
    }
}

/// `state.prefix` as used on a cluster whose nodes also hold keywatch's state.
///
/// Lua scripts and pipelines touch several state keys together (the ledger's sets, the queue's
/// zset and hash, a batch of claims), and a cluster runs those only when every key is in one
/// slot: so every state key gets the same hash tag. A prefix that already has one (`{kw}:`) is
/// kept; else the prefix up to its last `:` (or the whole prefix when there is none) becomes the
/// tag: `keywatch:` → `{keywatch}:`, `app:kw:` → `{app:kw}:`, `kw` → `{kw}`.
pub fn tagged_prefix(prefix: &str) -> String {
    if let Some(open) = prefix.find('{')
        && prefix[open + 1..].find('}').is_some_and(|len| len > 0)
    {
        return prefix.to_string();
    }
    match prefix.strip_suffix(':') {
        Some(head) if !head.is_empty() => format!("{{{head}}}:"),
        _ => format!("{{{prefix}}}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_prefix_gets_one_hash_tag() {
        assert_eq!(tagged_prefix("keywatch:"), "{keywatch}:");
        assert_eq!(tagged_prefix("app:kw:"), "{app:kw}:");
        assert_eq!(tagged_prefix("kw"), "{kw}");
        assert_eq!(tagged_prefix(":"), "{:}");
        assert_eq!(tagged_prefix("{kw}:"), "{kw}:");
        assert_eq!(tagged_prefix("x{y}z:"), "x{y}z:");
        // `{}` is no hash tag to Redis: the whole key would be hashed.
        assert_eq!(tagged_prefix("{}kw:"), "{{}kw}:");
    }
}
