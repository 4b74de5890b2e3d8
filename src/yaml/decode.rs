//! Typed reading of a [`yaml::Node`] tree that keeps going after a problem.
//!
//! Each getter reports what is wrong at the value's own position and returns `None`, and the
//! caller carries on with the next field, so one run shows every problem of a file.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::diagnostic::{Diagnostics, Loc, did_you_mean};
use super::env;
use super::{Kind, Node};

/// Whether missing environment variables and secret files are fatal. `check` runs on developer
/// machines where production secrets are absent, so there they are warnings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Check,
    Run,
}

/// A string value after `${ENV}` interpolation, with where it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Text {
    pub value: String,
    pub loc: Loc,
    /// It referred to a variable that is unset (allowed only by `check`): its content is not
    /// the real one, so content checks (URL syntax, …) are skipped.
    pub unresolved: bool,
    /// Quoted scalars start one column after their quote: used to point inside the value.
    pub quoted: bool,
}

impl Text {
    /// The place of the character at byte `offset` of the value (exact for one-line values).
    pub fn at(&self, offset: usize) -> Loc {
        let chars = self
            .value
            .get(..offset)
            .map_or(offset, |s| s.chars().count());
        self.loc.shifted(chars + self.quoted as usize)
    }
}

/// A value with the place it was written, for checks that happen after decoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spanned<T> {
    pub value: T,
    pub loc: Loc,
}

pub struct Decoder<'a> {
    pub diags: &'a mut Diagnostics,
    pub mode: Mode,
    env: &'a dyn Fn(&str) -> Option<String>,
    /// Every value taken from the environment or a `*_file` so far, to mask them.
    secret_values: Vec<String>,
}

impl<'a> Decoder<'a> {
    pub fn new(
        diags: &'a mut Diagnostics,
        mode: Mode,
        env: &'a dyn Fn(&str) -> Option<String>,
    ) -> Self {
        Decoder {
            diags,
            mode,
            env,
            secret_values: Vec::new(),
        }
    }

    /// Adds a credential written inline (a channel's URL, signing secret or header value), to
    /// be masked like the values taken from the environment.
    pub fn note_secret(&mut self, value: &str) {
        self.secret_values.push(value.to_string());
    }

    /// What every value taken from the environment or a file so far must be masked with.
    pub fn secrets(&self) -> super::Secrets {
        super::Secrets::new(self.secret_values.iter().cloned())
    }

    /// Marks `value` as a secret wherever it came from (a token written in the file itself is
    /// as secret as one from `${VAR}`), so it is masked in what people see.
    pub fn add_secret(&mut self, value: &str) {
        self.secret_values.push(value.to_string());
    }

    pub fn error(&mut self, loc: &Loc, msg: impl Into<String>) {
        self.diags.error(loc, msg);
    }

    pub fn warning(&mut self, loc: &Loc, msg: impl Into<String>) {
        self.diags.warning(loc, msg);
    }

    /// Something required at run time but absent here: an error for `run`, a warning for `check`.
    pub fn missing_at_run(&mut self, loc: &Loc, msg: impl Into<String>) {
        match self.mode {
            Mode::Run => self.diags.error(loc, msg),
            Mode::Check => self.diags.warning(loc, msg),
        }
    }

