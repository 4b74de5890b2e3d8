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

/// Every value the rule files took from the environment (`${VAR}`, `${VAR:-default}`) or from a
/// `*_file`: wherever one lands (a URL, a query, a header, a body, an argument) it is masked in
/// what people see (`explain`, logs, errors, history). Masking goes by where a value came from,
/// not by what a header is called: `X-Signature: ${SIG}` is as secret as `Authorization`.
///
/// Values shorter than [`Secrets::MIN_LEN`] are not masked: masking every `0` of a
/// `${DB:-0}` would garble all output, and a value that short protects nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Secrets {
    /// The values and the forms they take once encoded (JSON string, percent-encoding), longest
    /// first so that a secret containing another is masked whole.
    needles: Vec<String>,
}

impl Secrets {
    pub const MIN_LEN: usize = 4;

    pub fn new(values: impl IntoIterator<Item = String>) -> Secrets {
        let mut needles = Vec::new();
        for v in values {
            if v.chars().count() < Secrets::MIN_LEN {
                continue;
            }
            // Always `"…"`: the string's escaped form is what lies between the quotes.
            let quoted = serde_json::to_string(&v).unwrap_or_default();
            let json = quoted[1..quoted.len() - 1].to_string();
            let url = percent_encoding::utf8_percent_encode(&v, percent_encoding::NON_ALPHANUMERIC)
                .to_string();
            needles.extend([v, json, url]);
        }
        needles.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        needles.dedup();
        Secrets { needles }
    }

    /// `text` with every secret value, and the user info of every URL in it, replaced by
    /// `<secret>`.
    pub fn mask(&self, text: &str) -> String {
        let mut out = text.to_string();
        for n in &self.needles {
            if out.contains(n.as_str()) {
                out = out.replace(n.as_str(), "<secret>");
            }
        }
        mask_user_info(&out)
    }
}

/// `scheme://user:password@host` → `scheme://<secret>@host`, for every URL in `text`: a URL's
/// credentials are secret whether or not they came from the environment.
pub fn mask_user_info(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | '"' | '\'' | '`' | '<' | '>') || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..authority_end];
        match authority.rfind('@') {
            Some(at) if !authority[..at].is_empty() && &authority[..at] != "<secret>" => {
                out.push_str("<secret>");
                out.push_str(&authority[at..]);
            }
            _ => out.push_str(authority),
        }
        rest = &tail[authority_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_masked_raw_and_encoded_and_short_values_are_left() {
        let s = Secrets::new([
            "p@ss w\"rd".to_string(),
            "0".to_string(),
            "tok-123".to_string(),
        ]);
        assert_eq!(
            s.mask("u=p@ss w\"rd j=\"p@ss w\\\"rd\" q=p%40ss%20w%22rd t=tok-123 db 0"),
            "u=<secret> j=\"<secret>\" q=<secret> t=<secret> db 0"
        );
    }

    #[test]
    fn user_info_of_every_url_is_masked() {
        assert_eq!(
            mask_user_info("GET http://u:pw@h:1/a?x=1 and redis://:pw@r:6379/0, https://h/p@x"),
            "GET http://<secret>@h:1/a?x=1 and redis://<secret>@r:6379/0, https://h/p@x"
        );
        assert_eq!(mask_user_info("no url here"), "no url here");
    }
}
