//! `keywatch explain`: which rules match a key, and every action they would run, rendered.
//!
//! Sends nothing and touches no Redis: it renders with the key's real captures and a stand-in
//! for the `detail` value (which only exists in Redis at event time). Secrets are masked.

use std::ffi::OsStr;
use std::fmt::Write;

use chrono::Utc;

use crate::config::{Config, DetailSource, Rule};
use crate::event::{EventKind, KeyEvent, printable, printable_whole};
use crate::template::{Context, TemplateId};

pub struct Explanation {
    pub text: String,
    /// Some rule fires for this key and event.
    pub matched: bool,
}

/// The key as bytes: argv bytes as given, with `\xNN` escapes decoded so keys that are not UTF-8
/// can be typed.
pub fn key_bytes(arg: &OsStr) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let raw = arg.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'\\'
            && raw.get(i + 1) == Some(&b'x')
            && let Some(hex) = raw.get(i + 2..i + 4)
            && let Ok(b) = u8::from_str_radix(&String::from_utf8_lossy(hex), 16)
        {
            out.push(b);
            i += 4;
            continue;
        }
        out.push(raw[i]);
        i += 1;
    }
    out
}

/// What keywatch would do for `key`, with every secret masked ([`crate::config::Secrets`]: by
/// where a value came from, wherever it landed in a URL, header, body or argument).
#[cfg(test)]
pub fn explain(config: &Config, key: &[u8], kind: EventKind, db: u32) -> Explanation {
    explain_field(config, key, None, kind, db)
}

/// What keywatch would do for `key` (`explain`), or for one field of a hash (`explain KEY --field F`): `hexpired` rules match the
/// field's pattern too, and its captures join the key's.
pub fn explain_field(
    config: &Config,
    key: &[u8],
    field: Option<&[u8]>,
    kind: EventKind,
    db: u32,
) -> Explanation {
    let Explanation { text, matched } = explain_unmasked(config, key, field, kind, db);
    Explanation {
        text: config.secrets.mask(&text),
        matched,
    }
}

fn explain_unmasked(
    config: &Config,
    key: &[u8],
    field: Option<&[u8]>,
    kind: EventKind,
    db: u32,
) -> Explanation {
    let mut out = String::new();
    let shown = printable(key);
    match field {
        None => {
            let _ = writeln!(out, "key \"{shown}\" (db {db}, event {kind})");
        }
        Some(f) => {
            let f = printable(f);
            let _ = writeln!(out, "key \"{shown}\" field \"{f}\" (db {db}, event {kind})");
        }
    }
    if key.starts_with(config.state.prefix.as_bytes()) {
        let _ = writeln!(
            out,
            "this key is under `state.prefix` ({:?}): it is keywatch's own and never matched",
            config.state.prefix
        );
        return Explanation {
            text: out,
            matched: false,
        };
    }
    let mut idx = Vec::new();
    config.matching_rules(key, &mut idx);
    if idx.is_empty() {
        let _ = writeln!(out, "no rule matches this key");
        return Explanation {
            text: out,
            matched: false,
        };
    }
    let mut fired = false;
    for i in idx {
        let rule = &config.rules[i];
        let _ = writeln!(out, "\nrule {} ({})", rule.name, rule.loc);
        let _ = writeln!(out, "  pattern: {}", rule.pattern.source());
        if let Some(f) = &rule.field {
            let _ = writeln!(out, "  field pattern: {}", f.pattern.source());
        }
        if !rule.fires_on(kind, db) {
            let dbs = rule
                .db
                .as_ref()
                .map(|d| format!(" in db {d:?}"))
                .unwrap_or_default();
            let on: Vec<&str> = rule.on.iter().map(|k| k.as_str()).collect();
            let _ = writeln!(
                out,
                "  matches the key, but fires only on [{}]{dbs}: nothing runs for `{kind}` in db {db}",
                on.join(", ")
            );
            continue;
        }
        let Some(captures) = rule.captures_of(key, field) else {
            let _ = match field {
                None => writeln!(
                    out,
                    "  a rule on hash fields: give the field with `--field F`"
                ),
                Some(_) => writeln!(
                    out,
                    "  the field does not match the field pattern: nothing runs"
                ),
            };
            continue;
        };
        for (name, value) in rule.capture_names().iter().zip(&captures) {
            let _ = writeln!(out, "  capture {name} = \"{}\"", printable(value));
        }
        if !fired {
            // A number is a step's place in an event's run, so a rule without a detail starts
            // at 2: said once, before the first steps shown.
            let _ = writeln!(
                out,
                "  (steps are numbered in the order they run: 1 detail, 2 reload, 3 exec, 4 cleanup, 5 notify, 6 follow-ups)"
            );
        }
        fired = true;
        explain_rule(config, rule, (key, field), kind, db, &captures, &mut out);
    }
    Explanation {
        text: out,
        matched: fired,
    }
}

