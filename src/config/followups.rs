//! The `history` section: how long firings and their outcomes are kept in Redis.

use std::time::Duration;

use crate::yaml::Node;
use crate::yaml::decode::{Decoder, Spanned, Text};
use crate::yaml::diagnostic::Loc;

/// How long firings are kept when the rules do not say (`history.keep`).
pub const DEFAULT_KEEP: Duration = Duration::from_secs(7 * 86_400);

/// `history` as the files wrote it; at most one file may set each field.
#[derive(Default, Debug)]
pub struct HistoryDraft {
    pub keep: Option<(Duration, Loc)>,
}

#[derive(Clone, Debug)]
pub struct HistorySettings {
    /// How long a firing and its outcomes stay in Redis (`history.keep`, default 7d).
    pub keep: Duration,
}

impl HistoryDraft {
    pub fn settings(&self) -> HistorySettings {
        HistorySettings {
            keep: self.keep.as_ref().map_or(DEFAULT_KEEP, |(k, _)| *k),
        }
    }
}

pub fn decode_history(d: &mut Decoder<'_>, node: &Node, into: &mut HistoryDraft) {
    let Some(mut m) = d.map(node, "the `history` section") else {
        return;
    };
    if let Some(n) = m.get("keep")
        && let Some(k) = d.duration(n, "`history.keep`")
    {
        if k.value.is_zero() {
            d.error(&k.loc, "`history.keep` must be more than 0");
        } else if let Some((_, first)) = &into.keep {
            d.error(
                &k.loc,
                format!("`history.keep` is set twice: first at {first}"),
            );
        } else {
            into.keep = Some((k.value, k.loc));
        }
    }
    m.finish(d, &["keep"], &|_| None);
}

/// `escalate` or `resolved` of a rule, as written.
pub struct FollowupDraft {
    pub loc: Loc,
    /// `escalate.after` or `resolved.within`.
    pub wait: Duration,
    pub unless: Unless,
    pub to: Vec<Spanned<String>>,
    pub title: Option<Text>,
    pub message: Option<Text>,
}

/// What stops an escalation (`escalate.unless`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unless {
    /// The key exists again (or a person acknowledged).
    Recreated,
    /// Only a person's acknowledgement.
    Acknowledged,
}

/// Which follow-up a draft is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Escalate,
    Resolved,
}

/// `escalate: {after, unless, to, title, message}` or `resolved: {within, to, title, message}`.
pub fn decode_followup(
    d: &mut Decoder<'_>,
    node: &Node,
    what: &str,
    which: Which,
) -> Option<FollowupDraft> {
    let (name, wait_name) = match which {
        Which::Escalate => ("escalate", "after"),
        Which::Resolved => ("resolved", "within"),
    };
    let what = format!("{what} `{name}`");
    let mut m = d.map(node, &what)?;
    let wait = match (m.get(wait_name), which) {
        (Some(n), _) => d.duration(n, &format!("{what} `{wait_name}`")),
        (None, Which::Resolved) => Some(Spanned {
            value: Duration::from_secs(3600),
            loc: node.loc.clone(),
        }),
        (None, Which::Escalate) => {
            d.error(
                &node.loc,
                format!("{what} needs `after`, e.g. `after: 15m`"),
            );
            None
        }
    };
    if let Some(w) = &wait
        && w.value.is_zero()
    {
        d.error(&w.loc, format!("{what} `{wait_name}` must be more than 0"));
    }
    let mut unless = Unless::Recreated;
    if which == Which::Escalate
        && let Some(n) = m.get("unless")
        && let Some(t) = d.text(n, &format!("{what} `unless`"))
    {
        match t.value.as_str() {
            "recreated" => unless = Unless::Recreated,
            "acknowledged" => unless = Unless::Acknowledged,
            other => d.error(
                &t.loc,
                format!("{what} `unless` must be `recreated` or `acknowledged`, found `{other}`"),
            ),
        }
    }
    // A `resolved` may name no channel of its own: it still closes the alerts of channels that
    // keep them open (Alertmanager, PagerDuty), which `check` finds in `notify.to`.
    let (to, title, message) = to_title_message(d, &mut m, &what, which == Which::Escalate);
    let known: &[&str] = match which {
        Which::Escalate => &["after", "unless", "to", "title", "message"],
        Which::Resolved => &["within", "to", "title", "message"],
    };
    m.finish(d, known, &|_| None);
    Some(FollowupDraft {
        loc: node.loc.clone(),
        wait: wait?.value,
        unless,
        to,
        title,
        message,
    })
}

/// `links`: signed acknowledge/silence links at the end of messages of rules with `escalate`.
#[derive(Clone, Debug)]
pub struct LinksSettings {
    /// Where people reach keywatch's `--listen` address, e.g. `https://keywatch.example.internal`.
    pub base_url: String,
    /// The HMAC key; never shown in a message, log or page.
    pub secret: crate::yaml::Secret,
}

pub fn decode_links(d: &mut Decoder<'_>, node: &Node, into: &mut Option<LinksSettings>) {
    let Some(mut m) = d.map(node, "the `links` section") else {
        return;
    };
    let base = m
        .require(d, "base_url")
        .and_then(|n| d.text(n, "`links.base_url`"));
    let secret = m
        .require(d, "secret")
        .and_then(|n| d.text(n, "`links.secret`"));
    m.finish(d, &["base_url", "secret"], &|_| None);
    let (Some(base), Some(secret)) = (base, secret) else {
        return;
    };
    if !(base.value.starts_with("http://") || base.value.starts_with("https://")) {
        d.error(
            &base.loc,
            format!(
                "`links.base_url` must be an http(s) URL where people reach keywatch, e.g. `https://keywatch.example.internal`; got `{}`",
                base.value
            ),
        );
        return;
    }
    if secret.value.len() < 16 && !secret.unresolved {
        d.error(
            &secret.loc,
            "`links.secret` must be at least 16 characters: it is all that stands between a guessed link and an acknowledgement",
        );
        return;
    }
    if into.is_some() {
        d.error(&base.loc, "`links` is set twice");
        return;
    }
    *into = Some(LinksSettings {
        base_url: base.value.trim_end_matches('/').to_string(),
        secret: crate::yaml::Secret::new(secret.value),
    });
}

/// `to` (channel names, each once), `title` and `message`: what `notify`, `escalate` and
/// `resolved` share.
pub fn to_title_message(
    d: &mut Decoder<'_>,
    m: &mut crate::yaml::decode::MapReader<'_>,
    what: &str,
    required: bool,
) -> (Vec<Spanned<String>>, Option<Text>, Option<Text>) {
    let mut to = Vec::new();
    let node = if required {
        m.require(d, "to")
    } else {
        m.get("to")
    };
    if let Some(n) = node {
        for item in d.one_or_many(n, &format!("{what} `to`")) {
            if let Some(t) = d.text(item, &format!("{what} `to`")) {
                if to.iter().any(|x: &Spanned<String>| x.value == t.value) {
                    d.warning(
                        &t.loc,
                        format!("{what}: channel `{}` is listed twice", t.value),
                    );
                    continue;
                }
                to.push(Spanned {
                    value: t.value,
                    loc: t.loc,
                });
            }
        }
    }
    let title = m
        .get("title")
        .and_then(|n| d.text(n, &format!("{what} `title`")));
    let message = m
        .get("message")
        .and_then(|n| d.text(n, &format!("{what} `message`")));
    (to, title, message)
}
