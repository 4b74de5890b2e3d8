//! The second pass: drafts from every file → one validated [`Config`].
//!
//! Runs while every value still knows its place, so meaning-level problems (an unknown channel,
//! a template that reads a name the pattern does not capture, `expiring` without `warn_before`)
//! are reported at the line of the offending value, all of them in one run.

use std::path::PathBuf;
use std::time::Duration;

use crate::event::EventKind;
use crate::pattern::Pattern;
use crate::pattern::matcher::Matcher;
use crate::template::{CONTEXT_NAMES, Context, Escape, TemplateId, TemplateSet};

use super::model::*;
use super::rules::{
    CleanupDraft, DetailDraft, ExecDraft, MentionDraft, NotifyDraft, PatternSrc, ReloadDraft,
    RuleDraft,
};
use super::sections::{RedisDraft, ScannerDraft, StateDraft};
use crate::channel::{Channel, ChannelDraft, check_http_url};
use crate::yaml::decode::{Decoder, Text};
use crate::yaml::diagnostic::did_you_mean;

/// Everything read from all files, before meaning is checked.
#[derive(Default)]
pub struct Drafts {
    pub redis: RedisDraft,
    pub state: StateDraft,
    pub scanner: ScannerDraft,
    pub channels: Vec<ChannelDraft>,
    /// Every channel name defined, including channels whose definition had errors: a rule
    /// naming one of those must not get a second, misleading "unknown channel".
    pub channel_names: Vec<String>,
    pub rules: Vec<RuleDraft>,
    pub history: super::followups::HistoryDraft,
    pub links: Option<super::followups::LinksSettings>,
    pub server: Option<super::server::ServerSettings>,
}

/// The default message of docs/rules.md, with the TTL for `expiring`.
pub const DEFAULT_MESSAGE: &str =
    "{{ rule }}: {{ key }} {{ event }}{% if ttl %} (expires in {{ ttl }}){% endif %}";
pub const DEFAULT_TITLE: &str = "keywatch: {{ rule }}";

/// Builds the config; `None` when any error was reported (the diagnostics say why).
pub fn build(d: &mut Decoder<'_>, drafts: Drafts, files: Vec<PathBuf>) -> Option<Config> {
    let redis = redis_settings(d, drafts.redis);
    let mut state = StateSettings {
        prefix: drafts
            .state
            .prefix
            .map(|f| f.value.value)
            .unwrap_or_else(|| "keywatch:".into()),
        url: drafts.state.url.map(|f| Secret::new(f.value.value)),
    };
    if redis.cluster && state.url.is_none() {
        // The state shares the watched cluster: its keys must all hash to one slot.
        state.prefix = super::sections::tagged_prefix(&state.prefix);
    }
    let mut templates = TemplateSet::new();

    let mut channels = Vec::new();
    for ChannelDraft {
        mut channel,
        body,
        templates: fields,
    } in drafts.channels
    {
        for (field, text) in fields {
            let check = TemplateCheck {
                followup: false,
                rule: "send-test",
                captures: &[],
                kinds: &[EventKind::Expired],
                digest: false,
                pattern: "",
                has_detail: false,
                has_group: false,
            };
            let id = compile(
                d,
                &mut templates,
                &text,
                Escape::Raw,
                &format!("channel `{}` `{field}`", channel.name),
                &check,
            );
            if let Some(id) = id {
                channel.templates.push((field, id));
            }
        }
        if let Some(body) = body {
            let check = TemplateCheck {
                followup: false,
                rule: "send-test",
                captures: &[],
                kinds: &[EventKind::Expired],
                digest: false,
                pattern: "",
                has_detail: false,
                has_group: false,
            };
            channel.body = compile(
                d,
                &mut templates,
                &body,
                Escape::Raw,
                &format!("channel `{}` `body`", channel.name),
                &check,
            );
        }
        channels.push(channel);
    }

    let mut rules = Vec::new();
    for draft in drafts.rules {
        if let Some(rule) = build_rule(
            d,
            &mut templates,
            &channels,
            &drafts.channel_names,
            &redis,
            &state.prefix,
            draft,
        ) {
            rules.push(rule);
        }
    }
    warn_cleanup_overlaps(d, &rules, &templates);

    let wants_scanner = rules.iter().any(|r| r.on.contains(&EventKind::Expiring));
    let scanner = scanner_settings(drafts.scanner, wants_scanner);

    if d.diags.has_errors() {
        return None;
    }
    let patterns: Vec<Pattern> = rules.iter().map(|r| r.pattern.clone()).collect();
    let matcher = Matcher::new(&patterns);
    Some(Config {
        files,
        redis,
        state,
        channels,
        rules,
        scanner,
        templates,
        matcher,
        secrets: d.secrets(),
        history: drafts.history.settings(),
        links: drafts.links,
        server: drafts.server.unwrap_or_default(),
    })
}

