//! Turning settings into Redis clients: URL precedence, credentials, TLS, databases.
//!
//! Passwords reach redis-rs and nothing else: every error and log line names a node by
//! `host:port` only.

use std::path::Path;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use crate::config::{RedisSettings, Secret};

pub const DEFAULT_URL: &str = "redis://127.0.0.1:6379";

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(
        "the Redis URL is not valid: {0} (expected e.g. `redis://127.0.0.1:6379`, `rediss://user:pass@host:6380/0`)"
    )]
    BadUrl(String),
    #[error("TLS: {0}")]
    Tls(String),
}

/// docs/commands.md: `--redis`, then `KEYWATCH_REDIS_URL`, then `redis.url` in the rules, then the default.
pub fn pick_url(flag: Option<&str>, env: Option<String>, settings: &RedisSettings) -> Secret {
    if let Some(u) = flag {
        return Secret::new(u);
    }
    if let Some(u) = env.filter(|u| !u.is_empty()) {
        return Secret::new(u);
    }
    settings
        .url
        .clone()
        .unwrap_or_else(|| Secret::new(DEFAULT_URL))
}

/// Whether `url` asks for TLS (`rediss://`).
pub fn is_tls(url: &Secret) -> bool {
    url.expose().starts_with("rediss://")
}

/// `error`, from connecting to `url`, with what to check when it is a TLS problem. The TLS
/// layer's own words ("invalid peer certificate: UnknownIssuer", a time-out) do not say which
/// setting is wrong.
pub fn explain(url: &Secret, error: &redis::RedisError) -> String {
    if let Some(not_redis) = not_redis(url, error) {
        return not_redis;
    }
    format!("{error}{}", tls_hint(url, error))
}

/// What to say when the server at `url` answered, but not in Redis's protocol (RESP): an HTTP
/// server, say, whose `HTTP/1.1 400` redis-rs reports as `Parse error at 1 / Unexpected 33`,
/// which names neither the server nor the likely mistake. `None` for every other error.
pub fn not_redis(url: &Secret, error: &redis::RedisError) -> Option<String> {
    let parse =
        error.kind() == redis::ErrorKind::Parse || error.to_string().contains("Parse error");
    if !parse {
        return None;
    }
    let port = url::Url::parse(url.expose())
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(6379);
    Some(format!(
        "the server does not answer as a Redis server (is {port} the right port?)"
    ))
}

/// What [`explain`] appends: `""`, or what to check, in parentheses after a space.
pub fn tls_hint(url: &Secret, error: &redis::RedisError) -> &'static str {
    let text = error.to_string();
    if text.contains("invalid peer certificate") {
        " (TLS: the server's certificate is not trusted: set `redis.tls.ca_file` to the CA that signed it, and connect by a name or address the certificate lists)"
    } else if text.contains("CertificateRequired") || text.contains("certificate required") {
        " (TLS: the server asks for a client certificate: set `redis.tls.cert_file` and `redis.tls.key_file`)"
    } else if is_tls(url) && (error.is_timeout() || text.contains("timed out")) {
        // A plain server reads the TLS hello as a command and waits for the rest of it.
        " (`rediss://` expects TLS: is this the server's `tls-port`?)"
    } else if !is_tls(url) && text.contains("Connection reset by peer") {
        // A TLS port drops a client whose first bytes are not a TLS hello.
        " (if the server speaks TLS on this port, use `rediss://`)"
    } else {
        ""
    }
}

/// `host:port` of a URL, safe to print.
pub fn node_name(info: &ConnectionInfo) -> String {
    info.addr().to_string()
}

/// A resilient connection from `client`, with the one retry policy of every connection keywatch
/// keeps (watched databases, the state Redis, the admin commands). redis-rs's default retries six
/// times with growing pauses, so a wrong password or an untrusted certificate took long enough
/// to end in the caller's time-out instead of being reported as what it is.
pub async fn manager(client: &redis::Client) -> redis::RedisResult<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(10)))
        .set_number_of_retries(3)
        .set_max_delay(Duration::from_secs(2));
    client.get_connection_manager_with_config(config).await
}

/// A client for database `db` of the node at `url`, with `redis.username`/`redis.password` when
/// the URL carries none, and the TLS files of `redis.tls` for `rediss://`.
pub fn client(
    url: &Secret,
    settings: &RedisSettings,
    db: u32,
) -> Result<(redis::Client, String), ConnectError> {
    client_at(url, settings, db, None)
}

/// As [`client`], for the node at `at` (host, port) instead of the URL's: a cluster's other
/// nodes take the seed URL's credentials and TLS settings.
pub fn client_at(
    url: &Secret,
    settings: &RedisSettings,
    db: u32,
    at: Option<(&str, u16)>,
) -> Result<(redis::Client, String), ConnectError> {
    let info = connection_info(url, settings, db)?;
    let info = match at {
        None => info,
        Some((host, port)) => at_addr(info, host, port),
    };
    let name = node_name(&info);
    let client = match tls_files(url, settings)? {
        // These errors are about the certificate files (PEM that does not parse), never the URL.
        Some(certs) => redis::Client::build_with_tls(info, certs)
            .map_err(|e| ConnectError::Tls(e.to_string()))?,
        None => redis::Client::open(info)
            .map_err(|e| ConnectError::BadUrl(format!("{:?}", e.kind())))?,
    };
    Ok((client, name))
}

