//! The watched Redis as actions and matching see it: one resilient connection per database.
//!
//! Details are read and related keys deleted in the database of the event, so each database
//! gets its own `ConnectionManager` (a connection is bound to one database), made on first use.

use std::collections::HashMap;
use std::sync::Arc;

use redis::aio::ConnectionManager;
use tokio::sync::Mutex;

use crate::config::{RedisSettings, Secret};
use crate::connect::{self, ConnectError};

#[derive(Clone)]
pub struct Keyspace {
    inner: Arc<Inner>,
}

struct Inner {
    url: Secret,
    settings: RedisSettings,
    node: String,
    conns: Mutex<HashMap<u32, ConnectionManager>>,
}

impl Keyspace {
    /// Checks the URL now (so a bad one fails at start-up); connects on first use.
    pub fn new(url: Secret, settings: RedisSettings) -> Result<Keyspace, ConnectError> {
        let (_, node) = connect::client(&url, &settings, 0)?;
        if settings.tls.is_some() && !connect::is_tls(&url) {
            // Not an error: `--redis redis://…` may deliberately point rules written for a TLS
            // server at a local plain one. But the operator should know nothing is encrypted.
            tracing::warn!(redis = %node, "`redis.tls` is set but the Redis URL is not `rediss://`: the connection is not encrypted and the TLS files are not used.");
        }
        Ok(Keyspace {
            inner: Arc::new(Inner {
                url,
                settings,
                node,
                conns: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The URL, credentials included: for [`connect::explain`], never for printing.
    pub fn url(&self) -> &Secret {
        &self.inner.url
    }

    /// `host:port` of the node, safe to print.
    pub fn node(&self) -> &str {
        &self.inner.node
    }

    pub fn client(&self, db: u32) -> Result<redis::Client, ConnectError> {
        connect::client(&self.inner.url, &self.inner.settings, db).map(|(c, _)| c)
    }

    /// A connection to database `db` (cheap to clone; reconnects by itself).
    pub async fn conn(&self, db: u32) -> redis::RedisResult<ConnectionManager> {
        let mut conns = self.inner.conns.lock().await;
        if let Some(c) = conns.get(&db) {
            return Ok(c.clone());
        }
        let client = self.client(db).map_err(|e| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "bad Redis settings",
                e.to_string(),
            ))
        })?;
        let c = connect::manager(&client).await?;
        conns.insert(db, c.clone());
        Ok(c)
    }
}
