//! The HTTP endpoint under a hostile network (docs/operations.md#exposing-the-endpoint): idle and
//! slow clients, a token, `Host` and `Origin` checks, and signed links replayed or forged.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{HttpReceiver, Logs, PATIENCE, RedisServer};

/// keywatch's idle and header timeout (docs/operations.md#exposing-the-endpoint).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// `keywatch run` with its open-file limit (soft and hard) lowered to `nofile` before it starts,
/// so that a few hundred connections reach it.
fn run_with_nofile(
    redis: &RedisServer,
    rules: &std::path::Path,
    nofile: u64,
) -> common::KeywatchProcess {
    use std::os::unix::process::CommandExt;
    let mut command = common::keywatch_command(
        [
            "run".as_ref(),
            "-r".as_ref(),
            rules.as_os_str(),
            "--redis".as_ref(),
            redis.url().as_ref(),
            "--listen".as_ref(),
            "127.0.0.1:0".as_ref(),
        ] as [&std::ffi::OsStr; 7],
        &[],
    );
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let limit = rustix::process::Rlimit {
                current: Some(nofile),
                maximum: Some(nofile),
            };
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit)
                .map_err(std::io::Error::from)
        });
    }
    let mut kw = common::KeywatchProcess::from_command(command);
    kw.wait_for_event(common::SUBSCRIBED, "of the subscriber in place", |_| true);
    kw
}

