//! Jinja templates (minijinja) rendered strictly, with every interpolated value escaped for the
//! place the output goes, so untrusted key text can never widen an action (docs/rules.md).
//!
//! # Layout
//!
//! - [`bytestr`]: keys as minijinja strings without losing a byte (non-UTF-8 keys).
//! - [`escape`]: the escaping modes and the formatter that applies them to `{{ … }}`.
//! - [`context`]: the names a template can read, built once per event.
//! - [`datetime`]: the `datetime` filter, times in the rule files' `timezone`.
//!
//! One [`TemplateSet`] holds every template of a rule set in one minijinja environment, compiled
//! once at load; a render only looks the template up and runs it.

mod bytestr;
mod context;
mod datetime;
mod escape;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::fmt;

use minijinja::{AutoEscape, Environment, UndefinedBehavior};

pub use context::{CONTEXT_NAMES, Context, human_duration, verbatim};
pub use datetime::DEFAULT_FORMAT as DATETIME_FORMAT;
pub use escape::Escape;
pub(crate) use escape::hidden_chars_shown;

/// The work one render may do (minijinja's fuel: about one unit per instruction and per 64 bytes
/// made). A rule's template is code: a macro that calls itself twice (`m(60)`) would otherwise
/// spin `check`, hold a reload (and every later one) behind it, and take a worker per render.
/// A digest of 1,000 events with a loop per item uses a few tens of thousands; this leaves ten
/// times that, and bounds one render to about 30 MB and well under a second.
pub const FUEL: u64 = 500_000;

/// A template of a [`TemplateSet`]; only meaningful for the set that returned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TemplateId(u32);

/// A template that does not compile or does not render.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct TemplateError {
    pub message: String,
    /// 1-based line within the template source, when minijinja knows it.
    pub line: Option<usize>,
}

#[derive(Clone)]
struct Entry {
    /// As the user wrote it, for `source()` and error snippets.
    source: String,
    escape: Escape,
    /// The name in the environment: `{index}.{escape tag}`.
    name: String,
    /// The template as literal text and bare names, when it is only that and its mode writes
    /// values as they are, or glob-escaped (see [`TemplateSet::render_plain`]).
    plain: Option<Vec<Piece>>,
}

/// A part of a plain template: `order:` and `id` in `order:{{ id }}`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Name(String),
}

/// Names that minijinja reads as constants, not as variables.
const CONSTANTS: &[&str] = &["true", "false", "none", "True", "False", "None"];

/// `source` as literal text and `{{ name }}` references, when that is all it is. Anything else
/// (a filter, an expression, a tag, a comment, whitespace control, a delimiter in the text) is
/// left to minijinja: this only has to recognise the common forms, never to parse Jinja.
fn plain_pieces(source: &str) -> Option<Vec<Piece>> {
    let text = |t: &str| {
        let delimiter = ["{{", "{%", "{#", "}}", "%}", "#}"]
            .iter()
            .any(|d| t.contains(d));
        (!delimiter).then(|| Piece::Text(t.to_owned()))
    };
    let mut pieces = Vec::new();
    let mut rest = source;
    while let Some(open) = rest.find("{{") {
        if open > 0 {
            pieces.push(text(&rest[..open])?);
        }
        let after = &rest[open + 2..];
        let close = after.find("}}")?;
        let name = after[..close].trim_matches(|c: char| c == ' ' || c == '\t');
        let mut chars = name.chars();
        let identifier = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier || CONSTANTS.contains(&name) {
            return None;
        }
        pieces.push(Piece::Name(name.to_owned()));
        rest = &after[close + 2..];
    }
    if !rest.is_empty() {
        pieces.push(text(rest)?);
    }
    Some(pieces)
}

/// Every template of a rule set, compiled once.
#[derive(Clone)]
pub struct TemplateSet {
    env: Environment<'static>,
    entries: Vec<Entry>,
}

impl Default for TemplateSet {
    fn default() -> TemplateSet {
        TemplateSet::new()
    }
}

impl fmt::Debug for TemplateSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| (e.escape, &e.source)))
            .finish()
    }
}

