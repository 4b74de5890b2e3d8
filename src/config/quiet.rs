//! `timezone`, `quiet_hours` and a channel's `quiet` (docs/rules.md#quiet-hours), as the rule
//! files write them: decoded with their places, then checked across files once every window and
//! channel is known (a channel naming an unknown window, `quiet` on an alertmanager channel).
//! The arithmetic of windows is [`crate::quiet_hours`]'s.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::model::Config;
use crate::firing::Action;

use crate::channel::quiet::{ChannelQuietDraft, is_window_name};
use crate::quiet_hours::{self, DAY_NAMES, Days, Quiet, Release, Span, Window};
use crate::yaml::Node;
use crate::yaml::decode::{Decoder, Spanned, Text};
use crate::yaml::diagnostic::{Loc, did_you_mean};

/// `timezone` and `quiet_hours` from every file.
#[derive(Default, Debug)]
pub struct QuietDraft {
    pub timezone: Option<Spanned<Tz>>,
    /// Each window with where its name was written.
    pub windows: Vec<(Loc, Window)>,
    /// Every window name defined, those with errors too: a channel naming one of those must
    /// not get a second, misleading "unknown window".
    pub names: Vec<Spanned<String>>,
}

/// A time zone name of the tz database (`Asia/Shanghai`, `UTC`); `what` names the field in
/// messages. A name that is not one gets the closest name, or says why an abbreviation or an
/// offset will not do.
pub fn time_zone(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<Spanned<Tz>> {
    let t = d.text(node, what)?;
    if t.unresolved {
        return None;
    }
    let name = t.value.trim();
    if let Ok(tz) = name.parse::<Tz>() {
        return Some(Spanned {
            value: tz,
            loc: t.loc,
        });
    }
    let same_but_case = chrono_tz::TZ_VARIANTS
        .iter()
        .find(|tz| tz.name().eq_ignore_ascii_case(name));
    let hint = if let Some(tz) = same_but_case {
        format!("; did you mean `{}`?", tz.name())
    } else if name.len() <= 5 && name.chars().all(|c| c.is_ascii_uppercase()) {
        "; an abbreviation names no zone (CST is China's and America's): write the zone's name, e.g. `Asia/Shanghai` or `America/Chicago`".to_string()
    } else if name.starts_with(['+', '-'])
        || name.to_ascii_uppercase().starts_with("UTC")
        || name.to_ascii_uppercase().starts_with("GMT")
    {
        "; an offset does not follow the clock changes of a place: write the zone's name, e.g. `Europe/Berlin`".to_string()
    } else {
        match did_you_mean(name, chrono_tz::TZ_VARIANTS.iter().map(|tz| tz.name())) {
            s if s.is_empty() => "; write a name of the tz database, e.g. `UTC`, `Asia/Shanghai` or `America/New_York`".to_string(),
            s => s,
        }
    };
    d.error(
        &t.loc,
        format!("{what}: `{}` is not a time zone name{hint}", t.value),
    );
    None
}

/// The top-level `timezone`, which one file at most may set.
pub fn decode_timezone(d: &mut Decoder<'_>, node: &Node, into: &mut QuietDraft) {
    let Some(tz) = time_zone(d, node, "`timezone`") else {
        return;
    };
    match &into.timezone {
        Some(first) => d.error(
            &tz.loc,
            format!("`timezone` is set twice: first at {}", first.loc),
        ),
        None => into.timezone = Some(tz),
    }
}

/// `quiet_hours: { NAME: [ { days, from, to }, … ] }`.
pub fn decode_quiet_hours(d: &mut Decoder<'_>, node: &Node, into: &mut QuietDraft) {
    let Some(mut m) = d.map(node, "the `quiet_hours` section") else {
        return;
    };
    for e in m.drain() {
        let Some(name) = d.name(
            e.key,
            "quiet hours window name",
            is_window_name,
            "use lowercase letters, digits, `_` and `-`",
        ) else {
            continue;
        };
        if let Some(first) = into.names.iter().find(|n| n.value == name.value) {
            d.error(
                &name.loc,
                format!(
                    "quiet hours window `{}` is defined twice: first at {}",
                    name.value, first.loc
                ),
            );
            continue;
        }
        into.names.push(name.clone());
        if let Some(w) = decode_window(d, e.value, &name) {
            into.windows.push((name.loc, w));
        }
    }
}

/// One window: its entries, none with an empty or repeated day or a bad time, no two with
/// overlapping times on a shared day, and not quiet all week long.
fn decode_window(d: &mut Decoder<'_>, node: &Node, name: &Spanned<String>) -> Option<Window> {
    let what = format!("quiet hours window `{}`", name.value);
    let entries = d.list(node, &what);
    if entries.is_empty() && matches!(node.kind, crate::yaml::Kind::Seq(_)) {
        d.error(
            &node.loc,
            format!("{what} has no entries; write e.g. `- {{ days: [mon, tue, wed, thu, fri], from: \"22:00\", to: \"08:00\" }}`"),
        );
    }
    let mut spans = Vec::new();
    let mut places = Vec::new();
    let mut ok = !entries.is_empty();
    for entry in entries {
        match decode_span(d, entry, &what) {
            Some(s) => {
                spans.push(s);
                places.push(entry.loc.clone());
            }
            None => ok = false,
        }
    }
    if !ok {
        return None;
    }
    if let Some((i, j, day)) = quiet_hours::overlapping(&spans) {
        d.error(
            &places[j],
            format!(
                "{what}: `{}` is in two entries whose times overlap: {} (at {}) and {}; keep one, or make their times meet without overlapping",
                DAY_NAMES[day], spans[i], places[i], spans[j]
            ),
        );
        return None;
    }
    let window = Window {
        name: name.value.clone(),
        spans,
    };
    if window.covers_the_week() {
        d.error(
            &name.loc,
            format!("{what} is quiet all week long, so nothing it held would ever be released; leave some time outside it"),
        );
        return None;
    }
    Some(window)
}

fn decode_span(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<Span> {
    let what = format!("{what} entry");
    let mut m = d.map(node, &what)?;
    let days = m.require(d, "days").and_then(|n| decode_days(d, n, &what));
    let from = m
        .require(d, "from")
        .and_then(|n| decode_clock(d, n, &format!("{what} `from`"), false));
    let to = m
        .require(d, "to")
        .and_then(|n| decode_clock(d, n, &format!("{what} `to`"), true));
    m.finish(d, &["days", "from", "to"], &|_| None);
    let (days, from, to) = (days?, from?, to?);
    if from.value == to.value {
        d.error(
            &to.loc,
            format!(
                "{what}: `from` and `to` are both `{}`; for whole days write `from: \"00:00\", to: \"24:00\"`",
                quiet_hours::clock(from.value)
            ),
        );
        return None;
    }
    Some(Span {
        days,
        from: from.value,
        to: to.value,
    })
}

fn decode_days(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<Days> {
    let what = format!("{what} `days`");
    let items = d.one_or_many(node, &what);
    let mut days = Days::default();
    let mut ok = true;
    for item in items.iter().copied() {
        let Some(t) = d.text(item, &what) else {
            ok = false;
            continue;
        };
        let name = t.value.trim().to_ascii_lowercase();
        match Days::day(&name) {
            Some(day) if days.contains(day) => {
                d.error(&t.loc, format!("{what}: `{name}` is listed twice"));
                ok = false;
            }
            Some(day) => days = days.with(day),
            None => {
                d.error(
                    &t.loc,
                    format!(
                        "{what}: unknown day `{}`; write {}{}",
                        t.value,
                        DAY_NAMES.join(", "),
                        did_you_mean(&name, DAY_NAMES.iter().copied())
                    ),
                );
                ok = false;
            }
        }
    }
    if items.is_empty() && matches!(node.kind, crate::yaml::Kind::Seq(_)) {
        d.error(
            &node.loc,
            format!("{what} lists no day; write e.g. `[mon, tue, wed, thu, fri]`"),
        );
        return None;
    }
    ok.then_some(days).filter(|d| !d.is_empty())
}

fn decode_clock(d: &mut Decoder<'_>, node: &Node, what: &str, end: bool) -> Option<Spanned<u16>> {
    let t: Text = d.text(node, what)?;
    match quiet_hours::parse_clock(&t.value, end) {
        Some(value) => Some(Spanned { value, loc: t.loc }),
        None => {
            let also = if end {
                ", or `24:00` for the end of the day"
            } else if t.value.trim() == "24:00" {
                " (`24:00` only ends a day: a window from midnight starts at `00:00`)"
            } else {
                ""
            };
            d.error(
                &t.loc,
                format!(
                    "{what}: `{}` is not a time of day; write `HH:MM` in 24 hours, e.g. `\"22:00\"`{also}",
                    t.value
                ),
            );
            None
        }
    }
}

/// The channel's quiet hours once every window is known: the window must exist, and an
/// alertmanager channel cannot be quiet (Alertmanager mutes by its own time intervals, and its
/// alerts are posted again while they fire: holding them would only delay what it decides). A
/// channel that takes no digests (PagerDuty: each event is an incident of its own) releases
/// `each` held message, and may not say otherwise.
pub fn check_channel(
    d: &mut Decoder<'_>,
    channel: &crate::channel::Channel,
    draft: ChannelQuietDraft,
    quiet: &QuietDraft,
) -> Option<Quiet> {
    let alertmanager = channel.integration.alertmanager().is_some();
    let digests = channel.integration.takes_digests();
    let channel = &channel.name;
    let windows = &quiet.windows;
    let what = format!("channel `{channel}` `quiet`");
    if alertmanager {
        d.error(
            &draft.loc,
            format!("{what}: an alertmanager channel cannot be quiet: Alertmanager has its own time intervals (a route's `mute_time_intervals` or `active_time_intervals`); remove `quiet`, or hold the messages on another channel"),
        );
        return None;
    }
    let release = match draft.release {
        None if !digests => Release::Each,
        None => Release::default(),
        Some(r) if !digests && r.value != Release::Each => {
            d.error(
                &r.loc,
                format!("{what} `release`: channel `{channel}` takes no digests (each event is its own alert there), so it releases `each` held message; remove `release` or write `each`"),
            );
            return None;
        }
        Some(r) => r.value,
    };
    if !windows.iter().any(|(_, w)| w.name == draft.during.value) {
        if quiet.names.iter().any(|n| n.value == draft.during.value) {
            // Defined, with errors already reported.
            return None;
        }
        let names: Vec<&str> = quiet.names.iter().map(|n| n.value.as_str()).collect();
        let hint = match did_you_mean(&draft.during.value, names.iter().copied()) {
            s if !s.is_empty() => s,
            _ if names.is_empty() => "; define it under `quiet_hours`, e.g. `quiet_hours: { night: [ { days: [mon, tue, wed, thu, fri], from: \"22:00\", to: \"08:00\" } ] }`".to_string(),
            _ => format!("; define it under `quiet_hours` (known: {})", names.join(", ")),
        };
        d.error(
            &draft.during.loc,
            format!(
                "{what} `during`: unknown quiet hours window `{}`{hint}",
                draft.during.value
            ),
        );
        return None;
    }
    Some(Quiet {
        during: draft.during.value,
        release,
    })
}

/// `notify.quiet`: `ignore` is its only value.
pub fn decode_rule_quiet(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<Loc> {
    let t = d.text(node, &format!("{what} `quiet`"))?;
    if t.value.trim() == "ignore" {
        return Some(t.loc);
    }
    d.error(
        &t.loc,
        format!("{what} `quiet` must be `ignore` (this rule's messages pass every channel's quiet hours), found `{}`", t.value),
    );
    None
}

/// A message held by quiet hours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold<'c> {
    /// The channel's window.
    pub window: &'c Window,
    /// When the quiet period ends, and what is held is released.
    pub until: DateTime<Utc>,
    pub release: Release,
}

impl Config {
    /// The window `channel` is quiet during, and how it releases, when it has `quiet`.
    pub fn quiet_of(&self, channel: &str) -> Option<(&Window, Release)> {
        let quiet = self.channel(channel)?.quiet.as_ref()?;
        let window = self.quiet_hours.iter().find(|w| w.name == quiet.during)?;
        Some((window, quiet.release))
    }

    /// Whether `action` of rule `rule` attempted at `at` is held by its channel's quiet hours,
    /// and until when (docs/rules.md#quiet-hours): a message to people (a notification, an
    /// escalation, a resolved notice) through a channel with `quiet`, while its window is quiet,
    /// unless the rule says `notify.quiet: ignore`. An Alertmanager alert never is (`check`
    /// refuses `quiet` there), nor are reload, exec and cleanup. A rule that is gone (a reload
    /// removed it) does not ignore quiet hours.
    pub fn hold(&self, rule: &str, action: &Action, at: DateTime<Utc>) -> Option<Hold<'_>> {
        let channel = match action {
            Action::Notify { channel }
            | Action::Escalate { channel }
            | Action::Resolved { channel } => channel,
            Action::Alert { .. } | Action::Reload | Action::Exec | Action::Cleanup => return None,
        };
        if self.rule(rule).is_some_and(|r| r.ignores_quiet) {
            return None;
        }
        let (window, release) = self.quiet_of(channel)?;
        let until = window.quiet_until(self.timezone, at)?;
        Some(Hold {
            window,
            until,
            release,
        })
    }

    /// Whether what `channel` holds until `end` is to be released at `now`: its end has passed,
    /// or the channel's quiet hours (as these rules have them) no longer end then — a window
    /// edited or removed by a reload releases what it held at once.
    pub fn release_due(&self, channel: &str, end: DateTime<Utc>, now: DateTime<Utc>) -> bool {
        let current = self
            .quiet_of(channel)
            .and_then(|(w, _)| w.quiet_until(self.timezone, now));
        quiet_hours::release_due(end, now, current)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use chrono::{DateTime, Utc};

    use crate::config::{LoadError, Mode, load_texts};
    use crate::quiet_hours::Release;

    use crate::config::checked as check;

    #[test]
    fn quiet_hours_windows_channels_and_rules_load() {
        let loaded = check(
            r#"
timezone: Asia/Shanghai
quiet_hours:
  night:
    - { days: [mon, tue, wed, thu, fri], from: "22:00", to: "08:00" }
    - { days: [sat, sun], from: "00:00", to: "24:00" }
channels:
  team: { type: log, quiet: { during: night } }
  ops: { type: log, quiet: { during: night, release: count } }
  oncall: { type: log }
  pager: { type: pagerduty, routing_key: "R0UTINGKEY0123456789abcdefABCDEF", quiet: { during: night } }
rules:
  - name: locks
    match: "lock:{id}"
    notify: { to: [team, oncall], quiet: ignore }
  - name: caches
    match: "cache:{id}"
    on: [expiring]
    warn_before: 1h
    notify: { to: [team] }
"#,
        )
        .unwrap_or_else(|d| panic!("{d:#?}"));
        let c = &loaded.config;
        assert_eq!(c.timezone, chrono_tz::Asia::Shanghai);
        assert_eq!(
            c.scanner.as_ref().map(|s| s.timezone),
            Some(chrono_tz::Asia::Shanghai),
            "scanner.timezone follows timezone unless set"
        );
        assert_eq!(c.quiet_hours.len(), 1);
        assert_eq!(
            c.quiet_hours[0].to_string(),
            "mon–fri 22:00–08:00; sat, sun 00:00–24:00"
        );
        let quiet = |ch: &str| c.channel(ch).unwrap().quiet.clone();
        assert_eq!(
            quiet("team").map(|q| (q.during, q.release)),
            Some(("night".into(), Release::Digest))
        );
        assert_eq!(quiet("ops").map(|q| q.release), Some(Release::Count));
        assert_eq!(quiet("oncall"), None);
        assert_eq!(quiet("pager").map(|q| q.release), Some(Release::Each));
        assert!(c.rule("locks").unwrap().ignores_quiet);
        assert!(!c.rule("caches").unwrap().ignores_quiet);
        assert!(loaded.warnings.is_empty(), "{:#?}", loaded.warnings);
    }

    /// The `datetime` filter of the config's templates writes in its `timezone`, and `check`
    /// finds a bad format at the template's place.
    #[test]
    fn templates_write_times_in_the_timezone() {
        let yaml = |message: &str| {
            format!(
                "timezone: Asia/Tokyo\nchannels:\n  log: {{ type: log }}\nrules:\n  - name: r\n    match: \"a:{{id}}\"\n    notify: {{ to: [log], message: '{message}' }}\n"
            )
        };
        let loaded = check(&yaml("{{ deadline | datetime(\"%H:%M %Z\") }}"))
            .unwrap_or_else(|d| panic!("{d:#?}"));
        let c = &loaded.config;
        let id = c.rule("r").unwrap().notify.as_ref().unwrap().message.0[0].1;
        let sample = crate::template::Context::sample("r", crate::event::EventKind::Expired, &[]);
        let text = c.templates.render_text(id, &sample).unwrap();
        assert!(text.ends_with(" JST"), "{text}");
        let diags = check(&yaml("{{ deadline | datetime(\"%H:%Q\") }}"))
            .err()
            .expect("a bad format");
        assert_eq!(diags.len(), 1, "{diags:#?}");
        assert!(
            diags[0].starts_with("rules.yaml:7:35: rule `r` `notify.message` fails to render for `expired` events: invalid operation: `datetime`: `%H:%Q` is not a strftime format"),
            "{diags:#?}"
        );
    }

    /// Only messages to people through a quiet channel are held, and not a rule's that says
    /// `notify.quiet: ignore`; a reload that edits the window releases at once.
    #[test]
    fn what_is_held_and_until_when() {
        use crate::firing::Action;
        let yaml = r#"
timezone: Asia/Shanghai
quiet_hours:
  night: [{ days: [mon, tue, wed, thu, fri], from: "22:00", to: "08:00" }]
channels:
  team: { type: log, quiet: { during: night, release: each } }
  oncall: { type: log }
rules:
  - name: caches
    match: "cache:{id}"
    notify: { to: [team, oncall] }
    escalate: { after: 5m, to: [team] }
    reload: { url: "http://127.0.0.1:1/{{ id }}" }
  - name: locks
    match: "lock:{id}"
    notify: { to: [team], quiet: ignore }
"#;
        let loaded = check(yaml).unwrap_or_else(|d| panic!("{d:#?}"));
        let c = &loaded.config;
        let ch = |c: &str| c.to_string();
        // Monday 2026-12-07 23:00 in Shanghai.
        let night = "2026-12-07T15:00:00Z".parse::<DateTime<Utc>>().unwrap();
        let morning = "2026-12-08T00:00:00Z".parse::<DateTime<Utc>>().unwrap();
        let held = c
            .hold(
                "caches",
                &Action::Notify {
                    channel: ch("team"),
                },
                night,
            )
            .expect("held");
        assert_eq!(
            (held.window.name.as_str(), held.until, held.release),
            ("night", morning, Release::Each)
        );
        assert!(
            c.hold(
                "caches",
                &Action::Escalate {
                    channel: ch("team")
                },
                night
            )
            .is_some()
        );
        assert_eq!(
            c.hold(
                "caches",
                &Action::Notify {
                    channel: ch("oncall")
                },
                night
            ),
            None
        );
        assert_eq!(c.hold("caches", &Action::Reload, night), None);
        assert_eq!(
            c.hold(
                "locks",
                &Action::Notify {
                    channel: ch("team")
                },
                night
            ),
            None
        );
        assert_eq!(
            c.hold(
                "caches",
                &Action::Notify {
                    channel: ch("team")
                },
                morning
            ),
            None
        );
        assert!(
            c.hold(
                "gone",
                &Action::Notify {
                    channel: ch("team")
                },
                night
            )
            .is_some()
        );

        assert!(!c.release_due("team", morning, night));
        assert!(c.release_due("team", morning, morning));
        let edited = check(&yaml.replace("to: \"08:00\"", "to: \"07:00\""))
            .unwrap_or_else(|d| panic!("{d:#?}"));
        assert!(edited.config.release_due("team", morning, night));
        let removed = check(&yaml.replace(", quiet: { during: night, release: each }", ""))
            .unwrap_or_else(|d| panic!("{d:#?}"));
        assert!(removed.config.release_due("team", morning, night));
        assert!(c.release_due("gone", morning, night));
    }

    #[test]
    fn without_timezone_everything_is_utc() {
        let loaded = check(
            "channels:\n  log: { type: log }\nscanner: { schedule: \"@every 1m\" }\nrules:\n  - name: r\n    match: \"a:{id}\"\n    notify: { to: [log] }\n",
        )
        .unwrap_or_else(|d| panic!("{d:#?}"));
        assert_eq!(loaded.config.timezone, chrono_tz::UTC);
        assert_eq!(loaded.config.scanner.unwrap().timezone, chrono_tz::UTC);
    }

    /// Every mistake of quiet hours is found in one run, each at its place.
    #[test]
    fn every_mistake_is_located_in_one_run() {
        let yaml = r#"timezone: Asia/Shangai
quiet_hours:
  night:
    - { days: [mon, tue], from: "22:00", to: "08:00" }
    - { days: [tue, wed], from: "23:00", to: "02:00" }
  lunch:
    - { days: [], from: "12:00", to: "13:00" }
  typo:
    - { days: [mon, moon, mon], from: "25:00", to: "24:00" }
    - { days: [sun], from: "24:00", to: "24:30" }
    - { days: [sat], from: "09:00", to: "09:00", at: 1 }
  always:
    - { days: [mon, tue, wed, thu, fri, sat, sun], from: "00:00", to: "24:00" }
channels:
  team: { type: log, quiet: { during: nigth, release: everything } }
  am: { type: alertmanager, urls: ["http://127.0.0.1:9093"], quiet: { during: night } }
  ops: { type: log, quiet: { during: weekend, from: "22:00" } }
  pager: { type: pagerduty, routing_key: "R0UTINGKEY0123456789abcdefABCDEF", quiet: { during: night, release: digest } }
rules:
  - name: r
    match: "a:{id}"
    notify: { to: [team], quiet: never }
"#;
        let diags = check(yaml).err().expect("must be refused");
        assert_eq!(
            diags,
            [
                "rules.yaml:1:11: `timezone`: `Asia/Shangai` is not a time zone name; did you mean `Asia/Shanghai`?",
                "rules.yaml:5:7: quiet hours window `night`: `tue` is in two entries whose times overlap: mon, tue 22:00–08:00 (at rules.yaml:4:7) and tue, wed 23:00–02:00; keep one, or make their times meet without overlapping",
                "rules.yaml:7:15: quiet hours window `lunch` entry `days` lists no day; write e.g. `[mon, tue, wed, thu, fri]`",
                "rules.yaml:9:21: quiet hours window `typo` entry `days`: unknown day `moon`; write mon, tue, wed, thu, fri, sat, sun; did you mean `mon`?",
                "rules.yaml:9:27: quiet hours window `typo` entry `days`: `mon` is listed twice",
                "rules.yaml:9:39: quiet hours window `typo` entry `from`: `25:00` is not a time of day; write `HH:MM` in 24 hours, e.g. `\"22:00\"`",
                "rules.yaml:10:28: quiet hours window `typo` entry `from`: `24:00` is not a time of day; write `HH:MM` in 24 hours, e.g. `\"22:00\"` (`24:00` only ends a day: a window from midnight starts at `00:00`)",
                "rules.yaml:10:41: quiet hours window `typo` entry `to`: `24:30` is not a time of day; write `HH:MM` in 24 hours, e.g. `\"22:00\"`, or `24:00` for the end of the day",
                "rules.yaml:11:41: quiet hours window `typo` entry: `from` and `to` are both `09:00`; for whole days write `from: \"00:00\", to: \"24:00\"`",
                "rules.yaml:11:50: unknown field `at` in quiet hours window `typo` entry",
                "rules.yaml:12:3: quiet hours window `always` is quiet all week long, so nothing it held would ever be released; leave some time outside it",
                "rules.yaml:15:39: channel `team` `quiet` `during`: unknown quiet hours window `nigth`; did you mean `night`?",
                "rules.yaml:15:55: channel `team` `quiet` `release` must be `digest`, `each` or `count`, found `everything`",
                "rules.yaml:16:69: channel `am` `quiet`: an alertmanager channel cannot be quiet: Alertmanager has its own time intervals (a route's `mute_time_intervals` or `active_time_intervals`); remove `quiet`, or hold the messages on another channel",
                "rules.yaml:17:38: channel `ops` `quiet` `during`: unknown quiet hours window `weekend`; define it under `quiet_hours` (known: night, lunch, typo, always)",
                "rules.yaml:17:47: unknown field `from` in channel `ops` `quiet`: a channel names a window of `quiet_hours` with `during`; its days and times are written there",
                "rules.yaml:18:111: channel `pager` `quiet` `release`: channel `pager` takes no digests (each event is its own alert there), so it releases `each` held message; remove `release` or write `each`",
                "rules.yaml:22:34: rule `r` `notify` `quiet` must be `ignore` (this rule's messages pass every channel's quiet hours), found `never`",
            ],
        );
    }

    #[test]
    fn a_window_or_timezone_set_in_two_files_names_both() {
        let a = "timezone: UTC\nquiet_hours:\n  night: [{ days: [mon], from: \"22:00\", to: \"06:00\" }]\n";
        let b = "timezone: Asia/Tokyo\nquiet_hours:\n  night: [{ days: [tue], from: \"22:00\", to: \"06:00\" }]\nchannels:\n  log: { type: log }\nrules:\n  - name: r\n    match: \"a:{id}\"\n    notify: { to: [log], quiet: ignore }\n";
        let err = load_texts(
            vec![PathBuf::from("a.yaml"), PathBuf::from("b.yaml")],
            &[a.to_string(), b.to_string()],
            Mode::Check,
            &|_| None,
        );
        let Err(LoadError::Invalid(diags)) = err else {
            panic!("must be refused");
        };
        let text: Vec<String> = diags.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "b.yaml:1:11: `timezone` is set twice: first at a.yaml:1:11",
                "b.yaml:3:3: quiet hours window `night` is defined twice: first at a.yaml:3:3",
                "b.yaml:9:33: warning: rule `r`: `notify.quiet: ignore` has no effect: none of its channels has `quiet`",
            ]
        );
    }

    #[test]
    fn a_time_zone_that_is_no_name_says_what_to_write() {
        for (tz, says) in [
            ("asia/shanghai", "did you mean `Asia/Shanghai`?"),
            ("CST", "an abbreviation names no zone"),
            ("UTC+8", "an offset does not follow the clock changes"),
            ("Mars/Olympus", "write a name of the tz database"),
        ] {
            let diags = check(&format!("timezone: \"{tz}\"\n")).err().expect(tz);
            assert_eq!(diags.len(), 1, "{diags:#?}");
            assert!(
                diags[0].starts_with(&format!(
                    "rules.yaml:1:11: `timezone`: `{tz}` is not a time zone name; "
                )) && diags[0].contains(says),
                "{diags:#?}"
            );
        }
        let diags = check("scanner: { timezone: Europe/Berlln }\n")
            .err()
            .expect("scanner");
        assert_eq!(
            diags,
            [
                "rules.yaml:1:22: `scanner.timezone`: `Europe/Berlln` is not a time zone name; did you mean `Europe/Berlin`?"
            ]
        );
    }
}