fn redis_settings(d: &mut Decoder<'_>, r: RedisDraft) -> RedisSettings {
    let cluster = r.cluster.as_ref().is_some_and(|f| f.value);
    let databases = r
        .databases
        .as_ref()
        .map(|f| f.value.clone())
        .unwrap_or_else(|| vec![0]);
    if cluster
        && databases != [0]
        && let Some(f) = &r.databases
    {
        d.error(
            &f.loc,
            "a Redis Cluster has only database 0: remove `redis.databases` or set it to `[0]`",
        );
    }
    if cluster && let Some(f) = &r.sentinel {
        d.error(
            &f.loc,
            "`redis.sentinel` and `redis.cluster` exclude each other: a Redis Cluster fails over by itself, without sentinels",
        );
    }
    RedisSettings {
        url: r.url.map(|f| Secret::new(f.value.value)),
        cluster,
        databases,
        notifications: r
            .notifications
            .map(|f| f.value)
            .unwrap_or(Notifications::Check),
        tls: r.tls.map(|f| f.value),
        username: r.username.map(|f| f.value.value),
        password: r.password.map(|f| Secret::new(f.value.value)),
        sentinel: r.sentinel.map(|f| f.value),
    }
}

fn scanner_settings(s: ScannerDraft, wanted: bool) -> Option<ScannerSettings> {
    if s.loc.is_none() && !wanted {
        return None;
    }
    let (schedule_text, schedule) = s
        .schedule
        .map(|f| f.value)
        .unwrap_or_else(|| ("@every 1m".into(), Schedule::Every(Duration::from_secs(60))));
    Some(ScannerSettings {
        schedule_text,
        schedule,
        timezone: s.timezone.map(|f| f.value).unwrap_or(chrono_tz::UTC),
        max_keys_per_second: s.max_keys_per_second.map(|f| f.value).unwrap_or(50_000),
    })
}

/// What a rule's templates may read, and what `check` renders them against.
#[derive(Clone, Copy)]
struct TemplateCheck<'a> {
    /// An `escalate` or `resolved` message: `gap` and `gap_ms` are defined.
    followup: bool,
    rule: &'a str,
    captures: &'a [String],
    kinds: &'a [EventKind],
    /// Rendered for digests too (`count` and `events` defined).
    digest: bool,
    pattern: &'a str,
    /// The rule reads a `detail`, so templates may use it.
    has_detail: bool,
    /// The rule sends digests (`notify.group`).
    has_group: bool,
}

/// The events `escalate` and `resolved` follow: the key is gone, so it can come back.
const FOLLOWED: &[EventKind] = &[EventKind::Expired, EventKind::Evicted, EventKind::Hexpired];

/// Compiles one template, checks the names it reads, and renders it once per event kind of the
/// rule against sample values, strictly: what would fail at run time fails here.
fn compile(
    d: &mut Decoder<'_>,
    templates: &mut TemplateSet,
    text: &Text,
    escape: Escape,
    what: &str,
    check: &TemplateCheck<'_>,
) -> Option<TemplateId> {
    let id = match templates.add(&text.value, escape) {
        Ok(id) => id,
        Err(e) => {
            let mut loc = text.loc.clone();
            if let Some(line) = e.line.filter(|l| *l > 1) {
                loc.line += line - 1;
            }
            d.error(&loc, format!("{what}: invalid template: {}", e.message));
            return None;
        }
    };
    let mut ok = true;
    for var in templates.variables(id) {
        if (var == "count" || var == "events") && !check.digest {
            ok = false;
            let hint = if check.has_group {
                "it is set in `notify.title` of digests, not in per-event messages"
            } else {
                "it is set only in digest titles: add `notify.group` and use it in `notify.title`"
            };
            d.error(&text.loc, format!("{what} uses `{var}`, but {hint}"));
            continue;
        }
        if (var == "gap" || var == "gap_ms") && !check.followup {
            ok = false;
            d.error(
                &text.loc,
                format!(
                    "{what} uses `{var}`, but it is set only in `escalate` and `resolved` messages"
                ),
            );
            continue;
        }
        if var == "detail" && !check.has_detail {
            ok = false;
            d.error(&text.loc, format!("{what} uses `detail`, but the rule has no `detail` step to read it (add e.g. `detail: {{ hash: \"...\", field: \"{{{{ id }}}}\" }}`)"));
            continue;
        }
        if CONTEXT_NAMES.contains(&var.as_str()) || check.captures.contains(&var) {
            continue;
        }
        ok = false;
        let mut known: Vec<&str> = CONTEXT_NAMES.to_vec();
        known.extend(check.captures.iter().map(String::as_str));
        let why = if check.pattern.is_empty() {
            "it is not a context name".to_string()
        } else {
            format!(
                "the pattern `{}` does not capture it and it is not a context name",
                check.pattern
            )
        };
        d.error(
            &text.loc,
            format!(
                "{what} uses `{var}`, but {why}{}",
                did_you_mean(&var, known)
            ),
        );
    }
    if !ok {
        return None;
    }
    for &kind in check.kinds {
        let mut ctx = Context::sample(check.rule, kind, check.captures);
        if check.digest {
            ctx = ctx.with_digest(2, Vec::new());
        }
        if check.followup {
            ctx = ctx.with_gap(900_000);
        }
        if let Err(e) = templates.render(id, &ctx) {
            d.error(
                &text.loc,
                format!("{what} fails to render for `{kind}` events: {}", e.message),
            );
            return None;
        }
    }
    Some(id)
}

