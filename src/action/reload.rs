//! `reload`: an HTTP call that re-warms a cache or starts a job, with templated URL, headers and
//! body. Captures are percent-encoded inside the URL, so key text cannot change its path or query,
//! and a URL whose path would hold a `.` or `..` segment is never sent (see [`url_to_request`]).

use crate::config::{ReloadStep, Rule};
use crate::firing::{Action, Firing};

use super::context::ActionContext;
use crate::channel::http::{self, Request};
use crate::outcome::Outcome;

pub async fn run(a: &ActionContext, f: &Firing, _rule: &Rule, step: &ReloadStep) -> Outcome {
    match request(a, f, step) {
        Ok(req) => match http::send(&a.http, &req, step.timeout).await {
            Ok(answer) => http::judge_status(&answer),
            Err(o) => o,
        },
        Err(o) => o,
    }
}

/// The request of one attempt; a template that fails on this firing's data fails for good.
pub fn request(a: &ActionContext, f: &Firing, step: &ReloadStep) -> Result<Request, Outcome> {
    let t = &a.config.templates;
    let ctx = a.context_of(f);
    let fail = |what: &str, e: crate::template::TemplateError| {
        Outcome::Failed(format!("reload {what}: {}", e.message))
    };
    let url = url_to_request(&t.render(step.url, &ctx).map_err(|e| fail("url", e))?)
        .map_err(Outcome::Failed)?;
    let method =
        reqwest::Method::from_bytes(step.method.as_bytes()).unwrap_or(reqwest::Method::POST);
    let mut headers = Vec::with_capacity(step.headers.len() + 2);
    for (name, id) in &step.headers {
        headers.push((
            name.clone(),
            t.render_text(*id, &ctx).map_err(|e| fail("header", e))?,
        ));
    }
    let body = match step.body {
        Some(id) => t
            .render_text(id, &ctx)
            .map_err(|e| fail("body", e))?
            .into_bytes(),
        None => Vec::new(),
    };
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        let ct = if serde_json::from_slice::<serde_json::Value>(&body).is_ok() {
            "application/json"
        } else {
            "text/plain; charset=utf-8"
        };
        headers.push(("Content-Type".into(), ct.into()));
    }
    headers.push((
        "Idempotency-Key".into(),
        Action::Reload.idempotency_key(&f.id),
    ));
    Ok(Request {
        method,
        url,
        headers,
        body,
    })
}

/// The URL a reload requests, as the receiver will read it, from the rendered template; or why
/// it is never sent.
///
/// The URL standard resolves `.` and `..` path segments however they are spelled (`%2E%2E` and
/// `.%2e` too), and reqwest parses every URL by it: a capture `..` in `/reload/{{ kind }}/…`
/// would make the request climb out of `/reload/`. No spelling of such a segment reaches the
/// receiver as written, so the request is refused (`check` rejects one in the template's own
/// text, so only key text or a detail can make one). Every other value stays in its segment:
/// captures are percent-encoded, `/` as `%2F` (docs/rules.md#reload).
pub fn url_to_request(rendered: &[u8]) -> Result<String, String> {
    let url = String::from_utf8_lossy(rendered);
    if let Some(segment) = http::dot_segment(&url) {
        return Err(format!(
            "reload url: the path would hold the segment `{segment}`, which URLs resolve to another path; not sent"
        ));
    }
    // What reqwest sends is the parsed URL; one that does not parse is reported by the sender.
    Ok(match reqwest::Url::parse(&url) {
        Ok(u) => u.to_string(),
        Err(_) => url.into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_found_however_they_are_spelled() {
        for url in [
            "http://h/reload/../flushall",
            "http://h/reload/./x",
            "http://h/reload/%2E%2E/x",
            "http://h/reload/%2e./x",
            "http://h/reload/.%2E",
            "http://h/a\\..\\b",
            "http://h/a/..?x=1",
        ] {
            assert!(http::dot_segment(url).is_some(), "{url}");
            assert!(url_to_request(url.as_bytes()).is_err(), "{url}");
        }
        for url in [
            "http://h/reload/.../x",
            "http://h/reload/..%2Fx",
            "http://h/reload/%252E%252E",
            "http://h/a?x=..",
            "http://h/a#..",
            "http://h",
        ] {
            assert_eq!(http::dot_segment(url), None, "{url}");
        }
    }

    #[test]
    fn the_url_shown_is_the_url_requested() {
        assert_eq!(
            url_to_request(b"http://h:1/reload/x/a%2Fb").unwrap(),
            "http://h:1/reload/x/a%2Fb"
        );
        assert_eq!(url_to_request(b"http://h").unwrap(), "http://h/");
    }
}