/// (status, body) of a GET that gives up after `patience` (0 when it got no answer).
fn get_within(addr: &str, path: &str, patience: Duration) -> u16 {
    let Ok(mut conn) = TcpStream::connect(addr) else {
        return 0;
    };
    conn.set_read_timeout(Some(patience)).unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if conn.write_all(request.as_bytes()).is_err() {
        return 0;
    }
    let mut raw = String::new();
    let _ = conn.read_to_string(&mut raw);
    raw.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Whether the server has closed `conn` (end of stream or reset), waiting up to `patience`.
fn closed_by_server(conn: &mut TcpStream, patience: Duration) -> bool {
    conn.set_read_timeout(Some(patience)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            // An answer (408, 400) before the close is fine: keep reading to the end.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

/// Issue 36: under `ulimit -n 256`, 300 connections each sending half a request header made
/// `/healthz` fail and a webhook delivery fail (`cannot connect`) until they were released, and
/// idle connections were never closed.
#[test]
fn three_hundred_idle_connections_leave_healthz_and_delivery_working_and_are_cut_off() {
    let redis = RedisServer::with_events("Exg");
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::hook_rules(
        dir.path(),
        &receiver,
        "rules:\n  - name: locks\n    match: 'lock:{id}'\n    notify: { to: [hook] }\n",
    );
    let kw = run_with_nofile(&redis, &rules, 256);
    let addr = common::endpoint(&kw);

    let mut idle: Vec<TcpStream> = Vec::new();
    for _ in 0..300 {
        let mut c = TcpStream::connect(&addr).expect("connect");
        // Half a request header, never finished.
        let _ = c.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
        idle.push(c);
    }
    let opened = Instant::now();

    // At the bound, `/healthz` answers at once.
    assert_eq!(
        get_within(&addr, "/healthz", Duration::from_secs(5)),
        200,
        "/healthz did not answer with 300 idle connections open\n{}",
        kw.describe_output()
    );
    // And a webhook delivery goes out (it needs a file descriptor of its own).
    common::set_and_expire_now(&mut redis.conn(), &["lock:1"]);
    let got = receiver.wait_for(1, PATIENCE);
    assert_eq!(got[0].json()["key"], "lock:1", "{}", kw.describe_output());

    // Every idle connection is closed by keywatch once the header timeout has passed.
    for (i, c) in idle.iter_mut().enumerate() {
        let left = (HEADER_TIMEOUT + PATIENCE).saturating_sub(opened.elapsed());
        assert!(
            closed_by_server(c, left.max(Duration::from_millis(1))),
            "idle connection {i} is still open {:?} after it was opened",
            opened.elapsed()
        );
    }
    assert!(
        get_within(&addr, "/healthz", Duration::from_secs(5)) == 200,
        "{}",
        kw.describe_output()
    );
    // The limit in force and the bound taken from it are said at start.
    let listening = &kw.events("listening")[0];
    assert_eq!(listening["open_files"], "256", "{listening}");
    assert_eq!(listening["connections"], "128", "{listening}");
}

/// A client that connects and never sends anything is cut off after the header timeout, and
/// so is one that stays connected after its answer (keep-alive).
#[test]
fn a_silent_client_and_an_idle_kept_alive_one_are_cut_off() {
    let redis = RedisServer::with_events("Exg");
    let dir = tempfile::tempdir().unwrap();
    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [log] }\n",
    );
    let kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let addr = common::endpoint(&kw);
    let started = Instant::now();
    let mut silent = TcpStream::connect(&addr).unwrap();
    let mut kept = TcpStream::connect(&addr).unwrap();
    write!(kept, "GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    kept.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = [0u8; 512];
    let n = kept.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert!(closed_by_server(&mut silent, HEADER_TIMEOUT + PATIENCE));
    assert!(closed_by_server(&mut kept, HEADER_TIMEOUT + PATIENCE));
    assert!(
        started.elapsed() >= HEADER_TIMEOUT - Duration::from_secs(1),
        "cut off before the timeout: {:?}",
        started.elapsed()
    );
    drop(kw);
}

/// keywatch's bound on an answer's write that the client does not read
/// (docs/operations.md#exposing-the-endpoint).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Issue 36, left open after the header timeout: a client that sends its requests whole and
/// never reads the answers held its connection, a slot of the bound, for ever (the answer's
/// write waited on a full socket, and no timeout covered it).
#[test]
fn clients_that_never_read_their_answers_are_cut_off_and_healthz_still_answers() {
    let redis = RedisServer::with_events("Exg");
    let dir = tempfile::tempdir().unwrap();
    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [log] }\n",
    );
    let kw = common::run_subscribed(&redis.url(), &rules, Logs::Text, &[]);
    let addr = common::endpoint(&kw);

    // Pipelined requests for far more than the socket buffers of both ends hold (a few MB on
    // loopback while the reader reads nothing), so keywatch's write cannot finish.
    let one = common::get(&addr, "/metrics").1.len().max(1);
    let requests = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat((64 << 20) / one + 1);
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let conn = TcpStream::connect(&addr).expect("connect");
        let mut writer = conn.try_clone().unwrap();
        let requests = requests.clone();
        // Once keywatch stops reading the rest of the requests may not fit in the buffers
        // either: written from a thread, which ends with the connection.
        std::thread::spawn(move || {
            let _ = writer.write_all(requests.as_bytes());
        });
        stalled.push(conn);
    }

    assert_eq!(
        get_within(&addr, "/healthz", PATIENCE),
        200,
        "/healthz beside clients that read nothing\n{}",
        kw.describe_output()
    );
    common::poll(
        "a `client_stalled` event",
        WRITE_TIMEOUT + PATIENCE,
        || kw.events("client_stalled").first().cloned(),
        || kw.describe_output(),
    );
    for (i, conn) in stalled.iter_mut().enumerate() {
        // What was already in the buffers arrives first, then the end of the stream.
        assert!(
            read_to_close(conn, PATIENCE),
            "connection {i} is still open\n{}",
            kw.describe_output()
        );
    }
    assert_eq!(get_within(&addr, "/healthz", PATIENCE), 200);
}

