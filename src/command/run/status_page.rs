//! The status page at `GET /`: one server-rendered HTML page for an on-call engineer on a phone.
//!
//! No JavaScript and no front-end build: the page is a string rendered from [`Status`],
//! [`Metrics`] and the deadline ledger, and refreshes itself every 30 s with a `<meta>` tag.
//! Every piece of text that comes from Redis or the rules (keys above all) goes through [`esc`],
//! so a key such as `<script>` is shown, never run.

use std::fmt::Write;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use crate::action::actions_of;
use crate::config::Config;
use crate::engine::silences::Silence;
use crate::event::EventKind;
use crate::keyspace::Conn;
use crate::metrics::Metrics;
use crate::source::ledger::Ledger;
use crate::status::{ActionOutcome, RecentFiring, Status};

/// How many upcoming expiries and recent events the page lists.
const UPCOMING: usize = 20;
const RECENT_SHOWN: usize = 50;

/// A slow or unreachable Redis must not hold up the page: the ledger gets this long.
const LEDGER_TIMEOUT: Duration = Duration::from_secs(2);

/// One key whose deadline the ledger knows.
#[derive(Clone, Debug)]
pub struct UpcomingKey {
    pub db: u32,
    pub key: Vec<u8>,
    pub deadline_ms: i64,
    /// The rules that will fire when it expires.
    pub rules: Vec<String>,
}

/// What the page can say about upcoming expiries.
#[derive(Clone, Debug)]
pub enum Upcoming {
    /// No rule reacts to expiries, so keywatch keeps no ledger.
    NoLedger,
    Unavailable(String),
    Keys {
        keys: Vec<UpcomingKey>,
        /// What this instance has learnt so far: the keys of its index, and whether its fill
        /// (the walk of the keyspace after start or a reconnect) is done. Right after a
        /// restart the ledger in Redis already lists keys while the index is still filling.
        indexed: usize,
        filled: bool,
    },
}

/// The next [`UPCOMING`] deadlines over the watched databases, soonest first.
pub async fn upcoming(ledger: Option<&Ledger>, config: Option<&Config>) -> Upcoming {
    let (Some(ledger), Some(config)) = (ledger, config) else {
        return Upcoming::NoLedger;
    };
    let read = async {
        let mut keys = Vec::new();
        for &db in &config.redis.databases {
            for (key, deadline_ms) in ledger.upcoming(db, i64::MAX, UPCOMING).await? {
                let rules = rules_at_deadline(config, db, &key);
                keys.push(UpcomingKey {
                    db,
                    key,
                    deadline_ms,
                    rules,
                });
            }
        }
        keys.sort_by_key(|k| k.deadline_ms);
        keys.truncate(UPCOMING);
        Ok::<_, redis::RedisError>(keys)
    };
    match tokio::time::timeout(LEDGER_TIMEOUT, read).await {
        Ok(Ok(keys)) => Upcoming::Keys {
            keys,
            indexed: ledger.indexed(),
            filled: ledger.is_filled(),
        },
        Ok(Err(e)) => Upcoming::Unavailable(format!("cannot read the ledger: {e}")),
        Err(_) => Upcoming::Unavailable(format!(
            "the ledger did not answer within {}",
            humantime::format_duration(LEDGER_TIMEOUT)
        )),
    }
}

/// The rules a key's deadline matters to, in file order: those that fire when it expires and
/// those that warn before it.
fn rules_at_deadline(config: &Config, db: u32, key: &[u8]) -> Vec<String> {
    let mut idx = Vec::new();
    config.matching_rules(key, &mut idx);
    idx.into_iter()
        .map(|i| &config.rules[i])
        .filter(|r| r.fires_on(EventKind::Expired, db) || r.fires_on(EventKind::Expiring, db))
        .filter(|r| r.pattern.captures(key).is_some())
        .map(|r| r.name.clone())
        .collect()
}

