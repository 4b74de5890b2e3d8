//! Email over SMTP (lettre): the title as the subject, the message as a plain-text part and an
//! HTML alternative, a digest as one mail with a list. `smtp://` must be upgraded with STARTTLS
//! unless the channel says `tls: none`, `smtps://` is TLS from the first byte, and AUTH is used
//! when credentials are given (docs/rules.md#channels).
//!
//! Success is the server's 250 after DATA. A 5xx is permanent (the same mail would be refused
//! again: dead-lettered at once); a 4xx, a connection or TLS failure and a timeout are retried.
//! The `Message-ID` is made from the message's idempotency key, so a retry after a send whose
//! 250 never arrived carries the same id and mail systems can tell it is the same mail.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine;
use chrono::{DateTime, Utc};
use lettre::message::header::{ContentType, Header, HeaderName, HeaderValue};
use lettre::message::{Mailbox, MultiPart, SinglePart};
use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::{Certificate, CertificateStore, Tls, TlsParameters};
use lettre::{AsyncSmtpTransport, AsyncTransport, Tokio1Executor};
use sha2::{Digest, Sha256};

use crate::firing::Action;
use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;
use crate::yaml::decode::Text;

use super::fields::Fields;
use super::integration::{Channel, Dispatch, Integration, Kind, Rate};
use super::message::Message;

pub const KIND: Kind = Kind {
    name: "email",
    fields: &[
        "smtp",
        "username",
        "password",
        "password_file",
        "from",
        "to",
        "tls",
        "ca_file",
    ],
    // SMTP relays publish no common limit; Exchange Online, the strictest of the common hosted
    // ones, accepts 30 messages a minute per mailbox (docs/rules.md#channels).
    default_rate: Some(Rate {
        burst: 30,
        per: Duration::from_secs(60),
    }),
    example_url: "smtp://relay.internal:587",
    decode,
};

mod mail;
pub use mail::{html_body, plain_body};
use mail::subject;

/// How the connection is protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    /// `smtp://`: plain TCP upgraded with STARTTLS, which the server must offer.
    StartTls,
    /// `smtps://`: TLS from the first byte.
    Implicit,
    /// `smtp://` with `tls: none`: no TLS at all, for a relay on the same host or network.
    None,
}

impl Security {
    fn default_port(self) -> u16 {
        match self {
            Security::StartTls => 587,
            Security::Implicit => 465,
            Security::None => 25,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Security::StartTls => "STARTTLS",
            Security::Implicit => "TLS",
            Security::None => "no TLS",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Login {
    pub username: String,
    pub password: Secret,
}

#[derive(Clone, Debug)]
pub struct Email {
    pub scheme: &'static str,
    pub host: String,
    pub port: u16,
    pub security: Security,
    pub login: Option<Login>,
    pub from: Mailbox,
    pub to: Vec<Mailbox>,
    /// The CA certificates of `ca_file`, trusted instead of the system's.
    ca: Option<Arc<CaFile>>,
}

/// The certificates of a `ca_file`.
struct CaFile {
    pem: Vec<u8>,
}

impl std::fmt::Debug for CaFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CaFile({} bytes)", self.pem.len())
    }
}

/// The parts of an `smtp`/`smtps` URL.
struct Server {
    scheme: &'static str,
    host: String,
    port: Option<u16>,
    login: Option<Login>,
}

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let what = f.what.clone();
    let server = match f.m.get("smtp") {
        Some(n) => f
            .d
            .text(n, &format!("{what} `smtp`"))
            .and_then(|t| parse_server(f, &t)),
        None => {
            f.d.error(
                &f.m.loc,
                format!(
                    "{what} is missing the field `smtp` (the relay, e.g. `smtp://relay.internal:587`)"
                ),
            );
            None
        }
    };
    let security = tls(f, server.as_ref().map(|s| s.scheme));
    let ca = ca_file(f, security);

