//! How late are expiry alerts? keywatch's deadline ledger beside a plain keyevent subscriber.
//!
//! `cargo run --release --example lateness [-- --far 200000 --due 1000 --spread 10]`
//! `[--far-over 86400] [--far-first] [--no-plain] [--idle 60] [--ahead 2000]`
//!
//! `--far-over S` spreads the far keys' TTLs from an hour to S seconds; `--far-first` loads them
//! before keywatch starts, watches them with a rule of their own and waits until its start-up
//! fill has learnt them (the tracked keys of an existing keyspace); `--no-plain` skips the plain
//! subscriber's phase. `--idle S` lets keywatch sit idle for S seconds (after learning the far
//! keys) before the due keys are set, and `--ahead MS` sets the first of them MS ms before its
//! deadline (3,000 by default): a key set shortly before its deadline on a keywatch that has been
//! idle, which its poker, asleep until the next deadline it knew, must wake for
//! (docs/performance.md#an-idle-instance).
//!
//! Two phases on two fresh throwaway redis-servers set up the same way: `--far` keys with TTLs
//! an hour away, and `--due` keys whose deadlines fall evenly over `--spread` seconds, which
//! nobody touches. Phase 1 listens with a plain SUBSCRIBE to `__keyevent@0__:expired` (what
//! hand-written glue does); phase 2 runs keywatch with a webhook rule for the due keys and a
//! local receiver. Lateness is arrival minus the key's deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use futures_util::StreamExt;
use keywatch::command::run::{self, RunOptions};
use keywatch::config::{self, Mode};
use keywatch::local_redis::LocalRedis;
use tokio_util::sync::CancellationToken;

mod lateness_stats;
use lateness_stats::{Stats, arg, now_ms, stats};

/// The far keys: `far:N` with a TTL of an hour, or with `--far-over S` (seconds) TTLs spread
/// evenly from an hour to `S` seconds away, none due during the run.
async fn load_far(url: &str, far: u64) {
    let over = arg("--far-over", 0) as i64;
    let client = redis::Client::open(url).unwrap();
    // A pipeline of 10,000 `SET`s may take longer than the default half second while the keyspace's
    // table grows on a loaded machine: it ended both builds' runs here in `timed out`.
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(60)));
    let mut c = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    for chunk in (0..far).collect::<Vec<_>>().chunks(10_000) {
        let mut p = redis::pipe();
        for i in chunk {
            let ttl = if over > 3600 {
                3600 + (*i as i64 * (over - 3600)) / far as i64
            } else {
                3600
            };
            p.cmd("SET")
                .arg(format!("far:{i}"))
                .arg("x")
                .arg("EX")
                .arg(ttl)
                .ignore();
        }
        let _: () = p.query_async(&mut c).await.unwrap();
    }
}

/// The due keys, untouched, deadlines evenly over `spread_ms` from 3 s on; returns each one's
/// deadline.
async fn load_due(url: &str, due: u64, spread_ms: i64) -> HashMap<String, i64> {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let start = now_ms() + arg("--ahead", 3000) as i64;
    let mut deadlines = HashMap::new();
    let mut p = redis::pipe();
    for i in 0..due {
        let key = format!("task:{i}");
        let d = start + (i as i64 * spread_ms) / due as i64;
        p.cmd("SET").arg(&key).arg("x").arg("PXAT").arg(d).ignore();
        deadlines.insert(key, d);
    }
    let _: () = p.query_async(&mut c).await.unwrap();
    deadlines
}

/// Loads the far keys and the due keys; returns each due key's deadline.
async fn load(url: &str, far: u64, due: u64, spread_ms: i64) -> HashMap<String, i64> {
    load_far(url, far).await;
    load_due(url, due, spread_ms).await
}