/// `info` for the node at `host:port`, keeping its scheme and TLS parameters.
fn at_addr(info: ConnectionInfo, host: &str, port: u16) -> ConnectionInfo {
    let addr = match info.addr().clone() {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.to_string(),
            port,
            insecure,
            tls_params,
        },
        _ => ConnectionAddr::Tcp(host.to_string(), port),
    };
    info.set_addr(addr)
}

/// A client for the sentinel at `addr` (`host:port`): TLS as the URL says (with the files of
/// `redis.tls`), but the sentinels' own password (`redis.sentinel.password`) and no user or
/// database of the URL's, which are the data nodes'.
pub fn sentinel_client(
    url: &Secret,
    settings: &RedisSettings,
    addr: &str,
    password: Option<&Secret>,
) -> Result<redis::Client, ConnectError> {
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .ok_or_else(|| ConnectError::BadUrl(format!("sentinel `{addr}` is not host:port")))?;
    let info = at_addr(connection_info(url, settings, 0)?, host, port);
    let mut redis_info = redis::RedisConnectionInfo::default();
    if let Some(p) = password {
        redis_info = redis_info.set_password(p.expose());
    }
    let info = info.set_redis_settings(redis_info);
    match tls_files(url, settings)? {
        Some(certs) => {
            redis::Client::build_with_tls(info, certs).map_err(|e| ConnectError::Tls(e.to_string()))
        }
        None => {
            redis::Client::open(info).map_err(|e| ConnectError::BadUrl(format!("{:?}", e.kind())))
        }
    }
}

/// A client for the whole cluster the URL's node is part of (commands go to the node owning
/// their key, following MOVED and failovers by itself).
pub fn cluster_client(
    url: &Secret,
    settings: &RedisSettings,
) -> Result<redis::cluster::ClusterClient, ConnectError> {
    let info = connection_info(url, settings, 0)?;
    let mut builder = redis::cluster::ClusterClientBuilder::new(vec![info])
        .connection_timeout(Duration::from_secs(5))
        .response_timeout(Duration::from_secs(10));
    if let Some(certs) = tls_files(url, settings)? {
        builder = builder.certs(certs);
    }
    builder
        .build()
        .map_err(|e| ConnectError::BadUrl(format!("{:?}", e.kind())))
}

/// The URL with `redis.username`/`redis.password` when it carries none, for database `db`.
fn connection_info(
    url: &Secret,
    settings: &RedisSettings,
    db: u32,
) -> Result<ConnectionInfo, ConnectError> {
    let info: ConnectionInfo = url
        .expose()
        .into_connection_info()
        // redis-rs errors may quote the URL, password included; say only that it is wrong.
        .map_err(|_| ConnectError::BadUrl("it does not parse".into()))?;
    let mut redis_info = info.redis_settings().clone();
    if redis_info.username().is_none()
        && let Some(u) = &settings.username
    {
        redis_info = redis_info.set_username(u);
    }
    if redis_info.password().is_none()
        && let Some(p) = &settings.password
    {
        redis_info = redis_info.set_password(p.expose());
    }
    redis_info = redis_info.set_db(i64::from(db));
    Ok(info.set_redis_settings(redis_info))
}

/// The certificates of `redis.tls` for a `rediss://` URL, when files are given.
fn tls_files(
    url: &Secret,
    settings: &RedisSettings,
) -> Result<Option<redis::TlsCertificates>, ConnectError> {
    let files = match (&settings.tls, is_tls(url)) {
        (Some(files), true) if files.ca_file.is_some() || files.cert_file.is_some() => files,
        _ => return Ok(None),
    };
    let root_cert = files
        .ca_file
        .as_deref()
        .map(read_certificates)
        .transpose()?;
    let client_tls = match (&files.cert_file, &files.key_file) {
        (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
            client_cert: read_certificates(c)?,
            client_key: read_pem(k)?,
        }),
        _ => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

fn read_pem(path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path)
        .map_err(|e| ConnectError::Tls(format!("cannot read {}: {e}", path.display())))
}

/// A PEM file that must hold at least one certificate. redis-rs takes a file without any as an
/// empty list, which for a CA file means trusting nothing and failing every handshake later with
/// a less telling "unknown issuer".
fn read_certificates(path: &Path) -> Result<Vec<u8>, ConnectError> {
    let pem = read_pem(path)?;
    if !pem
        .windows(CERTIFICATE_PEM.len())
        .any(|w| w == CERTIFICATE_PEM)
    {
        return Err(ConnectError::Tls(format!(
            "{} holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)",
            path.display()
        )));
    }
    Ok(pem)
}