fn explain_rule(
    config: &Config,
    rule: &Rule,
    (key, field): (&[u8], Option<&[u8]>),
    kind: EventKind,
    db: u32,
    captures: &[Vec<u8>],
    out: &mut String,
) {
    let now = Utc::now();
    let ttl_ms =
        (kind == EventKind::Expiring).then(|| rule.warn_before.map_or(0, |w| w.as_millis() as i64));
    let event = KeyEvent {
        kind,
        db,
        key: key.to_vec().into(),
        field: field.map(<[u8]>::to_vec),
        observed_at: now,
        deadline: ttl_ms.map(|ms| now + chrono::Duration::milliseconds(ms)),
        ttl_ms,
        recovered: false,
        source: "explain".into(),
        place: None,
    };
    let values: Vec<bytes::Bytes> = captures.iter().cloned().map(bytes::Bytes::from).collect();
    let ctx = Context::for_event(&rule.name, &event, rule.capture_names(), &values, None)
        .with_sample_detail();
    let t = &config.templates;
    let render = |id: TemplateId| -> String {
        match t.render(id, &ctx) {
            Ok(b) => format!("\"{}\"", printable_whole(&b)),
            Err(e) => format!("<fails: {}>", e.message),
        }
    };
    // Rendered text holds key text: its controls and bidi characters are written out, so
    // the key cannot repaint the terminal or add lines of its own.
    let raw_text = |id: TemplateId| -> String {
        match t.render_text(id, &ctx) {
            Ok(s) => s,
            Err(e) => format!("<fails: {}>", e.message),
        }
    };
    let text = |id: TemplateId| -> String { printable_whole(raw_text(id).as_bytes()).into_owned() };

    if let Some(d) = &rule.detail {
        let remove = if d.remove {
            ", then removed once the jobs are stored"
        } else {
            ""
        };
        match &d.source {
            DetailSource::Hash { key, field } => {
                let _ = writeln!(
                    out,
                    "  1. detail: HGET {} {}{remove}",
                    render(*key),
                    render(*field)
                );
            }
            DetailSource::Key { key } => {
                let _ = writeln!(out, "  1. detail: GET {}{remove}", render(*key));
            }
        }
        let _ = writeln!(
            out,
            "     (`detail` is shown as <detail> below: its value exists only in Redis)"
        );
    }
    if let Some(r) = &rule.reload {
        // The URL as reqwest will request it (its parser may rewrite what was rendered), or
        // why it never is.
        let url = match t.render(r.url, &ctx) {
            Ok(b) => match crate::action::reload::url_to_request(&b) {
                Ok(url) => url,
                Err(why) => format!("<fails for good, never sent: {why}>"),
            },
            Err(e) => format!("<fails: {}>", e.message),
        };
        let _ = writeln!(
            out,
            "  2. reload: {} {} (timeout {})",
            r.method,
            url,
            humantime::format_duration(r.timeout)
        );
        for (name, id) in &r.headers {
            let _ = writeln!(out, "     header {name}: {}", text(*id));
        }
        if let Some(b) = r.body {
            let _ = writeln!(out, "     body: {}", text(b));
        }
    }
    if let Some(e) = &rule.exec {
        let args: Vec<String> = e.command.iter().map(|id| render(*id)).collect();
        let _ = writeln!(
            out,
            "  3. exec: [{}] (no shell, timeout {})",
            args.join(", "),
            humantime::format_duration(e.timeout)
        );
        for (name, id) in &e.env {
            let _ = writeln!(out, "     env {name}={}", render(*id));
        }
        let argv: Option<Vec<std::ffi::OsString>> = e
            .command
            .iter()
            .map(|id| {
                t.render(*id, &ctx)
                    .ok()
                    .map(std::os::unix::ffi::OsStringExt::from_vec)
            })
            .collect();
        if let Some(why) = argv.and_then(|a| crate::action::exec::refused(&a, &e.value_led, key)) {
            let _ = writeln!(out, "     fails for good, never run: {why}");
        }
    }
    if let Some(c) = &rule.cleanup {
        for id in &c.delete {
            let _ = writeln!(out, "  4. cleanup: SCAN MATCH {} + UNLINK", render(*id));
        }
        for h in &c.hdel {
            let _ = writeln!(
                out,
                "  4. cleanup: HDEL {} {}",
                render(h.key),
                render(h.field)
            );
        }
    }
    if let Some(n) = &rule.notify {
        if let Some(g) = &n.group {
            let _ = writeln!(
                out,
                "  5. notify (as a digest: one message per {} with up to {} items)",
                humantime::format_duration(g.window),
                g.max_items
            );
        }
        for name in &n.to {
            let Some(ch) = config.channel(name) else {
                continue;
            };
            let target = ch.integration.target();
            let rate = ch.rate.map(|r| format!(", rate {r}")).unwrap_or_default();
            let _ = writeln!(
                out,
                "  5. notify {name} ({} → {target}{rate})",
                ch.kind.name
            );
            for (field, id) in &ch.templates {
                let _ = writeln!(out, "     {field}: {}", text(*id));
            }
            if let Some(line) = quiet_line(config, rule, name, now, "a message now") {
                let _ = writeln!(out, "     {line}");
            }
            if ch.integration.alertmanager().is_some() {
                let firing = crate::firing::Firing::new(
                    &rule.name,
                    &event,
                    rule.capture_names(),
                    values.clone(),
                    None,
                );
                explain_alert(config, rule, n, &firing, ch, &text, out);
                continue;
            }
            let escape = ch.escape();
            if let Some(id) = n.title.get(escape) {
                let _ = writeln!(out, "     title: {}", text(id));
            }
            if let Some(id) = n.message.get(escape) {
                let body = raw_text(id);
                let body = match &ch.keyword {
                    Some(k) if !body.contains(k.as_str()) => format!("{k} {body}"),
                    _ => body,
                };
                // A chat message's line breaks are its template's own (key text's are escaped
                // as `\n`): shown as lines. Elsewhere they may be the key's: shown escaped.
                let lines: Vec<String> = match escape.is_chat() {
                    true => body
                        .lines()
                        .map(|l| printable_whole(l.as_bytes()).into_owned())
                        .collect(),
                    false => vec![printable_whole(body.as_bytes()).into_owned()],
                };
                for (i, line) in lines.iter().enumerate() {
                    let lead = if i == 0 {
                        "     message: "
                    } else {
                        "              "
                    };
                    let _ = writeln!(out, "{lead}{line}");
                }
            }
        }
    }
    for (name, step) in [("escalate", &rule.escalate), ("resolved", &rule.resolved)] {
        let Some(step) = step else { continue };
        let wait = humantime::format_duration(step.wait);
        let when = match (name, step.unless) {
            ("resolved", _) => format!("when the key exists again within {wait}"),
            (_, crate::config::Unless::Acknowledged) => {
                format!("after {wait}, unless acknowledged")
            }
            _ => format!("after {wait}, unless the key exists again or it is acknowledged"),
        };
        // `gap` as it would be at the end of the wait.
        let ctx = ctx.clone().with_gap(step.wait.as_millis() as i64);
        for to in &step.to {
            let _ = writeln!(out, "  6. {name} {to} ({when})");
            let due = now + chrono::Duration::from_std(step.wait).unwrap_or_default();
            let due_text = format!(
                "due at {}",
                crate::quiet_hours::shown_until(due, config.timezone, now)
            );
            if let Some(line) = quiet_line(config, rule, to, due, &due_text) {
                let _ = writeln!(out, "     {line}");
            }
            if let Some(id) = config
                .channel(to)
                .and_then(|ch| step.message.get(ch.escape()))
            {
                let body = t
                    .render_text(id, &ctx)
                    .unwrap_or_else(|e| format!("<fails: {}>", e.message));
                let _ = writeln!(out, "     message: {}", printable_whole(body.as_bytes()));
            }
        }
    }
}

