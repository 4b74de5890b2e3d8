//! The `channels` section: the fields every channel takes, then the integration's own, read by
//! the integration that `type` names ([`super::Kind::decode`]) so that a field belonging to
//! another type fails here with its line.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::yaml::Node;
use crate::yaml::Secret;
use crate::yaml::decode::{Decoder, MapReader, Spanned, Text, parse_duration};
use crate::yaml::diagnostic::{Loc, did_you_mean};

use super::chat::{ChatFormat, Mention};
use super::{Channel, Integration, KINDS, Kind, Rate};

/// A decoded channel; a webhook's custom `body` is compiled later with the rules' templates.
pub struct ChannelDraft {
    pub channel: Channel,
    pub body: Option<Text>,
}

const COMMON: &[&str] = &["type", "rate", "timeout", "keyword"];

/// What an integration's [`Kind::decode`] reads its fields from, with the helpers the chat
/// robots share.
pub struct Fields<'d, 'a> {
    pub d: &'d mut Decoder<'a>,
    pub m: MapReader<'d>,
    /// `channel \`NAME\``, for messages.
    pub what: String,
    /// Where the channel's name was written, for warnings about the channel as a whole.
    pub loc: Loc,
    /// The folder of the rule file, for `*_file` fields.
    pub base: &'d Path,
    kind: &'static Kind,
    /// A custom `body` template, for the integrations that take one.
    pub body: Option<Text>,
}

impl Fields<'_, '_> {
    /// The required `url` (or `url_file`), checked to be http(s) without ever printing it.
    pub fn url(&mut self) -> Option<Secret> {
        let Some(t) = self
            .d
            .inline_or_file(&mut self.m, "url", &self.what, self.base)
        else {
            self.d.error(
                &self.m.loc,
                format!("{} is missing the field `url` (or `url_file`)", self.what),
            );
            return None;
        };
        if !t.unresolved {
            let what = format!("{} `url`", self.what);
            check_http_url(self.d, &t.value, &t.loc, &what, self.kind.example_url);
        }
        Some(Secret::new(t.value))
    }

    /// An optional credential written inline or in a file (`secret`, `secret_file`).
    pub fn secret(&mut self, field: &str) -> Option<Secret> {
        self.d
            .inline_or_file(&mut self.m, field, &self.what, self.base)
            .map(|t| Secret::new(t.value))
    }

    /// Optional text.
    pub fn text(&mut self, field: &str) -> Option<Text> {
        let n = self.m.get(field)?;
        self.d.text(n, &format!("{} `{field}`", self.what))
    }

    /// `mention: {mobiles, user_ids, all}`; services that cannot mention by mobile number
    /// reject `mobiles` with the reason.
    pub fn mention(&mut self, mobiles_allowed: bool) -> Mention {
        let mut out = Mention::default();
        let what = self.what.clone();
        let d = &mut *self.d;
        let Some(node) = self.m.get("mention") else {
            return out;
        };
        let Some(mut mm) = d.map(node, &format!("{what} `mention`")) else {
            return out;
        };
        let read = |d: &mut Decoder<'_>, mm: &mut MapReader<'_>, field: &str| -> Vec<String> {
            let Some(n) = mm.get(field) else {
                return Vec::new();
            };
            d.one_or_many(n, &format!("{what} `mention.{field}`"))
                .into_iter()
                .filter_map(|item| {
                    d.text(item, &format!("{what} `mention.{field}`"))
                        .map(|t| t.value)
                })
                .collect()
        };
        if mobiles_allowed {
            out.mobiles = read(d, &mut mm, "mobiles");
        }
        out.user_ids = read(d, &mut mm, "user_ids");
        if let Some(n) = mm.get("all") {
            out.all = d.bool(n, &format!("{what} `mention.all`")).unwrap_or(false);
        }
        let known: &[&str] = if mobiles_allowed {
            &["mobiles", "user_ids", "all"]
        } else {
            &["user_ids", "all"]
        };
        mm.finish(d, known, &|f| {
            (f == "mobiles").then(|| {
                "Feishu robots cannot mention by mobile number; use `user_ids` (open_id)"
                    .to_string()
            })
        });
        out
    }

    /// `msgtype: text | markdown`.
    pub fn msgtype(&mut self, default: ChatFormat) -> ChatFormat {
        let Some(n) = self.m.get("msgtype") else {
            return default;
        };
        match self.d.text(n, &format!("{} `msgtype`", self.what)) {
            Some(t) if t.value == "text" => ChatFormat::Text,
            Some(t) if t.value == "markdown" => ChatFormat::Markdown,
            Some(t) => {
                self.d.error(
                    &t.loc,
                    format!(
                        "{} `msgtype` must be `text` or `markdown`, found `{}`",
                        self.what, t.value
                    ),
                );
                default
            }
            None => default,
        }
    }
}

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
    let Some(kind) = super::kind(&kind_text.value) else {
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
    let keyword = m
        .get("keyword")
        .and_then(|n| d.text(n, &format!("{what} `keyword`")))
        .map(|t| t.value);

    let mut fields = Fields {
        d,
        m,
        what,
        loc: name.loc.clone(),
        base,
        kind,
        body: None,
    };
    let integration: Option<Arc<dyn Integration>> = (kind.decode)(&mut fields);
    let Fields { d, m, body, .. } = fields;

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
            keyword,
            body: None,
        },
        body,
    })
}

/// Checks an absolute http(s) URL without ever printing it: channel URLs carry tokens.
pub fn check_http_url(d: &mut Decoder<'_>, value: &str, loc: &Loc, what: &str, example: &str) {
    match url::Url::parse(value) {
        Ok(u) if (u.scheme() == "http" || u.scheme() == "https") && u.host_str().is_some() => {}
        Ok(u) => d.error(
            loc,
            format!(
                "{what} must be an http:// or https:// URL, found scheme `{}`",
                u.scheme()
            ),
        ),
        Err(e) => {
            d.error(
                loc,
                format!("{what} is not a valid URL ({e}); expected e.g. `{example}`"),
            );
        }
    }
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