impl TemplateSet {
    pub fn new() -> TemplateSet {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_fuel(Some(FUEL));
        env.set_formatter(escape::format);
        context::add_sample_aware_filters(&mut env);
        datetime::add(&mut env, chrono_tz::UTC);
        escape::add_chat_aware_filters(&mut env);
        // Undefined-value errors name the variable only with debug info; `check` needs the name
        // in release builds too, and the cost is paid only when a render fails.
        env.set_debug(true);
        // The escaping mode travels in the template's name, the only thing this callback sees.
        env.set_auto_escape_callback(|name| {
            match name
                .rsplit_once('.')
                .and_then(|(_, tag)| Escape::from_tag(tag))
            {
                Some(mode) => AutoEscape::Custom(mode.tag().into()),
                None => AutoEscape::None,
            }
        });
        // Exact modes reproduce the literal text exactly, trailing newline included.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .keep_trailing_newline(true)
            .build();
        if let Ok(syntax) = syntax {
            env.set_syntax(syntax);
        }
        TemplateSet {
            env,
            entries: Vec::new(),
        }
    }

    /// Times written by the `datetime` filter are in `tz` (the rule files' `timezone`).
    pub fn set_timezone(&mut self, tz: chrono_tz::Tz) {
        datetime::add(&mut self.env, tz);
    }

    /// Compiles `source` now, so syntax errors surface at load with their line.
    pub fn add(&mut self, source: &str, escape: Escape) -> Result<TemplateId, TemplateError> {
        let index = u32::try_from(self.entries.len()).map_err(|_| TemplateError {
            message: "too many templates".to_owned(),
            line: None,
        })?;
        let name = format!("{index}.{}", escape.tag());
        let encoded = bytestr::encode_str(source).into_owned();
        self.env
            .add_template_owned(name.clone(), encoded)
            .map_err(|e| convert_error(&e, source))?;
        let plain = matches!(escape, Escape::RedisKey | Escape::Raw | Escape::Glob)
            .then(|| plain_pieces(source))
            .flatten();
        self.entries.push(Entry {
            source: source.to_owned(),
            escape,
            name,
            plain,
        });
        Ok(TemplateId(index))
    }

    /// # Panics
    /// If `id` comes from another set.
    pub fn source(&self, id: TemplateId) -> &str {
        &self.entry(id).source
    }

    /// # Panics
    /// If `id` comes from another set.
    pub fn escape(&self, id: TemplateId) -> Escape {
        self.entry(id).escape
    }

    /// Top-level names the template reads from its context, for checking them against the
    /// rule's captures and [`CONTEXT_NAMES`]. minijinja's globals (`range`, `dict`,
    /// `namespace`…) are always defined, so they are not among them: `check` must not call a
    /// loop over `range(3)` an undefined name.
    pub fn variables(&self, id: TemplateId) -> BTreeSet<String> {
        match self.env.get_template(&self.entry(id).name) {
            Ok(t) => {
                let mut names: BTreeSet<String> =
                    t.undeclared_variables(false).into_iter().collect();
                for (global, _) in self.env.globals() {
                    names.remove(global);
                }
                names
            }
            Err(_) => BTreeSet::new(),
        }
    }

    /// The exact bytes, for Redis keys and fields, argv, URLs and globs: a non-UTF-8 key comes
    /// out byte for byte.
    pub fn render(&self, id: TemplateId, ctx: &Context) -> Result<Vec<u8>, TemplateError> {
        let out = self.render_encoded(id, ctx)?;
        Ok(match bytestr::decode(&out) {
            std::borrow::Cow::Borrowed(_) => out.into_bytes(),
            std::borrow::Cow::Owned(bytes) => bytes,
        })
    }

