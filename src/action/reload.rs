//! `reload`: an HTTP call that re-warms a cache or starts a job, with templated URL, headers and
//! body. Captures are percent-encoded inside the URL, so key text cannot change its path or query.

use crate::config::{ReloadStep, Rule};
use crate::firing::{Action, Firing};

use super::context::Actions;
use crate::channel::http::{self, Request};
use crate::outcome::Outcome;

pub async fn run(a: &Actions, f: &Firing, _rule: &Rule, step: &ReloadStep) -> Outcome {
    match request(a, f, step) {
        Ok(req) => match http::send(&a.http, &req, step.timeout).await {
            Ok(answer) => http::judge_status(&answer),
            Err(o) => o,
        },
        Err(o) => o,
    }
}

/// The request of one attempt; a template that fails on this firing's data fails for good.
pub fn request(a: &Actions, f: &Firing, step: &ReloadStep) -> Result<Request, Outcome> {
    let t = &a.config.templates;
    let ctx = f.context();
    let fail = |what: &str, e: crate::template::TemplateError| {
        Outcome::Failed(format!("reload {what}: {}", e.message))
    };
    let url = String::from_utf8_lossy(&t.render(step.url, &ctx).map_err(|e| fail("url", e))?)
        .into_owned();
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
