//! The endpoint's connections: each is served by hyper with a header timeout, and their number is
//! bounded well below the open-file limit, so that idle or slow clients can neither hold file
//! descriptors forever nor starve `/healthz` and delivery (docs/operations.md#exposing-the-endpoint).
//!
//! At the bound a new connection takes the place of the oldest one that is not in the middle of
//! a request (idle, or still sending its header): a slow client cannot lock out a probe. When
//! every connection is busy the new one is closed at once rather than left queued.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::throttled_log::Throttled;

/// How long a client may take to send a request header, counted from when the connection opens
/// or its previous answer ends: the idle timeout of kept-alive connections too.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connections get to finish their answer at shutdown.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The address a request arrived on, for the `Host` check of `server`.
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    pub local: SocketAddr,
}

/// The most connections at once for an open-file limit of `nofile`: half of it, so that the
/// other half stays for Redis, delivery and the rest; at most 1,024, which is plenty for
/// scrapes, probes and people.
pub fn bound_for(nofile: u64) -> usize {
    (nofile / 2).clamp(8, 1024) as usize
}

struct Open {
    /// Requests of this connection being answered (their answers included).
    busy: Arc<AtomicUsize>,
    cut: CancellationToken,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Open>,
}

/// What [`Table::admit`] decided.
enum Admission {
    In {
        id: u64,
        busy: Arc<AtomicUsize>,
        cut: CancellationToken,
        /// Whether an idle connection was closed to make room.
        displaced: bool,
    },
    /// Every connection is in a request: the new one is closed.
    Full,
}

impl Table {
    fn admit(&mut self, bound: usize) -> Admission {
        let mut displaced = false;
        if self.open.len() >= bound {
            let idle = self
                .open
                .iter()
                .find(|(_, o)| o.busy.load(Ordering::Acquire) == 0)
                .map(|(id, _)| *id);
            match idle {
                Some(id) => {
                    if let Some(o) = self.open.remove(&id) {
                        o.cut.cancel();
                    }
                    displaced = true;
                }
                None => return Admission::Full,
            }
        }
        let id = self.next;
        self.next += 1;
        let busy = Arc::new(AtomicUsize::new(0));
        let cut = CancellationToken::new();
        self.open.insert(
            id,
            Open {
                busy: busy.clone(),
                cut: cut.clone(),
            },
        );
        Admission::In {
            id,
            busy,
            cut,
            displaced,
        }
    }
}

/// Counts a request (and its answer, to its last byte) as in progress on its connection.
struct InRequest(Arc<AtomicUsize>);

impl InRequest {
    fn enter(busy: &Arc<AtomicUsize>) -> InRequest {
        busy.fetch_add(1, Ordering::AcqRel);
        InRequest(busy.clone())
    }
}

impl Drop for InRequest {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` with at most `bound` connections until `shutdown`.
pub async fn serve(listener: TcpListener, app: Router, bound: usize, shutdown: CancellationToken) {
    let table = Arc::new(Mutex::new(Table::default()));
    let tracker = TaskTracker::new();
    let refused = Throttled::new(Duration::from_secs(10));
    let displaced = Throttled::new(Duration::from_secs(10));
    let failing = Throttled::new(Duration::from_secs(10));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (or a connection reset before it was accepted): the
                // listener stays; wait a moment rather than spin on the same error.
                if let Some(more) = failing.pass() {
                    tracing::warn!(error = %e, suppressed = more, "Cannot accept an HTTP connection.");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admission = table.lock().unwrap_or_else(|p| p.into_inner()).admit(bound);
        let Admission::In {
            id,
            busy,
            cut,
            displaced: made_room,
        } = admission
        else {
            drop(stream);
            if let Some(more) = refused.pass() {
                tracing::warn!(%peer, bound, suppressed = more, "HTTP connection closed at once: all connections are answering requests.");
            }
            continue;
        };
        if made_room && let Some(more) = displaced.pass() {
            tracing::warn!(%peer, bound, suppressed = more, "HTTP connections at their bound: the oldest idle one was closed to take a new one.");
        }
        let local = stream.local_addr().ok();
        let app = app.clone();
        let table = table.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            serve_one(stream, local, app, busy, cut, shutdown).await;
            table
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
        });
    }
    tracker.close();
    let _ = tokio::time::timeout(CLOSE_GRACE, tracker.wait()).await;
}

async fn serve_one(
    stream: tokio::net::TcpStream,
    local: Option<SocketAddr>,
    app: Router,
    busy: Arc<AtomicUsize>,
    cut: CancellationToken,
    shutdown: CancellationToken,
) {
    let inner = TowerToHyperService::new(app);
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        if let Some(local) = local {
            req.extensions_mut().insert(Arrival { local });
        }
        let guard = InRequest::enter(&busy);
        let answer = hyper::service::Service::call(&inner, req);
        async move {
            let response = answer.await?;
            // The guard lives as long as the answer's body: a connection still sending a large
            // status page is not idle.
            Ok::<_, std::convert::Infallible>(response.map(move |body| {
                Body::new(body.map_frame(move |frame| {
                    let _ = &guard;
                    frame
                }))
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        // Displaced to make room: dropping the connection closes it.
        _ = cut.cancelled() => {}
        _ = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_bound_the_oldest_idle_connection_makes_room_and_busy_ones_never_do() {
        let mut t = Table::default();
        let Admission::In { busy: first, .. } = t.admit(2) else {
            panic!("room")
        };
        let Admission::In { cut: second, .. } = t.admit(2) else {
            panic!("room")
        };
        let _working = InRequest::enter(&first);
        let Admission::In { displaced, .. } = t.admit(2) else {
            panic!("the idle one makes room")
        };
        assert!(displaced);
        assert!(second.is_cancelled(), "the idle one, not the busy one");
        // Now the table holds the busy first and the new (idle) third: the third goes next.
        assert!(matches!(t.admit(2), Admission::In { .. }));
        let busy: Vec<_> = t.open.values().map(|o| o.busy.clone()).collect();
        let _all = busy.iter().map(InRequest::enter).collect::<Vec<_>>();
        assert!(matches!(t.admit(2), Admission::Full));
    }

    #[test]
    fn the_bound_leaves_half_the_open_files_to_the_rest() {
        assert_eq!(bound_for(256), 128);
        assert_eq!(bound_for(1_048_576), 1024);
        assert_eq!(bound_for(4), 8);
    }
}
