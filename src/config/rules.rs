//! The `rules` section, read into drafts that keep the text and place of every pattern and
//! template; [`super::build`] compiles them once all files are read.

use std::time::Duration;

use crate::event::EventKind;

use super::model::{Group, Recover};
use crate::yaml::Node;
use crate::yaml::decode::{Decoder, Spanned, Text};
use crate::yaml::diagnostic::{Loc, did_you_mean};

pub enum PatternSrc {
    Match(Text),
    Regex(Text),
}

pub struct DetailDraft {
    pub hash: Option<Text>,
    pub field: Option<Text>,
    pub key: Option<Text>,
    pub remove: bool,
}

pub struct ReloadDraft {
    pub url: Text,
    pub method: Spanned<String>,
    pub headers: Vec<(Spanned<String>, Text)>,
    pub body: Option<Text>,
    pub timeout: Duration,
    pub concurrency: usize,
}

pub struct ExecDraft {
    pub command: Vec<Text>,
    /// `env`: variables given to the command besides `PATH`, `HOME` and the event's
    /// `KEYWATCH_*`, each a template (docs/rules.md#exec-environment).
    pub env: Vec<(Spanned<String>, Text)>,
    pub timeout: Duration,
    pub concurrency: usize,
}

pub struct CleanupDraft {
    pub delete: Vec<Text>,
    pub hdel: Vec<(Text, Text)>,
}

pub struct NotifyDraft {
    pub loc: Loc,
    pub to: Vec<Spanned<String>>,
    pub title: Option<Text>,
    pub message: Option<Text>,
    pub group: Option<Group>,
    /// Where `group` was written, for refusing it on an alertmanager channel.
    pub group_loc: Option<Loc>,
    pub mention: Option<MentionDraft>,
    /// `notify.labels` and `notify.annotations`: templates, for alertmanager channels.
    pub labels: Vec<(Spanned<String>, Text)>,
    pub annotations: Vec<(Spanned<String>, Text)>,
    /// Where `quiet: ignore` was written, if it was.
    pub quiet: Option<Loc>,
}

/// `notify.mention`: templates, rendered per event, added to each channel's own mentions.
pub struct MentionDraft {
    pub loc: Loc,
    pub mobiles: Vec<Text>,
    pub user_ids: Vec<Text>,
    pub all: bool,
}

pub struct RuleDraft {
    pub name: Spanned<String>,
    pub loc: Loc,
    pub pattern: PatternSrc,
    /// `field`: the pattern of a `hexpired` rule's hash field.
    pub field: Option<Text>,
    pub on: Vec<EventKind>,
    pub on_loc: Loc,
    pub db: Option<Spanned<Vec<u32>>>,
    pub warn_before: Option<Spanned<Duration>>,
    pub recover: Option<Spanned<Recover>>,
    /// `recover.max_late` (the long form): an expiry found later than this after its deadline
    /// is skipped.
    pub max_late: Option<Spanned<Duration>>,
    pub detail: Option<DetailDraft>,
    pub reload: Option<ReloadDraft>,
    pub exec: Option<ExecDraft>,
    pub cleanup: Option<CleanupDraft>,
    pub notify: Option<NotifyDraft>,
    pub escalate: Option<super::followups::FollowupDraft>,
    pub resolved: Option<super::followups::FollowupDraft>,
}

const RULE_FIELDS: &[&str] = &[
    "name",
    "match",
    "regex",
    "field",
    "on",
    "db",
    "warn_before",
    "recover",
    "detail",
    "notify",
    "reload",
    "exec",
    "cleanup",
    "escalate",
    "resolved",
];

pub fn is_rule_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

pub fn decode_rules(d: &mut Decoder<'_>, node: &Node, out: &mut Vec<RuleDraft>) {
    for item in d.list(node, "the `rules` section") {
        if let Some(r) = decode_rule(d, item) {
            if let Some(first) = out.iter().find(|r2| r2.name.value == r.name.value) {
                d.error(
                    &r.name.loc,
                    format!(
                        "rule `{}` is defined twice: first at {}",
                        r.name.value, first.name.loc
                    ),
                );
                continue;
            }
            out.push(r);
        }
    }
}