/// What `channel`'s quiet hours do to a message of `rule` sent at `at` (`when` says when that
/// is): held until when and released how, or why not (docs/rules.md#quiet-hours). `None` for
/// a channel without `quiet`.
fn quiet_line(
    config: &Config,
    rule: &Rule,
    channel: &str,
    at: chrono::DateTime<Utc>,
    when: &str,
) -> Option<String> {
    let (window, release) = config.quiet_of(channel)?;
    let tz = config.timezone;
    let what = format!("quiet hours \"{}\" ({window}, {tz})", window.name);
    if rule.ignores_quiet {
        return Some(format!(
            "{what}: passed, the rule says `notify.quiet: ignore`"
        ));
    }
    let show = |t| crate::quiet_hours::shown_until(t, tz, at);
    Some(match window.quiet_until(tz, at) {
        Some(until) => {
            let how = match release {
                crate::quiet_hours::Release::Digest => "in one digest of everything held",
                crate::quiet_hours::Release::Each => "on its own",
                crate::quiet_hours::Release::Count => "counted in one line",
            };
            format!(
                "{what}: {when} would be held until {}, then sent {how}",
                show(until)
            )
        }
        None => match (window.next_start(tz, at), window.next_end(tz, at)) {
            (Some(start), Some(end)) => format!(
                "{what}: {when} is sent at once; held from {} until {}",
                show(start),
                show(end)
            ),
            _ => format!("{what}: {when} is sent at once"),
        },
    })
}