/// A rule draft → a [`Rule`], one step at a time in the order of the rule file (pattern, events,
/// then each action), every problem reported at its place. `None` when anything was wrong.
fn build_rule(
    d: &mut Decoder<'_>,
    templates: &mut TemplateSet,
    channels: &[Channel],
    channel_names: &[String],
    redis: &RedisSettings,
    state_prefix: &str,
    r: RuleDraft,
) -> Option<Rule> {
    let what = format!("rule `{}`", r.name.value);
    let (src, pattern) = rule_pattern(d, &r, &what);
    let captures: Vec<String> = pattern
        .as_ref()
        .map(|p| p.capture_names().to_vec())
        .unwrap_or_default();
    check_captures(d, src, &captures, &what);
    let (captures, field) = super::fields::build_field(d, &r, &captures, &what);
    check_events(d, &r, redis, &what);

    let mut t = RuleTemplates {
        d,
        templates,
        what,
        state_prefix,
        check: TemplateCheck {
            followup: false,
            rule: &r.name.value,
            captures: &captures,
            kinds: &r.on,
            digest: false,
            pattern: &src.value,
            has_detail: r.detail.is_some(),
            has_group: r.notify.as_ref().is_some_and(|n| n.group.is_some()),
        },
    };
    let detail = r.detail.as_ref().map(|dd| t.detail(dd));
    let reload = r.reload.as_ref().map(|rd| t.reload(rd));
    let exec = r.exec.as_ref().map(|ed| t.exec(ed));
    let cleanup = r.cleanup.as_ref().map(|cd| t.cleanup(cd));
    let notify = r
        .notify
        .as_ref()
        .map(|nd| t.notify(nd, channels, channel_names));
    let escalate = r
        .escalate
        .as_ref()
        .map(|fd| t.followup(fd, channels, channel_names, &r.on, "escalate", &[]));
    // Alerts kept open at the receiver (Alertmanager, PagerDuty) are closed by `resolved`.
    let closing: Vec<String> = r
        .notify
        .iter()
        .flat_map(|n| &n.to)
        .filter_map(|name| channels.iter().find(|c| c.name == name.value))
        .filter(|c| c.integration.closes_on_resolved())
        .map(|c| c.name.clone())
        .collect();
    let resolved = r
        .resolved
        .as_ref()
        .map(|fd| t.followup(fd, channels, channel_names, &r.on, "resolved", &closing));
    check_has_action(t.d, &r, &t.what);

    Some(Rule {
        name: r.name.value.clone(),
        loc: r.loc.clone(),
        pattern: pattern?,
        field: field?,
        on: r.on.clone(),
        db: r.db.as_ref().map(|s| s.value.clone()),
        warn_before: r.warn_before.as_ref().map(|w| w.value),
        recover: r.recover.as_ref().map_or(
            if r.detail.is_some() {
                Recover::IfDetail
            } else {
                Recover::Always
            },
            |s| s.value,
        ),
        max_late: r.max_late.as_ref().map(|s| s.value),
        detail: built(detail)?,
        reload: built(reload)?,
        exec: built(exec)?,
        cleanup: built(cleanup)?,
        notify: built(notify)?,
        escalate: built(escalate)?,
        resolved: built(resolved)?,
    })
}

/// A step the rule may have: `Some(None)` when it has none, `None` when it has one that failed.
fn built<T>(step: Option<Option<T>>) -> Option<Option<T>> {
    match step {
        None => Some(None),
        Some(built) => built.map(Some),
    }
}

/// The rule's `match` or `regex`, compiled; the source text is kept for messages.
fn rule_pattern<'r>(
    d: &mut Decoder<'_>,
    r: &'r RuleDraft,
    what: &str,
) -> (&'r Text, Option<Pattern>) {
    let (src, parsed, field) = match &r.pattern {
        PatternSrc::Match(t) => (t, Pattern::parse(&t.value), "match"),
        PatternSrc::Regex(t) => (t, Pattern::from_regex(&t.value), "regex"),
    };
    match parsed {
        Ok(p) => (src, Some(p)),
        Err(e) => {
            d.error(
                &src.at(e.offset),
                format!("{what} `{field}`: {}", e.message),
            );
            (src, None)
        }
    }
}

/// A capture may not take the name of a context value: the template would see only one.
fn check_captures(d: &mut Decoder<'_>, src: &Text, captures: &[String], what: &str) {
    for name in captures {
        if CONTEXT_NAMES.contains(&name.as_str()) {
            let at = src
                .value
                .find(&format!("{{{name}}}"))
                .or_else(|| src.value.find(&format!("<{name}>")))
                .unwrap_or(0);
            d.error(
                &src.at(at),
                format!("{what}: the capture `{name}` shadows the context name `{name}`; rename it (e.g. `{name}_id`)"),
            );
        }
    }
}

