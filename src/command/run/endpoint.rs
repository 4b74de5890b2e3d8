//! The HTTP endpoint of docs/operations.md#endpoints: `/metrics`, `/healthz`, `/readyz`, `POST /-/reload`, and the
//! status page `/`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

use super::connections::Arrival;
use crate::command::run::reload::{Cause, ReloadHandle};
use crate::metrics::Metrics;
use crate::source::ledger::Ledger;
use crate::status::Status;

/// Refused links are logged once per this period, with a count of the others.
static LINKS_REFUSED: super::throttled_log::Throttled =
    super::throttled_log::Throttled::new(std::time::Duration::from_secs(10));

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
    /// The state connection and prefix, for `/api/history` and the status page's recent
    /// firings; `None` in tests of the page alone.
    pub history: Option<(crate::keyspace::Conn, String)>,
    /// The job queue, whose gauges (`keywatch_queue_pending`, `keywatch_queue_due`) are read
    /// when someone looks (a scrape, the status page), not on a timer: an idle keywatch sends
    /// Redis nothing for them (docs/performance.md#an-idle-instance).
    pub queue: Option<crate::store::queue::Queue>,
    /// The messages quiet hours hold: `keywatch_held{channel}` and the status page's "held
    /// until 08:00, 14 messages", read when someone looks, as the queue's gauges are.
    pub held: Option<crate::store::held::HeldStore>,
    /// The watched Redis, where a link's silence is announced to every instance
    /// ([`crate::store::notices`]); `None` in tests of the page alone.
    pub watched: Option<crate::keyspace::Conn>,
}

impl Shared {
    /// Reads the queue's gauges and what quiet hours hold anew.
    async fn refresh_gauges(&self) {
        if let Some(q) = &self.queue {
            match q.counts().await {
                Ok(c) => {
                    self.metrics.queue_pending.set(c.pending);
                    self.metrics.queue_due.set(c.due);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Cannot read the queue's gauges; they keep their last values.")
                }
            }
        }
        if let Some(h) = &self.held {
            match h.groups().await {
                Ok(groups) => {
                    let held = crate::store::held::by_channel(&groups);
                    self.metrics
                        .held_by_channel(held.iter().map(|c| (c.channel.as_str(), c.count as i64)));
                    self.status.set_held(held);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Cannot read what quiet hours hold; the gauge keeps its last values.")
                }
            }
        }
    }
}

pub fn router(shared: Shared) -> Router {
    // Behind the `Host` check, `server.token` and (for a reload) the origin check.
    let protected = Router::new()
        .route("/", get(status_page))
        .route("/-/reload", post(reload))
        .route("/api/history", get(api_history))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            protect,
        ));
    Router::new()
        .merge(protected)
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/l/{token}", get(link_page).post(link_act))
        .with_state(shared)
}

/// The middleware in front of the protected routes.
pub async fn protect(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let config = s.status.config();
    let arrival = req.extensions().get::<Arrival>().copied();
    match super::access::check(
        req.method(),
        req.uri().path(),
        req.headers(),
        arrival,
        config.as_deref(),
    ) {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            refusal.log();
            refusal.response()
        }
    }
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    s.metrics.ready.set(i64::from(s.status.ready()));
    s.refresh_gauges().await;
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn status_page(State(s): State<Shared>) -> impl IntoResponse {
    s.refresh_gauges().await;
    let config = s.status.config();
    let upcoming = super::status_page::upcoming(s.ledger.as_ref(), config.as_deref()).await;
    let silences = s.silences.as_ref().map(|a| a.current()).unwrap_or_default();
    let recent = super::status_page::recent_firings(&s.status, s.history.as_ref()).await;
    let page = super::status_page::render(
        &s.status,
        &s.metrics,
        &upcoming,
        &silences,
        &recent,
        chrono::Utc::now(),
    );
    ([(header::CACHE_CONTROL, "no-store")], Html(page))
}

/// The claim of a signed link, or the 403 page that refuses it (forged, expired, or no `links`
/// configured). The reason is logged, not shown.
fn link_claim(
    s: &Shared,
    token: &str,
) -> Result<crate::links::Claim, Box<axum::response::Response>> {
    let refused = || {
        Box::new(
            (
                StatusCode::FORBIDDEN,
                [(header::CACHE_CONTROL, "no-store")],
                Html(super::links_page::page(
                    "Link refused",
                    "This link is not valid or has expired.",
                    None,
                )),
            )
                .into_response(),
        )
    };
    let config = s.status.config().ok_or_else(refused)?;
    let links = config.links.as_ref().ok_or_else(refused)?;
    crate::links::verify(
        links.secret.expose().as_bytes(),
        token,
        crate::keyspace::clock::now_ms(),
    )
    .map_err(|why| {
        // Anyone can send forged links: one line per period, not one per request.
        if let Some(suppressed) = LINKS_REFUSED.pass() {
            crate::internal_events::LinkRefused {
                reason: &why,
                suppressed,
            }
            .emit();
        }
        refused()
    })
}

