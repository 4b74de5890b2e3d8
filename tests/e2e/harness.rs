//! Self-tests of the integration-test harness in `tests/common/`: if these fail, no other
//! end-to-end result can be trusted.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::{HttpReceiver, KeywatchProcess, RedisCluster, RedisServer, Response, write_rules};
use futures_util::StreamExt;
use redis::Commands;

/// Generous upper bound for anything to happen; a healthy run never waits this long.
const PATIENCE: Duration = Duration::from_secs(20);

fn config_get(conn: &mut redis::Connection, name: &str) -> String {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query(conn)
        .unwrap();
    assert_eq!(pair.len(), 2, "CONFIG GET {name} returned {pair:?}");
    pair[1].clone()
}

#[test]
fn two_servers_get_their_own_port_data_dir_and_keys() {
    let a = RedisServer::start();
    let b = RedisServer::start();
    assert_ne!(a.port(), b.port());
    assert_ne!(a.pid(), b.pid());
    assert_eq!(a.addr(), format!("127.0.0.1:{}", a.port()));
    assert_eq!(a.url(), format!("redis://127.0.0.1:{}", a.port()));

    let mut ca = a.conn();
    let mut cb = b.conn();
    let () = ca.set("only-in-a", "1").unwrap();
    let in_b: Option<String> = cb.get("only-in-a").unwrap();
    assert_eq!(
        in_b, None,
        "a key set on one server is visible on the other"
    );
    assert_ne!(config_get(&mut ca, "dir"), config_get(&mut cb, "dir"));

    // Like a freshly installed Redis: no notifications, no persistence, loopback only.
    assert_eq!(config_get(&mut ca, "notify-keyspace-events"), "");
    assert_eq!(config_get(&mut ca, "save"), "");
    assert_eq!(config_get(&mut ca, "appendonly"), "no");
    assert_eq!(config_get(&mut ca, "bind"), "127.0.0.1");
}

#[test]
fn restart_keeps_port_and_args_and_only_aof_keeps_data() {
    let mut durable = RedisServer::builder()
        .arg("--appendonly")
        .arg("yes")
        .start();
    let mut volatile = RedisServer::start();
    for server in [&durable, &volatile] {
        let () = server.conn().set("survivor", "yes").unwrap();
    }
    let (durable_port, durable_pid) = (durable.port(), durable.pid());
    durable.restart();
    volatile.restart();
    assert_eq!(
        durable.port(),
        durable_port,
        "restart moved the server to another port"
    );
    assert_ne!(
        durable.pid(),
        durable_pid,
        "restart did not start a new process"
    );

    let mut conn = durable.conn();
    assert_eq!(
        config_get(&mut conn, "appendonly"),
        "yes",
        "restart lost the extra args"
    );
    let kept: Option<String> = conn.get("survivor").unwrap();
    assert_eq!(
        kept.as_deref(),
        Some("yes"),
        "AOF did not keep the key\n{}",
        durable.log_tail()
    );
    let lost: Option<String> = volatile.conn().get("survivor").unwrap();
    assert_eq!(
        lost, None,
        "a server without persistence kept data across a restart"
    );
    assert_eq!(
        durable.log().matches("Ready to accept connections").count(),
        2
    );

    durable.kill();
    assert!(!durable.is_running());
    assert!(
        TcpStream::connect(durable.socket_addr()).is_err(),
        "something still listens on the port of a killed server"
    );
    durable.start_again();
    assert!(durable.is_running());
    assert_eq!(durable.port(), durable_port);
}

#[test]
fn builder_arguments_and_password_reach_the_server() {
    let server = RedisServer::builder()
        .arg("--maxmemory")
        .arg("1mb")
        .arg("--maxmemory-policy allkeys-lru")
        .args(["--client-output-buffer-limit", "pubsub 1mb 256kb 10"])
        .config("hz", "50")
        .requirepass("s3cret p@ss")
        .start();
    let mut conn = server.conn();
    assert_eq!(config_get(&mut conn, "maxmemory"), "1048576");
    assert_eq!(config_get(&mut conn, "maxmemory-policy"), "allkeys-lru");
    assert_eq!(config_get(&mut conn, "hz"), "50");
    let limits = config_get(&mut conn, "client-output-buffer-limit");
    assert!(
        limits.contains("pubsub 1048576 262144 10"),
        "got {limits:?}"
    );

    let mut anonymous = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let denied: redis::RedisResult<String> = anonymous.get("x");
    let error = denied.expect_err("an unauthenticated GET succeeded");
    assert!(error.to_string().contains("NOAUTH"), "got {error}");
}