/// The exact request an alertmanager channel would post for this event, per URL (headers'
/// values masked: they carry tokens), and when it would post again.
fn explain_alert(
    config: &Config,
    rule: &Rule,
    n: &crate::config::NotifyStep,
    firing: &crate::firing::Firing,
    ch: &crate::channel::Channel,
    text: &dyn Fn(TemplateId) -> String,
    out: &mut String,
) {
    use crate::channel::alert::Alert;
    let Some(am) = ch.integration.alertmanager() else {
        return;
    };
    let render = |id: Option<TemplateId>| id.map(text).unwrap_or_default();
    let title = render(n.title.get(ch.escape()));
    let message = render(n.message.get(ch.escape()));
    let pairs = |p: &[(String, TemplateId)]| -> Vec<(String, String)> {
        p.iter().map(|(k, id)| (k.clone(), text(*id))).collect()
    };
    let alert = Alert::of_event(
        &rule.name,
        &firing.to_json(),
        &title,
        &message,
        crate::action::alert::starts_at(firing),
        crate::action::alert::held_until(firing, am),
    )
    .with_labels(am.labels.iter().cloned())
    .with_labels(pairs(&n.labels))
    .with_annotations(pairs(&n.annotations));
    let alert = Alert {
        generator_url: crate::action::alert::generator_url(config, &firing.id),
        ..alert
    };
    for i in 0..am.urls.len() {
        let _ = writeln!(out, "     POST {}", am.shown_alerts_url(i));
    }
    let _ = writeln!(out, "     header Content-Type: application/json");
    for (name, _) in &am.headers {
        let _ = writeln!(out, "     header {name}: <secret>");
    }
    let _ = writeln!(
        out,
        "     body: {}",
        serde_json::to_string(&alert.body()).unwrap_or_default()
    );
    let ends = if rule.resolved.is_some() {
        ", or the rule's `resolved` ends it sooner (posted then with `endsAt` that moment)"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "     posted again every {} until `endsAt` ({} after `startsAt`){ends}",
        humantime::format_duration(am.resend),
        humantime::format_duration(am.hold)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For a quiet channel, whether a message would be held and until when; a rule that
    /// ignores quiet hours passes them; a follow-up is judged at its due time.
    #[test]
    fn a_quiet_channel_says_whether_a_message_now_would_be_held() {
        let config = crate::config::of_yaml(
            r#"
timezone: Asia/Shanghai
quiet_hours:
  night: [{ days: [mon, tue, wed, thu, fri], from: "22:00", to: "08:00" }]
channels:
  team: { type: log, quiet: { during: night } }
rules:
  - name: caches
    match: "cache:{id}"
    notify: { to: [team] }
  - name: locks
    match: "lock:{id}"
    notify: { to: [team], quiet: ignore }
"#,
            crate::config::Mode::Check,
        );
        let caches = config.rule("caches").unwrap();
        // Monday 2026-12-07 23:00 and 12:00 in Shanghai.
        let night: chrono::DateTime<Utc> = "2026-12-07T15:00:00Z".parse().unwrap();
        let noon: chrono::DateTime<Utc> = "2026-12-07T04:00:00Z".parse().unwrap();
        let what = "quiet hours \"night\" (mon–fri 22:00–08:00, Asia/Shanghai)";
        assert_eq!(
            quiet_line(&config, caches, "team", night, "a message now").unwrap(),
            format!(
                "{what}: a message now would be held until Tue 08:00, then sent in one digest of everything held"
            )
        );
        assert_eq!(
            quiet_line(&config, caches, "team", noon, "a message now").unwrap(),
            format!("{what}: a message now is sent at once; held from 22:00 until Tue 08:00")
        );
        let locks = config.rule("locks").unwrap();
        assert_eq!(
            quiet_line(&config, locks, "team", night, "a message now").unwrap(),
            format!("{what}: passed, the rule says `notify.quiet: ignore`")
        );
        let text = explain(&config, b"cache:1", EventKind::Expired, 0).text;
        assert!(
            text.contains(&format!("     {what}: a message now ")),
            "{text}"
        );
    }

    /// The steps are numbered by where they come in an event's run (1 detail … 6 follow-ups),
    /// so a rule without a detail starts at 2: the output says what the numbers are.
    #[test]
    fn the_step_numbers_are_explained() {
        let config = crate::config::of_yaml(
            r#"
channels:
  log: { type: log }
rules:
  - name: warm
    match: 'cache:{id}'
    reload: { url: "http://127.0.0.1:8080/warm/{{ id }}" }
    notify: { to: [log] }
"#,
            crate::config::Mode::Check,
        );
        let out = explain(&config, b"cache:1", EventKind::Expired, 0).text;
        assert!(
            out.contains("numbered in the order they run: 1 detail, 2 reload, 3 exec, 4 cleanup, 5 notify, 6 follow-ups"),
            "{out}"
        );
        assert!(
            out.contains("  2. reload: POST http://127.0.0.1:8080/warm/1"),
            "{out}"
        );
    }

    #[test]
    fn hex_escapes_give_raw_bytes() {
        assert_eq!(key_bytes(OsStr::new("a\\xffb")), b"a\xffb");
        assert_eq!(key_bytes(OsStr::new("a\\xzz")), b"a\\xzz");
        assert_eq!(key_bytes(OsStr::new("plain:1")), b"plain:1");
    }
}