/// `expiring` needs `warn_before` (and `warn_before` means nothing without it); `db` only names
/// watched databases.
fn check_events(d: &mut Decoder<'_>, r: &RuleDraft, redis: &RedisSettings, what: &str) {
    let expiring = r.on.contains(&EventKind::Expiring);
    match (&r.warn_before, expiring) {
        (None, true) => d.error(&r.on_loc, format!("{what}: `on: [expiring]` needs `warn_before` (how long before the deadline to warn, e.g. `warn_before: 7d`)")),
        (Some(w), false) => d.warning(&w.loc, format!("{what}: `warn_before` has no effect without `expiring` in `on`")),
        _ => {}
    }
    if let Some(rec) = &r.recover {
        if rec.value == Recover::IfDetail && r.detail.is_none() {
            d.error(&rec.loc, format!("{what}: `recover: if_detail` needs a `detail` to look for; use `always` or `never`, or add `detail`"));
        }
        let expiries =
            r.on.iter()
                .any(|k| matches!(k, EventKind::Expired | EventKind::Hexpired));
        if !expiries {
            d.warning(&rec.loc, format!("{what}: `recover` has no effect without `expired` or `hexpired` in `on` (only missed expiries are recovered)"));
        }
    }
    if let Some(dbs) = &r.db {
        for db in &dbs.value {
            if !redis.databases.contains(db) {
                d.error(&dbs.loc, format!("{what}: database {db} is not watched; add it to `redis.databases` (now {:?})", redis.databases));
            }
        }
    }
}

/// A rule must do something; one that reads a detail and does nothing with it is a mistake.
fn check_has_action(d: &mut Decoder<'_>, r: &RuleDraft, what: &str) {
    let acts = r.reload.is_some() || r.exec.is_some() || r.cleanup.is_some() || r.notify.is_some();
    if acts {
        return;
    }
    if r.detail.is_some() {
        d.error(&r.name.loc, format!("{what} fetches a `detail` but has no action to use it: add `notify`, `reload`, `exec` or `cleanup`"));
    } else {
        d.error(
            &r.name.loc,
            format!(
                "{what} has no action: add at least one of `notify`, `reload`, `exec`, `cleanup`"
            ),
        );
    }
}

/// Compiles one rule's templates against what they may read, each reported at its field.
struct RuleTemplates<'a, 'd, 'c> {
    d: &'a mut Decoder<'d>,
    templates: &'a mut TemplateSet,
    /// `rule \`NAME\``, for messages.
    what: String,
    /// keywatch's own keys: a `detail` it removes may not be one of them.
    state_prefix: &'c str,
    check: TemplateCheck<'c>,
}

