//! Where messages go: one [`Integration`] per chat service or webhook.
//!
//! Each integration is one file that owns everything about its service: the fields it takes in
//! the rule files ([`Kind::decode`]), the request a message becomes, and what success looks
//! like (DingTalk's HTTP 200 with `errcode` 130101 is a rate limit, Slack's success is the body
//! `ok`). The rest of keywatch sees a [`Channel`]: a name, the settings every channel shares,
//! and its integration behind the trait, as Alertmanager's notifiers are. Adding a service is
//! one new file and one line in [`KINDS`].

pub mod alert;
pub(crate) mod chat;
mod fields;
pub mod http;
mod integration;
pub(crate) mod message;
pub(crate) mod quiet;

use std::path::Path;
use std::time::Duration;

use chrono::Utc;

use crate::outcome::Outcome;
use crate::yaml::Node;
use crate::yaml::decode::{Decoder, Spanned, Text, parse_duration};
use crate::yaml::diagnostic::did_you_mean;

pub use fields::{Fields, check_http_url};
pub use integration::{
    Channel, DEFAULT_CONCURRENCY, Dispatch, Exchange, Integration, Kind, MAX_CONCURRENCY, Rate,
};
pub use message::{Followup, FollowupKind, Item, Message};

/// Registers integrations: each one's module, and its [`Kind`] in [`KINDS`], so that adding a
/// service is its file and its name here.
macro_rules! integrations {
    ($($name:ident),* $(,)?) => {
        $(pub mod $name;)*

        /// Every integration, in the order `check` lists the types.
        pub const KINDS: &[&Kind] = &[$(&$name::KIND),*];
    };
}

integrations![
    dingtalk,
    slack,
    feishu,
    wecom,
    webhook,
    alertmanager,
    email,
    teams,
    telegram,
    pagerduty,
    log
];

/// The integration registered for `type: name`.
pub fn kind(name: &str) -> Option<&'static Kind> {
    KINDS.iter().copied().find(|k| k.name == name)
}

/// Sends a composed message through its channel and judges the answer (also what `send-test`
/// uses).
pub async fn send(client: &reqwest::Client, ch: &Channel, msg: &Message) -> Outcome {
    match ch.integration.dispatch(ch, msg, Utc::now()) {
        Dispatch::Done(outcome) => outcome,
        Dispatch::Exchange(exchange) => exchange.await,
        Dispatch::Request(req) => match http::send(client, &req, ch.timeout).await {
            Ok(answer) => ch.integration.judge(ch, &answer),
            Err(o) => o,
        },
    }
}

