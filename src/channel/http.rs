//! Sending one HTTP request and deciding what its answer means.
//!
//! The decision is separate from the transport (Vector's `RetryAction`): every integration says
//! what success looks like for it (Slack's `ok`, DingTalk's `errcode`), the rest is shared here.

use std::time::Duration;

use reqwest::header::HeaderMap;

use crate::outcome::Outcome;

/// A request ready to send. `url` may carry a token: it never reaches a log or an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: reqwest::Method,
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// What came back.
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: reqwest::StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    /// The answer as text for the outcome, trimmed and capped at [`ANSWER_KEPT`] bytes. Not
    /// cut to what people are shown: that happens after secrets are masked
    /// ([`crate::yaml::Secrets::mask_bounded`], [`crate::outcome::SHOWN`]), so that a cut
    /// never leaves the start of an echoed token.
    pub fn body_text(&self) -> String {
        let kept = &self.body[..self.body.len().min(ANSWER_KEPT)];
        let s = String::from_utf8_lossy(kept);
        let s = s.trim();
        if kept.len() < self.body.len() {
            format!("{s}…")
        } else {
            s.to_string()
        }
    }

    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// How much of an answer's body is kept for its outcome's text before masking (memory only:
/// people see far less).
pub const ANSWER_KEPT: usize = 16 * 1024;

/// Redirects followed within one origin, at most.
const MAX_REDIRECTS: usize = 5;

/// The shared client: rustls, connection reuse, no proxy surprises, and redirects followed
/// only within the origin of the URL the rules named ([`redirect_policy`]).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .user_agent(concat!("keywatch/", env!("CARGO_PKG_VERSION")))
        .pool_idle_timeout(Duration::from_secs(30))
        .redirect(redirect_policy())
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// A redirect is followed only to the same origin (scheme, host and port) as the URL the
/// rules named: a request carries its credentials in its query and headers (`X-Token`,
/// `?access_token=`), and reqwest keeps both on a redirect to anywhere, dropping only
/// `Authorization` and cookies. A redirect elsewhere is not followed: its answer (the 3xx)
/// fails the attempt for good, naming where it pointed ([`judge_status`]), so the rules can be
/// pointed there on purpose (docs/how-it-works.md#redirects).
fn redirect_policy() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let same_origin = attempt
            .previous()
            .first()
            .is_some_and(|first| first.origin() == attempt.url().origin());
        if !same_origin || attempt.previous().len() > MAX_REDIRECTS {
            attempt.stop()
        } else {
            attempt.follow()
        }
    })
}

/// What in `req` no request can carry, if anything: such a request fails the same way on every
/// attempt (a key with CR/LF in a header value, a URL that a detail made unparsable), so it is
/// given up at once with the reason, not retried for 24 hours. Neither the URL nor a header
/// value is quoted: either may hold a token.
pub fn unsendable(req: &Request) -> Option<String> {
    use reqwest::header::{HeaderName, HeaderValue};
    if let Err(e) = reqwest::Url::parse(&req.url) {
        return Some(format!("the rendered URL is not a valid URL ({e})"));
    }
    for (name, value) in &req.headers {
        if HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Some(format!("`{name}` is not a valid HTTP header name"));
        }
        if HeaderValue::from_str(value).is_err() {
            return Some(format!(
                "the value of header `{name}` holds a character no HTTP header may carry (CR, LF, NUL or another control character)"
            ));
        }
    }
    None
}

/// The first path segment of `url` that the URL standard treats as `.` or `..`: the segment
/// itself, `%2e`, or `%2e%2e`, `.%2e`, `%2e.` in any case. A backslash separates segments in
/// http(s) URLs as `/` does.
pub fn dot_segment(url: &str) -> Option<&str> {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[after_scheme..];
    let path_start = rest.find(['/', '\\'])?;
    let path = &rest[path_start..];
    let path = &path[..path.find(['?', '#']).unwrap_or(path.len())];
    path.split(['/', '\\']).find(|s| {
        let s = s.to_ascii_lowercase().replace("%2e", ".");
        s == "." || s == ".."
    })
}

