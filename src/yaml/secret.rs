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

/// Every credential of the rule files: each value taken from the environment (`${VAR}`,
/// `${VAR:-default}`) or from a `*_file`, and each channel's URL, signing secret and header
/// value. Wherever one lands (a URL, a query, a header, a body, an argument, an answer that
/// echoes it) it is masked in what people see (`explain`, logs, errors, history). Masking goes
/// by where a value came from, not by what a header is called: `X-Signature: ${SIG}` is as
/// secret as `Authorization`.
///
/// A value travels in more spellings than its own, and each is masked: JSON-escaped,
/// percent-encoded (upper- or lowercase hex, unreserved characters kept or not, form encoding),
/// and for a URL its user info as the `Authorization: Basic` header reqwest makes of it
/// (base64 of `user:password`), its password and its query values.
///
/// Values shorter than [`Secrets::MIN_LEN`] are not masked: masking every `0` of a
/// `${DB:-0}` would garble all output, and a value that short protects nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Secrets {
    /// The values and the forms they take once encoded, longest first so that a secret
    /// containing another is masked whole.
    needles: Vec<String>,
}

impl Secrets {
    pub const MIN_LEN: usize = 4;

    pub fn new(values: impl IntoIterator<Item = String>) -> Secrets {
        let mut needles = Vec::new();
        for v in values {
            for part in url_credentials(&v).into_iter().chain([v]) {
                if part.chars().count() >= Secrets::MIN_LEN {
                    needles.extend(spellings(&part));
                }
            }
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

    /// `text` masked, then cut to at most `limit` bytes (on a char boundary, the cut marked
    /// with `…`). Masking comes first, so a cut never leaves part of a secret; and a secret's
    /// start left where someone else cut the text (an answer that was already cut, a service
    /// that echoes only the start of a request) is masked too: the bytes before a `…`, a `...`
    /// or the end that begin a secret.
    pub fn mask_bounded(&self, text: &str, limit: usize) -> String {
        let masked = self.mask(text);
        let mut out = if masked.len() > limit {
            let mut end = limit.saturating_sub('…'.len_utf8());
            while !masked.is_char_boundary(end) {
                end -= 1;
            }
            masked[..end].to_string()
        } else {
            masked.clone()
        };
        let cut = out.len() < masked.len();
        self.mask_edges(&mut out);
        if cut {
            out.push('…');
        }
        out
    }

    /// Masks the start of a secret that ends where `text` does or right before a cut mark.
    fn mask_edges(&self, text: &mut String) {
        let mut edges: Vec<usize> = text
            .match_indices("…")
            .chain(text.match_indices("..."))
            .map(|(i, _)| i)
            .collect();
        edges.push(text.len());
        edges.sort_unstable();
        edges.dedup();
        // From the last edge back, so that earlier positions stay valid.
        for &edge in edges.iter().rev() {
            let before = &text[..edge];
            let longest = self
                .needles
                .iter()
                .filter_map(|n| {
                    (Secrets::MIN_LEN..n.len())
                        .rev()
                        .filter(|&k| n.is_char_boundary(k))
                        .find(|&k| before.ends_with(&n[..k]))
                })
                .max();
            if let Some(k) = longest {
                text.replace_range(edge - k..edge, "<secret>");
            }
        }
    }
}

/// The spellings a value takes on its way out: as is, inside a JSON string (as serde writes it,
/// as Go writes it with `&`, `<`, `>` as `\u0026`…, and ASCII-only with `\u00e9`),
/// HTML-escaped (`&amp;`, `&quot;` or `&#34;`: a proxy's error page), percent-encoded the ways
/// URL libraries do it, and form-encoded.
fn spellings(v: &str) -> Vec<String> {
    use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
    /// RFC 3986 unreserved characters kept: reqwest's and keywatch's own URL encoding.
    const KEEP_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    // Always `"…"`: the string's escaped form is what lies between the quotes.
    let quoted = serde_json::to_string(v).unwrap_or_default();
    let json = quoted[1..quoted.len() - 1].to_string();
    let all = utf8_percent_encode(v, NON_ALPHANUMERIC).to_string();
    let unreserved = utf8_percent_encode(v, KEEP_UNRESERVED).to_string();
    let form: String = url::form_urlencoded::byte_serialize(v.as_bytes()).collect();
    let mut out = vec![
        lowercase_hex(&all),
        lowercase_hex(&unreserved),
        lowercase_hex(&form),
        all,
        unreserved,
        form,
        go_json(&json, false),
        go_json(&json, true),
        html(v, "&quot;"),
        html(v, "&#34;"),
        html(&json, "&quot;"),
        json,
        v.to_string(),
    ];
    out.sort();
    out.dedup();
    out
}

/// A JSON string's inside as Go's `encoding/json` writes it: `&`, `<`, `>` (and U+2028, U+2029)
/// as `\u0026`…; with `ascii`, every other character beyond ASCII as `\u00e9` too (Python's
/// `json.dumps`), surrogate pairs beyond the first plane.
fn go_json(json: &str, ascii: bool) -> String {
    let mut out = String::with_capacity(json.len() + 8);
    let mut units = [0u16; 2];
    for c in json.chars() {
        match c {
            '&' | '<' | '>' | '\u{2028}' | '\u{2029}' => {
                out.push_str(&format!("\\u{:04x}", u32::from(c)));
            }
            c if ascii && !c.is_ascii() => {
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out
}

/// `v` HTML-escaped: `&`, `<`, `>`, `'` as entities and `"` as `quot`.
fn html(v: &str, quot: &str) -> String {
    let mut out = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str(quot),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `%2F` → `%2f`: some encoders write lowercase hex.
fn lowercase_hex(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut after_percent = 0;
    for c in s.chars() {
        if after_percent > 0 {
            out.push(c.to_ascii_lowercase());
            after_percent -= 1;
        } else {
            out.push(c);
        }
        if c == '%' {
            after_percent = 2;
        }
    }
    out
}

/// What a URL carries besides itself that is as secret: the `Authorization: Basic` value
/// reqwest makes of its user info (base64 of the percent-decoded `user:password`), the
/// password, each query value long enough to be a token ([`TOKEN_LEN`]), and its path and
/// path segments likewise. Empty for text that is not a URL with any. Works on a
/// template's text too (`https://u:${PW}@host/{{ id }}`).
fn url_credentials(v: &str) -> Vec<String> {
    use base64::Engine;
    let mut out = Vec::new();
    let Some(i) = v.find("://") else {
        return out;
    };
    let rest = &v[i + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    if let Some(at) = authority.rfind('@') {
        let (user, password) = match authority[..at].split_once(':') {
            Some((u, p)) => (decode(u), decode(p)),
            None => (decode(&authority[..at]), String::new()),
        };
        out.push(base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")));
        out.push(password);
    }
    if let Some(q) = rest.find('?') {
        let query = &rest[q + 1..];
        let query = &query[..query.find('#').unwrap_or(query.len())];
        out.extend(
            url::form_urlencoded::parse(query.as_bytes())
                .map(|(_, v)| v.into_owned())
                .filter(|v| v.chars().count() >= TOKEN_LEN),
        );
    }
    // The path, which a target that echoes the request line shows without the host: Slack's
    // `/services/T…/B…/TOKEN`, Feishu's `/open-apis/bot/v2/hook/TOKEN`. As the request line
    // carries it (query included) and alone, and each segment long enough to be a token.
    let target = &rest[authority.len()..];
    let target = &target[..target.find('#').unwrap_or(target.len())];
    let path = &target[..target.find('?').unwrap_or(target.len())];
    for whole in [target, path] {
        if whole.chars().count() >= TOKEN_LEN {
            out.push(whole.to_string());
        }
    }
    for segment in path.split('/') {
        let decoded = decode(segment);
        if decoded.chars().count() >= TOKEN_LEN {
            if decoded != segment {
                out.push(segment.to_string());
            }
            out.push(decoded);
        }
    }
    out
}

/// The length from which a query value or a path segment of a URL is taken for a token:
/// DingTalk's `access_token`, WeCom's `key`, Slack's and Feishu's hook tokens; not
/// `?format=json` or `/api/v2/alerts`, whose masking would garble every message.
const TOKEN_LEN: usize = 16;

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
    fn every_spelling_of_a_credential_is_masked() {
        use base64::Engine;
        let s = Secrets::new([
            "https://svc:pa%22ss-1@h/x?access_token=tok+en/42-0123456789&format=json".to_string(),
        ]);
        let basic = base64::engine::general_purpose::STANDARD.encode("svc:pa\"ss-1");
        for (text, gone) in [
            (format!("Authorization: Basic {basic}"), basic.as_str()),
            ("{\"password\":\"pa\\\"ss-1\"}".to_string(), "ss-1"),
            ("token=tok%20en%2F42-0123456789".to_string(), "en%2F42"),
            ("token=tok%20en%2f42-0123456789".to_string(), "en%2f42"),
            ("token=tok+en%2F42-0123456789".to_string(), "en%2F42"),
            ("token=tok en/42-0123456789".to_string(), "en/42"),
        ] {
            let masked = s.mask(&text);
            assert!(!masked.contains(gone), "{text} -> {masked}");
            assert!(masked.contains("<secret>"), "{text} -> {masked}");
        }
        assert_eq!(s.mask("format json"), "format json");
    }

    /// A target that echoes the request line shows a channel URL's path, and a server or proxy
    /// that echoes a secret holding `&`, `<`, `>` writes it JSON-escaped the way Go does
    /// (`\u0026`) or HTML-escaped (`&amp;`): each spelling is masked.
    #[test]
    fn a_url_s_path_and_escaped_spellings_are_masked() {
        let s = Secrets::new([
            "https://hooks.slack.com/services/T0AB12CD3/B0EF45GH6/xoxbTOKENabcdef0123456789"
                .to_string(),
            "https://open.feishu.cn/open-apis/bot/v2/hook/6b7f1d4e-9a1c-4f0e-8d2b-3c5a7e9f1b2d"
                .to_string(),
            "p&ss<w>rd\"é-0123".to_string(),
        ]);
        for (text, gone) in [
            (
                "POST /services/T0AB12CD3/B0EF45GH6/xoxbTOKENabcdef0123456789 HTTP/1.1",
                "xoxbTOKEN",
            ),
            ("no such hook: xoxbTOKENabcdef0123456789", "xoxbTOKEN"),
            (
                "{\"path\":\"/open-apis/bot/v2/hook/6b7f1d4e-9a1c-4f0e-8d2b-3c5a7e9f1b2d\"}",
                "6b7f1d4e",
            ),
            ("hook%2F6b7f1d4e-9a1c-4f0e-8d2b-3c5a7e9f1b2d", "6b7f1d4e"),
            (
                "{\"got\":\"p\\u0026ss\\u003cw\\u003erd\\\"\\u00e9-0123\"}",
                "ss\\u003cw",
            ),
            (
                "{\"got\":\"p\\u0026ss\\u003cw\\u003erd\\\"é-0123\"}",
                "ss\\u003cw",
            ),
            ("<p>got p&amp;ss&lt;w&gt;rd&quot;é-0123</p>", "ss&lt;w"),
            ("<p>got p&amp;ss&lt;w&gt;rd&#34;é-0123</p>", "ss&lt;w"),
            ("got p%26ss%3Cw%3Erd%22%C3%A9-0123", "ss%3Cw"),
        ] {
            let masked = s.mask(text);
            assert!(!masked.contains(gone), "{text} -> {masked}");
            assert!(masked.contains("<secret>"), "{text} -> {masked}");
        }
        // Short paths and segments are not secrets: masking them would garble every answer.
        let plain = Secrets::new(["http://am:9093/api/v2/alerts".to_string()]);
        assert_eq!(
            plain.mask("POST /api/v2/alerts 400"),
            "POST /api/v2/alerts 400"
        );
    }

    #[test]
    fn masking_comes_before_the_cut_and_a_cut_secret_is_masked_too() {
        let s = Secrets::new(["tk9Zq-Secret-0123456789".to_string()]);
        let answer = format!("{} token=tk9Zq-Secret-0123456789 rest", "e".repeat(287));
        let shown = s.mask_bounded(&answer, 300);
        assert!(shown.len() <= 300, "{}", shown.len());
        assert!(shown.ends_with('…'), "{shown}");
        assert!(!shown.contains("tk9Z"), "{shown}");
        // Cut by someone else: the start of the secret before `…`, `...` or the end.
        for text in ["got tk9Zq-Sec…", "got tk9Zq-Sec... more", "got tk9Zq-Se"] {
            let shown = s.mask_bounded(text, 300);
            assert!(!shown.contains("tk9Z"), "{text} -> {shown}");
        }
        assert_eq!(s.mask_bounded("short", 300), "short");
        assert_eq!(s.mask_bounded("tk9Z is not it", 300), "tk9Z is not it");
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