    let username = f.text("username");
    let password = f.secret("password");
    let login = match (username, password) {
        (Some(u), Some(p)) => Some(Login {
            username: u.value,
            password: p,
        }),
        (None, None) => None,
        (u, _) => {
            let (given, missing) = if u.is_some() {
                ("username", "`password` (or `password_file`)")
            } else {
                ("password", "`username`")
            };
            let loc = f.m.key_loc(given).unwrap_or_else(|| f.m.loc.clone());
            f.d.error(
                &loc,
                format!("{what} has a `{given}` but no {missing}: AUTH needs both"),
            );
            None
        }
    };
    let login = match (login, server.as_ref().and_then(|s| s.login.clone())) {
        (Some(_), Some(_)) => {
            let loc = f.m.key_loc("username").unwrap_or_else(|| f.m.loc.clone());
            f.d.error(
                &loc,
                format!(
                    "{what} has credentials both in the `smtp` URL and in `username`/`password`: give them once"
                ),
            );
            None
        }
        (a, b) => a.or(b),
    };
    if let (Some(Security::None), Some(_)) = (security, &login) {
        let loc = f.m.key_loc("tls").unwrap_or_else(|| f.m.loc.clone());
        f.d.error(
            &loc,
            format!(
                "{what}: `tls: none` with credentials would send the password in clear text; \
                 drop `tls: none` (STARTTLS) or the credentials"
            ),
        );
    }

    let from = match f.m.get("from") {
        Some(n) => f
            .d
            .text(n, &format!("{what} `from`"))
            .and_then(|t| mailbox(f, &t, "from")),
        None => {
            f.d.error(
                &f.m.loc,
                format!("{what} is missing the field `from` (e.g. `keywatch <keywatch@example.com>`)"),
            );
            None
        }
    };
    let to = recipients(f);

    let server = server?;
    let security = security?;
    Some(Arc::new(Email {
        scheme: server.scheme,
        host: server.host,
        port: server
            .port
            .unwrap_or_else(|| security.default_port()),
        security,
        login,
        from: from?,
        to: to?,
        ca: ca?,
    }))
}

/// `smtp://[user:password@]host[:port]` or `smtps://…`, reported without ever printing the URL
/// (its user info is a credential). An unresolved `${VAR}` (at `check`) stands in as a relay
/// on localhost, so the other fields are still checked.
fn parse_server(f: &mut Fields<'_, '_>, t: &Text) -> Option<Server> {
    let what = format!("{} `smtp`", f.what);
    if t.unresolved {
        return Some(Server {
            scheme: "smtp",
            host: "localhost".into(),
            port: None,
            login: None,
        });
    }
    let u = match url::Url::parse(&t.value) {
        Ok(u) => u,
        Err(e) => {
            f.d.error(
                &t.loc,
                format!("{what} is not a valid URL ({e}); expected e.g. `smtp://relay.internal:587` or `smtps://smtp.example.com`"),
            );
            return None;
        }
    };
    let scheme = match u.scheme() {
        "smtp" => "smtp",
        "smtps" => "smtps",
        other => {
            f.d.error(
                &t.loc,
                format!(
                    "{what} must be an smtp:// (STARTTLS) or smtps:// (TLS) URL, found scheme `{other}`"
                ),
            );
            return None;
        }
    };
    let Some(host) = u.host_str().filter(|h| !h.is_empty()) else {
        f.d.error(&t.loc, format!("{what} names no host"));
        return None;
    };
    if !matches!(u.path(), "" | "/") || u.query().is_some() || u.fragment().is_some() {
        f.d.error(
            &t.loc,
            format!("{what} takes a scheme, a host and a port only; write TLS settings as `tls` and `ca_file`"),
        );
        return None;
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
    };
    let login = match (u.username(), u.password()) {
        ("", None) => None,
        (user, Some(pass)) if !user.is_empty() => match (decode(user), decode(pass)) {
            (Ok(username), Ok(password)) => Some(Login {
                username,
                password: Secret::new(password),
            }),
            _ => {
                f.d.error(&t.loc, format!("{what}: the user info is not UTF-8 once percent-decoded"));
                return None;
            }
        },
        _ => {
            f.d.error(
                &t.loc,
                format!("{what}: user info needs both a user and a password (`smtp://user:password@host`), or use `username` and `password`"),
            );
            return None;
        }
    };
    // IPv6 literals come bracketed; the socket address and the TLS name want them bare.
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    Some(Server {
        scheme,
        host,
        port: u.port(),
        login,
    })
}