/// Whether the server closes `conn`, reading whatever it sent before; gives up when nothing
/// arrives for `patience`.
fn read_to_close(conn: &mut TcpStream, patience: Duration) -> bool {
    conn.set_read_timeout(Some(patience)).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// (status, head, body) of one request with `headers` (each `Name: value`), `Connection: close`.
fn request(addr: &str, method: &str, path: &str, headers: &[&str]) -> (u16, String, String) {
    let mut conn = TcpStream::connect(addr).expect("connect to the HTTP endpoint");
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("host:"))
    {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("Content-Length: 0\r\nConnection: close\r\n\r\n");
    conn.write_all(head.as_bytes()).unwrap();
    let mut raw = String::new();
    let _ = conn.read_to_string(&mut raw);
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    (status, head.to_string(), body.to_string())
}

/// One kept-alive connection for many requests in a row.
struct KeptAlive {
    addr: String,
    reader: std::io::BufReader<TcpStream>,
    writer: TcpStream,
}

impl KeptAlive {
    fn open(addr: &str) -> KeptAlive {
        let conn = TcpStream::connect(addr).expect("connect to the HTTP endpoint");
        conn.set_read_timeout(Some(PATIENCE)).unwrap();
        // With Nagle's algorithm on, a request's second segment waited for the ACK of its
        // first, which the server delays by 40 ms: 2,000 round trips took 90 s, not 2.
        conn.set_nodelay(true).unwrap();
        KeptAlive {
            addr: addr.to_string(),
            reader: std::io::BufReader::new(conn.try_clone().unwrap()),
            writer: conn,
        }
    }

    /// The status of one request; its answer is read whole.
    fn round_trip(&mut self, method: &str, path: &str) -> u16 {
        use std::io::BufRead;
        let addr = &self.addr;
        // One write: `write!` on a socket sends each piece of the format as a segment.
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n");
        self.writer.write_all(request.as_bytes()).unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut len = 0;
        loop {
            line.clear();
            self.reader.read_line(&mut line).unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; len];
        self.reader.read_exact(&mut body).unwrap();
        status
    }
}

const TOKEN: &str = "endpoint-token-0123456789";
const LINK_SECRET: &str = "link-secret-0123456789";

fn protected_daemon(server_section: &str) -> common::Daemon {
    let yaml = format!(
        r#"{server_section}
links:
  base_url: "https://links.example.internal:8443/kw"
  secret: "${{LINK_SECRET}}"
channels:
  log: {{ type: log }}
rules:
  - name: locks
    match: "lock:{{id}}"
    notify: {{ to: [log] }}
"#
    );
    common::Daemon::start_with(
        RedisServer::with_events("Exg"),
        &yaml,
        &[("KW_TOKEN", TOKEN), ("LINK_SECRET", LINK_SECRET)],
    )
}

/// Issue 36: `POST /-/reload`, `/api/history` and `/` answered anyone, with any `Host` (a
/// DNS-rebinding page could read the history) and any `Origin` (a cross-site form could reload).
#[test]
fn with_a_token_the_status_page_history_and_reload_need_it_and_the_probes_stay_open() {
    let daemon =
        protected_daemon("server:\n  token: \"${KW_TOKEN}\"\n  hosts: [\"KeyWatch.internal\"]");
    let addr = common::endpoint(&daemon.process);
    let bearer = format!("Authorization: Bearer {TOKEN}");
    let wrong = format!("Authorization: Bearer {TOKEN}x");
    for (method, path) in [("GET", "/"), ("GET", "/api/history"), ("POST", "/-/reload")] {
        let (status, head, body) = request(&addr, method, path, &[]);
        assert_eq!(
            status, 401,
            "{method} {path} without a token: {head}\n{body}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{head}"
        );
        assert_eq!(
            request(&addr, method, path, &[&wrong]).0,
            401,
            "{method} {path}"
        );
        assert_eq!(
            request(&addr, method, path, &["Authorization: Basic a2V5OndhdGNo"]).0,
            401
        );
        let (status, _, body) = request(&addr, method, path, &[&bearer]);
        assert_eq!(status, 200, "{method} {path} with the token: {body}");
    }
    // Ready once the grants the rules need are checked, which under load can come after the
    // subscription the daemon was waited for (CI saw 503 here); a 401 would never become 200.
    common::wait_until("ready after the reload", PATIENCE, || {
        request(&addr, "GET", "/readyz", &[]).0 == 200
    });
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(request(&addr, "GET", path, &[]).0, 200, "{path} stays open");
        // Whatever the Host: Prometheus scrapes by pod address, probes by any name.
        assert_eq!(
            request(&addr, "GET", path, &["Host: anything.example"]).0,
            200
        );
    }
    // A signed link is its own capability: refused for being forged, not for lacking a token.
    assert_eq!(request(&addr, "GET", "/l/forged.link", &[]).0, 403);

    // Host: the listen address, loopback names on loopback, links.base_url's host, server.hosts.
    let port = addr.rsplit(':').next().unwrap();
    for host in [
        format!("Host: localhost:{port}"),
        "Host: links.example.internal".to_string(),
        "Host: keywatch.internal:443".to_string(),
    ] {
        assert_eq!(
            request(&addr, "GET", "/", &[&host, &bearer]).0,
            200,
            "{host}"
        );
    }
    let (status, _, body) = request(
        &addr,
        "GET",
        "/api/history",
        &["Host: rebound.example", &bearer],
    );
    assert_eq!(status, 421, "{body}");
    assert!(body.contains("server.hosts"), "{body}");

    // A cross-origin reload is refused, token or not; a same-origin one passes.
    for from in [
        "Origin: https://evil.example",
        "Sec-Fetch-Site: cross-site",
        "Origin: null",
    ] {
        let (status, _, body) = request(&addr, "POST", "/-/reload", &[&bearer, from]);
        assert_eq!(status, 403, "{from}: {body}");
    }
    let same = format!("Origin: http://{addr}");
    assert_eq!(
        request(
            &addr,
            "POST",
            "/-/reload",
            &[&bearer, &same, "Sec-Fetch-Site: same-origin"]
        )
        .0,
        200
    );
    common::assert_no_secret("the log", &daemon.stderr(), &[TOKEN]);
}

