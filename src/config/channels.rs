//! The `channels` section: where messages go, one typed shape per chat service.
//!
//! The `type` field picks a variant at load time (a tagged enum, not a map of strings looked up
//! at run time), so a field that belongs to another type fails here with its line.

use std::path::Path;
use std::time::Duration;

use super::decode::{Decoder, MapReader, Spanned, Text};
use super::diagnostic::{Loc, did_you_mean};
use super::model::{
    Channel, ChannelKind, ChatFormat, DingTalk, Feishu, Mention, Rate, Secret, Slack, WeCom,
    Webhook, WebhookFormat,
};
use super::yaml::Node;

/// A decoded channel; a webhook's custom `body` is compiled later with the rules' templates.
pub struct ChannelDraft {
    pub channel: Channel,
    pub body: Option<Text>,
}

const TYPES: &[&str] = &["dingtalk", "slack", "feishu", "wecom", "webhook", "log"];
const COMMON: &[&str] = &["type", "rate", "timeout", "keyword"];

/// Fields per type, beyond [`COMMON`]; also used to explain a field used on the wrong type.
fn fields_of(kind: &str) -> &'static [&'static str] {
    match kind {
        "dingtalk" => &[
            "url",
            "url_file",
            "secret",
            "secret_file",
            "mention",
            "msgtype",
        ],
        "slack" => &["url", "url_file"],
        "feishu" => &[
            "url",
            "url_file",
            "secret",
            "secret_file",
            "mention",
            "msgtype",
        ],
        "wecom" => &["url", "url_file", "mention", "msgtype"],
        "webhook" => &["url", "url_file", "headers", "format", "body"],
        _ => &[],
    }
}

pub fn is_channel_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// The default `rate` of SPEC §2: what each service tolerates per robot.
pub fn default_rate(kind: &str) -> Option<Rate> {
    let (burst, per) = match kind {
        "dingtalk" | "wecom" => (20, 60),
        "feishu" => (5, 1),
        "slack" => (1, 1),
        _ => return None,
    };
    Some(Rate {
        burst,
        per: Duration::from_secs(per),
    })
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
    let kind = kind_text.value.as_str();
    if !TYPES.contains(&kind) {
        d.error(
            &kind_text.loc,
            format!(
                "{what}: unknown type `{kind}`; expected one of {}{}",
                TYPES.join(", "),
                did_you_mean(kind, TYPES.iter().copied())
            ),
        );
        return None;
    }

    let rate = match m.get("rate") {
        Some(n) => d
            .text(n, &format!("{what} `rate`"))
            .and_then(|t| parse_rate(d, &t)),
        None => default_rate(kind),
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

    let mut body = None;
    let channel_kind = match kind {
        "log" => Some(ChannelKind::Log),
        _ => {
            let url = url_field(d, &mut m, &what, base, kind);
            match kind {
                "dingtalk" => {
                    let secret = d
                        .inline_or_file(&mut m, "secret", &what, base)
                        .map(|t| Secret::new(t.value));
                    let mention = mention(d, &mut m, &what, true);
                    let msgtype = msgtype(d, &mut m, &what, ChatFormat::Markdown);
                    url.map(|url| {
                        ChannelKind::DingTalk(DingTalk {
                            url,
                            secret,
                            mention,
                            msgtype,
                        })
                    })
                }
                "slack" => url.map(|url| ChannelKind::Slack(Slack { url })),
                "feishu" => {
                    let secret = d
                        .inline_or_file(&mut m, "secret", &what, base)
                        .map(|t| Secret::new(t.value));
                    let mention = mention(d, &mut m, &what, false);
                    let msgtype = msgtype(d, &mut m, &what, ChatFormat::Text);
                    url.map(|url| {
                        ChannelKind::Feishu(Feishu {
                            url,
                            secret,
                            mention,
                            msgtype,
                        })
                    })
                }
                "wecom" => {
                    let mention = mention(d, &mut m, &what, true);
                    let msgtype = msgtype(d, &mut m, &what, ChatFormat::Text);
                    if msgtype == ChatFormat::Markdown && !mention.mobiles.is_empty() {
                        d.warning(
                            &name.loc,
                            format!("{what}: WeCom markdown messages cannot mention by mobile number; use `msgtype: text` or `mention.user_ids`"),
                        );
                    }
                    url.map(|url| {
                        ChannelKind::WeCom(WeCom {
                            url,
                            mention,
                            msgtype,
                        })
                    })
                }
                "webhook" => {
                    let headers = m
                        .get("headers")
                        .map(|n| d.string_map(n, &format!("{what} `headers`")))
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k.value, Secret::new(v.value)))
                        .collect();
                    let format = match m.get("format") {
                        None => Some(WebhookFormat::Keywatch),
                        Some(n) => d.text(n, &format!("{what} `format`")).and_then(|t| match t.value.as_str() {
                            "keywatch" => Some(WebhookFormat::Keywatch),
                            "alertmanager" => Some(WebhookFormat::Alertmanager),
                            other => {
                                d.error(&t.loc, format!("{what} `format` must be `keywatch` or `alertmanager`, found `{other}`"));
                                None
                            }
                        }),
                    };
                    body = m
                        .get("body")
                        .and_then(|n| d.text(n, &format!("{what} `body`")));
                    match (url, format) {
                        (Some(url), Some(format)) => Some(ChannelKind::Webhook(Webhook {
                            url,
                            headers,
                            format,
                            body: None,
                        })),
                        _ => None,
                    }
                }
                _ => None,
            }
        }
    };

    let mut known: Vec<&str> = COMMON.to_vec();
    known.extend_from_slice(fields_of(kind));
    m.finish(d, &known, &|field| {
        let owners: Vec<&str> = TYPES
            .iter()
            .copied()
            .filter(|t| fields_of(t).contains(&field))
            .collect();
        (!owners.is_empty()).then(|| {
            format!(
                "`{field}` is not used by {kind} channels (it belongs to {})",
                owners.join(", ")
            )
        })
    });

    Some(ChannelDraft {
        channel: Channel {
            name: name.value.clone(),
            loc: name.loc.clone(),
            kind: channel_kind?,
            rate,
            timeout,
            keyword,
        },
        body,
    })
}

