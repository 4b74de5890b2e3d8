//! Queue throughput: jobs per second through claim → durable enqueue → deliver to a local
//! receiver → ack, with 1 and with 3 keywatch instances on one Redis, in one run.
//!
//! `cargo run --release --example queue [-- --jobs 20000] [--response-ms 0]`
//!
//! Each instance runs in this process (the library's `command::run::run`), each with its own
//! connections; `--jobs` keys expire at one instant on a webhook rule, and the time from that
//! instant to the last webhook received gives the rate. The receiver answers at once, or after
//! `--response-ms` as a real target would: the channel's 16 requests at once then bound the rate.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use keywatch::command::run::{self, RunOptions};
use keywatch::config::{self, Mode};
use keywatch::local_redis::LocalRedis;
use tokio_util::sync::CancellationToken;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the receiver saw: distinct keys, requests, when the last one came.
type Seen = Arc<Mutex<(HashSet<String>, usize, Option<Instant>)>>;

/// Seconds from the common deadline until every key was received, and how many requests came.
async fn run(instances: usize, jobs: u64, response: Duration) -> (f64, usize, usize) {
    let server = LocalRedis::start(&["--notify-keyspace-events", "Exg"]).unwrap();
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: Bytes| {
            let s = s.clone();
            async move {
                if !response.is_zero() {
                    tokio::time::sleep(response).await;
                }
                let j: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let mut g = s.lock().unwrap();
                g.1 += 1;
                if let Some(k) = j["key"].as_str() {
                    g.0.insert(k.to_string());
                }
                g.2 = Some(Instant::now());
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let rules = format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{hook}\"\nrules:\n  - name: job\n    match: \"job:{{id}}\"\n    notify: {{ to: [hook] }}\n"
    );
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..instances {
        let loaded = config::load_texts(
            vec!["queue.yaml".into()],
            std::slice::from_ref(&rules),
            Mode::Run,
            &|_| None,
        )
        .unwrap();
        let opts = RunOptions {
            redis: Some(server.url()),
            listen: "127.0.0.1:0".parse().unwrap(),
            stop_after: None,
            rules: Vec::new(),
            shadow: false,
        };
        runs.push(tokio::spawn(run::run(loaded.config, opts, stop.clone())));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    let client = redis::Client::open(server.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let deadline_ms = chrono::Utc::now().timestamp_millis() + 2000;
    for chunk in (0..jobs).collect::<Vec<_>>().chunks(5000) {
        let mut p = redis::pipe();
        for i in chunk {
            p.cmd("SET")
                .arg(format!("job:{i}"))
                .arg("x")
                .arg("PXAT")
                .arg(deadline_ms)
                .ignore();
        }
        let _: () = p.query_async(&mut c).await.unwrap();
    }
    let wait =
        Duration::from_millis((deadline_ms - chrono::Utc::now().timestamp_millis()).max(0) as u64);
    tokio::time::sleep(wait).await;
    let t0 = Instant::now();
    let give_up = t0 + Duration::from_secs(300);
    while seen.lock().unwrap().0.len() < jobs as usize && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (keys, requests, last) = {
        let g = seen.lock().unwrap();
        (g.0.len(), g.1, g.2)
    };
    stop.cancel();
    for r in runs {
        let _ = r.await;
    }
    let secs = last.map_or(f64::NAN, |l| l.saturating_duration_since(t0).as_secs_f64());
    (secs, keys, requests)
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let jobs = arg("--jobs", 20_000);
    let response = Duration::from_millis(arg("--response-ms", 0));
    println!(
        "queue throughput: {jobs} keys expiring at one instant, one webhook job each, answered in {response:?}\n"
    );
    println!("| instances | delivered | requests | seconds | jobs/s |");
    println!("|-----------|-----------|----------|---------|--------|");
    for n in [1, 3] {
        let (secs, keys, requests) = run(n, jobs, response).await;
        println!(
            "| {n:>9} | {keys:>9} | {requests:>8} | {secs:>7.2} | {:>6.0} |",
            keys as f64 / secs
        );
    }
    println!(
        "\n(peak RSS of this process, every instance and the receiver included: {:.0} MB)",
        keywatch::proc_stats::own_peak_rss_mb()
    );
}