/// Sends `req`; a transport failure comes back as the outcome to report (retryable: a target
/// that is down for an hour must still get its messages), a request that can never be sent as
/// a failure ([`unsendable`]).
pub async fn send(
    client: &reqwest::Client,
    req: &Request,
    timeout: Duration,
) -> Result<Answer, Outcome> {
    if let Some(why) = unsendable(req) {
        return Err(Outcome::Failed(why));
    }
    let mut b = client
        .request(req.method.clone(), &req.url)
        .timeout(timeout);
    for (k, v) in &req.headers {
        b = b.header(k, v);
    }
    let resp = b
        .body(req.body.clone())
        .send()
        .await
        .map_err(transport_error)?;
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.bytes().await.map_err(transport_error)?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// A reqwest error without its URL (which may hold a token), as Alertmanager's `RedactURL` does.
pub fn transport_error(e: reqwest::Error) -> Outcome {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_body() || e.is_decode() {
        "broken response"
    } else {
        "request failed"
    };
    let detail = e.without_url().to_string();
    Outcome::Retry {
        reason: format!("{kind}: {detail}"),
        after: None,
    }
}

/// `Retry-After` as seconds or an HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = chrono::DateTime::parse_from_rfc2822(v).ok()?;
    let wait = when.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or(Duration::ZERO))
}

/// Where a redirect pointed, as its origin only (its path and query may hold a token):
/// `http://other:8080`.
fn redirect_origin(headers: &HeaderMap) -> String {
    headers
        .get(reqwest::header::LOCATION)
        .and_then(|l| l.to_str().ok())
        .and_then(|l| reqwest::Url::parse(l).ok())
        .map_or_else(
            || "another place".to_string(),
            |u| u.origin().ascii_serialization(),
        )
}

/// The generic meaning of a status: 2xx done; a 3xx is a redirect not followed, given up;
/// 429 (with `Retry-After`), 408 and 5xx retried; other 4xx given up (the request itself is wrong and will not get better).
pub fn judge_status(a: &Answer) -> Outcome {
    let s = a.status.as_u16();
    match s {
        200..=299 => Outcome::Sent(format!("HTTP {s}")),
        429 => Outcome::Retry {
            reason: format!("HTTP 429 rate limited: {}", a.body_text()),
            after: retry_after(&a.headers),
        },
        408 | 500..=599 => Outcome::Retry {
            reason: format!("HTTP {s}: {}", a.body_text()),
            after: retry_after(&a.headers),
        },
        300..=399 => Outcome::Failed(format!(
            "HTTP {s}: a redirect to {} was not followed (keywatch follows redirects only within the URL's own origin, so credentials never travel elsewhere; point the URL where it leads)",
            redirect_origin(&a.headers)
        )),
        _ => Outcome::Failed(format!("HTTP {s}: {}", a.body_text())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::StatusCode;

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Answer {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(
                reqwest::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: h,
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn statuses_mean_what_they_say() {
        assert!(matches!(
            judge_status(&answer(204, &[], "")),
            Outcome::Sent(_)
        ));
        assert!(matches!(
            judge_status(&answer(500, &[], "boom")),
            Outcome::Retry { after: None, .. }
        ));
        assert!(
            matches!(judge_status(&answer(404, &[], "no_service")), Outcome::Failed(m) if m.contains("no_service"))
        );
        match judge_status(&answer(429, &[("retry-after", "7")], "")) {
            Outcome::Retry { after, .. } => assert_eq!(after, Some(Duration::from_secs(7))),
            o => panic!("{o:?}"),
        }
    }

    fn request(url: &str, header: &str) -> Request {
        Request {
            method: reqwest::Method::POST,
            url: url.into(),
            headers: vec![("X-Key".into(), header.into())],
            body: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_request_no_attempt_can_send_fails_for_good() {
        let client = client();
        let timeout = Duration::from_secs(5);
        for (req, why) in [
            (
                request("http://127.0.0.1:9/x", "a\r\nX-Evil: 1"),
                "header `X-Key`",
            ),
            (request("http://127.0.0.1:9/x", "a\0b"), "header `X-Key`"),
            (
                request("http://[::1/x?token=SECRET", "a"),
                "not a valid URL",
            ),
        ] {
            match send(&client, &req, timeout).await {
                Err(Outcome::Failed(m)) => {
                    assert!(m.contains(why), "{m}");
                    assert!(!m.contains("SECRET") && !m.contains("Evil"), "{m}");
                }
                other => panic!("{req:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn retry_after_accepts_http_dates() {
        let later = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc2822();
        let h = answer(429, &[("retry-after", &later)], "").headers;
        let d = retry_after(&h).unwrap();
        assert!(
            d <= Duration::from_secs(30) && d >= Duration::from_secs(25),
            "{d:?}"
        );
    }
}