/// The summary's word on the deadline ledger, from what this instance knows now (the
/// `keywatch_ledger_keys` gauge is only refreshed every few seconds).
fn ledger_pill(upcoming: &Upcoming) -> String {
    match upcoming {
        Upcoming::NoLedger => "no ledger".into(),
        Upcoming::Unavailable(_) => "ledger unavailable".into(),
        Upcoming::Keys {
            indexed,
            filled: true,
            ..
        } => format!("{indexed} ledger keys"),
        Upcoming::Keys { indexed, .. } => {
            format!("learning deadlines ({indexed} ledger keys so far)")
        }
    }
}

/// Text for HTML, element content and attribute values alike. Control characters are shown as
/// `\xNN`: a key may hold any byte, and an invisible one would make two keys look the same.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            // Would reverse the rest of the line, keywatch's own words included.
            c if crate::event::reorders(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// A key's exact bytes for HTML: text as [`esc`] shows it, and each byte that is not UTF-8 as
/// `\xNN` (replaced by U+FFFD, two keys would look the same; `explain` takes the `\xNN` back).
/// A key longer than [`crate::long_key::IN_TEXT`] is shown by its cut view.
pub fn esc_key(key: &[u8]) -> String {
    let key = crate::long_key::view(key, crate::long_key::IN_TEXT);
    let mut out = String::with_capacity(key.len());
    for chunk in key.utf8_chunks() {
        out.push_str(&esc(chunk.valid()));
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// `4m 3s`, `2h 5m`, `3d 4h`: two units are enough to read at a glance.
fn span(d: chrono::TimeDelta) -> String {
    let s = d.num_seconds().unsigned_abs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

fn clock(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn ago(now: DateTime<Utc>, at: DateTime<Utc>) -> String {
    format!("{} ago", span(now - at))
}

/// The CSS class of an outcome badge.
fn badge(outcome: &str) -> &'static str {
    match outcome {
        "sent" => "ok",
        "retry" | "retrying" => "warn",
        "failed" | "dead" => "bad",
        _ => "idle",
    }
}

const STYLE: &str = "\
:root{color-scheme:light dark;--fg:#1b1f24;--bg:#f6f7f9;--card:#fff;--line:#d8dde3;--mute:#5b6570;\
--ok:#1a7f37;--warn:#9a6700;--bad:#cf222e}\
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--card:#161b22;--line:#30363d;\
--mute:#9da7b3;--ok:#3fb950;--warn:#d29922;--bad:#f85149}}\
*{box-sizing:border-box}\
body{margin:0;font:16px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'Noto Sans','PingFang SC',sans-serif;\
color:var(--fg);background:var(--bg)}\
main{max-width:60rem;margin:0 auto;padding:.75rem}\
h1{font-size:1.35rem;margin:.25rem 0}\
h2{font-size:1.1rem;margin:1.25rem 0 .5rem;border-bottom:1px solid var(--line);padding-bottom:.25rem}\
.summary{display:flex;flex-wrap:wrap;gap:.4rem;margin:.5rem 0}\
.pill{border:1px solid var(--line);border-radius:999px;padding:.1rem .6rem;background:var(--card);font-size:.9rem}\
ul{list-style:none;margin:0;padding:0}\
li.card{background:var(--card);border:1px solid var(--line);border-radius:.5rem;padding:.55rem .7rem;margin:.45rem 0}\
.key,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.92rem;\
overflow-wrap:anywhere;word-break:break-all}\
.key{font-weight:600}\
.meta{color:var(--mute);font-size:.85rem}\
.badge{display:inline-block;border-radius:.3rem;padding:0 .4rem;margin:.15rem .25rem 0 0;font-size:.85rem;\
border:1px solid currentColor}\
.ok{color:var(--ok)}.warn{color:var(--warn)}.bad{color:var(--bad)}.idle{color:var(--mute)}\
.n{white-space:nowrap}\
.reason{font-size:.85rem;overflow-wrap:anywhere}\
.none{color:var(--mute);font-style:italic}\
";

/// Renders the whole page. `now` is passed in so tests get a fixed page.
pub fn render(
    status: &Status,
    metrics: &Metrics,
    upcoming: &Upcoming,
    silences: &[Silence],
    recent_firings: &[RecentFiring],
    now: DateTime<Utc>,
) -> String {
    let config = status.config();
    let ready = status.ready();
    let mut h = String::with_capacity(16 * 1024);
    h.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"refresh\" content=\"30\">\
         <title>keywatch status</title><style>",
    );
    h.push_str(STYLE);
    h.push_str("</style></head><body><main>\n");

    let _ = writeln!(
        h,
        "<h1>keywatch <span class=\"meta\">{}</span></h1>\
         <div class=\"summary\" id=\"summary\">\
         <span class=\"pill {}\" id=\"ready\">{}</span>\
         <span class=\"pill\">{} rules</span>\
         <span class=\"pill\">{} pending</span>\
         <span class=\"pill {}\">{} dead letters</span>\
         <span class=\"pill\">{} reconnects</span>\
         <span class=\"pill\" id=\"ledger\">{}</span></div>\
         <div class=\"meta\">As of {}; refreshes every 30 s. Counts since this process started.</div>",
        esc(env!("CARGO_PKG_VERSION")),
        if ready { "ok" } else { "bad" },
        if ready { "ready" } else { "not ready" },
        config.as_ref().map_or(0, |c| c.rules.len()),
        metrics.queue_pending.get(),
        if metrics.dead_letters.get() > 0 {
            "bad"
        } else {
            ""
        },
        metrics.dead_letters.get(),
        metrics.reconnects.get(),
        esc(&ledger_pill(upcoming)),
        clock(now),
    );

    subscribers(&mut h, status);
    rules(&mut h, status, config.as_deref());
    upcoming_section(&mut h, upcoming, now);
    recent(&mut h, recent_firings, config.as_deref(), now);
    dead_letters(&mut h, status, now);

    quiet(&mut h, status, config.as_deref(), now);

    h.push_str("<section id=\"silences\"><h2>Silences</h2>");
    if silences.is_empty() {
        h.push_str("<p class=\"none\">none</p>");
    } else {
        h.push_str("<ul>");
        for s in silences {
            h.push_str(&format!(
                "<li><b>{}</b> {} until {} — {} <small>({})</small></li>",
                esc(&s.rule),
                match (s.exact_key(), s.pattern.as_deref(), s.invalid_pattern()) {
                    (_, _, _) if s.refused(now).is_some() && s.invalid_pattern().is_none() => {
                        format!(
                            "<b>refused</b> ({}): ignored, mutes nothing",
                            esc(&s.refused(now).unwrap_or_default())
                        )
                    }
                    // A link's silence mutes exactly its key, whatever the pattern spells.
                    (_, _, _) if s.key_sha256.is_some() => {
                        format!("key {}", esc(&s.key_shown().unwrap_or_default()))
                    }
                    (Some(Ok(key)), _, _) => format!("key {}", esc_key(&key)),
                    (Some(Err(_)), _, _) => {
                        "<b>invalid key</b> (not base64): ignored, mutes nothing".into()
                    }
                    (_, Some(p), Some(e)) => format!(
                        "<b>invalid pattern</b> {} ({}): ignored, mutes nothing",
                        esc(p),
                        esc(&e)
                    ),
                    (_, Some(p), None) => format!("keys {}", esc(p)),
                    (_, None, _) => "all keys".into(),
                },
                esc(&crate::firing::rfc3339(s.until)),
                esc(&s.comment),
                esc(&s.id)
            ));
        }
        h.push_str("</ul>");
    }
    h.push_str("</section>\n");
    h.push_str("</main></body></html>\n");
    h
}

fn subscribers(h: &mut String, status: &Status) {
    h.push_str("<section id=\"subscribers\"><h2>Subscribers</h2><ul>");
    let nodes = status.nodes();
    if nodes.is_empty() {
        h.push_str("<li class=\"none\">none</li>");
    }
    for (node, up) in nodes {
        let _ = write!(
            h,
            "<li class=\"card\"><span class=\"key\">{}</span> \
             <span class=\"badge {}\">{}</span></li>",
            esc(&node),
            if up { "ok" } else { "bad" },
            if up { "subscribed" } else { "not subscribed" },
        );
    }
    h.push_str("</ul></section>\n");
}

fn rules(h: &mut String, status: &Status, config: Option<&Config>) {
    h.push_str("<section id=\"rules\"><h2>Rules</h2><ul>");
    let Some(config) = config.filter(|c| !c.rules.is_empty()) else {
        h.push_str("<li class=\"none\">none</li></ul></section>\n");
        return;
    };
    for rule in &config.rules {
        let c = status.counts(&rule.name);
        let on: Vec<&str> = rule.on.iter().map(|k| k.as_str()).collect();
        let mut actions: Vec<String> = Vec::new();
        let mut channels: Vec<String> = Vec::new();
        for a in actions_of(rule) {
            match a {
                crate::firing::Action::Notify { channel }
                | crate::firing::Action::Alert { channel, .. } => {
                    if !channels.contains(&channel) {
                        channels.push(channel)
                    }
                }
                other => actions.push(other.name().to_string()),
            }
        }
        if !channels.is_empty() {
            actions.push(format!("notify → {}", channels.join(", ")));
        }
        let _ = write!(
            h,
            "<li class=\"card\" data-rule=\"{name}\"><div><strong>{name}</strong> \
             <span class=\"meta\">on {on}</span></div>\
             <div><code>{pattern}</code></div>\
             <div class=\"meta\">{actions}</div>\
             <div class=\"counts\">{matched} · {sent} · {retried} · {failed} · {dead}{shadow}</div></li>",
            name = esc(&rule.name),
            on = esc(&on.join(", ")),
            pattern = esc(rule.pattern.source()),
            actions = esc(&actions.join(" · ")),
            matched = count(c.matched, "matched", ""),
            sent = count(c.sent, "sent", "ok"),
            retried = count(c.retried, "retries", "warn"),
            failed = count(c.failed, "failed", "bad"),
            dead = count(c.dead, "dead", "bad"),
            // Only a shadow's (`run --shadow`) actions are rendered and not done.
            shadow = match c.shadow {
                0 => String::new(),
                n => format!(" · {}", count(n, "shadow (not done)", "")),
            },
        );
    }
    h.push_str("</ul></section>\n");
}

/// One count of a rule; coloured only when it is not zero, so trouble stands out.
fn count(n: u64, what: &str, class: &str) -> String {
    let class = if n == 0 { "idle" } else { class };
    format!("<span class=\"n {class}\">{n} {what}</span>")
}

fn upcoming_section(h: &mut String, upcoming: &Upcoming, now: DateTime<Utc>) {
    let _ = write!(
        h,
        "<section id=\"upcoming\"><h2>Upcoming expiries <span class=\"meta\">(next {UPCOMING})</span></h2><ul>"
    );
    match upcoming {
        Upcoming::NoLedger => h.push_str(
            "<li class=\"none\">none (no rule reacts to expiries, so no deadlines are kept)</li>",
        ),
        Upcoming::Unavailable(why) => {
            let _ = write!(h, "<li class=\"none bad\">unavailable: {}</li>", esc(why));
        }
        Upcoming::Keys { keys, .. } if keys.is_empty() => {
            h.push_str("<li class=\"none\">none</li>")
        }
        Upcoming::Keys { keys, .. } => {
            for k in keys {
                let at = Utc
                    .timestamp_millis_opt(k.deadline_ms)
                    .single()
                    .unwrap_or(now);
                let when = if at >= now {
                    format!("in {}", span(at - now))
                } else {
                    format!("due {}", ago(now, at))
                };
                let _ = write!(
                    h,
                    "<li class=\"card\"><div class=\"key\">{}</div>\
                     <div class=\"meta\">db {} · {} · {}</div><div class=\"meta\">{}</div></li>",
                    esc_key(&k.key),
                    k.db,
                    esc(&when),
                    clock(at),
                    if k.rules.is_empty() {
                        "no rule fires".to_string()
                    } else {
                        esc(&k.rules.join(", "))
                    },
                );
            }
        }
    }
    h.push_str("</ul></section>\n");
}

fn recent(h: &mut String, recent: &[RecentFiring], config: Option<&Config>, now: DateTime<Utc>) {
    h.push_str("<section id=\"recent\"><h2>Recent events</h2><ul>");
    if recent.is_empty() {
        h.push_str("<li class=\"none\">none</li>");
    }
    for f in recent.iter().take(RECENT_SHOWN) {
        let _ = write!(
            h,
            "<li class=\"card event\" data-id=\"{id}\"><div class=\"key\">{key}</div>\
             <div class=\"meta\">{rule} · {event}{recovered} · {ago} · {at}</div><div>",
            id = esc(&f.id),
            key = esc(&f.key),
            rule = esc(&f.rule),
            event = esc(&f.event),
            recovered = if f.recovered { " (recovered)" } else { "" },
            ago = ago(now, f.at),
            at = clock(f.at),
        );
        // A digest stands for many firings, so its outcome is counted for the rule, not shown
        // here: say where the notification went instead of leaving it "pending" for ever.
        let digest = config
            .and_then(|c| c.rule(&f.rule))
            .and_then(|r| r.notify.as_ref())
            .filter(|n| n.group.is_some());
        if f.outcomes.is_empty() && digest.is_none() {
            h.push_str("<span class=\"badge idle\">pending</span>");
        }
        for o in &f.outcomes {
            let tries = if o.attempts > 1 {
                format!(" ×{}", o.attempts)
            } else {
                String::new()
            };
            let _ = write!(
                h,
                "<span class=\"badge {}\" title=\"{}\">{}: {}{}</span>",
                badge(&o.outcome),
                esc(&o.detail),
                esc(&o.action),
                esc(&o.outcome),
                tries,
            );
        }
        if let Some(n) = digest {
            let _ = write!(
                h,
                "<span class=\"badge idle\">notify:{}: in digest</span>",
                esc(&n.to.join(", "))
            );
        }
        h.push_str("</div></li>");
    }
    h.push_str("</ul></section>\n");
}

fn dead_letters(h: &mut String, status: &Status, now: DateTime<Utc>) {
    h.push_str("<section id=\"dead\"><h2>Dead letters</h2><ul>");
    let dead = status.dead_letters();
    if dead.is_empty() {
        h.push_str("<li class=\"none\">none</li>");
    }
    for d in &dead {
        let _ = write!(
            h,
            "<li class=\"card dead\"><div class=\"key\">{key}</div>\
             <div class=\"meta\">{rule} · {action} · {ago} · {at}</div>\
             <div class=\"reason bad\">{reason}</div></li>",
            key = esc(&d.key),
            rule = esc(&d.rule),
            action = esc(&d.label()),
            ago = ago(now, d.at),
            at = clock(d.at),
            reason = esc(&d.reason),
        );
    }
    h.push_str("</ul></section>\n");
}

/// The recent firings the page lists: from the history in Redis (every instance's work, kept
/// across restarts), or this instance's memory when there is no history to read.
pub async fn recent_firings(
    status: &Status,
    history: Option<&(Conn, String)>,
) -> Vec<RecentFiring> {
    let Some((conn, prefix)) = history else {
        return status.recent();
    };
    let filter = crate::store::history::Filter {
        limit: RECENT_SHOWN,
        ..Default::default()
    };
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        crate::store::history::list(&mut conn.clone(), prefix, &filter),
    )
    .await;
    match read {
        Ok(Ok(records)) => records.iter().map(from_history).collect(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "Cannot read the history for the status page; showing this instance's recent firings.");
            status.recent()
        }
        Err(_) => {
            tracing::warn!(
                "Reading the history for the status page timed out; showing this instance's recent firings."
            );
            status.recent()
        }
    }
}

fn from_history(r: &crate::store::history::Record) -> RecentFiring {
    let mut event = r.str_field("event").to_string();
    if let Some(f) = r.event.get("followup").and_then(|f| f.as_str()) {
        event = format!("{event} ({f})");
    }
    RecentFiring {
        at: r
            .str_field("observed_at")
            .parse()
            .unwrap_or_else(|_| Utc::now()),
        rule: r.str_field("rule").to_string(),
        event,
        key: r.str_field("key").to_string(),
        id: r.str_field("id").to_string(),
        recovered: r.event["recovered"] == true,
        outcomes: r
            .actions
            .iter()
            .map(|a| ActionOutcome {
                action: match &a.channel {
                    Some(c) => format!("{}:{c}", a.action),
                    None => a.action.clone(),
                },
                outcome: a.outcome.clone(),
                attempts: a.attempts,
                detail: a.last_error.clone().unwrap_or_default(),
            })
            .collect(),
    }
}

/// What each quiet channel holds: "held until 08:00, 14 messages" (docs/rules.md#quiet-hours).
fn quiet(
    h: &mut String,
    status: &Status,
    config: Option<&crate::config::Config>,
    now: DateTime<Utc>,
) {
    let held = status.held();
    if held.is_empty() {
        return;
    }
    let tz = config.map_or(chrono_tz::UTC, |c| c.timezone);
    h.push_str("<section id=\"quiet\"><h2>Quiet hours</h2><ul>");
    for c in held {
        let _ = write!(
            h,
            "<li><b>{}</b> {}</li>",
            esc(&c.channel),
            esc(&crate::quiet_hours::held_line(c.until, c.count, tz, now))
        );
    }
    h.push_str("</ul></section>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firing::{Action, DeadLetter};

    #[test]
    fn escapes_markup_quotes_and_control_bytes() {
        assert_eq!(
            esc("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
        assert_eq!(esc("a\u{1b}[31mb\n"), "a\\x1b[31mb\\x0a");
        assert_eq!(esc("订单锁:42"), "订单锁:42");
        assert_eq!(esc("a\u{202e}b\u{2067}"), "a\\u{202e}b\\u{2067}");
    }

    #[test]
    fn spans_read_at_a_glance() {
        let s = chrono::TimeDelta::seconds;
        assert_eq!(span(s(5)), "5s");
        assert_eq!(span(s(243)), "4m 3s");
        assert_eq!(span(s(7500)), "2h 5m");
        assert_eq!(span(s(3 * 86400 + 4 * 3600 + 9)), "3d 4h");
        assert_eq!(span(s(-5)), "5s");
    }

    #[test]
    fn an_empty_process_says_none_everywhere() {
        let status = Status::default();
        let page = render(
            &status,
            &Metrics::new(),
            &Upcoming::NoLedger,
            &[],
            &status.recent(),
            Utc::now(),
        );
        for id in [
            "subscribers",
            "rules",
            "upcoming",
            "recent",
            "dead",
            "silences",
        ] {
            let start = page
                .find(&format!("<section id=\"{id}\">"))
                .unwrap_or_else(|| panic!("no section {id}"));
            let section = &page[start..];
            let section = &section[..section.find("</section>").unwrap()];
            assert!(section.contains("none"), "{id}: {section}");
        }
        assert!(page.contains("not ready"));
    }

    #[test]
    fn key_text_never_becomes_markup() {
        let status = Status::default();
        status.record_dead_letter(&DeadLetter::new(
            "r",
            "<img src=x onerror=alert(1)>".into(),
            Action::Notify {
                channel: "hook".into(),
            },
            "HTTP 404 <b>no</b>",
            Vec::new(),
            false,
        ));
        let page = render(
            &status,
            &Metrics::new(),
            &Upcoming::NoLedger,
            &[],
            &status.recent(),
            Utc::now(),
        );
        assert!(!page.contains("<img"), "{page}");
        assert!(!page.contains("<b>"), "{page}");
        assert!(page.contains("&lt;img src=x onerror=alert(1)&gt;"));
    }

    /// A key with a rule that warns before its deadline and one that fires at it lists both.
    #[test]
    fn an_upcoming_key_names_every_rule_its_deadline_matters_to() {
        let config = crate::config::of_yaml(
            r#"
channels:
  log: { type: log }
rules:
  - name: license-expiring
    match: "license:{customer}"
    on: [expiring]
    warn_before: 7d
    notify: { to: [log] }
  - name: license-expired
    match: "license:{customer}"
    notify: { to: [log] }
  - name: license-evicted
    match: "license:{customer}"
    on: [evicted]
    notify: { to: [log] }
"#,
            crate::config::Mode::Check,
        );
        assert_eq!(
            rules_at_deadline(&config, 0, b"license:acme"),
            ["license-expiring", "license-expired"]
        );
    }

    /// Right after a restart this instance's index of the ledger is still filling (its gauge
    /// reads 0) while the ledger in Redis already lists the upcoming keys: the page must not
    /// say "0 ledger keys" beside them.
    #[test]
    fn the_ledger_count_agrees_with_the_upcoming_keys() {
        let status = Status::default();
        let now = Utc::now();
        let key = |k: &str| UpcomingKey {
            db: 0,
            key: k.as_bytes().to_vec(),
            deadline_ms: now.timestamp_millis() + 60_000,
            rules: vec!["r".into()],
        };
        let upcoming = Upcoming::Keys {
            keys: vec![key("a:1"), key("a:2"), key("a:3")],
            indexed: 0,
            filled: false,
        };
        let page = render(
            &status,
            &Metrics::new(),
            &upcoming,
            &[],
            &status.recent(),
            now,
        );
        assert!(!page.contains(">0 ledger keys<"), "{page}");
        assert!(page.contains("learning deadlines"), "{page}");
    }

    /// Issue 36: a link's silence for a key that is not UTF-8 was listed by its pattern, the
    /// spelling with U+FFFD, which is another key.
    #[test]
    fn keys_that_are_not_utf8_are_shown_by_their_bytes() {
        use base64::Engine;
        let status = Status::default();
        let now = Utc::now();
        let silence = Silence {
            id: "0462bbcb".into(),
            rule: "locks".into(),
            pattern: Some("lock:\u{fffd}".into()),
            key: Some(base64::engine::general_purpose::STANDARD.encode(b"lock:\xff<")),
            key_sha256: None,
            until: now + chrono::TimeDelta::hours(1),
            comment: "silenced from a signed link".into(),
            created: now,
            by: "link".into(),
        };
        let upcoming = Upcoming::Keys {
            keys: vec![UpcomingKey {
                db: 0,
                key: b"cache:\xfe\x1b".to_vec(),
                deadline_ms: now.timestamp_millis() + 60_000,
                rules: vec![],
            }],
            indexed: 1,
            filled: true,
        };
        let page = render(
            &status,
            &Metrics::new(),
            &upcoming,
            &[silence],
            &status.recent(),
            now,
        );
        assert!(page.contains(r"key lock:\xff&lt;"), "{page}");
        assert!(page.contains(r"cache:\xfe\x1b"), "{page}");
        assert!(!page.contains('\u{fffd}'), "{page}");
    }
}
