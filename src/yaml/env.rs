//! `${NAME}`, `${NAME:-default}` and `$$` in string values.
//!
//! Substitution happens after YAML parsing, on one string value at a time, so an environment
//! value can never inject YAML structure. A `$` not followed by `{` or `$` stays as it is, so
//! regexes ending in `$` need no escaping.

/// The result of interpolating one value.
#[derive(Debug, PartialEq, Eq)]
pub struct Interpolated {
    pub value: String,
    /// Variables that were unset and had no default (substituted by nothing).
    pub unset: Vec<String>,
    /// True when the value used any variable: such values may be secrets.
    pub used_env: bool,
    /// What each reference was replaced by (the variable's value, or its default): secrets,
    /// to be masked wherever they land ([`super::Secrets`]).
    pub substituted: Vec<String>,
}

/// A malformed reference, with the byte offset where it starts.
#[derive(Debug, PartialEq, Eq)]
pub struct EnvSyntaxError {
    pub offset: usize,
    pub message: String,
}

pub fn interpolate(
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Interpolated, EnvSyntaxError> {
    let mut out = Interpolated {
        value: String::with_capacity(text.len()),
        unset: Vec::new(),
        used_env: false,
        substituted: Vec::new(),
    };
    let mut rest = text;
    let mut offset = 0;
    while let Some(i) = rest.find('$') {
        out.value.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.value.push('$');
            rest = stripped;
            offset += i + 2;
        } else if let Some(body) = after.strip_prefix('{') {
            let start = offset + i;
            let Some(end) = body.find('}') else {
                return Err(EnvSyntaxError {
                    offset: start,
                    message: "`${` without a closing `}`; write `$$` for a literal `$`".into(),
                });
            };
            let inner = &body[..end];
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (inner, None),
            };
            if !valid_name(name) {
                return Err(EnvSyntaxError {
                    offset: start,
                    message: format!(
                        "`${{{inner}}}` is not a valid variable reference: use `${{NAME}}` or `${{NAME:-default}}` with NAME made of letters, digits and `_`"
                    ),
                });
            }
            out.used_env = true;
            let value = match (lookup(name), default) {
                (Some(v), Some(d)) if v.is_empty() => d.to_string(),
                (Some(v), _) => v,
                (None, Some(d)) => d.to_string(),
                (None, None) => {
                    out.unset.push(name.to_string());
                    String::new()
                }
            };
            out.value.push_str(&value);
            if !value.is_empty() {
                out.substituted.push(value);
            }
            rest = &body[end + 1..];
            offset += i + 2 + end + 1;
        } else {
            out.value.push('$');
            rest = after;
            offset += i + 1;
        }
    }
    out.value.push_str(rest);
    Ok(out)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOOK" => Some("https://x/y".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    fn run(s: &str) -> Interpolated {
        interpolate(s, &env).unwrap()
    }

    #[test]
    fn substitutes_defaults_and_dollars() {
        assert_eq!(run("${HOOK}/a").value, "https://x/y/a");
        assert_eq!(run("${NOPE:-redis://h:1}").value, "redis://h:1");
        assert_eq!(run("${EMPTY:-d}").value, "d");
        assert_eq!(run("${EMPTY}").value, "");
        assert_eq!(run("cost: $$5").value, "cost: $5");
        assert_eq!(run("^a\\d+$").value, "^a\\d+$");
        assert!(!run("plain").used_env);
        assert!(run("${HOOK}").used_env);
        assert_eq!(
            run("a${HOOK}b${NOPE:-dflt}${EMPTY}").substituted,
            ["https://x/y", "dflt"]
        );
    }

    #[test]
    fn reports_unset_variables() {
        let r = run("a${NOPE}b${ALSO}");
        assert_eq!(r.value, "ab");
        assert_eq!(r.unset, ["NOPE", "ALSO"]);
    }

    #[test]
    fn rejects_malformed_references() {
        let e = interpolate("x ${HOOK", &env).unwrap_err();
        assert_eq!(e.offset, 2);
        let e = interpolate("${1A}", &env).unwrap_err();
        assert!(
            e.message.contains("not a valid variable reference"),
            "{}",
            e.message
        );
    }
}