/// `tls: none` (only with `smtp://`); without it `smtp://` requires STARTTLS.
fn tls(f: &mut Fields<'_, '_>, scheme: Option<&'static str>) -> Option<Security> {
    let by_scheme = match scheme {
        Some("smtps") => Security::Implicit,
        _ => Security::StartTls,
    };
    let Some(n) = f.m.get("tls") else {
        return Some(by_scheme);
    };
    let t = f.d.text(n, &format!("{} `tls`", f.what))?;
    match (t.value.as_str(), by_scheme) {
        ("starttls", Security::StartTls) => Some(Security::StartTls),
        ("none", Security::StartTls) => Some(Security::None),
        ("none" | "starttls", Security::Implicit) => {
            f.d.error(
                &t.loc,
                format!(
                    "{} `tls: {}` does not go with smtps://, which is TLS from the first byte; use an smtp:// URL",
                    f.what, t.value
                ),
            );
            None
        }
        (other, _) => {
            f.d.error(
                &t.loc,
                format!(
                    "{} `tls` must be `starttls` (the default for smtp://) or `none`, found `{other}`",
                    f.what
                ),
            );
            None
        }
    }
}

/// `ca_file`: PEM certificates to trust instead of the system's (a relay with a private CA),
/// read and checked now so that a wrong path is a located error, not a retry loop.
fn ca_file(f: &mut Fields<'_, '_>, security: Option<Security>) -> Option<Option<Arc<CaFile>>> {
    let Some(t) = f.text("ca_file") else {
        return Some(None);
    };
    if security == Some(Security::None) {
        f.d.error(
            &t.loc,
            format!("{} `ca_file` has no use with `tls: none`", f.what),
        );
        return None;
    }
    if t.unresolved {
        return Some(None);
    }
    let path = f.base.join(Path::new(&t.value));
    let pem = match std::fs::read(&path) {
        Ok(pem) => pem,
        Err(e) => {
            f.d.missing_at_run(
                &t.loc,
                format!("{} `ca_file`: cannot read {}: {e}", f.what, path.display()),
            );
            return Some(None);
        }
    };
    let has_certificate = String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----");
    if !has_certificate || Certificate::from_pem(&pem).is_err() {
        f.d.error(
            &t.loc,
            format!(
                "{} `ca_file`: {} holds no PEM certificate",
                f.what,
                path.display()
            ),
        );
        return None;
    }
    Some(Some(Arc::new(CaFile { pem })))
}

/// An address as lettre will write it: `Name <user@example.com>` or `user@example.com`.
fn mailbox(f: &mut Fields<'_, '_>, t: &Text, field: &str) -> Option<Mailbox> {
    if t.unresolved {
        return Some(Mailbox::new(None, "unset@localhost".parse().ok()?));
    }
    match t.value.parse::<Mailbox>() {
        Ok(m) => Some(m),
        Err(e) => {
            f.d.error(
                &t.loc,
                format!(
                    "{} `{field}`: `{}` is not an email address ({e}); write e.g. `oncall@example.com` or `On-call <oncall@example.com>`",
                    f.what, t.value
                ),
            );
            None
        }
    }
}

