//! The endpoint's connections: each is served by hyper with a header timeout and a bound on how
//! long an answer's write may wait on its client, and their number is bounded well below the
//! open-file limit, so that idle or slow clients can neither hold file descriptors forever nor
//! starve `/healthz` and delivery (docs/operations.md#exposing-the-endpoint).
//!
//! At the bound a new connection takes the place of the oldest one that is not in the middle of
//! a request (idle, or still sending its header): a slow client cannot lock out a probe. When
//! every connection is busy the new one is closed at once rather than left queued.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::throttled_log::Throttled;

/// How long a client may take to send a request header, counted from when the connection opens
/// or its previous answer ends: the idle timeout of kept-alive connections too.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a write of an answer may wait without the client taking a byte before the connection
/// is closed. hyper has no such timeout, and a client that sends its request and never reads the
/// answer would otherwise keep its connection, a slot of the bound, for as long as it likes.
/// Counted per write, not per answer: a client that keeps reading is not cut off in the middle of
/// a long answer. Prometheus gives up on a scrape after 10 s by default, so a scrape stalled this
/// long has been abandoned already.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections closed because their client stopped reading, logged once per period.
static STALLED: Throttled = Throttled::new(Duration::from_secs(10));

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
            serve_one(stream, peer, local, app, busy, cut, shutdown).await;
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
    peer: SocketAddr,
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
    let io = WriteBound::new(stream, WRITE_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        served = conn.as_mut() => {
            if let Err(e) = served
                && stalled(&e)
                && let Some(more) = STALLED.pass()
            {
                crate::internal_events::ClientStalled {
                    peer: &peer,
                    write_timeout_s: WRITE_TIMEOUT.as_secs(),
                    suppressed: more,
                }
                .emit();
            }
        }
        // Displaced to make room: dropping the connection closes it.
        _ = cut.cancelled() => {}
        _ = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
        }
    }
}

/// A write that waited [`WRITE_TIMEOUT`] for its client.
#[derive(Debug, thiserror::Error)]
#[error("the client took nothing of the answer for {0:?}")]
struct Stalled(Duration);

/// Whether hyper gave up on a connection because [`WriteBound`] cut it.
fn stalled(e: &hyper::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .is_some_and(|inner| inner.is::<Stalled>())
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A stream whose writes fail once one has waited `limit` without a byte taken. The timer runs
/// only while a write (or flush) is pending and starts over at every byte the socket takes.
struct WriteBound<S> {
    inner: S,
    limit: Duration,
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteBound<S> {
    fn new(inner: S, limit: Duration) -> WriteBound<S> {
        WriteBound {
            inner,
            limit,
            waiting: None,
        }
    }

    fn bound<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = None;
            return polled;
        }
        let limit = self.limit;
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, Stalled(limit))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteBound<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteBound<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bound(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.bound(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.bound(cx, polled)
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

    #[tokio::test(start_paused = true)]
    async fn a_write_that_no_one_reads_fails_after_the_limit() {
        use tokio::io::AsyncWriteExt;
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut w = WriteBound::new(ours, Duration::from_secs(10));
        let started = tokio::time::Instant::now();
        let e = w.write_all(&[b'x'; 1024]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.get_ref().is_some_and(|inner| inner.is::<Stalled>()));
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_is_never_cut_off_while_it_takes_bytes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (ours, mut theirs) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            loop {
                // Slower than the whole answer may take, faster than the limit per write.
                tokio::time::sleep(Duration::from_secs(9)).await;
                match theirs.read(&mut buf).await.unwrap() {
                    0 => return got,
                    n => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        let mut w = WriteBound::new(ours, Duration::from_secs(10));
        w.write_all(&[b'x'; 1024]).await.unwrap();
        w.shutdown().await.unwrap();
        drop(w);
        assert_eq!(reader.await.unwrap().len(), 1024);
    }

    #[test]
    fn the_bound_leaves_half_the_open_files_to_the_rest() {
        assert_eq!(bound_for(256), 128);
        assert_eq!(bound_for(1_048_576), 1024);
        assert_eq!(bound_for(4), 8);
    }
}
