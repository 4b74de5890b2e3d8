//! The fields of a channel in the rule files, as an integration reads its own
//! ([`super::Kind::decode`]), with the helpers the chat robots share.

use std::path::Path;

use crate::yaml::Secret;
use crate::yaml::decode::{Decoder, MapReader, Text};
use crate::yaml::diagnostic::Loc;

use super::chat::{ChatFormat, Mention};

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
    /// A URL of the right shape, for the error that rejects a malformed one.
    pub(super) example_url: &'static str,
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
            check_http_url(self.d, &t.value, &t.loc, &what, self.example_url);
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
