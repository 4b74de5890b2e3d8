//! Rules on hash fields (`on: [hexpired]`, `field: PATTERN`): the field's pattern and the captures of
//! key and field together (which rules an event of one field fires is [`super::matching`]'s).
//!
//! Kept apart from [`super::model`] so the key rules read as before: a rule without `field`
//! behaves exactly as it did, and a `hexpired` rule without `field` matches every field.

use crate::event::EventKind;
use crate::pattern::Pattern;

use super::model::{Config, FieldPattern, Rule};

impl Rule {
    /// The names of the values [`Rule::captures_of`] returns, in order.
    pub fn capture_names(&self) -> &[String] {
        match &self.field {
            Some(f) => &f.names,
            None => self.pattern.capture_names(),
        }
    }

    /// The captures of `key` (and, for a `field` rule, of `field`), or `None` when the event does
    /// not match: a field rule needs a field that matches its pattern.
    pub fn captures_of(&self, key: &[u8], field: Option<&[u8]>) -> Option<Vec<Vec<u8>>> {
        let mut out = self.pattern.captures(key)?;
        if let Some(f) = &self.field {
            out.extend(f.pattern.captures(field?)?);
        }
        Some(out)
    }

    /// [`Rule::captures_of`] sharing `key`'s bytes: a key's captures are slices of it.
    pub fn captures_in(
        &self,
        key: &bytes::Bytes,
        field: Option<&[u8]>,
    ) -> Option<Vec<bytes::Bytes>> {
        let mut out: Vec<bytes::Bytes> = self
            .pattern
            .capture_ranges(key)?
            .into_iter()
            .map(|r| key.slice(r))
            .collect();
        if let Some(f) = &self.field {
            out.extend(
                f.pattern
                    .captures(field?)?
                    .into_iter()
                    .map(bytes::Bytes::from),
            );
        }
        Some(out)
    }

    /// Whether the rule fires when a field of a hash expires.
    pub fn watches_fields(&self) -> bool {
        self.on.contains(&EventKind::Hexpired)
    }
}

impl Config {
    /// Whether some rule fires on expired hash fields: then keywatch learns field deadlines and
    /// the server must support hash-field expiry.
    pub fn watches_fields(&self) -> bool {
        self.rules.iter().any(Rule::watches_fields)
    }
}

/// Compiles a rule's `field` pattern. Returns every capture name of the rule (the key's, then the
/// field's) and the pattern: `Some(None)` without `field`, `None` when it was wrong (reported at
/// its place: a bad pattern, a name the key captures too, `field` on a rule not on `hexpired`).
pub(super) fn build_field(
    d: &mut crate::yaml::decode::Decoder<'_>,
    r: &super::rules::RuleDraft,
    key_names: &[String],
    what: &str,
) -> (Vec<String>, Option<Option<FieldPattern>>) {
    let mut names = key_names.to_vec();
    let hexpired = r.on.contains(&EventKind::Hexpired);
    if hexpired {
        d.warning(&r.on_loc, format!("{what}: `hexpired` needs a server with hash-field expiry (Redis 7.4 or later, Valkey 9.0 or later); `run` and `doctor` refuse an older one"));
    }
    let Some(src) = &r.field else {
        return (names, Some(None));
    };
    if let Some(other) = r.on.iter().find(|k| **k != EventKind::Hexpired) {
        d.error(&src.loc, format!("{what}: `field` is the pattern of an expired hash field, for `on: [hexpired]` only; `{other}` events have no field (make a rule of its own for them)"));
        return (names, None);
    }
    let pattern = match Pattern::parse(&src.value) {
        Ok(p) => p,
        Err(e) => {
            d.error(&src.at(e.offset), format!("{what} `field`: {}", e.message));
            return (names, None);
        }
    };
    let mut ok = true;
    for name in pattern.capture_names() {
        let at = src.value.find(&format!("{{{name}}}")).unwrap_or(0);
        if names.contains(name) {
            ok = false;
            d.error(&src.at(at), format!("{what} `field`: the capture `{name}` is also captured by the key pattern; one name holds one value, rename one of them (e.g. `field_{name}`)"));
        } else if crate::template::CONTEXT_NAMES.contains(&name.as_str()) {
            ok = false;
            d.error(&src.at(at), format!("{what} `field`: the capture `{name}` shadows the context name `{name}`; rename it (e.g. `{name}_id`)"));
        }
        names.push(name.clone());
    }
    let built = ok.then(|| FieldPattern {
        pattern,
        names: names.clone(),
    });
    (names, built.map(Some))
}
