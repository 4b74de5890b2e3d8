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
pub fn explain(config: &Config, key: &[u8], kind: EventKind, db: u32) -> Explanation {
    explain_field(config, key, None, kind, db)
}

/// [`explain`] for one field of a hash (`explain KEY --field F`): `hexpired` rules match the
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
        fired = true;
        for (name, value) in rule.capture_names().iter().zip(&captures) {
            let _ = writeln!(out, "  capture {name} = \"{}\"", printable(value));
        }
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
        key: key.to_vec(),
        field: field.map(<[u8]>::to_vec),
        observed_at: now,
        deadline: ttl_ms.map(|ms| now + chrono::Duration::milliseconds(ms)),
        ttl_ms,
        recovered: false,
        source: "explain".into(),
    };
    let ctx = Context::for_event(&rule.name, &event, rule.capture_names(), captures, None)
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
            if ch.integration.alertmanager().is_some() {
                let firing = crate::firing::Firing::new(
                    &rule.name,
                    &event,
                    rule.capture_names(),
                    captures.to_vec(),
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

    #[test]
    fn hex_escapes_give_raw_bytes() {
        assert_eq!(key_bytes(OsStr::new("a\\xffb")), b"a\xffb");
        assert_eq!(key_bytes(OsStr::new("a\\xzz")), b"a\\xzz");
        assert_eq!(key_bytes(OsStr::new("plain:1")), b"plain:1");
    }
}
