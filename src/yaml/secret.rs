//! Credentials read from rule files (URLs with tokens, signing secrets, passwords).

use std::fmt;

/// A value that must never reach a log, `explain`, `doctor` or an error message.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The real value, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A URL with everything that can carry a credential hidden: user info, path, query.
    /// `https://oapi.dingtalk.com/robot/send?access_token=…` → `https://oapi.dingtalk.com/<secret>`.
    pub fn redacted_url(&self) -> String {
        match url::Url::parse(&self.0) {
            Ok(u) => match u.host_str() {
                Some(h) => match u.port() {
                    Some(p) => format!("{}://{h}:{p}/<secret>", u.scheme()),
                    None => format!("{}://{h}/<secret>", u.scheme()),
                },
                None => "<secret>".into(),
            },
            Err(_) => "<secret>".into(),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}