/// `keywatch_ledger_keys` on keywatch's `/metrics` at `port`.
async fn ledger_keys(port: u16) -> u64 {
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return 0;
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = s
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    body.lines()
        .find_map(|l| l.strip_prefix("keywatch_ledger_keys "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn plain(far: u64, due: u64, spread_ms: i64) -> Stats {
    let server = LocalRedis::start(&["--notify-keyspace-events", "Ex"]).unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe("__keyevent@0__:expired").await.unwrap();
    let deadlines = load(&server.url(), far, due, spread_ms).await;
    let mut late = Vec::new();
    let mut stream = pubsub.on_message();
    let give_up =
        tokio::time::Instant::now() + Duration::from_millis(spread_ms as u64 + 3000 + 20_000);
    while late.len() < deadlines.len() {
        tokio::select! {
            m = stream.next() => {
                let Some(m) = m else { break };
                let key = String::from_utf8_lossy(m.get_payload_bytes()).into_owned();
                if let Some(d) = deadlines.get(&key) {
                    late.push(now_ms() - d);
                }
            }
            _ = tokio::time::sleep_until(give_up) => break,
        }
    }
    stats(late)
}

async fn with_keywatch(far: u64, due: u64, spread_ms: i64) -> (Stats, Stats) {
    let server = LocalRedis::start(&["--notify-keyspace-events", "Exg"]).unwrap();
    let received: Arc<Mutex<Vec<(i64, serde_json::Value)>>> = Arc::default();
    let r = received.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: Bytes| {
            let r = r.clone();
            async move {
                let at = now_ms();
                let j: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                r.lock().unwrap().push((at, j));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let far_first = std::env::args().any(|a| a == "--far-first");
    let mut rules = format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{hook}\"\nrules:\n  - name: task-due\n    match: \"task:{{id}}\"\n    notify: {{ to: [hook] }}\n"
    );
    if far_first {
        // The far keys are watched too (none falls due during the run): the ledger holds
        // every one of them, as a session store's would.
        rules.push_str("  - name: far-due\n    match: \"far:{id}\"\n    notify: { to: [hook] }\n");
    }
    let loaded =
        config::load_texts(vec!["lateness.yaml".into()], &[rules], Mode::Run, &|_| None).unwrap();
    let stop = CancellationToken::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let opts = RunOptions {
        redis: Some(server.url()),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        stop_after: None,
        rules: Vec::new(),
        shadow: false,
    };
    // `--far-first`: the far keys exist before keywatch starts, and its start-up fill learns
    // them (as with an existing keyspace), not 10 million `expire` events.
    if far_first {
        load_far(&server.url(), far).await;
    }
    let run = tokio::spawn(run::run(loaded.config, opts, stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = Duration::from_secs(arg("--idle", 0));
    let deadlines = if far_first {
        let t = std::time::Instant::now();
        while ledger_keys(port).await < far {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!(
            "keywatch learnt the {far} far deadlines {:.1} s after it started",
            t.elapsed().as_secs_f64() + 1.0
        );
        if !idle.is_zero() {
            println!("keywatch idle for {} s", idle.as_secs());
            tokio::time::sleep(idle).await;
        }
        load_due(&server.url(), due, spread_ms).await
    } else if !idle.is_zero() {
        load_far(&server.url(), far).await;
        println!("keywatch idle for {} s", idle.as_secs());
        tokio::time::sleep(idle).await;
        load_due(&server.url(), due, spread_ms).await
    } else {
        load(&server.url(), far, due, spread_ms).await
    };
    let give_up =
        tokio::time::Instant::now() + Duration::from_millis(spread_ms as u64 + 3000 + 20_000);
    while received.lock().unwrap().len() < deadlines.len() && tokio::time::Instant::now() < give_up
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let _ = run.await;
    let got = received.lock().unwrap().clone();
    let late_ms: Vec<i64> = got
        .iter()
        .filter_map(|(_, j)| j["late_ms"].as_i64())
        .collect();
    let receipt: Vec<i64> = got
        .iter()
        .filter_map(|(at, j)| deadlines.get(j["key"].as_str()?).map(|d| at - d))
        .collect();
    (stats(late_ms), stats(receipt))
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let far = arg("--far", 200_000);
    let due = arg("--due", 1000);
    let spread_ms = arg("--spread", 10) as i64 * 1000;
    println!(
        "lateness: {far} keys with TTLs an hour away, {due} untouched keys due over {} s",
        spread_ms / 1000
    );
    let plain = if std::env::args().any(|a| a == "--no-plain") {
        stats(Vec::new())
    } else {
        plain(far, due, spread_ms).await
    };
    let (late, receipt) = with_keywatch(far, due, spread_ms).await;
    println!();
    println!(
        "| measured after the deadline                 | delivered | p50 ms | p99 ms | max ms |"
    );
    println!(
        "|---------------------------------------------|-----------|--------|--------|--------|"
    );
    for (name, s) in [
        ("plain subscriber: `expired` received", &plain),
        ("keywatch: `late_ms` (event taken)", &late),
        ("keywatch: webhook received", &receipt),
    ] {
        println!(
            "| {name:<43} | {:>4}/{due:<4} | {:>6} | {:>6} | {:>6} |",
            s.n, s.p50, s.p99, s.max
        );
    }
    println!(
        "\n(undelivered within 20 s after the last deadline count as missing; peak RSS of this process {:.0} MB)",
        keywatch::proc_stats::own_peak_rss_mb()
    );
}