impl RuleTemplates<'_, '_, '_> {
    fn compile(&mut self, text: &Text, escape: Escape, field: &str) -> Option<TemplateId> {
        self.compile_as(text, escape, field, self.check)
    }

    fn compile_as(
        &mut self,
        text: &Text,
        escape: Escape,
        field: &str,
        check: TemplateCheck<'_>,
    ) -> Option<TemplateId> {
        let what = format!("{} `{field}`", self.what);
        compile(self.d, self.templates, text, escape, &what, &check)
    }

    fn detail(&mut self, dd: &DetailDraft) -> Option<DetailStep> {
        let removed = match (&dd.hash, &dd.key) {
            (Some(k), _) | (None, Some(k)) if dd.remove => Some(k),
            _ => None,
        };
        // Templates whose literal start is under the prefix always remove keywatch's own keys;
        // the others are guarded at run time, where the rendered key is known.
        if let Some(k) = removed
            && k.value
                .split('{')
                .next()
                .unwrap_or("")
                .starts_with(self.state_prefix)
        {
            let field = if dd.hash.is_some() {
                "detail.hash"
            } else {
                "detail.key"
            };
            self.d.error(
                &k.loc,
                format!(
                    "{} `{field}`: `remove: true` would delete `{}`, under `state.prefix` (`{}`): keywatch never deletes its own keys (cleanup refuses them too); keep the detail elsewhere or drop `remove`",
                    self.what, k.value, self.state_prefix
                ),
            );
            return None;
        }
        let source = match (&dd.hash, &dd.field, &dd.key) {
            (Some(h), Some(f), None) => {
                let key = self.compile(h, Escape::RedisKey, "detail.hash");
                let field = self.compile(f, Escape::RedisKey, "detail.field");
                DetailSource::Hash {
                    key: key?,
                    field: field?,
                }
            }
            (None, None, Some(k)) => DetailSource::Key {
                key: self.compile(k, Escape::RedisKey, "detail.key")?,
            },
            _ => return None,
        };
        Some(DetailStep {
            source,
            remove: dd.remove,
        })
    }

    /// A `.` or `..` segment in the reload URL's own text: such a URL is never sent as written
    /// (docs/rules.md#reload), so it is an error here, not a failure per
    /// event. Samples of captures hold no dots, so one found here is the author's.
    fn dot_segment_in_url(&mut self, rendered: &[u8], loc: &crate::yaml::diagnostic::Loc) -> bool {
        let url = String::from_utf8_lossy(rendered);
        let Some(segment) = crate::channel::http::dot_segment(&url) else {
            return false;
        };
        self.d.error(
            loc,
            format!(
                "{} `reload.url` has the path segment `{segment}`; write the path it stands for (URLs resolve `.` and `..`, and keywatch never sends a reload whose path holds one)",
                self.what
            ),
        );
        true
    }

    fn reload(&mut self, rd: &ReloadDraft) -> Option<ReloadStep> {
        let url = self.compile(&rd.url, Escape::Url, "reload.url");
        // Its user info travels as `Authorization: Basic`: masked in that spelling too.
        if let Some(info) = user_info(&rd.url.value) {
            self.d.note_secret(&format!("http://{info}@host/"));
        }
        // `on` is empty when every event listed was unknown (already an error): no sample then.
        if let Some(id) = url
            && let Some(&kind) = self.check.kinds.first()
            && !rd.url.unresolved
        {
            let sample = Context::sample(self.check.rule, kind, self.check.captures);
            if let Ok(bytes) = self.templates.render(id, &sample)
                && !self.dot_segment_in_url(&bytes, &rd.url.loc)
            {
                check_http_url(
                    self.d,
                    &String::from_utf8_lossy(&bytes),
                    &rd.url.loc,
                    &format!("{} `reload.url`", self.what),
                    "https://example.com/reload",
                );
            }
        }
        let headers: Vec<(String, TemplateId)> = rd
            .headers
            .iter()
            .filter_map(|(k, v)| {
                self.compile(v, Escape::Raw, &format!("reload.headers.{}", k.value))
                    .map(|id| (k.value.clone(), id))
            })
            .collect();
        let body = match &rd.body {
            Some(b) => Some(self.compile(b, Escape::Raw, "reload.body")?),
            None => None,
        };
        Some(ReloadStep {
            url: url?,
            method: rd.method.value.clone(),
            headers,
            body,
            timeout: rd.timeout,
            concurrency: rd.concurrency,
        })
    }

    fn exec(&mut self, ed: &ExecDraft) -> Option<ExecStep> {
        let command: Vec<Option<TemplateId>> = ed
            .command
            .iter()
            .map(|a| self.compile(a, Escape::RedisKey, "exec.command"))
            .collect();
        let env: Vec<Option<(String, TemplateId)>> = ed
            .env
            .iter()
            .map(|(k, v)| {
                self.compile(v, Escape::RedisKey, &format!("exec.env.{}", k.value))
                    .map(|id| (k.value.clone(), id))
            })
            .collect();
        Some(ExecStep {
            command: command.into_iter().collect::<Option<Vec<_>>>()?,
            env: env.into_iter().collect::<Option<Vec<_>>>()?,
            value_led: ed
                .command
                .iter()
                .map(|a| a.value.starts_with("{{") || a.value.starts_with("{%"))
                .collect(),
            timeout: ed.timeout,
            concurrency: ed.concurrency,
        })
    }

    fn cleanup(&mut self, cd: &CleanupDraft) -> Option<CleanupStep> {
        let delete: Vec<Option<TemplateId>> = cd
            .delete
            .iter()
            .map(|p| self.compile(p, Escape::Glob, "cleanup.delete"))
            .collect();
        let hdel: Vec<Option<HdelTarget>> = cd
            .hdel
            .iter()
            .map(|(k, f)| {
                let key = self.compile(k, Escape::RedisKey, "cleanup.hdel.key");
                let field = self.compile(f, Escape::RedisKey, "cleanup.hdel.field");
                Some(HdelTarget {
                    key: key?,
                    field: field?,
                })
            })
            .collect();
        Some(CleanupStep {
            delete: delete.into_iter().collect::<Option<Vec<_>>>()?,
            hdel: hdel.into_iter().collect::<Option<Vec<_>>>()?,
        })
    }

    /// The channels must exist; title and message are compiled once per escaping those
    /// channels need.
    fn notify(
        &mut self,
        nd: &NotifyDraft,
        channels: &[Channel],
        channel_names: &[String],
    ) -> Option<NotifyStep> {
        let what = self.what.clone();
        let mut escapes: Vec<Escape> = Vec::new();
        let mut to = Vec::new();
        for name in &nd.to {
            match channels.iter().find(|c| c.name == name.value) {
                Some(c) => {
                    if nd.group.is_some() && !c.integration.takes_digests() {
                        self.d.error(
                            &name.loc,
                            format!(
                                "{what} `notify.to`: channel `{}` ({}) takes no digests: each event is its own alert there; drop `notify.group` or send the digest to another channel",
                                c.name, c.kind.name
                            ),
                        );
                    }
                    if !escapes.contains(&c.escape()) {
                        escapes.push(c.escape());
                    }
                    to.push(name.value.clone());
                }
                // Defined, but its definition had errors (already reported).
                None if channel_names.contains(&name.value) => {}
                None => self.d.error(
                    &name.loc,
                    format!(
                        "{what} `notify.to`: unknown channel `{}`{}",
                        name.value,
                        match did_you_mean(&name.value, channels.iter().map(|c| c.name.as_str())) {
                            s if s.is_empty() => format!(
                                "; define it under `channels` (known: {})",
                                channel_list(channels)
                            ),
                            s => s,
                        }
                    ),
                ),
            }
        }
        if nd.to.is_empty() {
            self.d
                .error(&nd.loc, format!("{what} `notify.to` names no channel"));
        }
        let default_message = Text {
            value: DEFAULT_MESSAGE.into(),
            loc: nd.loc.clone(),
            unresolved: false,
            quoted: false,
        };
        let default_title = Text {
            value: DEFAULT_TITLE.into(),
            ..default_message.clone()
        };
        let message_src = nd.message.as_ref().unwrap_or(&default_message);
        let title_src = nd.title.as_ref().unwrap_or(&default_title);
        // With `group` every message is a digest, so the title is rendered for digests only.
        let title_check = TemplateCheck {
            digest: nd.group.is_some(),
            ..self.check
        };
        let mut message = Vec::new();
        let mut title = Vec::new();
        for &e in &escapes {
            message.push((e, self.compile(message_src, e, "notify.message")?));
            title.push((
                e,
                self.compile_as(title_src, e, "notify.title", title_check)?,
            ));
        }
        let mention = match &nd.mention {
            Some(md) => self.mention(md, channels, &to)?,
            None => RuleMention::default(),
        };
        let alerts: Vec<(String, u32)> = to
            .iter()
            .filter_map(|name| channels.iter().find(|c| c.name == *name))
            .filter_map(|c| {
                let am = c.integration.alertmanager()?;
                Some((
                    c.name.clone(),
                    u32::try_from(am.urls.len()).unwrap_or(u32::MAX),
                ))
            })
            .collect();
        if let (Some(loc), Some((am, _))) = (&nd.group_loc, alerts.first()) {
            self.d.error(
                loc,
                format!(
                    "{what} `notify.group`: channel `{am}` is an alertmanager channel, and Alertmanager groups alerts itself (its route's `group_by`, `group_wait`, `group_interval`): remove `group`, or send digests to another channel in a rule of their own"
                ),
            );
        }
        let (labels, annotations) = self.alert_fields(nd, &alerts)?;
        Some(NotifyStep {
            to,
            title: PerEscape(title),
            message: PerEscape(message),
            group: nd.group,
            mention,
            labels,
            annotations,
            alerts,
        })
    }
}