/// `to`: one address or a list, at least one.
fn recipients(f: &mut Fields<'_, '_>) -> Option<Vec<Mailbox>> {
    let what = f.what.clone();
    let Some(n) = f.m.get("to") else {
        let loc = f.m.key_loc("to").unwrap_or_else(|| f.m.loc.clone());
        f.d.error(
            &loc,
            format!("{what} is missing the field `to` (who gets the mail, e.g. `[oncall@example.com]`)"),
        );
        return None;
    };
    let items = f.d.one_or_many(n, &format!("{what} `to`"));
    if items.is_empty() {
        f.d.error(&n.loc, format!("{what} `to` is empty: name at least one address"));
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for item in items {
        match f
            .d
            .text(item, &format!("{what} `to`"))
            .and_then(|t| mailbox(f, &t, "to"))
        {
            Some(m) => out.push(m),
            None => ok = false,
        }
    }
    ok.then_some(out)
}

impl Integration for Email {
    /// Plain chat text: a key cannot start a line of its own, mention, or make a bare link
    /// (`://` is broken by a zero-width space); the HTML part escapes the whole text again.
    fn escape(&self) -> Escape {
        Escape::Text
    }

    /// Mails have room: a key's first 4 KiB.
    fn key_limit(&self) -> usize {
        4_096
    }

    fn target(&self) -> String {
        let to: Vec<String> = self.to.iter().map(|m| m.email.to_string()).collect();
        let auth = if self.login.is_some() { ", AUTH" } else { "" };
        format!(
            "{}://{}:{} ({}{auth}) to {}",
            self.scheme,
            host_for_url(&self.host),
            self.port,
            self.security.label(),
            to.join(", ")
        )
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, now: DateTime<Utc>) -> Dispatch {
        let mail = match self.compose(ch, msg, now.into()) {
            Ok(mail) => mail,
            Err(why) => return Dispatch::Done(Outcome::Failed(why)),
        };
        let transport = match self.transport(ch.timeout) {
            Ok(t) => t,
            // Only a `ca_file` rustls refuses can fail here: fixing it takes a new config.
            Err(why) => return Dispatch::Done(Outcome::Failed(self.mask(&why))),
        };
        let masks = self.masks();
        let timeout = ch.timeout;
        Dispatch::Exchange(Box::pin(async move {
            // lettre bounds the connect with the timeout but not the commands after it: the whole
            // exchange is bounded here. Dropping it drops the connection (there is no pool).
            let outcome = match tokio::time::timeout(timeout, transport.send(mail)).await {
                Err(_) => Outcome::Retry {
                    reason: format!(
                        "timed out after {}: no answer to the whole SMTP exchange",
                        humantime::format_duration(timeout)
                    ),
                    after: None,
                },
                Ok(result) => judge(result),
            };
            outcome.map_text(|t| mask_with(&masks, t))
        }))
    }
}

/// The outcome of one SMTP exchange.
fn judge(result: Result<lettre::transport::smtp::response::Response, lettre::transport::smtp::Error>) -> Outcome {
    match result {
        Ok(r) => {
            let text = format!("{} {}", r.code(), r.message().collect::<Vec<_>>().join(" "));
            if r.code().to_string() == "250" {
                Outcome::Sent(text.trim_end().to_string())
            } else {
                Outcome::Retry {
                    reason: format!("the server answered DATA with {text}, not 250"),
                    after: None,
                }
            }
        }
        Err(e) if e.is_permanent() => Outcome::Failed(format!("SMTP {e}")),
        Err(e) => {
            let reason = match tls_error(&e) {
                Some(tls) => format!("TLS failed: {tls}"),
                None if e.is_tls() => format!("TLS failed: {e}"),
                None if e.is_timeout() => format!("timed out: {e}"),
                None if e.is_transient() => format!("SMTP {e}"),
                None => format!("cannot deliver: {e}"),
            };
            Outcome::Retry {
                reason,
                after: None,
            }
        }
    }
}

/// The rustls error under `e`: lettre reports a failed handshake (an untrusted certificate, a
/// wrong name) as a connection error, and says it twice.
fn tls_error<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e rustls::Error> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
        {
            return Some(tls);
        }
        next = err.source();
    }
    None
}

/// A host as written in a URL: IPv6 literals in brackets.
fn host_for_url(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// `Auto-Submitted: auto-generated` (RFC 3834): out-of-office responders do not answer it.
#[derive(Clone)]
struct AutoSubmitted;

impl Header for AutoSubmitted {
    fn name() -> HeaderName {
        HeaderName::new_from_ascii_str("Auto-Submitted")
    }

    fn parse(_: &str) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        Ok(AutoSubmitted)
    }

    fn display(&self) -> HeaderValue {
        HeaderValue::new(Self::name(), "auto-generated".into())
    }
}

/// `X-Keywatch-Rule`, for mail filters.
#[derive(Clone)]
struct KeywatchRule(String);

impl Header for KeywatchRule {
    fn name() -> HeaderName {
        HeaderName::new_from_ascii_str("X-Keywatch-Rule")
    }

    fn parse(s: &str) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        Ok(KeywatchRule(s.to_string()))
    }

    fn display(&self) -> HeaderValue {
        HeaderValue::new(Self::name(), self.0.clone())
    }
}

