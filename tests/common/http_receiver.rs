//! A real HTTP/1.1 server for chat webhooks and reload targets, on std threads.
//!
//! It records every request exactly as it arrived (head bytes, header order and case, body bytes,
//! which connection carried it, when it arrived) and answers from a script: first the queued
//! responses in order, then the handler if one is set, then the default. It can go "down"
//! (listener closed, open connections cut) and come back on the same port, to simulate outages.
//! Keep-alive, `Content-Length` and chunked bodies, and `Expect: 100-continue` are supported.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use super::ports;

/// Largest request head accepted; a bigger one is a bug in the sender (or in this parser).
const MAX_HEAD: usize = 1 << 20;

/// One request as it arrived.
#[derive(Clone, Debug)]
pub struct Request {
    /// Position in arrival order over the receiver's whole life, from 0.
    pub index: usize,
    /// Which TCP connection carried it (equal ids: one kept-alive connection).
    pub connection: u64,
    pub method: String,
    /// The request target as sent: path with query, e.g. `/robot/send?access_token=x&sign=y`.
    pub target: String,
    /// `HTTP/1.1`.
    pub version: String,
    /// Header names and values in the order and case they were sent.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked if it was sent chunked.
    pub body: Vec<u8>,
    /// Whether the body came with `Transfer-Encoding: chunked`.
    pub chunked: bool,
    /// Request line and headers, byte for byte, including the final empty line.
    pub raw_head: Vec<u8>,
    /// When the whole request had been read.
    pub received_at: SystemTime,
    pub received_instant: Instant,
}

impl Request {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of header `name` (case-insensitive), in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The target without its query.
    pub fn path(&self) -> &str {
        self.target
            .split_once('?')
            .map_or(&self.target, |(path, _)| path)
    }

    /// The raw query string (after `?`), if any.
    pub fn query(&self) -> Option<&str> {
        self.target.split_once('?').map(|(_, query)| query)
    }

    /// The first value of query parameter `name`, percent-decoded (`+` is a space).
    pub fn query_param(&self, name: &str) -> Option<String> {
        url::form_urlencoded::parse(self.query()?.as_bytes())
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.into_owned())
    }

    /// The body as UTF-8; panics (showing the bytes) when it is not.
    pub fn body_str(&self) -> &str {
        std::str::from_utf8(&self.body)
            .unwrap_or_else(|e| panic!("request body is not UTF-8 ({e}): {:?}", self.body))
    }

    /// The body parsed as JSON; panics (showing the body) when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "request body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// One line for diagnostics: `#3 conn 1 POST /path (42 bytes): {...}`.
    pub fn summary(&self) -> String {
        let body = String::from_utf8_lossy(&self.body);
        let body: String = body.chars().take(400).collect();
        format!(
            "#{} conn {} {} {} ({} bytes): {body}",
            self.index,
            self.connection,
            self.method,
            self.target,
            self.body.len()
        )
    }
}

/// What the receiver answers to one request.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Wait this long before answering (to make a sender time out).
    pub delay: Option<Duration>,
    /// Answer with `Connection: close` and close the connection afterwards.
    pub close: bool,
    /// Close the connection without answering at all.
    pub drop_connection: bool,
}

impl Response {
    /// Status `status`, empty body.
    pub fn status(status: u16) -> Response {
        Response {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            delay: None,
            close: false,
            drop_connection: false,
        }
    }

    /// 200 with `body`.
    pub fn ok_body(body: impl AsRef<[u8]>) -> Response {
        Response::status(200).body(body)
    }

    /// 200 with a JSON body and `Content-Type: application/json`.
    pub fn json(value: &serde_json::Value) -> Response {
        Response::status(200)
            .header("Content-Type", "application/json")
            .body(value.to_string())
    }

    /// Close the connection as soon as the request has been read, without answering.
    pub fn drop_connection() -> Response {
        Response {
            drop_connection: true,
            ..Response::status(0)
        }
    }