    /// Opens a mapping; `what` names it in messages ("rule", "channel `oncall`").
    pub fn map<'n>(&mut self, node: &'n Node, what: &str) -> Option<MapReader<'n>> {
        match &node.kind {
            Kind::Map(entries) => {
                let mut out = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    match &k.kind {
                        Kind::Scalar { text, .. } => out.push(Entry {
                            name: text.clone(),
                            key: k,
                            value: v,
                            used: Cell::new(false),
                        }),
                        _ => self.error(
                            &k.loc,
                            format!("keys of {what} must be names, found {}", k.kind_name()),
                        ),
                    }
                }
                Some(MapReader {
                    loc: node.loc.clone(),
                    what: what.to_string(),
                    entries: out,
                })
            }
            _ => {
                self.error(
                    &node.loc,
                    format!("{what} must be a mapping, found {}", node.kind_name()),
                );
                None
            }
        }
    }

    /// Any scalar as text (a plain `42` is the text "42"), with `${ENV}` interpolated.
    pub fn text(&mut self, node: &Node, what: &str) -> Option<Text> {
        let raw = match &node.kind {
            Kind::Scalar { text, .. } => text,
            _ => {
                self.error(
                    &node.loc,
                    format!("{what} must be a string, found {}", node.kind_name()),
                );
                return None;
            }
        };
        match env::interpolate(raw, self.env) {
            Ok(i) => {
                self.secret_values.extend(i.substituted);
                for name in &i.unset {
                    self.missing_at_run(
                        &node.loc,
                        format!("{what} uses the environment variable `{name}`, which is not set (give a default with `${{{name}:-...}}`)"),
                    );
                }
                Some(Text {
                    unresolved: !i.unset.is_empty(),
                    value: i.value,
                    loc: node.loc.clone(),
                    quoted: matches!(node.kind, Kind::Scalar { plain: false, .. }),
                })
            }
            Err(e) => {
                self.error(
                    &scalar_loc(node, e.offset),
                    format!("{what}: {}", e.message),
                );
                None
            }
        }
    }

    /// A name-like string: no interpolation, must match `valid`.
    pub fn name(
        &mut self,
        node: &Node,
        what: &str,
        valid: fn(&str) -> bool,
        rule: &str,
    ) -> Option<Spanned<String>> {
        match &node.kind {
            Kind::Scalar { text, .. } if valid(text) => Some(Spanned {
                value: text.clone(),
                loc: node.loc.clone(),
            }),
            Kind::Scalar { text, .. } => {
                self.error(&node.loc, format!("{what} `{text}` is not valid: {rule}"));
                None
            }
            _ => {
                self.error(
                    &node.loc,
                    format!("{what} must be a string, found {}", node.kind_name()),
                );
                None
            }
        }
    }

    pub fn bool(&mut self, node: &Node, what: &str) -> Option<bool> {
        match &node.kind {
            Kind::Scalar { text, plain: true } => match text.as_str() {
                "true" | "True" | "TRUE" => Some(true),
                "false" | "False" | "FALSE" => Some(false),
                _ => {
                    self.error(
                        &node.loc,
                        format!("{what} must be `true` or `false`, found `{text}`"),
                    );
                    None
                }
            },
            Kind::Scalar { text, .. } => {
                self.error(
                    &node.loc,
                    format!("{what} must be `true` or `false` without quotes, found \"{text}\""),
                );
                None
            }
            _ => {
                self.error(
                    &node.loc,
                    format!(
                        "{what} must be `true` or `false`, found {}",
                        node.kind_name()
                    ),
                );
                None
            }
        }
    }

    pub fn uint(&mut self, node: &Node, what: &str, min: u64, max: u64) -> Option<u64> {
        let parsed = match &node.kind {
            Kind::Scalar { text, .. } => {
                let t = text.replace('_', "");
                t.parse::<u64>().ok().map(|n| (n, text))
            }
            _ => None,
        };
        match parsed {
            Some((n, _)) if (min..=max).contains(&n) => Some(n),
            Some((n, _)) => {
                self.error(
                    &node.loc,
                    format!("{what} must be between {min} and {max}, found {n}"),
                );
                None
            }
            None => {
                let found = match &node.kind {
                    Kind::Scalar { text, .. } => format!("`{text}`"),
                    _ => node.kind_name().to_string(),
                };
                self.error(
                    &node.loc,
                    format!("{what} must be a whole number, found {found}"),
                );
                None
            }
        }
    }

    /// `500ms`, `30s`, `15m`, `2h`, `7d` (and combinations such as `1h 30m`).
    pub fn duration(&mut self, node: &Node, what: &str) -> Option<Spanned<Duration>> {
        let text = self.text(node, what)?;
        match parse_duration(&text.value) {
            Some(d) => Some(Spanned {
                value: d,
                loc: text.loc,
            }),
            None => {
                self.error(
                    &text.loc,
                    format!("{what}: `{}` is not a duration; write e.g. `500ms`, `30s`, `15m`, `2h` or `7d`", text.value),
                );
                None
            }
        }
    }

    /// A list, or a single value standing for a list of one (`on: expired`, `to: oncall`).
    pub fn one_or_many<'n>(&mut self, node: &'n Node, what: &str) -> Vec<&'n Node> {
        match &node.kind {
            Kind::Seq(items) => items.iter().collect(),
            Kind::Scalar { .. } => vec![node],
            _ => {
                self.error(
                    &node.loc,
                    format!("{what} must be a list, found {}", node.kind_name()),
                );
                Vec::new()
            }
        }
    }

    pub fn list<'n>(&mut self, node: &'n Node, what: &str) -> &'n [Node] {
        match &node.kind {
            Kind::Seq(items) => items,
            _ => {
                self.error(
                    &node.loc,
                    format!("{what} must be a list, found {}", node.kind_name()),
                );
                &[]
            }
        }
    }

    /// A mapping of names to strings (HTTP headers), in file order.
    pub fn string_map(&mut self, node: &Node, what: &str) -> Vec<(Spanned<String>, Text)> {
        let mut out = Vec::new();
        let Some(mut m) = self.map(node, what) else {
            return out;
        };
        for e in m.drain() {
            if let Some(v) = self.text(e.value, &format!("{what} `{}`", e.name)) {
                out.push((
                    Spanned {
                        value: e.name.clone(),
                        loc: e.key.loc.clone(),
                    },
                    v,
                ));
            }
        }
        out
    }

    /// A value given inline (`field`) or read from a file (`field_file`, for mounted secrets).
    /// Returns `None` when neither is present.
    pub fn inline_or_file(
        &mut self,
        m: &mut MapReader<'_>,
        field: &str,
        what: &str,
        base: &Path,
    ) -> Option<Text> {
        let file_field = format!("{field}_file");
        let inline = m.get(field);
        let from_file = m.get(&file_field);
        match (inline, from_file) {
            (Some(a), Some(_)) => {
                self.error(
                    &a.loc,
                    format!("{what}: give `{field}` or `{file_field}`, not both"),
                );
                None
            }
            (Some(n), None) => self.text(n, &format!("{what} `{field}`")),
            (None, Some(n)) => {
                let path = self.text(n, &format!("{what} `{file_field}`"))?;
                let full: PathBuf = base.join(&path.value);
                match std::fs::read_to_string(&full) {
                    Ok(s) => {
                        let value = s.trim_end_matches(['\n', '\r']).to_string();
                        self.secret_values.push(value.clone());
                        Some(Text {
                            value,
                            loc: path.loc,
                            unresolved: path.unresolved,
                            quoted: false,
                        })
                    }
                    Err(e) => {
                        self.missing_at_run(
                            &path.loc,
                            format!("{what} `{file_field}`: cannot read {}: {e}", full.display()),
                        );
                        Some(Text {
                            value: String::new(),
                            loc: path.loc,
                            unresolved: true,
                            quoted: false,
                        })
                    }
                }
            }
            (None, None) => None,
        }
    }
}