    /// Text for people: bytes of a key that are not UTF-8 show as U+FFFD.
    pub fn render_text(&self, id: TemplateId, ctx: &Context) -> Result<String, TemplateError> {
        let out = self.render_encoded(id, ctx)?;
        Ok(match bytestr::decode(&out) {
            std::borrow::Cow::Borrowed(_) => out,
            std::borrow::Cow::Owned(bytes) => match String::from_utf8(bytes) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            },
        })
    }

    /// [`TemplateSet::render`] without a context, for a template of literal text and bare names
    /// in a mode that writes values as they are (`order:{{ id }}` as a detail location) or
    /// glob-escaped (`session:{{ id }}:*` in a cleanup): each name's bytes come from `value`. `None` when the template is not of that form or `value`
    /// does not know a name; the caller then renders it the usual way (which also reports an
    /// undefined name as it always has). A mass expiry rendered a whole context per event to
    /// place one capture in a hash field, a tenth of the intake's CPU; and a cleanup of a key of
    /// megabytes held the key and its captures several times over in the context and the
    /// renderer's output (docs/reliability.md#bounded-whatever-the-key).
    pub fn render_plain<'v>(
        &self,
        id: TemplateId,
        value: impl Fn(&str) -> Option<&'v [u8]>,
    ) -> Option<Vec<u8>> {
        let entry = self.entry(id);
        let pieces = entry.plain.as_ref()?;
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => out.extend_from_slice(t.as_bytes()),
                Piece::Name(n) if matches!(entry.escape, Escape::Glob) => {
                    crate::pattern::glob_escape_into(&mut out, value(n)?)
                }
                Piece::Name(n) => out.extend_from_slice(value(n)?),
            }
        }
        Some(out)
    }

    /// [`TemplateSet::render_plain`] where the template is plain, else [`TemplateSet::render`]
    /// with the context in `ctx`, made by `make` on first need: a context holds the key and
    /// each capture again, which a key of megabytes makes costly.
    pub fn render_bytes<'v>(
        &self,
        id: TemplateId,
        value: impl Fn(&str) -> Option<&'v [u8]>,
        ctx: &std::cell::OnceCell<Context>,
        make: impl FnOnce() -> Context,
    ) -> Result<Vec<u8>, TemplateError> {
        match self.render_plain(id, value) {
            Some(bytes) => Ok(bytes),
            None => self.render(id, ctx.get_or_init(make)),
        }
    }

    fn render_encoded(&self, id: TemplateId, ctx: &Context) -> Result<String, TemplateError> {
        let entry = self.entry(id);
        let template = self
            .env
            .get_template(&entry.name)
            .map_err(|e| convert_error(&e, &entry.source))?;
        template
            .render(ctx.root().clone())
            .map(|out| entry.escape.finish(out))
            .map_err(|e| convert_error(&e, &entry.source))
    }

    fn entry(&self, id: TemplateId) -> &Entry {
        &self.entries[id.0 as usize]
    }
}

/// The tag of a statement that would render another template, which this build of minijinja does
/// not know (no `multi_template` feature, see Cargo.toml): its syntax error says so plainly.
fn other_template_tag(err: &minijinja::Error) -> Option<&'static str> {
    if err.kind() != minijinja::ErrorKind::SyntaxError {
        return None;
    }
    let detail = err.detail()?;
    let name = detail.strip_prefix("unknown statement ")?;
    ["include", "import", "extends", "from", "block"]
        .into_iter()
        .find(|t| *t == name.trim())
}

/// minijinja's error as one line for `FILE:LINE:COLUMN: message`: its kind and detail, the
/// failing expression quoted when minijinja points at one and the detail does not already quote
/// it, and the underlying cause. The template's internal name (`3.glob`) means nothing to users
/// and is left out.
fn convert_error(err: &minijinja::Error, source: &str) -> TemplateError {
    if err.kind() == minijinja::ErrorKind::OutOfFuel {
        return TemplateError {
            message: format!(
                "the template does more work than one render may ({FUEL} steps): a macro that calls itself, or a loop over too many items?"
            ),
            line: err.line(),
        };
    }
    if let Some(tag) = other_template_tag(err) {
        return TemplateError {
            message: format!(
                "`{{% {tag} %}}` is not allowed: a template cannot render another template (every rule's templates share one set, `${{VAR}}` secrets substituted, so it could send one in clear); write the text here, or use a macro defined in this template"
            ),
            line: err.line(),
        };
    }
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    let encoded = bytestr::encode_str(source);
    if let Some(snippet) = err.range().and_then(|r| encoded.get(r)) {
        let snippet = String::from_utf8_lossy(&bytestr::decode(snippet)).into_owned();
        let quoted = format!("`{snippet}`");
        if !snippet.is_empty() && !snippet.contains('\n') && !message.contains(&quoted) {
            message.push_str(&format!(" in {quoted}"));
        }
    }
    let mut cause = std::error::Error::source(err);
    while let Some(c) = cause {
        message.push_str(&format!(": {c}"));
        cause = c.source();
    }
    TemplateError {
        message,
        line: err.line(),
    }
}