/// Without `server`, the `Host` and `Origin` checks still hold (they cost a legitimate client
/// nothing).
#[test]
fn without_a_token_host_and_origin_are_still_checked() {
    let daemon = protected_daemon("");
    let addr = common::endpoint(&daemon.process);
    assert_eq!(request(&addr, "GET", "/", &[]).0, 200);
    assert_eq!(
        request(&addr, "GET", "/", &["Host: rebound.example"]).0,
        421
    );
    assert_eq!(
        request(
            &addr,
            "POST",
            "/-/reload",
            &["Origin: https://evil.example"]
        )
        .0,
        403
    );
    assert_eq!(request(&addr, "POST", "/-/reload", &[]).0, 200);
    assert_eq!(
        daemon.events("listening")[0]["open"],
        false,
        "a token guards it"
    );
}

/// `keywatch run` with `rules` on `redis`, listening on every interface.
fn run_wide(rules: &std::path::Path, redis: &RedisServer) -> common::KeywatchProcess {
    common::spawn_keywatch(
        [
            "--log-format".as_ref(),
            "json".as_ref(),
            "run".as_ref(),
            "-r".as_ref(),
            rules.as_os_str(),
            "--redis".as_ref(),
            redis.url().as_ref(),
            "--listen".as_ref(),
            "0.0.0.0:0".as_ref(),
        ] as [&std::ffi::OsStr; 9],
        &[("KW_TOKEN", TOKEN)],
    )
}

/// docs/operations.md#exposing-the-endpoint: listening beyond loopback without `server.token`
/// is refused at start, the error naming the fixes, unless `server.open: true` says it is
/// meant; and a reload that would take the token away is refused, the old rules kept.
#[test]
fn listening_beyond_loopback_needs_a_token_or_open_true() {
    const RULE: &str = "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [log] }\n";
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::with_events("Exg");

    let rules = common::write_rules(dir.path(), "rules.yaml", RULE);
    let mut refused = run_wide(&rules, &redis);
    // The error's last words, read once the process has written them (it exits at once).
    let said = refused.wait_for_output("(docs/operations.md#exposing-the-endpoint)", PATIENCE);
    let status = refused.wait_timeout(PATIENCE).expect("refused at start");
    assert_eq!(status.code(), Some(1), "{}", refused.describe_output());
    for fix in [
        "`--listen 0.0.0.0:0` reaches beyond loopback",
        "server: { token: \"${KEYWATCH_TOKEN}\" }",
        "listen on 127.0.0.1",
        "`server.open: true`",
    ] {
        assert!(said.contains(fix), "{fix}: {said}");
    }

    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        &format!("server: {{ open: true }}\n{RULE}"),
    );
    let mut open = run_wide(&rules, &redis);
    let listening = open.wait_for_event("listening", "of the HTTP endpoint", |_| true);
    assert_eq!(listening["open"], true, "{}", open.describe_output());
    assert_eq!(listening["level"], "WARN", "{}", open.describe_output());
    open.stop();

    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        &format!("server: {{ token: \"${{KW_TOKEN}}\" }}\n{RULE}"),
    );
    let mut wide = run_wide(&rules, &redis);
    wide.wait_for_event(common::SUBSCRIBED, "of the subscriber in place", |_| true);
    let addr = common::endpoint(&wide).replace("0.0.0.0", "127.0.0.1");
    common::write_rules(dir.path(), "rules.yaml", RULE);
    let bearer = format!("Authorization: Bearer {TOKEN}");
    let (status, _, body) = request(&addr, "POST", "/-/reload", &[&bearer]);
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("`server.open: true`"), "{body}");
    // The token still stands.
    assert_eq!(request(&addr, "GET", "/", &[]).0, 401);
    wide.stop();
}