/// A decoded channel; a webhook's custom `body` is compiled later with the rules' templates.
pub struct ChannelDraft {
    pub channel: Channel,
    pub body: Option<Text>,
    /// The integration's template fields, compiled with the rules' templates too.
    pub templates: Vec<(&'static str, Text)>,
    /// `quiet`, whose window is looked up once every file is read.
    pub quiet: Option<quiet::ChannelQuietDraft>,
}

const COMMON: &[&str] = &["type", "rate", "timeout", "concurrency", "keyword", "quiet"];

pub fn is_channel_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

pub fn decode_channels(
    d: &mut Decoder<'_>,
    node: &Node,
    base: &Path,
    out: &mut Vec<ChannelDraft>,
    names: &mut Vec<Spanned<String>>,
) {
    let Some(mut m) = d.map(node, "the `channels` section") else {
        return;
    };
    for e in m.drain() {
        let Some(name) = d.name(
            e.key,
            "channel name",
            is_channel_name,
            "use lowercase letters, digits, `_` and `-`",
        ) else {
            continue;
        };
        if let Some(first) = names.iter().find(|n| n.value == name.value) {
            d.error(
                &name.loc,
                format!(
                    "channel `{}` is defined twice: first at {}",
                    name.value, first.loc
                ),
            );
            continue;
        }
        names.push(name.clone());
        if let Some(c) = decode_channel(d, e.value, &name, base) {
            out.push(c);
        }
    }
}

fn decode_channel(
    d: &mut Decoder<'_>,
    node: &Node,
    name: &Spanned<String>,
    base: &Path,
) -> Option<ChannelDraft> {
    let what = format!("channel `{}`", name.value);
    let mut m = d.map(node, &what)?;
    let kind_node = m.require(d, "type")?;
    let kind_text = d.text(kind_node, &format!("{what} `type`"))?;
    let Some(kind) = kind(&kind_text.value) else {
        let names: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
        d.error(
            &kind_text.loc,
            format!(
                "{what}: unknown type `{}`; expected one of {}{}",
                kind_text.value,
                names.join(", "),
                did_you_mean(&kind_text.value, names.iter().copied())
            ),
        );
        return None;
    };

    let rate = match m.get("rate") {
        Some(n) => d
            .text(n, &format!("{what} `rate`"))
            .and_then(|t| parse_rate(d, &t)),
        None => kind.default_rate,
    };
    let timeout = match m.get("timeout") {
        // A bad value is reported; the default stands in so the other fields are still checked.
        Some(n) => d
            .duration(n, &format!("{what} `timeout`"))
            .map_or(Duration::from_secs(10), |t| t.value),
        None => Duration::from_secs(10),
    };
    let concurrency = concurrency(d, m.get("concurrency"), &what);
    let keyword = m
        .get("keyword")
        .and_then(|n| d.text(n, &format!("{what} `keyword`")))
        .map(|t| t.value);
    let quiet = m
        .get("quiet")
        .and_then(|n| quiet::decode_channel_quiet(d, n, &what));

    let mut fields = Fields {
        d,
        m,
        what,
        loc: name.loc.clone(),
        base,
        example_url: kind.example_url,
        body: None,
        templates: Vec::new(),
    };
    let integration = (kind.decode)(&mut fields);
    let Fields {
        d,
        m,
        body,
        templates,
        ..
    } = fields;

    let mut known: Vec<&str> = COMMON.to_vec();
    known.extend_from_slice(kind.fields);
    m.finish(d, &known, &|field| {
        let owners: Vec<&str> = KINDS
            .iter()
            .filter(|k| k.fields.contains(&field))
            .map(|k| k.name)
            .collect();
        (!owners.is_empty()).then(|| {
            format!(
                "`{field}` is not used by {} channels (it belongs to {})",
                kind.name,
                owners.join(", ")
            )
        })
    });

    Some(ChannelDraft {
        channel: Channel {
            name: name.value.clone(),
            loc: name.loc.clone(),
            kind,
            integration: integration?,
            rate,
            timeout,
            concurrency,
            keyword,
            body: None,
            templates: Vec::new(),
            quiet: None,
        },
        body,
        templates,
        quiet,
    })
}

/// A `concurrency` field of `what` (a channel, a `reload` or an `exec`): at least 1, since a
/// limit of none would leave its jobs in the queue for good. A bad value is reported and the
/// default stands in, so the other fields are still checked.
pub fn concurrency(d: &mut Decoder<'_>, node: Option<&Node>, what: &str) -> usize {
    node.and_then(|n| d.uint(n, &format!("{what} `concurrency`"), 1, MAX_CONCURRENCY))
        .map_or(DEFAULT_CONCURRENCY, |n| n as usize)
}

/// `20/min`, `5/s`, `100/h`, `3/10s`: a burst of N refilled evenly over the period.
pub fn parse_rate(d: &mut Decoder<'_>, t: &Text) -> Option<Rate> {
    let bad = |d: &mut Decoder<'_>| {
        d.error(
            &t.loc,
            format!(
                "`rate`: `{}` is not a rate; write e.g. `20/min`, `5/s` or `100/h`",
                t.value
            ),
        );
        None
    };
    let Some((n, per)) = t.value.split_once('/') else {
        return bad(d);
    };
    let Ok(burst) = n.trim().parse::<u32>() else {
        return bad(d);
    };
    let per = match per.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        "d" | "day" => Duration::from_secs(86_400),
        other => match parse_duration(other) {
            Some(p) => p,
            None => return bad(d),
        },
    };
    if burst == 0 || per.is_zero() {
        d.error(&t.loc, "`rate` must allow at least one message per period");
        return None;
    }
    Some(Rate { burst, per })
}