fn decode_rule(d: &mut Decoder<'_>, node: &Node) -> Option<RuleDraft> {
    let mut m = d.map(node, "a rule")?;
    let name = m.require(d, "name").and_then(|n| {
        d.name(
            n,
            "rule name",
            is_rule_name,
            "use lowercase letters, digits, `_` and `-`, e.g. `order-lock-timeout`",
        )
    });
    let what = match &name {
        Some(n) => format!("rule `{}`", n.value),
        None => "this rule".to_string(),
    };
    m.what = what.clone();

    let pattern = match (m.get("match"), m.get("regex")) {
        (Some(a), Some(_)) => {
            d.error(&a.loc, format!("{what}: give `match` or `regex`, not both"));
            None
        }
        (Some(n), None) => d.text(n, &format!("{what} `match`")).map(PatternSrc::Match),
        (None, Some(n)) => d.text(n, &format!("{what} `regex`")).map(PatternSrc::Regex),
        (None, None) => {
            d.error(&m.loc, format!("{what} needs `match` (a key pattern such as `order_lock:{{order_id}}`) or `regex`"));
            None
        }
    };

    let field = m
        .get("field")
        .and_then(|n| d.text(n, &format!("{what} `field`")));

    let mut on = Vec::new();
    let on_loc = m.key_loc("on").unwrap_or_else(|| m.loc.clone());
    match m.get("on") {
        None => on.push(EventKind::Expired),
        Some(n) => {
            for item in d.one_or_many(n, &format!("{what} `on`")) {
                let Some(t) = d.text(item, &format!("{what} `on`")) else {
                    continue;
                };
                match EventKind::parse(&t.value) {
                    Some(k) if on.contains(&k) => {
                        d.warning(&t.loc, format!("{what}: `{k}` is listed twice in `on`"))
                    }
                    Some(k) => on.push(k),
                    None => {
                        let names = EventKind::ALL.map(|k| k.as_str());
                        let hint = if t.value == "del" {
                            "; did you mean `deleted`?".to_string()
                        } else {
                            did_you_mean(&t.value, names)
                        };
                        d.error(
                            &t.loc,
                            format!(
                                "{what}: unknown event `{}` in `on`; expected {}{hint}",
                                t.value,
                                names.join(", ")
                            ),
                        );
                    }
                }
            }
            if on.is_empty() && matches!(n.kind, crate::yaml::Kind::Seq(ref v) if v.is_empty()) {
                d.error(&n.loc, format!("{what}: `on` lists no event"));
            }
        }
    }

    let db = m.get("db").map(|n| {
        let mut dbs: Vec<u32> = d
            .one_or_many(n, &format!("{what} `db`"))
            .into_iter()
            .filter_map(|i| d.uint(i, "a database number", 0, 10_000).map(|v| v as u32))
            .collect();
        dbs.sort_unstable();
        dbs.dedup();
        Spanned {
            value: dbs,
            loc: n.loc.clone(),
        }
    });
    let warn_before = m
        .get("warn_before")
        .and_then(|n| d.duration(n, &format!("{what} `warn_before`")));
    if let Some(w) = &warn_before
        && w.value.is_zero()
    {
        d.error(&w.loc, format!("{what}: `warn_before` must be more than 0"));
    }

    let (recover, max_late) = match m.get("recover") {
        None => (None, None),
        Some(n) if matches!(n.kind, crate::yaml::Kind::Map(_)) => decode_recover_long(d, n, &what),
        Some(n) => (decode_recover_when(d, n, &what, "recover"), None),
    };
    let detail = m.get("detail").and_then(|n| decode_detail(d, n, &what));
    let reload = m.get("reload").and_then(|n| decode_reload(d, n, &what));
    let exec = m.get("exec").and_then(|n| decode_exec(d, n, &what));
    let cleanup = m.get("cleanup").and_then(|n| decode_cleanup(d, n, &what));
    let notify = m.get("notify").and_then(|n| decode_notify(d, n, &what));
    let escalate = m.get("escalate").and_then(|n| {
        super::followups::decode_followup(d, n, &what, super::followups::Which::Escalate)
    });
    let resolved = m.get("resolved").and_then(|n| {
        super::followups::decode_followup(d, n, &what, super::followups::Which::Resolved)
    });

    m.finish(d, RULE_FIELDS, &|f| match f {
        "pattern" | "key" | "prefix" => {
            Some("the key pattern is given with `match` (or `regex`)".into())
        }
        "event" | "events" => Some("events are listed in `on`".into()),
        "channels" | "channel" => Some("channels are named in `notify.to`".into()),
        _ => None,
    });

    Some(RuleDraft {
        name: name?,
        loc: node.loc.clone(),
        pattern: pattern?,
        field,
        on,
        on_loc,
        db,
        warn_before,
        recover,
        max_late,
        detail,
        reload,
        exec,
        cleanup,
        notify,
        escalate,
        resolved,
    })
}

