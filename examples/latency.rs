//! How long keywatch takes from Redis's `expired` message to the webhook's receipt.
//!
//! ```sh
//! cargo run --release --example latency          # 1,000 keys
//! cargo run --release --example latency -- 5000  # another count
//! ```
//!
//! A throwaway redis-server (free loopback port, `notify-keyspace-events Ex`), the recording
//! HTTP receiver of the test harness, and keywatch's `run` pipeline in this process (subscriber →
//! engine → delivery → webhook over HTTP). A separate raw subscriber timestamps each `expired`
//! message; the receiver timestamps each request; the difference is the figure. Keys get
//! deadlines spread over 2 s and are read (`PTTL`) right after their deadline, so Redis expires
//! them on time instead of whenever its expiry cycle gets there. Prints figures; asserts nothing.

#[allow(dead_code)]
#[path = "../tests/common/http_receiver.rs"]
mod http_receiver;
#[allow(dead_code)]
#[path = "../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../tests/common/redis_server.rs"]
mod redis_server;
#[allow(dead_code)]
#[path = "../tests/common/tls.rs"]
mod tls;
#[allow(dead_code)]
#[path = "../tests/common/tools.rs"]
mod tools;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_receiver::HttpReceiver;
use redis_server::RedisServer;
use tokio_util::sync::CancellationToken;

const SPREAD: Duration = Duration::from_secs(2);
const FIRST_DEADLINE: Duration = Duration::from_millis(500);
const PATIENCE: Duration = Duration::from_secs(120);

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the key count, e.g. 1000"))
        .unwrap_or(1000);
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();

    // The flags keywatch needs for an `expired` rule (`Ex`, and `g` for keys deleted or renamed
    // before their deadline); with `Ex` alone it refuses to start (docs/operations.md).
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();

    // The raw subscriber: when Redis published each `expired`.
    let published: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    {
        let published = published.clone();
        let mut conn = redis.conn();
        std::thread::spawn(move || {
            let mut pubsub = conn.as_pubsub();
            pubsub.subscribe("__keyevent@0__:expired").unwrap();
            while let Ok(msg) = pubsub.get_message() {
                let at = Instant::now();
                let key: String = msg.get_payload().unwrap_or_default();
                published.lock().unwrap().insert(key, at);
            }
        });
    }

    // keywatch, in this process.
    let rules = format!(
        r#"
channels:
  hook: {{ type: webhook, url: "{}/hook" }}
rules:
  - name: latency
    match: "lat:{{n}}"
    notify: {{ to: [hook] }}
"#,
        receiver.url()
    );
    let env = |_: &str| None;
    let loaded = keywatch::config::load_texts(
        vec![PathBuf::from("latency.yaml")],
        &[rules],
        keywatch::config::Mode::Run,
        &env,
    )
    .unwrap_or_else(|e| panic!("the rules do not load: {e}"));
    let stop = CancellationToken::new();
    let keywatch = {
        let stop = stop.clone();
        let opts = keywatch::command::run::RunOptions {
            redis: Some(redis.url()),
            listen: "127.0.0.1:0".parse().unwrap(),
            stop_after: None,
            rules: Vec::new(),
            shadow: false,
        };
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(keywatch::command::run::run(loaded.config, opts, stop))
        })
    };

    let mut conn = redis.conn();
    let started = Instant::now();
    loop {
        let subs: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg("__keyevent@0__:expired")
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("PUBSUB NUMSUB: {e}\n{}", redis.log_tail()));
        if subs.1 >= 2 {
            break;
        }
        if keywatch.is_finished() {
            let ended = keywatch.join();
            panic!("keywatch stopped before it subscribed: {ended:?}");
        }
        assert!(started.elapsed() < PATIENCE, "keywatch did not subscribe");
        std::thread::sleep(Duration::from_millis(10));
    }

    // Deadlines spread evenly; each key is poked with PTTL once it is due.
    let t0 = Instant::now();
    let mut due: Vec<(Instant, String)> = (0..n)
        .map(|i| {
            let offset = FIRST_DEADLINE + SPREAD.mul_f64(i as f64 / n as f64);
            (t0 + offset, format!("lat:{i}"))
        })
        .collect();
    let mut pipe = redis::pipe();
    for (at, key) in &due {
        let ms = at
            .saturating_duration_since(Instant::now())
            .as_millis()
            .max(1) as u64;
        pipe.cmd("SET").arg(key).arg("v").arg("PX").arg(ms).ignore();
    }
    pipe.exec(&mut conn).unwrap();
    while !due.is_empty() {
        std::thread::sleep(Duration::from_millis(1));
        let now = Instant::now();
        let ready: Vec<String> = due
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, k)| k.clone())
            .collect();
        if ready.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for k in &ready {
            pipe.cmd("PTTL").arg(k);
        }
        let ttls: Vec<i64> = pipe.query(&mut conn).unwrap();
        let gone: Vec<&String> = ready
            .iter()
            .zip(ttls)
            .filter(|(_, t)| *t == -2)
            .map(|(k, _)| k)
            .collect();
        due.retain(|(_, k)| !gone.contains(&k));
        assert!(t0.elapsed() < PATIENCE, "keys did not expire");
    }

    receiver.wait_for(n, PATIENCE);
    stop.cancel();
    let _ = keywatch.join();

    let published = published.lock().unwrap().clone();
    let mut latencies: Vec<Duration> = receiver
        .requests()
        .iter()
        .filter_map(|r| {
            let key = r.json()["key"].as_str()?.to_owned();
            Some(
                r.received_instant
                    .saturating_duration_since(*published.get(&key)?),
            )
        })
        .collect();
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1]
    };
    let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1000.0);
    println!(
        "keywatch latency, `expired` message -> webhook request received, {} keys ({} requests, {} matched to an event):",
        n,
        receiver.count(),
        latencies.len()
    );
    println!("  min    {}", ms(latencies[0]));
    println!("  median {}", ms(pct(0.50)));
    println!("  p90    {}", ms(pct(0.90)));
    println!("  p99    {}", ms(pct(0.99)));
    println!("  max    {}", ms(latencies[latencies.len() - 1]));
}