const CERTIFICATE_PEM: &[u8] = b"-----BEGIN CERTIFICATE-----";

crate::keyspace::commands::declare! {
    /// The commands the Redis client sends on its own for the connections made here
    /// ([`crate::keyspace::commands`]): `SELECT` for a database other than 0, and on a cluster
    /// `CLUSTER SLOTS` to learn who serves what and `ASKING` to follow a slot being moved (and
    /// `AUTH`, which every user may send).
    [
        Use::new(
            Server::Watched,
            "select",
            "connections to the watched databases other than 0",
        )
        .access(Access::Write)
        .args("{db}")
        .when(When::OtherDatabase),
        Use::new(
            Server::Watched,
            "cluster|slots",
            "cluster connection: who serves each slot",
        )
        .when(When::Cluster),
        // It changes how the connection's next command is served.
        Use::new(
            Server::Watched,
            "asking",
            "cluster connection: follows a slot being moved",
        )
        .access(Access::Write)
        .when(When::Cluster),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Notifications, TlsFiles};

    fn settings(tls: Option<TlsFiles>) -> RedisSettings {
        RedisSettings {
            url: None,
            cluster: false,
            databases: vec![0],
            notifications: Notifications::Check,
            tls,
            username: None,
            password: None,
            sentinel: None,
        }
    }

    fn tls_error(url: &str, files: TlsFiles) -> String {
        match client(&Secret::new(url), &settings(Some(files)), 0) {
            Err(ConnectError::Tls(m)) => m,
            Err(other) => panic!("expected a TLS error, got {other}"),
            Ok(_) => panic!("expected a TLS error, got a client"),
        }
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let message = tls_error(
            "rediss://:hunter2@127.0.0.1:6380",
            TlsFiles {
                ca_file: Some(ca.clone()),
                ..TlsFiles::default()
            },
        );
        assert!(message.contains(&ca.display().to_string()), "{message}");
        assert!(message.contains("no PEM certificate"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn a_missing_key_file_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("client.pem");
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let key = dir.path().join("client.key");
        let message = tls_error(
            "rediss://127.0.0.1:6380",
            TlsFiles {
                ca_file: None,
                cert_file: Some(cert),
                key_file: Some(key.clone()),
            },
        );
        assert!(message.starts_with("cannot read "), "{message}");
        assert!(message.contains(&key.display().to_string()), "{message}");
    }

    #[test]
    fn tls_files_are_not_read_for_a_plain_url() {
        let files = TlsFiles {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..TlsFiles::default()
        };
        let made = client(
            &Secret::new("redis://127.0.0.1:6379"),
            &settings(Some(files)),
            3,
        );
        assert!(made.is_ok(), "a redis:// URL must not need the TLS files");
    }

    fn io_error(kind: std::io::ErrorKind, text: &str) -> redis::RedisError {
        redis::RedisError::from(std::io::Error::new(kind, text.to_owned()))
    }

    #[test]
    fn tls_failures_are_explained_with_the_setting_to_check() {
        let tls = Secret::new("rediss://127.0.0.1:6380");
        let plain = Secret::new("redis://127.0.0.1:6380");
        let untrusted = io_error(
            std::io::ErrorKind::InvalidData,
            "invalid peer certificate: UnknownIssuer",
        );
        assert!(explain(&tls, &untrusted).contains("set `redis.tls.ca_file`"));
        let no_client_cert = io_error(
            std::io::ErrorKind::InvalidData,
            "received fatal alert: CertificateRequired",
        );
        assert!(explain(&tls, &no_client_cert).contains("set `redis.tls.cert_file`"));
        let timeout = io_error(std::io::ErrorKind::TimedOut, "timed out");
        assert!(explain(&tls, &timeout).contains("is this the server's `tls-port`?"));
        assert_eq!(explain(&plain, &timeout), timeout.to_string());
        let reset = io_error(
            std::io::ErrorKind::ConnectionReset,
            "Connection reset by peer (os error 104)",
        );
        assert!(explain(&plain, &reset).contains("use `rediss://`"));
        let refused = io_error(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        assert_eq!(explain(&plain, &refused), refused.to_string());
    }

    #[test]
    fn a_server_that_does_not_speak_resp_is_named_as_such() {
        let url = Secret::new("redis://:hunter2@127.0.0.1:8080/0");
        let parse = redis::RedisError::from(redis::ParsingError::from("Unexpected `33`"));
        let said = explain(&url, &parse);
        assert_eq!(
            said,
            "the server does not answer as a Redis server (is 8080 the right port?)"
        );
        let refused = io_error(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        assert_eq!(not_redis(&url, &refused), None);
    }

    #[test]
    fn a_url_that_does_not_parse_is_reported_without_its_text() {
        let made = client(&Secret::new("rediss://:hunter2@[::1"), &settings(None), 0);
        match made {
            Err(e) => assert!(!e.to_string().contains("hunter2"), "{e}"),
            Ok(_) => panic!("a broken URL made a client"),
        }
    }
}
