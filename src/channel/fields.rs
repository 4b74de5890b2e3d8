//! The fields of a channel in the rule files, as an integration reads its own
//! ([`super::Kind::decode`]), with the helpers the chat robots share.

use std::path::Path;

use crate::yaml::Secret;
use crate::yaml::decode::{Decoder, MapReader, Text};
use crate::yaml::diagnostic::Loc;

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
    /// Fields that are templates, rendered per message ([`super::Channel::templates`]).
    pub templates: Vec<(&'static str, Text)>,
}

impl Fields<'_, '_> {
    /// The required `url` (or `url_file`), checked to be http(s) without ever printing it, and
    /// masked wherever it or its credentials show ([`crate::yaml::Secrets`]).
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
        self.d.note_secret(&t.value);
        Some(Secret::new(t.value))
    }

    /// An optional credential written inline or in a file (`secret`, `secret_file`), masked
    /// wherever it shows.
    pub fn secret(&mut self, field: &str) -> Option<Secret> {
        let t = self
            .d
            .inline_or_file(&mut self.m, field, &self.what, self.base)?;
        self.d.note_secret(&t.value);
        Some(Secret::new(t.value))
    }

    /// Optional text.
    pub fn text(&mut self, field: &str) -> Option<Text> {
        let n = self.m.get(field)?;
        self.d.text(n, &format!("{} `{field}`", self.what))
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
