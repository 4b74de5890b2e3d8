//! Problems found in rule files, each pinned to `FILE:LINE:COLUMN`.
//!
//! Every stage of loading pushes into one list instead of returning at the first problem, so a user
//! fixing a file sees all of it in one run (Alertmanager stops at the first error; we do better).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// A place in a rule file. Lines and columns are 1-based, as editors show them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc {
    pub file: Arc<Path>,
    pub line: usize,
    pub col: usize,
}

impl Loc {
    pub fn new(file: &Arc<Path>, line: usize, col: usize) -> Loc {
        Loc {
            file: file.clone(),
            line,
            col,
        }
    }

    /// A place inside a scalar, `offset` characters after its first character. Only exact for
    /// scalars written on one line; good enough to point at the right word.
    pub fn shifted(&self, offset: usize) -> Loc {
        Loc {
            file: self.file.clone(),
            line: self.line,
            col: self.col + offset,
        }
    }
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file.display(), self.line, self.col)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Error,
    Warning,
}

/// One problem. Printed as `FILE:LINE:COLUMN: message` (errors) or
/// `FILE:LINE:COLUMN: warning: message`, the shape compilers use so editors can jump to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub loc: Loc,
    pub severity: Severity,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.severity {
            Severity::Error => write!(f, "{}: {}", self.loc, self.message),
            Severity::Warning => write!(f, "{}: warning: {}", self.loc, self.message),
        }
    }
}

/// The growing list of problems of one load.
#[derive(Debug, Default)]
pub struct Diagnostics {
    list: Vec<Diagnostic>,
}

impl Diagnostics {
    pub fn error(&mut self, loc: &Loc, message: impl Into<String>) {
        self.push(loc, Severity::Error, message.into());
    }

    pub fn warning(&mut self, loc: &Loc, message: impl Into<String>) {
        self.push(loc, Severity::Warning, message.into());
    }

    fn push(&mut self, loc: &Loc, severity: Severity, message: String) {
        let d = Diagnostic {
            loc: loc.clone(),
            severity,
            message: one_line(message),
        };
        // The same problem can be reached twice (a template checked for two channels).
        if !self.list.contains(&d) {
            self.list.push(d);
        }
    }

    pub fn has_errors(&self) -> bool {
        self.list.iter().any(|d| d.severity == Severity::Error)
    }

    /// Problems in file order, then by position, so output is stable and reads top to bottom.
    /// `order` gives each file's position in the load.
    pub fn into_sorted(mut self, order: &dyn Fn(&Path) -> usize) -> Vec<Diagnostic> {
        self.list.sort_by(|a, b| {
            (order(&a.loc.file), a.loc.line, a.loc.col, a.severity).cmp(&(
                order(&b.loc.file),
                b.loc.line,
                b.loc.col,
                b.severity,
            ))
        });
        self.list
    }
}

/// Messages quote the user's text (an unknown field, a bad value), which YAML lets span lines or
/// hold terminal escapes; `check` promises one problem per line, so control characters are
/// written as escapes (`\n`, `\u{1b}`).
fn one_line(message: String) -> String {
    if !message.chars().any(|c| c.is_control() && c != '\t') {
        return message;
    }
    let mut out = String::with_capacity(message.len() + 8);
    for c in message.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push('\t'),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// "did you mean `x`?" for a misspelt name among the names that would have been accepted.
pub fn did_you_mean<'a>(given: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    let best = candidates
        .into_iter()
        .map(|c| (strsim::damerau_levenshtein(given, c), c))
        .filter(|(d, c)| *d <= (c.len().max(given.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((_, c)) => format!("; did you mean `{c}`?"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        assert_eq!(
            did_you_mean("mesage", ["message", "title", "to"]),
            "; did you mean `message`?"
        );
        assert_eq!(did_you_mean("colour", ["message", "title", "to"]), "");
        assert_eq!(did_you_mean("ot", ["to", "on"]), "; did you mean `to`?");
    }

    /// Found by `fuzz/fuzz_targets/rules_check.rs`: an unknown field spelt over several lines
    /// (a quoted YAML key with newlines) printed a diagnostic over several lines.
    #[test]
    fn user_text_with_newlines_and_escapes_stays_on_one_line() {
        let file: Arc<Path> = Arc::from(Path::new("rules/a.yaml"));
        let mut diags = Diagnostics::default();
        diags.error(
            &Loc::new(&file, 23, 1),
            "unknown field `/\n\n3fir\r\x1b[31m` in a rule file",
        );
        let line = diags.into_sorted(&|_| 0)[0].to_string();
        assert_eq!(
            line,
            "rules/a.yaml:23:1: unknown field `/\\n\\n3fir\\r\\u{1b}[31m` in a rule file"
        );
    }

    #[test]
    fn prints_like_a_compiler() {
        let file: Arc<Path> = Arc::from(Path::new("rules/a.yaml"));
        let d = Diagnostic {
            loc: Loc::new(&file, 3, 5),
            severity: Severity::Warning,
            message: "x".into(),
        };
        assert_eq!(d.to_string(), "rules/a.yaml:3:5: warning: x");
    }
}