/// `GET /l/{token}`: what the link's button does; changes nothing (chat apps prefetch links).
async fn link_page(
    State(s): State<Shared>,
    axum::extract::Path(token): axum::extract::Path<String>,
) -> axum::response::Response {
    match link_claim(&s, &token) {
        Ok(claim) => {
            let key = match s.history.clone() {
                Some((mut conn, prefix)) => {
                    super::links_page::key_of(&mut conn, &prefix, &claim)
                        .await
                        .0
                }
                None => None,
            };
            (
                [(header::CACHE_CONTROL, "no-store")],
                Html(super::links_page::page(
                    "keywatch",
                    &claim.describe(key.as_deref()),
                    Some(super::links_page::button(claim.act)),
                )),
            )
                .into_response()
        }
        Err(refused) => *refused,
    }
}

/// `POST /l/{token}`: does what the link says, and says what it did.
async fn link_act(
    State(s): State<Shared>,
    axum::extract::Path(token): axum::extract::Path<String>,
) -> axum::response::Response {
    let claim = match link_claim(&s, &token) {
        Ok(c) => c,
        Err(refused) => return *refused,
    };
    let Some((conn, prefix)) = s.history.clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no state here\n").into_response();
    };
    match super::links_page::act(conn, &prefix, &claim, &token).await {
        Ok(done) => {
            tracing::info!(rule = %claim.rule, id = %claim.id, act = ?claim.act, "Acted on a signed link.");
            // Every instance reads silences again at once (an acknowledgement changes none).
            if let Some(mut w) = s.watched.clone() {
                let notice = crate::store::notices::Notice::Silences;
                if let Err(e) = crate::store::notices::publish(&mut w, &prefix, notice).await {
                    tracing::warn!(error = %e, "Cannot tell the other instances of a link's silence; they read it within 30 s.");
                }
            }
            (
                [(header::CACHE_CONTROL, "no-store")],
                Html(super::links_page::page("keywatch", &done, None)),
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Html(super::links_page::page(
                "Not done",
                &format!("Redis could not be reached ({e}); try again."),
                None,
            )),
        )
            .into_response(),
    }
}

/// `GET /api/history?key=PATTERN&rule=NAME&id=ID&since=DUR&limit=N`: the JSON of `keywatch history`,
/// as one array.
async fn api_history(
    State(s): State<Shared>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> axum::response::Response {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m + "\n").into_response();
    let Some((conn, prefix)) = s.history else {
        return (StatusCode::NOT_FOUND, "no history here\n").into_response();
    };
    let mut filter = crate::store::history::Filter {
        limit: 100,
        ..Default::default()
    };
    for (name, value) in url::form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match name.as_ref() {
            "key" => match crate::pattern::Pattern::parse(&value) {
                Ok(p) => filter.key = Some(p),
                Err(e) => return bad(format!("`key`: `{value}` is not a pattern: {e}")),
            },
            "rule" => filter.rule = Some(value.into_owned()),
            "id" => filter.id = Some(value.into_owned()),
            "since" => match crate::yaml::decode::parse_duration(&value) {
                Some(d) => filter.since = Some(d),
                None => return bad(format!("`since`: `{value}` is not a duration, e.g. `2h`")),
            },
            "limit" => match value.parse::<usize>() {
                Ok(n) if (1..=10_000).contains(&n) => filter.limit = n,
                _ => {
                    return bad(format!(
                        "`limit`: `{value}` is not a number from 1 to 10000"
                    ));
                }
            },
            other => {
                return bad(format!(
                    "unknown parameter `{other}`; use key, rule, id, since, limit"
                ));
            }
        }
    }
    match crate::store::history::list(&mut conn.clone(), &prefix, &filter).await {
        Ok(records) => {
            let list: Vec<serde_json::Value> = records.iter().map(|r| r.to_json()).collect();
            ([(header::CACHE_CONTROL, "no-store")], axum::Json(list)).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the history: {e}\n"),
        )
            .into_response(),
    }
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
    for why in s.status.blockers() {
        body.push_str(&format!("not ready: {why}\n"));
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

/// Serves the endpoint on `listener` with at most `bound` connections until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Shared,
    bound: usize,
    shutdown: CancellationToken,
) {
    super::connections::serve(listener, router(shared), bound, shutdown).await;
}