/// `check` says where `server` is wrong, and suggests the field meant.
#[test]
fn check_says_where_the_server_section_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        "server:\n  tokn: \"x\"\n  token: \"short\"\n  hosts: [\"https://k.internal/\", \"ok.internal\"]\nchannels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [log] }\n",
    );
    let out = common::run_keywatch(
        ["check".as_ref(), "-r".as_ref(), rules.as_os_str()] as [&std::ffi::OsStr; 3],
        &[],
    );
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for wanted in [
        "rules.yaml:2:3: unknown field `tokn` in the `server` section; did you mean `token`?",
        "rules.yaml:3:10: `server.token` must be at least 16 characters",
        "rules.yaml:4:11: `server.hosts`: `https://k.internal/` is not a host name",
    ] {
        assert!(text.contains(wanted), "missing {wanted:?} in:\n{text}");
    }
    assert!(!text.contains("ok.internal"), "{text}");
}

/// Issue 36: each of 20,000 bad link requests wrote a WARN line.
#[test]
fn twenty_thousand_forged_links_make_a_few_log_lines_not_twenty_thousand() {
    let daemon = protected_daemon("");
    let addr = common::endpoint(&daemon.process);
    let started = Instant::now();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                // Kept-alive connections, so that 20,000 requests take seconds, not minutes.
                let mut conn = KeptAlive::open(&addr);
                let mut refused = 0;
                for i in 0..5_000 {
                    if conn.round_trip("GET", &format!("/l/forged{t}x{i}.c2ln")) == 403 {
                        refused += 1;
                    }
                }
                refused
            })
        })
        .collect();
    let refused: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(refused, 20_000);
    let took = started.elapsed();
    let logged = daemon.events("link_refused").len();
    // One line per 10 s at most, the first at once.
    let allowed = 1 + took.as_secs() as usize / 10;
    assert!(
        (1..=allowed).contains(&logged),
        "{logged} log lines for 20,000 refused links in {took:?}"
    );
}

/// A silence link for `key` (named by its hash, as keywatch names it), signed as keywatch signs
/// it, for an event history does not know.
fn silence_link(key: &[u8]) -> String {
    let claim = keywatch::links::Claim {
        act: keywatch::links::Act::Silence,
        id: "0123456789abcdef0123456789abcdef".into(),
        rule: "locks".into(),
        sha256: keywatch::long_key::sha256_hex(key),
        db: 0,
        exp: chrono::Utc::now().timestamp_millis() + 3_600_000,
    };
    keywatch::links::sign(LINK_SECRET.as_bytes(), &claim)
}

/// Issue 36: one silence link replayed 2,000 times made 2,000 silences. Issue 43: a link acts
/// once, so after `keywatch silence remove` the same link does not silence again.
#[test]
fn a_silence_link_replayed_two_thousand_times_makes_one_silence() {
    let daemon = protected_daemon("");
    let addr = common::endpoint(&daemon.process);
    let link = format!("/l/{}", silence_link(b"lock:7"));
    let mut conn = KeptAlive::open(&addr);
    for _ in 0..2_000 {
        assert_eq!(conn.round_trip("POST", &link), 200);
    }
    let n: i64 = redis::cmd("HLEN")
        .arg("keywatch:silences")
        .query(&mut daemon.conn())
        .unwrap();
    assert_eq!(n, 1, "silences made by one link replayed 2,000 times");
    let (_, _, page) = request(&addr, "POST", &link, &[]);
    assert!(page.contains("already used"), "{page}");

    let ids: Vec<String> = redis::cmd("HKEYS")
        .arg("keywatch:silences")
        .query(&mut daemon.conn())
        .unwrap();
    let out = daemon.rules.run(
        &["silence", "remove", &ids[0], "--redis", &daemon.redis.url()],
        &[("LINK_SECRET", LINK_SECRET)],
    );
    assert!(out.status.success(), "{out:?}");
    let (status, _, page) = request(&addr, "POST", &link, &[]);
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("already used"), "{page}");
    let n: i64 = redis::cmd("HLEN")
        .arg("keywatch:silences")
        .query(&mut daemon.conn())
        .unwrap();
    assert_eq!(
        n, 0,
        "the link made its silence again after `silence remove`"
    );
}

