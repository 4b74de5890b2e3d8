//! The HTTP endpoint of SPEC §6: `/metrics`, `/healthz`, `/readyz`, `POST /-/reload`, and the
//! status page `/`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

use crate::command::run::reload::{Cause, ReloadHandle};
use crate::metrics::Metrics;
use crate::source::ledger::Ledger;
use crate::status::Status;

#[derive(Clone)]
pub struct Shared {
    pub metrics: Arc<Metrics>,
    pub status: Arc<Status>,
    /// For the upcoming expiries of the status page; `None` when keywatch keeps no ledger.
    pub ledger: Option<Ledger>,
    /// `None` where nothing can be reloaded (tests of the page alone).
    pub reload: Option<ReloadHandle>,
    /// The silences in force, for the status page; `None` in tests of the page alone.
    pub silences: Option<Arc<crate::engine::silences::Active>>,
}

pub fn router(shared: Shared) -> Router {
    Router::new()
        .route("/", get(status_page))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/-/reload", post(reload))
        .with_state(shared)
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn status_page(State(s): State<Shared>) -> impl IntoResponse {
    let config = s.status.config();
    let upcoming = super::status_page::upcoming(s.ledger.as_ref(), config.as_deref()).await;
    let silences = s.silences.as_ref().map(|a| a.current()).unwrap_or_default();
    let page = super::status_page::render(
        &s.status,
        &s.metrics,
        &upcoming,
        &silences,
        chrono::Utc::now(),
    );
    ([(header::CACHE_CONTROL, "no-store")], Html(page))
}

async fn readyz(State(s): State<Shared>) -> impl IntoResponse {
    let nodes = s.status.nodes();
    let mut body = String::new();
    for (node, up) in &nodes {
        let state = match (up, s.status.refusal(node)) {
            (true, _) => "subscribed".to_string(),
            (false, Some(why)) => format!("not watched: {why}"),
            (false, None) => "not subscribed".to_string(),
        };
        body.push_str(&format!("{node}: {state}\n"));
    }
    if s.status.ready() {
        (StatusCode::OK, format!("ready\n{body}"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{body}"),
        )
    }
}

/// Like Prometheus's `/-/reload`: 200 once the new rules are in force, 500 with the reasons when
/// the old ones stay.
async fn reload(State(s): State<Shared>) -> impl IntoResponse {
    let Some(handle) = s.reload else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "reloading is not available here\n".to_string(),
        );
    };
    match handle.reload(Cause::Http).await {
        Ok(summary) => (StatusCode::OK, format!("{summary}\n")),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failed to reload the rules; the old rules stay in force: {e}\n"),
        ),
    }
}

/// Binds `addr` now (so a taken port fails at start-up) and serves until `shutdown`.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

pub async fn serve(listener: tokio::net::TcpListener, shared: Shared, shutdown: CancellationToken) {
    let app = router(shared);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
    {
        tracing::error!(error = %e, "HTTP endpoint stopped.");
    }
}
