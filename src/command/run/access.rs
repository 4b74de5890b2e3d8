//! Who may reach `/`, `/api/*` and `POST /-/reload` (docs/operations.md#exposing-the-endpoint):
//! a `Host` keywatch answers to (so that a DNS-rebinding page cannot read the history), the
//! bearer token of `server.token` when it is set, and for a reload a same-origin request (so that
//! a cross-site form cannot reload). `/metrics`, `/healthz`, `/readyz` and signed links are not
//! behind this: a link's token is its own capability.

use std::time::Duration;

use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::Digest;
use subtle::ConstantTimeEq;

use super::connections::Arrival;
use super::throttled_log::Throttled;
use crate::config::Config;
use crate::config::server::host_name;

/// Refusals are logged once per this period, with a count of the others.
static REFUSED: Throttled = Throttled::new(Duration::from_secs(10));

/// Why a request was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `Host` names nothing keywatch answers to (421).
    Host(String),
    /// No bearer token, or another one (401).
    Token,
    /// A reload from another origin (403).
    CrossOrigin(String),
}

impl Refusal {
    pub fn response(&self) -> Response {
        match self {
            Refusal::Host(_) => (
                StatusCode::MISDIRECTED_REQUEST,
                "this Host is not one keywatch answers to; add it to server.hosts\n",
            )
                .into_response(),
            Refusal::Token => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer realm=\"keywatch\"")],
                "a bearer token is required: Authorization: Bearer TOKEN (server.token)\n",
            )
                .into_response(),
            Refusal::CrossOrigin(_) => (
                StatusCode::FORBIDDEN,
                "a reload must come from keywatch's own origin, or from a client that is no browser\n",
            )
                .into_response(),
        }
    }

    pub fn log(&self) {
        if let Some(suppressed) = REFUSED.pass() {
            let reason = match self {
                Refusal::Host(h) => format!(
                    "Host `{}` is not accepted",
                    crate::event::printable(h.as_bytes())
                ),
                Refusal::Token => "no or another bearer token".to_string(),
                Refusal::CrossOrigin(o) => format!(
                    "cross-origin reload from `{}`",
                    crate::event::printable(o.as_bytes())
                ),
            };
            tracing::warn!(%reason, suppressed, "An HTTP request was refused.");
        }
    }
}

/// Whether a request may go on.
pub fn check(
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    arrival: Option<Arrival>,
    config: Option<&Config>,
) -> Result<(), Refusal> {
    let host = headers
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .unwrap_or_default();
    if !host_accepted(&host, arrival, config) {
        return Err(Refusal::Host(host));
    }
    if let Some(token) = config.and_then(|c| c.server.token.as_ref()) {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        if !presented.is_some_and(|p| same_secret(p, token.expose())) {
            return Err(Refusal::Token);
        }
    }
    if method == Method::POST && path == "/-/reload" {
        same_origin(headers, &host)?;
    }
    Ok(())
}

/// Constant time: how long a refusal takes says nothing about how much of the token was right
/// (both are hashed first, so not even its length).
fn same_secret(presented: &str, token: &str) -> bool {
    let a = sha2::Sha256::digest(presented.as_bytes());
    let b = sha2::Sha256::digest(token.as_bytes());
    a.ct_eq(&b).into()
}

/// The names keywatch answers to: the address the request arrived on, loopback names when it
/// arrived on loopback, the host of `links.base_url`, and `server.hosts`. Ports are not
/// compared: a rebinding page can only bring its own name.
fn host_accepted(host: &str, arrival: Option<Arrival>, config: Option<&Config>) -> bool {
    let Some(name) = host_name(host) else {
        return false;
    };
    if let Some(a) = arrival {
        let ip = a.local.ip().to_canonical();
        let own = match ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        if name == own {
            return true;
        }
        if ip.is_loopback() && matches!(name.as_str(), "localhost" | "127.0.0.1" | "[::1]") {
            return true;
        }
    }
    let Some(config) = config else {
        return arrival.is_none();
    };
    if let Some(links) = &config.links
        && let Ok(url) = url::Url::parse(&links.base_url)
        && url
            .host_str()
            .is_some_and(|h| h.eq_ignore_ascii_case(&name))
    {
        return true;
    }
    config.server.hosts.contains(&name)
}