impl RuleTemplates<'_, '_, '_> {
    /// `notify.labels` and `notify.annotations`: names every Alertmanager accepts, values
    /// templates rendered as text. Without an alertmanager channel in `to` they do nothing,
    /// which is worth a warning.
    #[allow(clippy::type_complexity)]
    fn alert_fields(
        &mut self,
        nd: &NotifyDraft,
        alerts: &[(String, u32)],
    ) -> Option<(Vec<(String, TemplateId)>, Vec<(String, TemplateId)>)> {
        let mut out = (Vec::new(), Vec::new());
        let mut ok = true;
        for (field, pairs, labels) in [
            ("labels", &nd.labels, true),
            ("annotations", &nd.annotations, false),
        ] {
            let what = format!("{} `notify.{field}`", self.what);
            if !pairs.is_empty() && alerts.is_empty() {
                let w = format!(
                    "{what} has no effect: they are for alertmanager channels, and `notify.to` names none"
                );
                self.d.warning(&pairs[0].0.loc, w);
            }
            ok &= crate::channel::alert::check_names(self.d, pairs, &what, labels);
            for (k, v) in pairs {
                match self.compile(v, Escape::Raw, &format!("notify.{field}.{}", k.value)) {
                    Some(id) if labels => out.0.push((k.value.clone(), id)),
                    Some(id) => out.1.push((k.value.clone(), id)),
                    None => ok = false,
                }
            }
        }
        ok.then_some(out)
    }

    /// `escalate` or `resolved`: channels and templates as for `notify`, with `gap` defined;
    /// only after an alert of a key (or hash field) that is gone (`expired`, `evicted`,
    /// `hexpired`). `also`: channels of `notify.to` that keep alerts open
    /// ([`crate::channel::Integration::closes_on_resolved`]), which a `resolved` reaches
    /// whether or not its `to` lists them.
    fn followup(
        &mut self,
        fd: &super::followups::FollowupDraft,
        channels: &[Channel],
        channel_names: &[String],
        on: &[EventKind],
        name: &str,
        also: &[String],
    ) -> Option<FollowupStep> {
        if !on.iter().any(|k| FOLLOWED.contains(k)) {
            let w = format!(
                "{} `{name}` follows alerts of keys that are gone: add `expired`, `evicted` or `hexpired` to `on`",
                self.what
            );
            self.d.error(&fd.loc, w);
            return None;
        }
        let default_message = match name {
            "escalate" => "{{ rule }}: {{ key }} is still {{ event }} after {{ gap }} (escalation)",
            _ => "{{ rule }}: {{ key }} exists again after {{ gap }}",
        };
        if name == "escalate" {
            for t in &fd.to {
                if let Some(c) = channels.iter().find(|c| c.name == t.value)
                    && c.integration.alertmanager().is_some()
                {
                    let w = format!(
                        "{} `escalate.to`: channel `{}` is an alertmanager channel, where the alert already is: escalate with Alertmanager's own routes (e.g. a route with a longer `repeat_interval` or another receiver), or name a chat channel here",
                        self.what, c.name
                    );
                    self.d.error(&t.loc, w);
                    return None;
                }
            }
        }
        let mut to = fd.to.clone();
        for name in also {
            if !to.iter().any(|t| t.value == *name) {
                to.push(crate::yaml::decode::Spanned {
                    value: name.clone(),
                    loc: fd.loc.clone(),
                });
            }
        }
        if to.is_empty() {
            let w = format!(
                "{} `{name}` names no channel: add `to`, e.g. `to: [oncall]` (a `resolved` without `to` only closes the alerts of channels in `notify.to` that keep them open, such as alertmanager channels)",
                self.what
            );
            self.d.error(&fd.loc, w);
            return None;
        }
        let nd = NotifyDraft {
            loc: fd.loc.clone(),
            to,
            title: fd.title.clone(),
            message: Some(fd.message.clone().unwrap_or(Text {
                value: default_message.into(),
                loc: fd.loc.clone(),
                unresolved: false,
                quoted: false,
            })),
            group: None,
            group_loc: None,
            mention: None,
            labels: Vec::new(),
            annotations: Vec::new(),
        };
        let saved = self.check;
        self.check.followup = true;
        let step = self.notify(&nd, channels, channel_names);
        self.check = saved;
        let step = step?;
        Some(FollowupStep {
            wait: fd.wait,
            unless: fd.unless,
            to: step.to,
            title: step.title,
            message: step.message,
        })
    }

    /// `notify.mention`'s templates, rendered as plain values (they are checked, not escaped,
    /// when rendered: `action::mention`). Mobiles on a channel that cannot mention by mobile
    /// are a warning: they are left out there.
    fn mention(
        &mut self,
        md: &MentionDraft,
        channels: &[Channel],
        to: &[String],
    ) -> Option<RuleMention> {
        let mut mobiles = Vec::new();
        for t in &md.mobiles {
            mobiles.push(self.compile(t, Escape::Raw, "notify.mention.mobiles"));
        }
        let mut user_ids = Vec::new();
        for t in &md.user_ids {
            user_ids.push(self.compile(t, Escape::Raw, "notify.mention.user_ids"));
        }
        if !md.mobiles.is_empty() {
            for c in channels.iter().filter(|c| to.contains(&c.name)) {
                if c.escape().is_chat() && !c.integration.mentions_mobiles() {
                    let w = format!(
                        "{} `notify.mention.mobiles`: channel `{}` ({}) cannot mention by mobile number; only `user_ids` reach it",
                        self.what, c.name, c.kind.name
                    );
                    self.d.warning(&md.loc, w);
                }
            }
        }
        Some(RuleMention {
            mobiles: mobiles.into_iter().collect::<Option<Vec<_>>>()?,
            user_ids: user_ids.into_iter().collect::<Option<Vec<_>>>()?,
            all: md.all,
        })
    }
}