impl Email {
    /// The mail for `msg`, dated `date`.
    pub fn compose(
        &self,
        ch: &Channel,
        msg: &Message,
        date: SystemTime,
    ) -> Result<lettre::Message, String> {
        let plain = plain_body(msg);
        let html = html_body(msg);
        let mut b = lettre::Message::builder()
            .from(self.from.clone())
            .subject(subject(ch, &msg.title))
            .date(date)
            .message_id(Some(self.message_id(&msg.idempotency_key)))
            .header(AutoSubmitted)
            .header(KeywatchRule(msg.rule.clone()));
        for to in &self.to {
            b = b.to(to.clone());
        }
        // An escalation or a resolved notice is a reply to the alert's mail on this channel, so
        // mail clients show them as one thread.
        if let Some(alert) = self.alert_message_id(ch, msg) {
            b = b.in_reply_to(alert.clone()).references(alert);
        }
        // A boundary made from both parts cannot occur in them (a key would have to contain the
        // hash of itself), and the same message always has the same bytes.
        let boundary = {
            let mut h = Sha256::new();
            h.update(plain.as_bytes());
            h.update([0]);
            h.update(html.as_bytes());
            format!("keywatch-{}", hex::encode(&h.finalize()[..12]))
        };
        let body = MultiPart::alternative()
            .boundary(boundary)
            .singlepart(
                SinglePart::builder()
                    .header(ContentType::TEXT_PLAIN)
                    .body(plain),
            )
            .singlepart(
                SinglePart::builder()
                    .header(ContentType::TEXT_HTML)
                    .body(html),
            );
        b.multipart(body)
            .map_err(|e| format!("cannot compose the mail: {e}"))
    }

    /// `<id-left@domain>` (RFC 5322 §3.6.4) from the message's idempotency key, on the domain of
    /// `from`: the same notification always has the same id.
    fn message_id(&self, key: &str) -> String {
        format!("<{}@{}>", id_left(key), self.from.email.domain())
    }

    /// The `Message-ID` of the alert a follow-up (escalation, resolved notice) belongs to, as it
    /// went out on this channel.
    fn alert_message_id(&self, ch: &Channel, msg: &Message) -> Option<String> {
        let followup = msg.followup.as_ref()?;
        let key = Action::Notify {
            channel: ch.name.clone(),
        }
        .idempotency_key(&followup.alert_id);
        Some(self.message_id(&key))
    }

    fn transport(&self, timeout: Duration) -> Result<AsyncSmtpTransport<Tokio1Executor>, String> {
        let tls = match self.security {
            Security::None => Tls::None,
            Security::StartTls => Tls::Required(self.tls_parameters()?),
            Security::Implicit => Tls::Wrapper(self.tls_parameters()?),
        };
        let mut b = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(self.host.as_str())
            .port(self.port)
            .tls(tls)
            .timeout(Some(timeout));
        if let Some(l) = &self.login {
            b = b.credentials(Credentials::new(
                l.username.clone(),
                l.password.expose().to_string(),
            ));
        }
        Ok(b.build())
    }

    fn tls_parameters(&self) -> Result<TlsParameters, String> {
        let mut b = TlsParameters::builder(self.host.clone());
        if let Some(ca) = &self.ca {
            let cert = Certificate::from_pem(&ca.pem)
                .map_err(|e| format!("`ca_file` is not usable: {e}"))?;
            b = b
                .certificate_store(CertificateStore::None)
                .add_root_certificate(cert);
        }
        b.build_rustls()
            .map_err(|e| format!("cannot set up TLS: {e}"))
    }

    /// Every form the password takes on the wire (as is, AUTH LOGIN's base64, AUTH PLAIN's
    /// base64 blob): a server that echoes what it was sent must not put it in a log.
    fn masks(&self) -> Vec<String> {
        let Some(l) = &self.login else {
            return Vec::new();
        };
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
        let p = l.password.expose();
        let mut out = vec![
            b64(&format!("\0{}\0{p}", l.username)),
            b64(p),
            p.to_string(),
        ];
        out.retain(|s| !s.is_empty());
        out
    }

    fn mask(&self, text: &str) -> String {
        mask_with(&self.masks(), text)
    }
}

fn mask_with(masks: &[String], text: &str) -> String {
    let mut out = text.to_string();
    for m in masks {
        if out.contains(m.as_str()) {
            out = out.replace(m.as_str(), "<secret>");
        }
    }
    out
}