/// `recover: always | if_detail | never`, or the long form's `when`.
fn decode_recover_when(
    d: &mut Decoder<'_>,
    n: &Node,
    what: &str,
    field: &str,
) -> Option<Spanned<Recover>> {
    let t = d.text(n, &format!("{what} `{field}`"))?;
    match Recover::parse(&t.value) {
        Some(value) => Some(Spanned { value, loc: t.loc }),
        None => {
            let names = Recover::ALL.map(Recover::as_str);
            d.error(
                &t.loc,
                format!(
                    "{what}: unknown `{field}` value `{}`; expected {}{}",
                    t.value,
                    names.join(", "),
                    did_you_mean(&t.value, names)
                ),
            );
            None
        }
    }
}

/// The long form `recover: { when: if_detail, max_late: 6h }` (docs/rules.md#recover-expiries-found-afterwards).
fn decode_recover_long(
    d: &mut Decoder<'_>,
    n: &Node,
    what: &str,
) -> (Option<Spanned<Recover>>, Option<Spanned<Duration>>) {
    let Some(mut m) = d.map(n, &format!("{what} `recover`")) else {
        return (None, None);
    };
    let when = m
        .get("when")
        .and_then(|w| decode_recover_when(d, w, what, "recover.when"));
    let max_late = m
        .get("max_late")
        .and_then(|x| d.duration(x, &format!("{what} `recover.max_late`")));
    if let Some(late) = &max_late
        && late.value.is_zero()
    {
        d.error(
            &late.loc,
            format!("{what}: `recover.max_late` must be more than 0 (to fire no expiry found afterwards, say `when: never`)"),
        );
    }
    let (has_when, has_late) = (m.get("when").is_some(), m.get("max_late").is_some());
    m.finish(d, &["when", "max_late"], &|_| None);
    if !has_when && !has_late {
        d.error(
            &n.loc,
            format!("{what}: `recover` needs `when` (always, if_detail, never) or `max_late` (e.g. `6h`), or is given as one word: `recover: if_detail`"),
        );
    }
    (when, max_late)
}