fn url_field(
    d: &mut Decoder<'_>,
    m: &mut MapReader<'_>,
    what: &str,
    base: &Path,
    kind: &str,
) -> Option<Secret> {
    let Some(t) = d.inline_or_file(m, "url", what, base) else {
        d.error(
            &m.loc,
            format!("{what} is missing the field `url` (or `url_file`)"),
        );
        return None;
    };
    if !t.unresolved {
        check_http_url(d, &t.value, &t.loc, &format!("{what} `url`"), kind);
    }
    Some(Secret::new(t.value))
}

/// Checks an absolute http(s) URL without ever printing it: channel URLs carry tokens.
pub fn check_http_url(d: &mut Decoder<'_>, value: &str, loc: &Loc, what: &str, kind: &str) {
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
            let example = match kind {
                "dingtalk" => "https://oapi.dingtalk.com/robot/send?access_token=...",
                "slack" => "https://hooks.slack.com/services/T000/B000/XXXX",
                "feishu" => "https://open.feishu.cn/open-apis/bot/v2/hook/...",
                "wecom" => "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=...",
                _ => "https://example.com/hooks/keywatch",
            };
            d.error(
                loc,
                format!("{what} is not a valid URL ({e}); expected e.g. `{example}`"),
            );
        }
    }
}

fn mention(
    d: &mut Decoder<'_>,
    m: &mut MapReader<'_>,
    what: &str,
    mobiles_allowed: bool,
) -> Mention {
    let mut out = Mention::default();
    let Some(node) = m.get("mention") else {
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
            "Feishu robots cannot mention by mobile number; use `user_ids` (open_id)".to_string()
        })
    });
    out
}

fn msgtype(
    d: &mut Decoder<'_>,
    m: &mut MapReader<'_>,
    what: &str,
    default: ChatFormat,
) -> ChatFormat {
    let Some(n) = m.get("msgtype") else {
        return default;
    };
    match d.text(n, &format!("{what} `msgtype`")) {
        Some(t) if t.value == "text" => ChatFormat::Text,
        Some(t) if t.value == "markdown" => ChatFormat::Markdown,
        Some(t) => {
            d.error(
                &t.loc,
                format!(
                    "{what} `msgtype` must be `text` or `markdown`, found `{}`",
                    t.value
                ),
            );
            default
        }
        None => default,
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
        other => match super::decode::parse_duration(other) {
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