/// Parses the durations of docs/commands.md (`500ms`, `30s`, `15m`, `2h`, `7d`).
pub fn parse_duration(s: &str) -> Option<Duration> {
    humantime::parse_duration(s.trim()).ok()
}

/// The place of a character inside a scalar; quoted scalars start one column later.
pub fn scalar_loc(node: &Node, offset: usize) -> Loc {
    let quote = matches!(&node.kind, Kind::Scalar { plain: false, .. }) as usize;
    let chars = match &node.kind {
        Kind::Scalar { text, .. } => text.get(..offset).map_or(offset, |s| s.chars().count()),
        _ => offset,
    };
    node.loc.shifted(chars + quote)
}

pub struct Entry<'n> {
    pub name: String,
    pub key: &'n Node,
    pub value: &'n Node,
    used: Cell<bool>,
}

/// The fields of one mapping being read; fields left unread are reported by [`MapReader::finish`].
pub struct MapReader<'n> {
    pub loc: Loc,
    pub what: String,
    entries: Vec<Entry<'n>>,
}

impl<'n> MapReader<'n> {
    /// The value of `field`; a field written with no value (`secret:`) counts as absent.
    pub fn get(&mut self, field: &str) -> Option<&'n Node> {
        let e = self.entries.iter().find(|e| e.name == field)?;
        e.used.set(true);
        match e.value.kind {
            Kind::Null => None,
            _ => Some(e.value),
        }
    }

    /// The key node of `field`, to point at a field name rather than its value.
    pub fn key_loc(&self, field: &str) -> Option<Loc> {
        self.entries
            .iter()
            .find(|e| e.name == field)
            .map(|e| e.key.loc.clone())
    }

    pub fn require(&mut self, d: &mut Decoder<'_>, field: &str) -> Option<&'n Node> {
        let v = self.get(field);
        if v.is_none() {
            let what = self.what.clone();
            d.error(&self.loc, format!("{what} is missing the field `{field}`"));
        }
        v
    }

    /// Every entry, for free-form maps (channel names, headers).
    pub fn drain(&mut self) -> Vec<Entry<'n>> {
        std::mem::take(&mut self.entries)
    }

    /// Reports every field that nobody read. `known` lists the fields this mapping may have, for
    /// "did you mean"; `elsewhere` explains fields that belong to a sibling shape (a `secret` on a
    /// slack channel).
    pub fn finish(
        self,
        d: &mut Decoder<'_>,
        known: &[&str],
        elsewhere: &dyn Fn(&str) -> Option<String>,
    ) {
        for e in self.entries.iter().filter(|e| !e.used.get()) {
            if known.contains(&e.name.as_str()) {
                continue;
            }
            let msg = match elsewhere(&e.name) {
                Some(why) => format!("unknown field `{}` in {}: {why}", e.name, self.what),
                None => format!(
                    "unknown field `{}` in {}{}",
                    e.name,
                    self.what,
                    did_you_mean(&e.name, known.iter().copied())
                ),
            };
            d.error(&e.key.loc, msg);
        }
    }
}