/// A browser says where a request comes from (`Sec-Fetch-Site`, `Origin`); a request from
/// another site is refused. Clients that are no browser (curl, systemd, Prometheus) send
/// neither and pass.
fn same_origin(headers: &HeaderMap, host: &str) -> Result<(), Refusal> {
    let text = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    if let Some(site) = text("sec-fetch-site")
        && !matches!(site.as_str(), "same-origin" | "none")
    {
        return Err(Refusal::CrossOrigin(format!("Sec-Fetch-Site: {site}")));
    }
    if let Some(origin) = text("origin") {
        let from = url::Url::parse(&origin)
            .ok()
            .and_then(|u| u.host_str().map(str::to_ascii_lowercase));
        if from.is_none() || from != host_name(host) {
            return Err(Refusal::CrossOrigin(origin));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.insert(*n, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn on(addr: &str) -> Option<Arrival> {
        Some(Arrival {
            local: addr.parse().unwrap(),
        })
    }

    #[test]
    fn loopback_names_pass_on_loopback_and_other_names_do_not() {
        let get = Method::GET;
        for host in [
            "127.0.0.1:9464",
            "localhost:9464",
            "LOCALHOST",
            "[::1]:9464",
        ] {
            let h = headers(&[("host", host)]);
            assert_eq!(
                check(&get, "/", &h, on("127.0.0.1:9464"), None),
                Ok(()),
                "{host}"
            );
        }
        let h = headers(&[("host", "rebound.example:9464")]);
        assert!(matches!(
            check(&get, "/", &h, on("127.0.0.1:9464"), None),
            Err(Refusal::Host(_))
        ));
        // Listening on every interface: the address the request came to is accepted, a
        // loopback name only on loopback.
        let h = headers(&[("host", "10.1.2.3:9464")]);
        assert_eq!(check(&get, "/", &h, on("10.1.2.3:9464"), None), Ok(()));
        let h = headers(&[("host", "localhost:9464")]);
        assert!(check(&get, "/", &h, on("10.1.2.3:9464"), None).is_err());
        assert!(check(&get, "/", &HeaderMap::new(), on("127.0.0.1:1"), None).is_err());
    }

    #[test]
    fn a_reload_from_another_site_is_refused_and_one_from_no_browser_passes() {
        let post = Method::POST;
        let at = on("127.0.0.1:9464");
        let ok = headers(&[("host", "127.0.0.1:9464")]);
        assert_eq!(check(&post, "/-/reload", &ok, at, None), Ok(()));
        for (name, value) in [
            ("origin", "https://evil.example"),
            ("origin", "null"),
            ("sec-fetch-site", "cross-site"),
            ("sec-fetch-site", "same-site"),
        ] {
            let h = headers(&[("host", "127.0.0.1:9464"), (name, value)]);
            assert!(
                matches!(
                    check(&post, "/-/reload", &h, at, None),
                    Err(Refusal::CrossOrigin(_))
                ),
                "{name}: {value}"
            );
        }
        let h = headers(&[
            ("host", "127.0.0.1:9464"),
            ("origin", "http://127.0.0.1:9464"),
            ("sec-fetch-site", "same-origin"),
        ]);
        assert_eq!(check(&post, "/-/reload", &h, at, None), Ok(()));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_secret("0123456789abcdef", "0123456789abcdef"));
        assert!(!same_secret("0123456789abcdeX", "0123456789abcdef"));
        assert!(!same_secret("0123456789abcdef0", "0123456789abcdef"));
        assert!(!same_secret("", "0123456789abcdef"));
    }
}
