//! What `doctor` found: one verdict per check, printed as an aligned table for people or as JSON
//! for scripts. The exit code follows from it: any `FAIL` means Redis is not ready.

use std::fmt::Write;

/// How a check came out. `Warn` never fails the run: keywatch works, but something deserves a
/// look (a stale-key backlog, a sample with no matching key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// Short and stable (`reachable`, `notifications`, `permission`), for scripts and eyes.
    pub name: String,
    pub verdict: Verdict,
    pub detail: String,
    /// The exact thing to do about a `Warn` or `Fail`, when there is one.
    pub fix: Option<String>,
}

/// Every check of one doctor run, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `host:port` of the node doctor was pointed at (never the URL: it may carry a password).
    pub node: String,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(node: &str) -> Report {
        Report {
            node: node.to_string(),
            checks: Vec::new(),
        }
    }

    pub fn add(&mut self, verdict: Verdict, name: &str, detail: impl Into<String>) -> &mut Check {
        self.checks.push(Check {
            name: name.to_string(),
            verdict,
            detail: detail.into(),
            fix: None,
        });
        self.checks.last_mut().expect("just pushed")
    }

    pub fn ok(&mut self, name: &str, detail: impl Into<String>) {
        self.add(Verdict::Ok, name, detail);
    }

    pub fn warn(&mut self, name: &str, detail: impl Into<String>, fix: Option<String>) {
        self.add(Verdict::Warn, name, detail).fix = fix;
    }

    pub fn fail(&mut self, name: &str, detail: impl Into<String>, fix: Option<String>) {
        self.add(Verdict::Fail, name, detail).fix = fix;
    }

    pub fn count(&self, verdict: Verdict) -> usize {
        self.checks.iter().filter(|c| c.verdict == verdict).count()
    }

    /// Ready for keywatch: nothing failed.
    pub fn ready(&self) -> bool {
        self.count(Verdict::Fail) == 0
    }

    /// The table: verdict, check name, detail; fixes indented under their line.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "keywatch doctor: Redis at {}\n", self.node);
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let indent = " ".repeat(6 + width + 2);
        for c in &self.checks {
            let mut lines = c.detail.lines();
            let first = lines.next().unwrap_or("");
            let _ = writeln!(
                out,
                "{:<4}  {:<width$}  {first}",
                c.verdict.as_str(),
                c.name
            );
            for l in lines {
                let _ = writeln!(out, "{indent}{l}");
            }
            if let Some(fix) = &c.fix {
                let mut fl = fix.lines();
                let _ = writeln!(out, "{indent}fix: {}", fl.next().unwrap_or(""));
                for l in fl {
                    let _ = writeln!(out, "{indent}     {l}");
                }
            }
        }
        let fails = self.count(Verdict::Fail);
        let warns = self.count(Verdict::Warn);
        let _ = writeln!(out);
        if fails == 0 {
            let _ = writeln!(
                out,
                "Ready: Redis at {} has what keywatch needs ({warns} warning(s)).",
                self.node
            );
        } else {
            let _ = writeln!(
                out,
                "Not ready: {fails} check(s) failed, {warns} warning(s); each FAIL above says its fix."
            );
        }
        out
    }

    /// `{"node", "ready", "checks": [{"check", "verdict", "detail", "fix"}]}`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "node": self.node,
            "ready": self.ready(),
            "checks": self.checks.iter().map(|c| serde_json::json!({
                "check": c.name,
                "verdict": c.verdict.as_str().to_ascii_lowercase(),
                "detail": c.detail,
                "fix": c.fix,
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_names_and_indents_fixes() {
        let mut r = Report::new("127.0.0.1:6379");
        r.ok("reachable", "answered PING");
        r.fail(
            "notifications",
            "lacks `Ex`",
            Some("CONFIG SET notify-keyspace-events Ex\nand in redis.conf".into()),
        );
        let text = r.text();
        assert!(
            text.contains("ok    reachable      answered PING\n"),
            "{text}"
        );
        assert!(text.contains("FAIL  notifications  lacks `Ex`\n"), "{text}");
        assert!(
            text.contains("\n                     fix: CONFIG SET notify-keyspace-events Ex\n                          and in redis.conf\n"),
            "{text}"
        );
        assert!(text.contains("Not ready: 1 check(s) failed"), "{text}");
        assert!(!r.ready());
        assert_eq!(r.json()["checks"][1]["verdict"], "fail");
    }
}