/// The left of a `Message-ID`: RFC 5322 `dot-atom-text`. Keys are hex ids, rule and channel
/// names and `:`; `:` (not allowed) becomes `.`, and anything else outside `atext` too.
fn id_left(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        let keep = c.is_ascii_alphanumeric() || "!#$%&'*+-/=?^_`{|}~".contains(c);
        if keep {
            out.push(c);
        } else if !out.is_empty() && !out.ends_with('.') {
            out.push('.');
        }
    }
    while out.ends_with('.') {
        out.pop();
    }
    if out.is_empty() {
        out.push_str("keywatch");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::message::Item;
    use serde_json::json;

    const ID: &str = "0123456789abcdef0123456789abcdef";

    fn email() -> Email {
        Email {
            scheme: "smtp",
            host: "relay.example.com".into(),
            port: 587,
            security: Security::StartTls,
            login: None,
            from: "keywatch <keywatch@example.com>".parse().unwrap(),
            to: vec![
                "oncall@example.com".parse().unwrap(),
                "Team Lead <lead@example.com>".parse().unwrap(),
            ],
            ca: None,
        }
    }

    fn channel(keyword: Option<&str>) -> Channel {
        Channel {
            keyword: keyword.map(String::from),
            ..Channel::for_test("mail", &KIND, Arc::new(email()))
        }
    }

    fn message(title: &str, text: &str) -> Message {
        Message {
            rule: "order-lock".into(),
            event: "expired".into(),
            title: title.into(),
            text: text.into(),
            items: vec![Item {
                event: json!({"id": ID, "key": "order_lock:42"}),
                text: text.into(),
            }],
            count: 1,
            digest: false,
            idempotency_key: format!("{ID}:notify:mail"),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    fn bytes(ch: &Channel, msg: &Message) -> String {
        // 2026-12-04T10:15:00Z
        let date = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_379_300);
        let mail = email().compose(ch, msg, date).unwrap();
        String::from_utf8(mail.formatted()).unwrap()
    }

    #[test]
    fn a_mail_is_exactly_these_bytes() {
        let msg = message(
            "Order lock 42 expired",
            "Lock of order 42 expired.\n\nAcknowledge: https://kw.example/l/abc",
        );
        let got = bytes(&channel(None), &msg);
        let b = "keywatch-9ae0c34e4154c527ef70db4d";
        let expected = format!(
            "From: keywatch <keywatch@example.com>\r\n\
             Subject: Order lock 42 expired\r\n\
             Date: Fri, 04 Dec 2026 10:15:00 +0000\r\n\
             Message-ID: <{ID}.notify.mail@example.com>\r\n\
             Auto-Submitted: auto-generated\r\n\
             X-Keywatch-Rule: order-lock\r\n\
             To: oncall@example.com, \"Team Lead\" <lead@example.com>\r\n\
             MIME-Version: 1.0\r\n\
             Content-Type: multipart/alternative;\r\n \
             boundary=\"{b}\"\r\n\
             \r\n\
             --{b}\r\n\
             Content-Type: text/plain; charset=utf-8\r\n\
             Content-Transfer-Encoding: 7bit\r\n\
             \r\n\
             Lock of order 42 expired.\r\n\
             \r\n\
             Acknowledge: https://kw.example/l/abc\r\n\
             \r\n\
             --{b}\r\n\
             Content-Type: text/html; charset=utf-8\r\n\
             Content-Transfer-Encoding: quoted-printable\r\n\
             \r\n\
             <!DOCTYPE html>\r\n\
             <html><head><meta charset=3D\"utf-8\"></head><body>\r\n\
             <p>Lock of order 42 expired.<br>\r\n\
             <br>\r\n\
             Acknowledge: <a href=3D\"https://kw.example/l/abc\">https://kw.example/l/abc<=\r\n\
             /a></p>\r\n\
             </body></html>\r\n\
             \r\n\
             --{b}--\r\n"
        );
        assert_eq!(got, expected, "\n{got}");
    }

    #[test]
    fn a_hostile_title_cannot_add_a_header_and_the_subject_is_bounded() {
        let title = format!(
            "Lock <\u{200B}script>\r\nBcc: evil@\u{200B}x\u{202E}gpj.exe\r\n\r\nbody{}",
            "k".repeat(10_000)
        );
        let got = bytes(&channel(Some("[kw]")), &message(&title, "text"));
        let head = &got[..got.find("\r\n\r\n").unwrap()];
        assert!(!head.contains("\r\nBcc"), "{head}");
        assert!(head.lines().all(|l| l.len() <= 78), "{head}");
        let s = subject(&channel(Some("[kw]")), &title);
        assert!(s.starts_with("[kw] Lock <\u{200B}script> Bcc: evil@\u{200B}xgpj.exe bodykkk"), "{s}");
        assert_eq!(s.chars().count(), mail::SUBJECT_CHARS + 1);
        assert!(s.ends_with("k…"));
        assert_eq!(subject(&channel(None), "  a\t\tb \n"), "a b");
    }

    #[test]
    fn the_html_part_escapes_everything_and_links_only_real_links() {
        let msg = message(
            "t",
            "<b>&'\"</b> http:\u{200B}//evil.example\n\u{202E}\u{0}x\nAcknowledge: https://kw.example/l/a?b=1&c=2",
        );
        assert_eq!(
            html_body(&msg),
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n\
             <p>&lt;b&gt;&amp;&#39;&quot;&lt;/b&gt; http:\u{200B}//evil.example<br>\n\
             \u{FFFD}\u{FFFD}x<br>\n\
             Acknowledge: <a href=\"https://kw.example/l/a?b=1&amp;c=2\">https://kw.example/l/a?b=1&amp;c=2</a></p>\n\
             </body></html>\n"
        );
    }

    #[test]
    fn a_digest_is_a_list_saying_how_many_were_left_out() {
        let mut msg = message("t", "3 expired events:\n- a <1>\n- b\n… and 1 more");
        msg.digest = true;
        msg.count = 3;
        msg.items = ["a <1>", "b"]
            .iter()
            .map(|t| Item {
                event: json!({}),
                text: t.to_string(),
            })
            .collect();
        assert_eq!(
            html_body(&msg),
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n\
             <p>3 expired events:</p>\n<ul>\n<li>a &lt;1&gt;</li>\n<li>b</li>\n</ul>\n\
             <p>… and 1 more</p>\n</body></html>\n"
        );
        assert_eq!(plain_body(&msg), "3 expired events:\n- a <1>\n- b\n… and 1 more\n");
    }

    #[test]
    fn the_message_id_comes_from_the_idempotency_key() {
        let e = email();
        assert_eq!(
            e.message_id(&format!("{ID}:notify:mail")),
            format!("<{ID}.notify.mail@example.com>")
        );
        assert_eq!(id_left("a:digest:mail:12"), "a.digest.mail.12");
        assert_eq!(id_left("::a@@b..c::"), "a.b.c");
        assert_eq!(id_left(":::"), "keywatch");
        // A follow-up replies to the alert's mail on the same channel.
        let mut msg = message("t", "x");
        msg.items[0].event["followup"] = json!("escalation");
        msg.followup = Some(crate::channel::Followup {
            kind: crate::channel::FollowupKind::Escalation,
            alert_id: ID.to_string(),
        });
        msg.idempotency_key = format!("{ID}:escalate:mail");
        let got = bytes(&channel(None), &msg);
        let alert = format!("<{ID}.notify.mail@example.com>");
        assert!(got.contains(&format!("In-Reply-To: {alert}\r\n")), "{got}");
        assert!(got.contains(&format!("References: {alert}\r\n")), "{got}");
        assert!(got.contains(&format!("Message-ID: <{ID}.escalate.mail@example.com>\r\n")));
        // The same message gives the same bytes: a retry is the same mail.
        let again = message("t", "x");
        assert_eq!(bytes(&channel(None), &again), bytes(&channel(None), &again));
    }

    #[test]
    fn every_wire_form_of_the_password_is_masked() {
        let mut e = email();
        e.login = Some(Login {
            username: "kw".into(),
            password: Secret::new("pa55-word"),
        });
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let echoed = format!(
            "535 5.7.8 bad pa55-word {} {}",
            b64("pa55-word"),
            b64("\0kw\0pa55-word")
        );
        assert_eq!(
            e.mask(&echoed),
            "535 5.7.8 bad <secret> <secret> <secret>"
        );
        assert_eq!(email().mask("nothing to hide"), "nothing to hide");
    }

    #[test]
    fn the_target_names_the_relay_its_protection_and_the_recipients() {
        let mut e = email();
        assert_eq!(
            e.target(),
            "smtp://relay.example.com:587 (STARTTLS) to oncall@example.com, lead@example.com"
        );
        e.host = "::1".into();
        e.security = Security::None;
        e.port = 25;
        e.login = Some(Login {
            username: "kw".into(),
            password: Secret::new("x"),
        });
        assert!(e.target().starts_with("smtp://[::1]:25 (no TLS, AUTH) to "));
    }
}