    pub fn body(mut self, body: impl AsRef<[u8]>) -> Response {
        self.body = body.as_ref().to_vec();
        self
    }

    /// Adds a header. `Content-Length` is added automatically unless given here.
    pub fn header(mut self, name: &str, value: &str) -> Response {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn delay(mut self, delay: Duration) -> Response {
        self.delay = Some(delay);
        self
    }

    pub fn close(mut self) -> Response {
        self.close = true;
        self
    }

    fn to_bytes(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status)).into_bytes();
        for (name, value) in &self.headers {
            out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        if !self
            .headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        if self.close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !head_only {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

type Handler = Arc<dyn Fn(&Request) -> Option<Response> + Send + Sync>;

struct State {
    requests: Vec<Request>,
    scripted: VecDeque<Response>,
    default: Response,
    handler: Option<Handler>,
    /// What the test asked for.
    up: bool,
    /// What the accept thread has done about it: whether a listener is bound right now.
    listening: bool,
    bind_error: Option<String>,
    shutdown: bool,
    connections: HashMap<u64, TcpStream>,
    /// The client's address of each connection in `connections`, from its accept until its
    /// thread has recorded its last request.
    peers: HashMap<u64, SocketAddr>,
    next_connection: u64,
}

struct Inner {
    port: u16,
    state: Mutex<State>,
    changed: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking connection thread must not take every later assertion down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A recording HTTP/1.1 server on a free loopback port; see the module docs.
pub struct HttpReceiver {
    inner: Arc<Inner>,
    accept_thread: Mutex<Option<JoinHandle<()>>>,
}

impl HttpReceiver {
    /// A receiver whose default answer is 200 with body `ok` (Slack's success answer).
    pub fn start() -> HttpReceiver {
        HttpReceiver::with_default(Response::ok_body("ok"))
    }

    /// A receiver that answers `default` when nothing is scripted.
    pub fn with_default(default: Response) -> HttpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the HTTP receiver");
        let port = listener.local_addr().expect("receiver local_addr").port();
        ports::reserve(port);
        let inner = Arc::new(Inner {
            port,
            state: Mutex::new(State {
                requests: Vec::new(),
                scripted: VecDeque::new(),
                default,
                handler: None,
                up: true,
                listening: true,
                bind_error: None,
                shutdown: false,
                connections: HashMap::new(),
                peers: HashMap::new(),
                next_connection: 1,
            }),
            changed: Condvar::new(),
        });
        let thread_inner = Arc::clone(&inner);
        let accept_thread = std::thread::Builder::new()
            .name(format!("http-receiver-{port}"))
            .spawn(move || accept_loop(thread_inner, listener))
            .expect("spawn the receiver's accept thread");
        HttpReceiver {
            inner,
            accept_thread: Mutex::new(Some(accept_thread)),
        }
    }

    pub fn port(&self) -> u16 {
        self.inner.port
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.inner.port)
    }

    /// `http://127.0.0.1:PORT/path` (a leading `/` is optional).
    pub fn url_for(&self, path: &str) -> String {
        format!("{}/{}", self.url(), path.trim_start_matches('/'))
    }

    /// Queues a response: queued responses are used first, in order, one per request.
    pub fn push(&self, response: Response) {
        self.inner.lock().scripted.push_back(response);
    }

    /// The answer when nothing is queued and the handler (if any) declines.
    pub fn set_default(&self, response: Response) {
        self.inner.lock().default = response;
    }

    /// Decides per request after the queue is empty; `None` falls back to the default.
    pub fn set_handler(
        &self,
        handler: impl Fn(&Request) -> Option<Response> + Send + Sync + 'static,
    ) {
        self.inner.lock().handler = Some(Arc::new(handler));
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        self.inner.lock().requests.clone()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().requests.len()
    }

    /// Waits until at least `n` requests have arrived and returns all of them (maybe more than
    /// `n`). Panics after `timeout`, listing what did arrive.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Request> {
        self.wait_until(&format!("{n} request(s)"), timeout, |requests| {
            requests.len() >= n
        })
    }

    /// For "nothing more arrived" without sleeping: the test has sent each of `sentinels` (say,
    /// keys that expire) through the same pipeline after everything else, so whatever the
    /// earlier events were going to cause (a duplicate, a retry) comes before them. Waits until a
    /// request whose JSON body holds each sentinel as a string (`"lock:sentinel"`) has arrived,
    /// asserts that each came once, and returns every other request so far, in arrival order.
    pub fn wait_past<S: AsRef<str>>(&self, sentinels: &[S], timeout: Duration) -> Vec<Request> {
        let sentinels: Vec<String> = sentinels
            .iter()
            .map(|s| format!("\"{}\"", s.as_ref()))
            .collect();
        let holds = |r: &Request, s: &str| String::from_utf8_lossy(&r.body).contains(s);
        let requests = self.wait_until(&format!("the sentinels {sentinels:?}"), timeout, |rs| {
            sentinels.iter().all(|s| rs.iter().any(|r| holds(r, s)))
        });
        for s in &sentinels {
            let n = requests.iter().filter(|r| holds(r, s)).count();
            assert_eq!(n, 1, "sentinel {s:?} arrived {n} times");
        }
        requests
            .into_iter()
            .filter(|r| !sentinels.iter().any(|s| holds(r, s)))
            .collect()
    }

    /// Waits until `done` holds for the requests so far and returns them. Panics after `timeout`
    /// with `what`, listing what did arrive.
    pub fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Request]) -> bool,
    ) -> Vec<Request> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        while !done(&state.requests) {
            let now = Instant::now();
            if now >= deadline {
                let got: Vec<String> = state.requests.iter().map(Request::summary).collect();
                panic!(
                    "HTTP receiver {} expected {what} within {timeout:?}, got {}:\n{}",
                    self.url(),
                    got.len(),
                    got.join("\n")
                );
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        state.requests.clone()
    }

    /// The client addresses of the connections being served: from the accept until the peer
    /// has closed its end (or the receiver cut it) and every request read from it is recorded.
    pub fn open_peers(&self) -> Vec<SocketAddr> {
        self.inner.lock().peers.values().copied().collect()
    }

    /// Returns once every connection made to this receiver before the call has been accepted
    /// (and shows in [`HttpReceiver::open_peers`] until it is read to its end): connects once
    /// more and waits until the accept loop has taken that connection, since the listener hands
    /// connections out in the order they came. Panics after `timeout`.
    pub fn accept_pending(&self, timeout: Duration) {
        let probe = TcpStream::connect(("127.0.0.1", self.inner.port))
            .unwrap_or_else(|e| panic!("connect to the receiver {}: {e}", self.url()));
        let me = probe
            .local_addr()
            .expect("local_addr of a connected socket");
        self.wait_state("accepted every connection made so far", timeout, |state| {
            state.peers.values().any(|p| *p == me)
        });
    }

    /// Waits until `done` holds for the state; panics after `timeout` with `what`.
    fn wait_state(&self, what: &str, timeout: Duration, done: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        while !done(&state) {
            let now = Instant::now();
            assert!(
                now < deadline,
                "HTTP receiver {}: not {what} within {timeout:?}",
                self.url()
            );
            state = self
                .inner
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Outage: closes the listener (new connections are refused) and cuts open connections.
    /// Returns once the port no longer accepts.
    pub fn down(&self) {
        {
            let mut state = self.inner.lock();
            state.up = false;
            for (_, stream) in state.connections.drain() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.inner.changed.notify_all();
        // Wake the blocking accept so that it sees `up == false` and drops the listener.
        let _ = TcpStream::connect(("127.0.0.1", self.inner.port));
        let mut state = self.inner.lock();
        while state.listening {
            state = self
                .inner
                .changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Ends an outage: listens on the same port again. Returns once it accepts.
    pub fn up(&self) {
        self.inner.lock().up = true;
        self.inner.changed.notify_all();
        let mut state = self.inner.lock();
        while !state.listening {
            if let Some(error) = state.bind_error.take() {
                panic!("HTTP receiver could not listen on its port again: {error}");
            }
            state = self
                .inner
                .changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn is_up(&self) -> bool {
        self.inner.lock().up
    }
}

impl Drop for HttpReceiver {
    fn drop(&mut self) {
        {
            let mut state = self.inner.lock();
            state.shutdown = true;
            for (_, stream) in state.connections.drain() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        self.inner.changed.notify_all();
        let _ = TcpStream::connect(("127.0.0.1", self.inner.port));
        if let Some(thread) = self
            .accept_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = thread.join();
        }
    }
}

fn accept_loop(inner: Arc<Inner>, first: TcpListener) {
    let mut listener = Some(first);
    // The port while the receiver is down, held so that no other process binds it meanwhile.
    let mut held: Option<socket2::Socket> = None;
    loop {
        let current = match listener.take() {
            Some(l) => l,
            None => {
                let mut state = inner.lock();
                while !state.up && !state.shutdown {
                    state = inner.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                if state.shutdown {
                    return;
                }
                drop(state);
                drop(held.take());
                let bound = rebind(inner.port);
                let mut state = inner.lock();
                match bound {
                    Ok(l) => {
                        state.listening = true;
                        drop(state);
                        inner.changed.notify_all();
                        l
                    }
                    Err(e) => {
                        state.bind_error = Some(e);
                        state.up = false;
                        drop(state);
                        inner.changed.notify_all();
                        continue;
                    }
                }
            }
        };
        for stream in current.incoming() {
            let Ok(stream) = stream else { continue };
            let mut state = inner.lock();
            if state.shutdown || !state.up {
                break;
            }
            let id = state.next_connection;
            state.next_connection += 1;
            match stream.try_clone() {
                Ok(clone) => {
                    state.connections.insert(id, clone);
                }
                Err(_) => continue,
            }
            if let Ok(peer) = stream.peer_addr() {
                state.peers.insert(id, peer);
            }
            drop(state);
            inner.changed.notify_all();
            let conn_inner = Arc::clone(&inner);
            let spawned = std::thread::Builder::new()
                .name(format!("http-receiver-{}-conn-{id}", inner.port))
                .spawn(move || {
                    serve_connection(&conn_inner, id, stream);
                    let mut state = conn_inner.lock();
                    state.connections.remove(&id);
                    state.peers.remove(&id);
                    drop(state);
                    conn_inner.changed.notify_all();
                });
            if spawned.is_err() {
                let mut state = inner.lock();
                state.connections.remove(&id);
                state.peers.remove(&id);
            }
        }
        drop(current);
        held = ports::hold(inner.port);
        let mut state = inner.lock();
        state.listening = false;
        let shutdown = state.shutdown;
        drop(state);
        inner.changed.notify_all();
        if shutdown {
            return;
        }
    }
}

/// Binds the receiver's port again after an outage, waiting out a slow release of the port.
fn rebind(port: u16) -> Result<TcpListener, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpListener::bind(("127.0.0.1", port)) {
            Ok(listener) => return Ok(listener),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("bind 127.0.0.1:{port}: {e}"));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Serves requests on one connection until the peer closes it, a response closes it, or the
/// receiver cuts it.
fn serve_connection(inner: &Inner, connection: u64, stream: TcpStream) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let Some(raw_head) = read_head(&mut reader) else {
            return;
        };
        let Some(mut request) = parse_head(raw_head, connection) else {
            let _ = writer.write_all(&Response::status(400).close().to_bytes(false));
            return;
        };
        if request
            .header("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
        {
            let _ = writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        let body = if request
            .header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
        {
            request.chunked = true;
            read_chunked(&mut reader)
        } else {
            match request
                .header("content-length")
                .map(|v| v.trim().parse::<usize>())
            {
                None => Some(Vec::new()),
                Some(Ok(len)) => {
                    let mut body = vec![0; len];
                    reader.read_exact(&mut body).ok().map(|()| body)
                }
                Some(Err(_)) => None,
            }
        };
        let Some(body) = body else { return };
        request.body = body;
        request.received_at = SystemTime::now();
        request.received_instant = Instant::now();

        let wants_close = request
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
            || (request.version == "HTTP/1.0"
                && !request
                    .header("connection")
                    .is_some_and(|v| v.eq_ignore_ascii_case("keep-alive")));
        let head_only = request.method == "HEAD";

        let (queued, handler, default) = {
            let mut state = inner.lock();
            request.index = state.requests.len();
            state.requests.push(request.clone());
            let queued = state.scripted.pop_front();
            (queued, state.handler.clone(), state.default.clone())
        };
        inner.changed.notify_all();
        let mut response = queued
            .or_else(|| handler.and_then(|h| h(&request)))
            .unwrap_or(default);

        if let Some(delay) = response.delay {
            std::thread::sleep(delay);
        }
        if response.drop_connection {
            let _ = writer.shutdown(Shutdown::Both);
            return;
        }
        response.close |= wants_close;
        if writer.write_all(&response.to_bytes(head_only)).is_err() || writer.flush().is_err() {
            return;
        }
        if response.close {
            let _ = writer.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// Reads up to and including the empty line that ends a request head. `None` at end of stream
/// or on an oversized head.
fn read_head(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    loop {
        let start = head.len();
        let read = reader.read_until(b'\n', &mut head).ok()?;
        if read == 0 || head.len() > MAX_HEAD {
            return None;
        }
        let line = &head[start..];
        if line == b"\r\n" || line == b"\n" {
            if start == 0 {
                // Tolerate a stray empty line between requests (RFC 9112 §2.2).
                head.clear();
                continue;
            }
            return Some(head);
        }
    }
}

fn parse_head(raw_head: Vec<u8>, connection: u64) -> Option<Request> {
    let text = String::from_utf8_lossy(&raw_head).into_owned();
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let mut request_line = lines.next()?.splitn(3, ' ');
    let method = request_line.next()?.to_owned();
    let target = request_line.next()?.to_owned();
    let version = request_line.next()?.to_owned();
    let mut headers = Vec::new();
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':')?;
        headers.push((name.to_owned(), value.trim().to_owned()));
    }
    Some(Request {
        index: 0,
        connection,
        method,
        target,
        version,
        headers,
        body: Vec::new(),
        chunked: false,
        raw_head,
        received_at: SystemTime::now(),
        received_instant: Instant::now(),
    })
}

fn read_chunked(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut size_line = String::new();
        if reader.read_line(&mut size_line).ok()? == 0 {
            return None;
        }
        let size_text = size_line.trim().split(';').next()?.trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        if size == 0 {
            // Trailers, then the empty line.
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).ok()? == 0 || line.trim().is_empty() {
                    return Some(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).ok()?;
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf).ok()?;
    }
}

/// The keys of webhook requests (keywatch's JSON payload), each with how often it came and
/// whether (the last time) it was recovered.
pub fn delivered(requests: &[Request]) -> std::collections::BTreeMap<String, (usize, bool)> {
    let mut out: std::collections::BTreeMap<String, (usize, bool)> = Default::default();
    for r in requests {
        let j = r.json();
        let e = out
            .entry(j["key"].as_str().unwrap().to_string())
            .or_default();
        e.0 += 1;
        e.1 = j["recovered"].as_bool().unwrap();
    }
    out
}
