//! Turning settings into Redis clients: URL precedence, credentials, TLS, databases.
//!
//! Passwords reach redis-rs and nothing else: every error and log line names a node by
//! `host:port` only.

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

/// SPEC §1: `--redis`, then `KEYWATCH_REDIS_URL`, then `redis.url` in the rules, then the default.
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

/// `host:port` of a URL, safe to print.
pub fn node_name(info: &ConnectionInfo) -> String {
    info.addr().to_string()
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
        Some((host, port)) => {
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
    };
    let name = node_name(&info);
    let client = match tls_files(url, settings)? {
        Some(certs) => redis::Client::build_with_tls(info, certs)
            .map_err(|e| ConnectError::Tls(format!("{:?}", e.kind())))?,
        None => redis::Client::open(info)
            .map_err(|e| ConnectError::BadUrl(format!("{:?}", e.kind())))?,
    };
    Ok((client, name))
}

/// A client for the whole cluster the URL's node is part of (commands go to the node owning
/// their key, following MOVED and failovers by itself).
pub fn cluster_client(
    url: &Secret,
    settings: &RedisSettings,
) -> Result<redis::cluster::ClusterClient, ConnectError> {
    let info = connection_info(url, settings, 0)?;
    let mut builder = redis::cluster::ClusterClientBuilder::new(vec![info])
        .connection_timeout(std::time::Duration::from_secs(5))
        .response_timeout(std::time::Duration::from_secs(10));
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
    let tls_url = url.expose().starts_with("rediss://");
    let files = match (&settings.tls, tls_url) {
        (Some(files), true) if files.ca_file.is_some() || files.cert_file.is_some() => files,
        _ => return Ok(None),
    };
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| ConnectError::Tls(format!("cannot read {}: {e}", p.display())))
    };
    let root_cert = files.ca_file.as_deref().map(read).transpose()?;
    let client_tls = match (&files.cert_file, &files.key_file) {
        (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
            client_cert: read(c)?,
            client_key: read(k)?,
        }),
        _ => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}