fn decode_detail(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<DetailDraft> {
    let what = format!("{what} `detail`");
    let mut m = d.map(node, &what)?;
    let hash = m
        .get("hash")
        .and_then(|n| d.text(n, &format!("{what} `hash`")));
    let field = m
        .get("field")
        .and_then(|n| d.text(n, &format!("{what} `field`")));
    let key = m
        .get("key")
        .and_then(|n| d.text(n, &format!("{what} `key`")));
    let remove = m
        .get("remove")
        .and_then(|n| d.bool(n, &format!("{what} `remove`")))
        .unwrap_or(false);
    match (&hash, &field, &key) {
        (Some(_), Some(_), None) | (None, None, Some(_)) => {}
        (Some(_), None, None) => d.error(
            &node.loc,
            format!("{what}: `hash` needs a `field`, e.g. `field: \"{{{{ id }}}}\"`"),
        ),
        (None, Some(_), None) => d.error(&node.loc, format!("{what}: `field` needs a `hash`")),
        (None, None, None) => d.error(
            &node.loc,
            format!("{what} needs `hash` and `field`, or `key`"),
        ),
        _ => d.error(
            &node.loc,
            format!("{what}: give `hash` and `field`, or `key`, not both"),
        ),
    }
    m.finish(d, &["hash", "field", "key", "remove"], &|_| None);
    Some(DetailDraft {
        hash,
        field,
        key,
        remove,
    })
}

fn decode_reload(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<ReloadDraft> {
    let what = format!("{what} `reload`");
    let mut m = d.map(node, &what)?;
    let url = m
        .require(d, "url")
        .and_then(|n| d.text(n, &format!("{what} `url`")));
    let method = match m.get("method") {
        Some(n) => d.text(n, &format!("{what} `method`")).and_then(|t| {
            let up = t.value.to_ascii_uppercase();
            if ["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&up.as_str()) {
                Some(Spanned {
                    value: up,
                    loc: t.loc,
                })
            } else {
                d.error(
                    &t.loc,
                    format!(
                        "{what} `method` must be GET, POST, PUT, PATCH or DELETE, found `{}`",
                        t.value
                    ),
                );
                None
            }
        }),
        None => Some(Spanned {
            value: "POST".into(),
            loc: node.loc.clone(),
        }),
    };
    let headers = m
        .get("headers")
        .map(|n| d.string_map(n, &format!("{what} `headers`")))
        .unwrap_or_default();
    let body = m
        .get("body")
        .and_then(|n| d.text(n, &format!("{what} `body`")));
    let timeout = match m.get("timeout") {
        // A bad value is reported; the default stands in so the other fields are still checked.
        Some(n) => d
            .duration(n, &format!("{what} `timeout`"))
            .map_or(Duration::from_secs(10), |t| t.value),
        None => Duration::from_secs(10),
    };
    let concurrency = crate::channel::concurrency(d, m.get("concurrency"), &what);
    m.finish(
        d,
        &["url", "method", "headers", "body", "timeout", "concurrency"],
        &|_| None,
    );
    Some(ReloadDraft {
        url: url?,
        method: method?,
        headers,
        body,
        timeout,
        concurrency,
    })
}

fn decode_exec(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<ExecDraft> {
    let what = format!("{what} `exec`");
    let mut m = d.map(node, &what)?;
    let command: Vec<Text> = match m.require(d, "command") {
        Some(n) => match &n.kind {
            crate::yaml::Kind::Seq(items) => items
                .iter()
                .filter_map(|i| d.text(i, &format!("{what} `command`")))
                .collect(),
            _ => {
                d.error(&n.loc, format!("{what} `command` must be a list of arguments (no shell is used), e.g. `[\"/usr/local/bin/job\", \"--id\", \"{{{{ id }}}}\"]`"));
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    if let Some(first) = command.first()
        && first.value.trim().is_empty()
    {
        d.error(
            &first.loc,
            format!("{what}: the program (first argument) is empty"),
        );
    }
    let timeout = match m.get("timeout") {
        Some(n) => d
            .duration(n, &format!("{what} `timeout`"))
            .map_or(Duration::from_secs(60), |t| t.value),
        None => Duration::from_secs(60),
    };
    let concurrency = crate::channel::concurrency(d, m.get("concurrency"), &what);
    let env = m
        .get("env")
        .map(|n| decode_exec_env(d, n, &what))
        .unwrap_or_default();
    m.finish(
        d,
        &["command", "env", "timeout", "concurrency"],
        &|f| match f {
            "shell" => Some("keywatch never runs a shell: give `command` as a list".to_string()),
            "environment" => Some("the command's variables are given in `env`".to_string()),
            _ => None,
        },
    );
    if command.is_empty() {
        return None;
    }
    Some(ExecDraft {
        command,
        env,
        timeout,
        concurrency,
    })
}

/// `exec.env`: a map of variable names to templates. The command gets nothing else of keywatch's
/// environment (docs/rules.md#exec-environment): a variable it needs is named here, e.g. `TZ: "${TZ}"`.
fn decode_exec_env(d: &mut Decoder<'_>, node: &Node, what: &str) -> Vec<(Spanned<String>, Text)> {
    let what = format!("{what} `env`");
    if !matches!(node.kind, crate::yaml::Kind::Map(_)) {
        d.error(
            &node.loc,
            format!("{what} must be a map of variable names to values (templates), e.g. `{{ REPORT_DAY: \"{{{{ day }}}}\", TZ: \"${{TZ}}\" }}`"),
        );
        return Vec::new();
    }
    let mut out = Vec::new();
    for (name, value) in d.string_map(node, &what) {
        let n = &name.value;
        let valid = n
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            d.error(
                &name.loc,
                format!("{what}: `{n}` is not a variable name: use letters, digits and `_`, not starting with a digit, e.g. `REPORT_DAY`"),
            );
        } else if n.starts_with("KEYWATCH_") {
            d.error(
                &name.loc,
                format!("{what}: `{n}` is reserved: keywatch sets KEYWATCH_KEY, KEYWATCH_RULE, KEYWATCH_EVENT, KEYWATCH_DB and KEYWATCH_ID itself, and passes no other KEYWATCH_ variable; pick another name"),
            );
        } else {
            out.push((name, value));
        }
    }
    out
}

fn decode_cleanup(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<CleanupDraft> {
    let what = format!("{what} `cleanup`");
    let mut m = d.map(node, &what)?;
    let delete: Vec<Text> = m
        .get("delete")
        .map(|n| {
            d.one_or_many(n, &format!("{what} `delete`"))
                .into_iter()
                .filter_map(|i| d.text(i, &format!("{what} `delete`")))
                .collect()
        })
        .unwrap_or_default();
    let mut hdel = Vec::new();
    if let Some(n) = m.get("hdel") {
        for item in d.one_or_many(n, &format!("{what} `hdel`")) {
            let Some(mut hm) = d.map(item, &format!("{what} `hdel` item")) else {
                continue;
            };
            let key = hm
                .require(d, "key")
                .and_then(|n| d.text(n, &format!("{what} `hdel.key`")));
            let field = hm
                .require(d, "field")
                .and_then(|n| d.text(n, &format!("{what} `hdel.field`")));
            hm.finish(d, &["key", "field"], &|_| None);
            if let (Some(k), Some(f)) = (key, field) {
                hdel.push((k, f));
            }
        }
    }
    m.finish(d, &["delete", "hdel"], &|_| None);
    if delete.is_empty() && hdel.is_empty() {
        d.error(
            &node.loc,
            format!("{what} needs `delete` (glob patterns) or `hdel` (hash fields)"),
        );
        return None;
    }
    Some(CleanupDraft { delete, hdel })
}

fn decode_notify(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<NotifyDraft> {
    let what = format!("{what} `notify`");
    let mut m = d.map(node, &what)?;
    let (to, title, message) = super::followups::to_title_message(d, &mut m, &what, true);
    let group = m.get("group").and_then(|n| {
        let gw = format!("{what} `group`");
        let mut g = d.map(n, &gw)?;
        let window = g
            .require(d, "window")
            .and_then(|w| d.duration(w, &format!("{gw} `window`")));
        let max_items = match g.get("max_items") {
            Some(x) => d.uint(x, &format!("{gw} `max_items`"), 1, 1000)? as usize,
            None => 20,
        };
        g.finish(d, &["window", "max_items"], &|_| None);
        let window = window?;
        if window.value.is_zero() {
            d.error(&window.loc, format!("{gw} `window` must be more than 0"));
            return None;
        }
        Some(Group {
            window: window.value,
            max_items,
        })
    });
    let group_loc = m.key_loc("group");
    let mention = m.get("mention").and_then(|n| decode_mention(d, n, &what));
    let mut pairs = |d: &mut Decoder<'_>, field: &str| {
        m.get(field)
            .map(|n| d.string_map(n, &format!("{what} `{field}`")))
            .unwrap_or_default()
    };
    let labels = pairs(d, "labels");
    let annotations = pairs(d, "annotations");
    let quiet = m
        .get("quiet")
        .and_then(|n| super::quiet::decode_rule_quiet(d, n, &what));
    m.finish(
        d,
        &[
            "to",
            "title",
            "message",
            "group",
            "mention",
            "labels",
            "annotations",
            "quiet",
        ],
        &|_| None,
    );
    Some(NotifyDraft {
        loc: node.loc.clone(),
        to,
        title,
        message,
        group,
        group_loc,
        mention,
        labels,
        annotations,
        quiet,
    })
}

fn decode_mention(d: &mut Decoder<'_>, node: &Node, what: &str) -> Option<MentionDraft> {
    let what = format!("{what} `mention`");
    let mut m = d.map(node, &what)?;
    let mut list = |d: &mut Decoder<'_>, field: &str| -> Vec<Text> {
        m.get(field)
            .map(|n| {
                d.one_or_many(n, &format!("{what} `{field}`"))
                    .into_iter()
                    .filter_map(|i| d.text(i, &format!("{what} `{field}`")))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mobiles = list(d, "mobiles");
    let user_ids = list(d, "user_ids");
    let all = m
        .get("all")
        .and_then(|n| d.bool(n, &format!("{what} `all`")))
        .unwrap_or(false);
    m.finish(d, &["mobiles", "user_ids", "all"], &|_| None);
    Some(MentionDraft {
        loc: node.loc.clone(),
        mobiles,
        user_ids,
        all,
    })
}