#[tokio::test]
async fn keyevent_subscriber_sees_expired_key_only_with_ex_flags() {
    let server = RedisServer::builder().notify_keyspace_events("Ex").start();
    let mut pubsub = server.client().get_async_pubsub().await.unwrap();
    pubsub.subscribe("__keyevent@0__:expired").await.unwrap();

    let mut conn = server.async_conn().await;
    let () = redis::cmd("SET")
        .arg("order_lock:42")
        .arg("1")
        .arg("PX")
        .arg(50)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut messages = pubsub.on_message();
    let message = tokio::time::timeout(PATIENCE, messages.next())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no expired event within {PATIENCE:?}\n{}",
                server.log_tail()
            )
        })
        .expect("pub/sub stream ended");
    assert_eq!(message.get_channel_name(), "__keyevent@0__:expired");
    assert_eq!(message.get_payload::<String>().unwrap(), "order_lock:42");

    let plain = RedisServer::start();
    let mut conn = plain.conn();
    assert_eq!(config_get(&mut conn, "notify-keyspace-events"), "");
}

#[tokio::test]
async fn receiver_records_exact_requests_over_keep_alive_and_plays_the_script() {
    let receiver = HttpReceiver::start();
    receiver.push(Response::status(500).body("x"));
    receiver.push(Response::status(429).header("Retry-After", "1"));
    let client = reqwest::Client::new();
    let mut answers = Vec::new();
    for i in 0..3 {
        let response = client
            .post(receiver.url_for(&format!("/hook/{i}?sign=a%2Bb%3D&n={i}")))
            .header("X-Trace", format!("t{i}"))
            .header("Content-Type", "application/json")
            .body(format!(r#"{{"n":{i}}}"#))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        answers.push((status, retry_after, response.text().await.unwrap()));
    }
    assert_eq!(
        answers,
        vec![
            (500, None, "x".to_owned()),
            (429, Some("1".to_owned()), String::new()),
            (200, None, "ok".to_owned()),
        ]
    );

    let requests = receiver.wait_for(3, PATIENCE);
    assert_eq!(requests.len(), 3);
    for (i, request) in requests.iter().enumerate() {
        assert_eq!(request.index, i);
        assert_eq!(request.method, "POST");
        assert_eq!(request.target, format!("/hook/{i}?sign=a%2Bb%3D&n={i}"));
        assert_eq!(request.path(), format!("/hook/{i}"));
        assert_eq!(request.query_param("sign").as_deref(), Some("a+b="));
        assert_eq!(request.header("x-trace"), Some(format!("t{i}").as_str()));
        assert_eq!(request.json(), serde_json::json!({ "n": i }));
        assert_eq!(request.body_str(), format!(r#"{{"n":{i}}}"#));
        assert_eq!(request.header("content-length"), Some("7"));
    }
    assert!(
        requests
            .iter()
            .all(|r| r.connection == requests[0].connection),
        "reqwest did not reuse one connection: {:?}",
        requests.iter().map(|r| r.connection).collect::<Vec<_>>()
    );
    assert!(requests[0].received_instant <= requests[2].received_instant);
}

/// Sends raw bytes and reads until `responses` complete HTTP responses (with Content-Length)
/// have arrived.
fn exchange(stream: &mut TcpStream, request: &[u8], responses: usize) -> String {
    stream.write_all(request).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut received = Vec::new();
    let complete = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        let mut rest: &str = &text;
        for _ in 0..responses {
            let Some((head, after)) = rest.split_once("\r\n\r\n") else {
                return false;
            };
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .map_or(0, |v| v.parse().unwrap());
            if after.len() < length {
                return false;
            }
            rest = &after[length..];
        }
        true
    };
    let mut buf = [0u8; 4096];
    while !complete(&received) {
        let n = stream.read(&mut buf).expect("read a response");
        assert!(
            n > 0,
            "connection closed after {:?}",
            String::from_utf8_lossy(&received)
        );
        received.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(received).unwrap()
}

#[test]
fn receiver_keeps_raw_head_header_order_and_chunked_bodies() {
    let receiver = HttpReceiver::with_default(Response::status(202).body("accepted"));
    receiver.set_handler(|request| {
        (request.path() == "/teapot").then(|| Response::status(418).header("X-Why", "handler"))
    });
    let head = "POST /robot/send?access_token=t0k&sign=x%2By%3D HTTP/1.1\r\n\
                Host: example\r\n\
                X-Zeta: last-alphabetically-first-sent\r\n\
                x-alpha: lower case kept\r\n\
                Transfer-Encoding: chunked\r\n\r\n";
    let mut stream = TcpStream::connect(("127.0.0.1", receiver.port())).unwrap();
    let second = "GET /teapot HTTP/1.1\r\nHost: example\r\nContent-Length: 3\r\n\r\nabc";
    let request =
        format!("{head}5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\n{second}");
    let answers = exchange(&mut stream, request.as_bytes(), 2);
    assert!(
        answers.starts_with("HTTP/1.1 202 Accepted\r\n"),
        "{answers}"
    );
    assert!(answers.contains("accepted"), "{answers}");
    assert!(answers.contains("HTTP/1.1 418 "), "{answers}");
    assert!(answers.contains("X-Why: handler"), "{answers}");

    let requests = receiver.wait_for(2, PATIENCE);
    let first = &requests[0];
    assert_eq!(first.raw_head, head.as_bytes());
    assert_eq!(
        first.headers,
        vec![
            ("Host".to_owned(), "example".to_owned()),
            (
                "X-Zeta".to_owned(),
                "last-alphabetically-first-sent".to_owned()
            ),
            ("x-alpha".to_owned(), "lower case kept".to_owned()),
            ("Transfer-Encoding".to_owned(), "chunked".to_owned()),
        ]
    );
    assert!(first.chunked);
    assert_eq!(first.body, b"hello world");
    assert_eq!(first.query_param("access_token").as_deref(), Some("t0k"));
    assert_eq!(first.query_param("sign").as_deref(), Some("x+y="));
    assert_eq!(first.query_param("missing"), None);
    assert_eq!(requests[1].method, "GET");
    assert_eq!(requests[1].body, b"abc");
    assert_eq!(requests[1].connection, first.connection);
}

#[test]
fn receiver_goes_down_and_comes_back_on_the_same_port() {
    let receiver = HttpReceiver::start();
    let port = receiver.port();
    let mut kept_alive = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let ping = b"GET /before HTTP/1.1\r\nHost: x\r\n\r\n";
    assert!(exchange(&mut kept_alive, ping, 1).starts_with("HTTP/1.1 200 OK"));

    receiver.down();
    assert!(!receiver.is_up());
    let refused = TcpStream::connect(("127.0.0.1", port));
    assert!(refused.is_err(), "a down receiver accepted a connection");
    let mut buf = [0u8; 64];
    kept_alive.set_read_timeout(Some(PATIENCE)).unwrap();
    let cut = kept_alive
        .write_all(ping)
        .and_then(|()| kept_alive.read(&mut buf));
    assert!(
        matches!(cut, Ok(0) | Err(_)),
        "a kept-alive connection survived the outage: {cut:?}"
    );

    receiver.up();
    assert_eq!(receiver.port(), port);
    let mut again = TcpStream::connect(("127.0.0.1", port)).expect("receiver is up again");
    let answer = exchange(&mut again, b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n", 1);
    assert!(answer.ends_with("\r\n\r\nok"), "{answer}");
    let paths: Vec<String> = receiver
        .requests()
        .iter()
        .map(|r| r.target.clone())
        .collect();
    assert_eq!(paths, ["/before", "/after"]);
}

#[test]
fn receiver_can_delay_or_drop_without_answering() {
    let receiver = HttpReceiver::start();
    receiver.push(Response::drop_connection());
    receiver.push(
        Response::status(200)
            .body("late")
            .delay(Duration::from_millis(200))
            .close(),
    );
    let mut stream = TcpStream::connect(("127.0.0.1", receiver.port())).unwrap();
    stream
        .write_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf);
    assert!(
        buf.is_empty(),
        "a dropped connection answered {:?}",
        String::from_utf8_lossy(&buf)
    );

    let mut stream = TcpStream::connect(("127.0.0.1", receiver.port())).unwrap();
    let started = std::time::Instant::now();
    stream
        .write_all(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "the delay was not applied"
    );
    assert!(
        answer.contains("Connection: close") && answer.ends_with("late"),
        "{answer}"
    );
    assert_eq!(receiver.wait_for(2, PATIENCE).len(), 2);
}

#[test]
fn process_capture_sees_both_streams_and_signals() {
    // The keywatch CLI is written elsewhere; the capture machinery is checked on a shell script.
    let script = r#"echo "to stdout"; echo "to stderr" >&2
        trap 'echo "got TERM" >&2; exit 7' TERM
        echo ready >&2
        while :; do sleep 0.05; done"#;
    let mut command = Command::new("sh");
    command.arg("-c").arg(script);
    let mut process = KeywatchProcess::from_command(command);
    // The two streams are read by separate threads: wait for each, never infer one from the other.
    let stderr = process.wait_for_output("ready", PATIENCE);
    assert!(stderr.starts_with("to stderr\nready\n"), "{stderr:?}");
    let stdout = process.wait_for_output("to stdout", PATIENCE);
    assert_eq!(stdout, "to stdout\n");
    assert_eq!(process.stdout(), "to stdout\n");
    assert!(
        !process.stdout().contains("ready"),
        "stderr leaked into stdout"
    );
    assert_eq!(
        process.wait_timeout(Duration::from_millis(50)),
        None,
        "script exited early"
    );
    process.sigterm();
    let status = process
        .wait_timeout(PATIENCE)
        .expect("script ignored SIGTERM");
    assert_eq!(status.code(), Some(7));
    process.wait_for_output("got TERM", PATIENCE);
}

#[test]
fn rules_land_in_nested_folders() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_rules(dir.path(), "team/a.yaml", "rules: []\n");
    assert_eq!(path, dir.path().join("team/a.yaml"));
    assert_eq!(std::fs::read_to_string(path).unwrap(), "rules: []\n");
}

#[test]
fn cluster_of_three_masters_and_three_replicas_forms_and_fails_over() {
    let cluster = RedisCluster::start(3, 1);
    assert_eq!(cluster.nodes().len(), 6);
    assert_eq!(cluster.masters(), [0, 1, 2]);
    for master in 0..3 {
        assert_eq!(cluster.replicas_of(master), [3 + master]);
    }

    // A cluster client routes a key to each master.
    let mut client = cluster.client().get_connection().unwrap();
    let keys: Vec<String> = (0..3).map(|m| cluster.key_on(m, "k")).collect();
    for key in &keys {
        let () = client.set(key, key).unwrap();
    }
    for (master, key) in keys.iter().enumerate() {
        let mut direct = cluster.node(master).conn();
        let here: Option<String> = direct.get(key).unwrap();
        assert_eq!(
            here.as_deref(),
            Some(key.as_str()),
            "{key} is not on node {master}"
        );
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(10_000)
            .query(&mut direct)
            .unwrap();
        assert_eq!(acked, 1, "the replica of node {master} did not acknowledge");
    }

    cluster.failover_takeover(3);
    assert_eq!(cluster.masters(), [1, 2, 3]);
    assert_eq!(cluster.master_for_key(&keys[0]), 3);
    let moved: Option<String> = cluster.node(3).conn().get(&keys[0]).unwrap();
    assert_eq!(moved.as_deref(), Some(keys[0].as_str()));
}
