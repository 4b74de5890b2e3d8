//! `server`: protection of the `--listen` endpoint (docs/operations.md#exposing-the-endpoint).

use std::path::Path;

use crate::yaml::decode::Decoder;
use crate::yaml::{Node, Secret};

/// What protects `/`, `/api/*` and `POST /-/reload`; `/metrics`, `/healthz`, `/readyz` and
/// signed links stay open.
#[derive(Clone, Debug, Default)]
pub struct ServerSettings {
    /// `Authorization: Bearer TOKEN` is required when set; never shown.
    pub token: Option<Secret>,
    /// Host names accepted in `Host` besides the listen address and `links.base_url`'s, lower
    /// case, without a port.
    pub hosts: Vec<String>,
    /// `open: true`: listening beyond loopback without `token` is meant (a network that is
    /// itself the protection); otherwise `run` refuses it ([`ServerSettings::unprotected`]).
    pub open: bool,
}

impl ServerSettings {
    /// Why `run` must not listen on `listen` with these settings: beyond loopback, without a
    /// token, and not said to be meant (docs/operations.md#exposing-the-endpoint). The text
    /// names the fixes.
    pub fn unprotected(&self, listen: std::net::SocketAddr) -> Option<String> {
        if listen.ip().is_loopback() || self.token.is_some() || self.open {
            return None;
        }
        Some(format!(
            "`--listen {listen}` reaches beyond loopback, but the rules set no `server.token`: anyone who reaches it could read the status page and the history and reload the rules. Set `server: {{ token: \"${{KEYWATCH_TOKEN}}\" }}` (or `token_file`) with a token of 16 characters or more, listen on 127.0.0.1, or set `server.open: true` if an open endpoint is meant (docs/operations.md#exposing-the-endpoint)"
        ))
    }
}

/// A token shorter than this is refused: it is all that stands between the network and the
/// history, the status page and a reload.
const MIN_TOKEN: usize = 16;

pub fn decode_server(
    d: &mut Decoder<'_>,
    node: &Node,
    base: &Path,
    into: &mut Option<ServerSettings>,
) {
    let Some(mut m) = d.map(node, "the `server` section") else {
        return;
    };
    let token = d.inline_or_file(&mut m, "token", "`server`", base);
    let mut hosts = Vec::new();
    if let Some(n) = m.get("hosts") {
        for item in d.one_or_many(n, "`server.hosts`") {
            let Some(t) = d.text(item, "an entry of `server.hosts`") else {
                continue;
            };
            if t.unresolved {
                continue;
            }
            match host_name(&t.value) {
                Some(h) => hosts.push(h),
                None => d.error(
                    &t.loc,
                    format!(
                        "`server.hosts`: `{}` is not a host name; write a name as clients put it in `Host`, e.g. `keywatch.internal` (no scheme, no path)",
                        t.value
                    ),
                ),
            }
        }
    }
    let open = m
        .get("open")
        .and_then(|n| d.bool(n, "`server.open`"))
        .unwrap_or(false);
    m.finish(d, &["token", "token_file", "hosts", "open"], &|f| match f {
        "base_url" => Some("`base_url` belongs to `links:`".into()),
        "listen" => Some("the address is given with `keywatch run --listen`".into()),
        _ => None,
    });
    let token = match token {
        Some(t) if t.value.chars().count() < MIN_TOKEN && !t.unresolved => {
            d.error(
                &t.loc,
                format!("`server.token` must be at least {MIN_TOKEN} characters: it is all that stands between the network and the history, the status page and a reload"),
            );
            return;
        }
        Some(t) => Some(Secret::new(t.value)),
        None => None,
    };
    if into.is_some() {
        d.error(&node.loc, "`server` is set twice");
        return;
    }
    *into = Some(ServerSettings { token, hosts, open });
}

/// The host of `text` (a name or an address, maybe with a port), lower case and without the
/// port; `None` when it is anything more (a scheme, a path, user info).
pub fn host_name(text: &str) -> Option<String> {
    if text.is_empty() || text.contains(['/', '@', '?', '#', ' ']) {
        return None;
    }
    let url = url::Url::parse(&format!("http://{text}/")).ok()?;
    url.host_str().map(str::to_ascii_lowercase)
}

#[cfg(test)]
mod tests {
    use super::{ServerSettings, host_name};

    #[test]
    fn only_a_wide_listen_without_token_or_open_is_refused() {
        let wide: std::net::SocketAddr = "0.0.0.0:9464".parse().unwrap();
        let local: std::net::SocketAddr = "127.0.0.1:9464".parse().unwrap();
        let none = ServerSettings::default();
        let why = none.unprotected(wide).expect("refused");
        assert!(
            why.contains("server.token") && why.contains("server.open: true"),
            "{why}"
        );
        assert_eq!(none.unprotected(local), None);
        let token = ServerSettings {
            token: Some(crate::yaml::Secret::new("0123456789abcdef")),
            ..ServerSettings::default()
        };
        assert_eq!(token.unprotected(wide), None);
        let open = ServerSettings {
            open: true,
            ..ServerSettings::default()
        };
        assert_eq!(open.unprotected(wide), None);
    }

    #[test]
    fn host_names_are_compared_without_port_or_case() {
        assert_eq!(
            host_name("KeyWatch.internal").as_deref(),
            Some("keywatch.internal")
        );
        assert_eq!(
            host_name("keywatch.internal:8443").as_deref(),
            Some("keywatch.internal")
        );
        assert_eq!(host_name("[::1]:9464").as_deref(), Some("[::1]"));
        assert_eq!(host_name("127.0.0.1").as_deref(), Some("127.0.0.1"));
        assert_eq!(host_name("https://k.internal"), None);
        assert_eq!(host_name("k.internal/x"), None);
        assert_eq!(host_name(""), None);
    }
}
