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
use crate::template::{CONTEXT_NAMES, Escape, TemplateSet};

use super::model::*;
use super::rules::{PatternSrc, RuleDraft};
use super::sections::{RedisDraft, ScannerDraft, StateDraft};
use crate::channel::{Channel, ChannelDraft};
use crate::yaml::decode::{Decoder, Text};

mod templates;
use templates::{RuleTemplates, TemplateCheck, compile};

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
    /// `timezone` and `quiet_hours`.
    pub quiet: super::quiet::QuietDraft,
}

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
        shadow_of: None,
    };
    if redis.cluster && state.url.is_none() {
        // The state shares the watched cluster: its keys must all hash to one slot.
        state.prefix = super::sections::tagged_prefix(&state.prefix);
    }
    let timezone = drafts
        .quiet
        .timezone
        .as_ref()
        .map_or(chrono_tz::UTC, |t| t.value);
    let mut templates = TemplateSet::new();
    templates.set_timezone(timezone);

    let mut channels = Vec::new();
    for ChannelDraft {
        mut channel,
        body,
        templates: fields,
        quiet,
    } in drafts.channels
    {
        if let Some(q) = quiet {
            channel.quiet = super::quiet::check_channel(d, &channel, q, &drafts.quiet);
        }
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
    let scanner = scanner_settings(drafts.scanner, wants_scanner, timezone);

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
        timezone,
        quiet_hours: drafts.quiet.windows.into_iter().map(|(_, w)| w).collect(),
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

/// `scanner.timezone` is the top-level `timezone` unless it says otherwise.
fn scanner_settings(
    s: ScannerDraft,
    wanted: bool,
    timezone: chrono_tz::Tz,
) -> Option<ScannerSettings> {
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
        timezone: s.timezone.map_or(timezone, |f| f.value),
        max_keys_per_second: s.max_keys_per_second.map(|f| f.value).unwrap_or(50_000),
    })
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
    let key_captures: Vec<String> = pattern
        .as_ref()
        .map(|p| p.capture_names().to_vec())
        .unwrap_or_default();
    check_captures(d, src, &key_captures, &what);
    let (captures, field) = super::fields::build_field(d, &r, &key_captures, &what);
    check_alert_captures(d, &r, src, &key_captures, &captures, channels, &what);
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
    // Alerts kept open at the receiver (Alertmanager, PagerDuty) are closed by `resolved`:
    // those of `notify.to`, and PagerDuty incidents an escalation opened (alertmanager
    // channels cannot be in `escalate.to`). docs/rules.md#pagerduty.
    let mut closing: Vec<String> = Vec::new();
    let paged = r.notify.iter().flat_map(|n| &n.to);
    for name in paged.chain(r.escalate.iter().flat_map(|e| &e.to)) {
        if let Some(c) = channels.iter().find(|c| c.name == name.value)
            && c.integration.closes_on_resolved()
            && !closing.contains(&c.name)
        {
            closing.push(c.name.clone());
        }
    }
    let resolved = r
        .resolved
        .as_ref()
        .map(|fd| t.followup(fd, channels, channel_names, &r.on, "resolved", &closing));
    check_has_action(t.d, &r, &t.what);
    warn_quiet_ignored(t.d, &r, channels, &t.what);

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
        ignores_quiet: r.notify.as_ref().is_some_and(|n| n.quiet.is_some()),
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

/// Each capture is a label of the alerts of an alertmanager channel the rule notifies: it may
/// not replace one of the event's own labels (key text passing for the rule's name) nor take a
/// name Alertmanager refuses or Prometheus reserves (docs/rules.md#alertmanager). Names that
/// shadow a context name are reported by [`check_captures`] and `build_field` already.
fn check_alert_captures(
    d: &mut Decoder<'_>,
    r: &RuleDraft,
    src: &Text,
    key_captures: &[String],
    captures: &[String],
    channels: &[Channel],
    what: &str,
) {
    let Some(am) = r
        .notify
        .iter()
        .flat_map(|n| &n.to)
        .filter_map(|t| channels.iter().find(|c| c.name == t.value))
        .find(|c| c.integration.alertmanager().is_some())
    else {
        return;
    };
    for name in captures {
        if CONTEXT_NAMES.contains(&name.as_str()) {
            continue;
        }
        let Some(why) = crate::channel::alert::bad_capture_label(name, &am.name) else {
            continue;
        };
        let (text, part) = match &r.field {
            Some(f) if !key_captures.contains(name) => (f, " `field`"),
            _ => (src, ""),
        };
        let at = text
            .value
            .find(&format!("{{{name}}}"))
            .or_else(|| text.value.find(&format!("<{name}>")))
            .unwrap_or(0);
        d.error(&text.at(at), format!("{what}{part}: {why}"));
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

/// `notify.quiet: ignore` on a rule none of whose channels is quiet does nothing: worth a
/// warning, since the files may mean another channel.
fn warn_quiet_ignored(d: &mut Decoder<'_>, r: &RuleDraft, channels: &[Channel], what: &str) {
    let Some(loc) = r.notify.as_ref().and_then(|n| n.quiet.as_ref()) else {
        return;
    };
    let named = r
        .notify
        .iter()
        .flat_map(|n| &n.to)
        .chain(r.escalate.iter().flat_map(|e| &e.to))
        .chain(r.resolved.iter().flat_map(|e| &e.to));
    let mut quiet = named.filter_map(|n| channels.iter().find(|c| c.name == n.value));
    if !quiet.any(|c| c.quiet.is_some()) {
        d.warning(
            loc,
            format!(
                "{what}: `notify.quiet: ignore` has no effect: none of its channels has `quiet`"
            ),
        );
    }
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::config::{LoadError, Mode, load_texts};

    use crate::config::checked as check;

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

    /// A PagerDuty incident opened by `notify.to` or `escalate.to` is resolved by the rule's
    /// `resolved` whichever channels `resolved.to` names (docs/rules.md#pagerduty), as an alertmanager alert is.
    #[test]
    fn resolved_reaches_the_pagerduty_channels_that_paged() {
        let yaml = r#"
channels:
  pager: { type: pagerduty, routing_key: "R0UTINGKEY0123456789abcdefABCDEF" }
  night: { type: pagerduty, routing_key: "N1GHTKEY000123456789abcdefABCDEF" }
  log: { type: log }
rules:
  - name: r
    match: "a:{id}"
    notify: { to: [pager, log] }
    escalate: { after: 5m, to: [night] }
    resolved: { within: 1h, to: [log] }
"#;
        let loaded = check(yaml).unwrap_or_else(|d| panic!("{d:#?}"));
        let rule = loaded.config.rule("r").unwrap();
        assert_eq!(
            rule.resolved.as_ref().unwrap().to,
            ["log", "pager", "night"]
        );
        // Without `to`, `resolved` only resolves.
        let quiet = yaml.replace(
            "resolved: { within: 1h, to: [log] }",
            "resolved: { within: 1h }",
        );
        let loaded = check(&quiet).unwrap_or_else(|d| panic!("{d:#?}"));
        assert_eq!(
            loaded
                .config
                .rule("r")
                .unwrap()
                .resolved
                .as_ref()
                .unwrap()
                .to,
            ["pager", "night"]
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