/// Issue 36: a silence link for a key that is not UTF-8 muted a *different* key (the spelling
/// with the replacement character), and not the key itself.
#[test]
fn a_silence_link_for_a_key_that_is_not_utf8_mutes_exactly_that_key() {
    let receiver = HttpReceiver::start();
    let yaml = format!(
        r#"
links:
  base_url: "https://links.example.internal"
  secret: "${{LINK_SECRET}}"
channels:
  hook: {{ type: webhook, url: "{}" }}
rules:
  - name: locks
    match: "lock:{{id}}"
    notify: {{ to: [hook] }}
"#,
        receiver.url_for("/hook")
    );
    let daemon = common::Daemon::start_with(
        RedisServer::with_events("Exg"),
        &yaml,
        &[("LINK_SECRET", LINK_SECRET)],
    );
    let addr = common::endpoint(&daemon.process);
    let raw: &[u8] = b"lock:\xff";
    let replacement = "lock:\u{fffd}".as_bytes();
    let (status, _, page) = request(&addr, "POST", &format!("/l/{}", silence_link(raw)), &[]);
    assert_eq!(status, 200, "{page}");
    let id = page
        .split("(silence ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .expect("the silence's id")
        .to_string();
    // In force once the status page lists it (silences are read every second).
    common::wait_until("the silence is in force", PATIENCE, || {
        request(&addr, "GET", "/", &[]).2.contains(&id)
    });
    // Shown by the key's hash (history does not know this made-up event), never by the
    // spelling it does not mute.
    let sha = &keywatch::long_key::sha256_hex(raw)[..12];
    let page = request(&addr, "GET", "/", &[]).2;
    let listed = page
        .lines()
        .find(|l| l.contains(&id))
        .unwrap_or_default()
        .to_string();
    assert!(listed.contains(sha), "the status page: {listed}");
    assert!(!listed.contains('\u{fffd}'), "the status page: {listed}");
    let out = daemon.rules.run(
        &["silence", "list", "--redis", &daemon.redis.url()],
        &[("LINK_SECRET", LINK_SECRET)],
    );
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let listed = out.lines().find(|l| l.contains(&id)).unwrap_or_default();
    assert!(listed.contains(sha), "silence list:\n{out}");
    assert!(!listed.contains('\u{fffd}'), "silence list:\n{out}");
    let silenced = || {
        common::metric(
            &request(&addr, "GET", "/metrics", &[]).2,
            "keywatch_silenced_total",
        )
    };

    common::set_and_expire_now(&mut daemon.conn(), &[raw]);
    common::wait_until("the key's event is silenced or sent", PATIENCE, || {
        silenced() >= 1.0 || receiver.count() > 0
    });
    // The log names the key by its bytes too.
    daemon.wait_for_event("silenced", "of the key", |e| {
        common::field_is(e, "key", r"lock:\xff")
    });
    assert_eq!(
        receiver.count(),
        0,
        "the silenced key was sent: {:?}",
        receiver
            .requests()
            .iter()
            .map(|r| r.summary())
            .collect::<Vec<_>>()
    );

    common::set_and_expire_now(&mut daemon.conn(), &[replacement]);
    let got = receiver.wait_for(1, PATIENCE);
    assert_eq!(
        got[0].json()["key"],
        "lock:\u{fffd}",
        "another key is not muted"
    );
    assert_eq!(silenced(), 1.0);
}