fn channel_list(channels: &[Channel]) -> String {
    if channels.is_empty() {
        return "none".into();
    }
    channels
        .iter()
        .map(|c| format!("`{}`", c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// keywatch cannot tell its own deletions from others': a `cleanup` that deletes keys a
/// `deleted` rule watches would make that rule fire on keywatch's own work.
fn warn_cleanup_overlaps(d: &mut Decoder<'_>, rules: &[Rule], templates: &TemplateSet) {
    for r in rules {
        let Some(c) = &r.cleanup else { continue };
        for &id in &c.delete {
            let prefix = literal_prefix(templates.source(id));
            for other in rules.iter().filter(|o| o.on.contains(&EventKind::Deleted)) {
                let theirs = literal_prefix(&String::from_utf8_lossy(other.pattern.scan_glob()));
                if prefix.starts_with(&theirs) || theirs.starts_with(&prefix) {
                    d.warning(
                        &r.loc,
                        format!(
                            "rule `{}`: `cleanup.delete` pattern `{}` may delete keys that rule `{}` watches for `deleted` events, and keywatch cannot tell its own deletions from others'",
                            r.name,
                            templates.source(id),
                            other.name
                        ),
                    );
                }
            }
        }
    }
}

/// The text before the first template tag or wildcard.
fn literal_prefix(s: &str) -> String {
    let end = s
        .find(['{', '*', '?', '[', '\\', '(', '^', '.', '$'])
        .unwrap_or(s.len());
    s[..end].to_string()
}

/// The user info of a URL (template) `u`: `user:pw` of `https://user:pw@host/…`.
fn user_info(u: &str) -> Option<&str> {
    let rest = &u[u.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    Some(&authority[..authority.rfind('@')?])
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::config::{LoadError, Loaded, Mode, load_texts};

    /// `check`'s verdict on one rule file: the config, or every diagnostic as printed.
    fn check(yaml: &str) -> Result<Loaded, Vec<String>> {
        load_texts(
            vec![PathBuf::from("rules.yaml")],
            &[yaml.to_string()],
            Mode::Check,
            &|_| None,
        )
        .map_err(|e| match e {
            LoadError::Invalid(diags) => diags.iter().map(ToString::to_string).collect(),
            LoadError::Unreadable(m) => vec![m],
        })
    }

    /// One rule `r` on `a:{id}` that logs `message` (written at line 9, column 16).
    fn logging(message: &str) -> String {
        format!(
            "
channels:
  log: {{ type: log }}
rules:
  - name: r
    match: \"a:{{id}}\"
    notify:
      to: [log]
      message: \"{message}\"
"
        )
    }

    /// An alertmanager channel is one job per URL; the rule's `resolved` reaches it from
    /// `notify.to` (its own `to` may be left out), and `escalate.to` may not name it.
    #[test]
    fn an_alertmanager_channel_is_a_job_per_url_and_resolved_reaches_it() {
        use crate::firing::Action;
        let yaml = r#"
channels:
  am: { type: alertmanager, urls: ["http://a:9093", "http://b:9093/"] }
  log: { type: log }
rules:
  - name: r
    match: "a:{id}"
    notify: { to: [am, log], labels: { sev: "{{ id }}" } }
    resolved: { within: 1h }
"#;
        let loaded = check(yaml).unwrap_or_else(|d| panic!("{d:#?}"));
        let rule = loaded.config.rule("r").unwrap();
        let alert = |target| Action::Alert {
            channel: "am".into(),
            target,
        };
        assert_eq!(
            crate::action::actions_of(rule),
            [
                alert(0),
                alert(1),
                Action::Notify {
                    channel: "log".into()
                }
            ]
        );
        assert_eq!(rule.resolved.as_ref().unwrap().to, ["am"]);

        let refused = yaml.replace(
            "    resolved: { within: 1h }",
            "    escalate: { after: 5m, to: [am] }",
        );
        let diags = check(&refused)
            .err()
            .expect("escalate.to: [am] must be refused");
        assert!(
            diags[0].starts_with(
                "rules.yaml:9:33: rule `r` `escalate.to`: channel `am` is an alertmanager channel"
            ),
            "{diags:#?}"
        );
        let nothing = "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: \"a:{id}\"\n    notify: { to: [log] }\n    resolved: { within: 1h }\n";
        let diags = check(nothing)
            .err()
            .expect("a resolved with no channel must be refused");
        assert!(
            diags[0].starts_with("rules.yaml:7:15: rule `r` `resolved` names no channel"),
            "{diags:#?}"
        );
    }

    #[test]
    fn a_dot_segment_in_a_reload_url_is_an_error() {
        let rule = |url: &str| {
            format!(
                "rules:\n  - name: r\n    match: \"a:{{id}}\"\n    reload: {{ url: \"{url}\" }}\n"
            )
        };
        let Err(diags) = check(&rule("http://127.0.0.1:1/reload/../{{ id }}")) else {
            panic!("a `..` segment passed `check`");
        };
        assert!(
            diags.iter().any(|d| d.contains("path segment `..`")),
            "{diags:#?}"
        );
        if let Err(diags) = check(&rule("http://127.0.0.1:1/reload/.../{{ id }}")) {
            panic!("{diags:#?}");
        }
    }

    #[test]
    fn minijinja_globals_such_as_range_are_not_undefined_names() {
        let yaml = logging(
            "{% for i in range(3) %}{{ i }}{% endfor %} {{ dict(x=id).x }} {% set ns = namespace(n=0) %}{{ ns.n }}",
        );
        if let Err(diags) = check(&yaml) {
            panic!("{diags:#?}");
        }
    }

    #[test]
    fn removing_a_detail_under_the_state_prefix_is_refused() {
        let yaml = r#"
channels:
  log: { type: log }
rules:
  - name: k
    match: "a:{id}"
    detail: { key: "keywatch:ledger:{{ id }}", remove: true }
    notify: { to: [log] }
  - name: h
    match: "b:{id}"
    detail: { hash: "keywatch:silences", field: "{{ id }}", remove: true }
    notify: { to: [log] }
  - name: read-only
    match: "c:{id}"
    detail: { key: "keywatch:ledger:{{ id }}" }
    notify: { to: [log] }
"#;
        let diags = check(yaml).err().expect("must be refused");
        assert_eq!(diags.len(), 2, "{diags:#?}");
        assert!(
            diags[0].starts_with("rules.yaml:7:20: rule `k` `detail.key`: `remove: true` would delete `keywatch:ledger:{{ id }}`, under `state.prefix` (`keywatch:`)"),
            "{diags:#?}"
        );
        assert!(
            diags[1].starts_with("rules.yaml:11:21: rule `h` `detail.hash`"),
            "{diags:#?}"
        );
    }

    #[test]
    fn a_template_that_never_ends_is_a_located_error_not_a_hang() {
        let yaml = logging(
            "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
        );
        let diags = check(&yaml)
            .err()
            .expect("an endless template must not pass");
        assert_eq!(diags.len(), 1, "{diags:#?}");
        assert!(
            diags[0].starts_with("rules.yaml:9:16: rule `r` `notify.message` fails to render for `expired` events: the template does more work"),
            "{diags:#?}"
        );
    }

    /// Found by `fuzz/fuzz_targets/rules_check.rs`: a `reload` rule whose `on` lists only
    /// unknown events panicked (indexing the empty list) instead of reporting the event.
    #[test]
    fn reload_rule_with_only_unknown_events_is_an_error_not_a_panic() {
        let yaml = "rules:\n  - name: r\n    match: \"a:{id}\"\n    on: [e$xpired]\n    reload: { url: \"http://127.0.0.1:1/{{ id }}\" }\n";
        let result = load_texts(
            vec![PathBuf::from("rules.yaml")],
            &[yaml.to_string()],
            Mode::Check,
            &|_| None,
        );
        let Err(LoadError::Invalid(diags)) = result else {
            panic!("an unknown event must be an error");
        };
        let text: Vec<String> = diags.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "rules.yaml:4:10: rule `r`: unknown event `e$xpired` in `on`; expected expired, evicted, deleted, expiring, hexpired; did you mean `expired`?"
            ],
        );
    }
}
