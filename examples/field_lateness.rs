//! How late are hash-field expiry alerts? keywatch's field ledger beside a plain `hexpired`
//! subscriber, in one run on one valkey-server 9.1.2 (the pinned one: hash-field expiry).
//!
//! `cargo run --release --example field_lateness [-- --far 200000 --due 1000 --spread 10]`
//!
//! `--far` fields with deadlines an hour away (1,000 per hash) are loaded first and learnt by
//! keywatch at start-up; then `--due` fields (100 per hash) whose deadlines fall evenly over
//! `--spread` seconds, which nobody touches. keywatch alerts a local webhook receiver; beside it
//! a plain SUBSCRIBE to `__keyevent@0__:hexpired` hears the hashes. That event names no field, so
//! the subscriber is credited, generously, with every field of the hash whose deadline had passed
//! when the event came. Lateness is arrival minus the field's deadline.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use futures_util::StreamExt;
use keywatch::command::run::{self, RunOptions};
use keywatch::config::{self, Mode};
use keywatch::local_redis::LocalRedis;
use keywatch::local_redis::fetch;
use tokio_util::sync::CancellationToken;

mod lateness_stats;
use lateness_stats::{arg, now_ms, stats};

async fn load_far(c: &mut redis::aio::MultiplexedConnection, far: u64) {
    for h in 0..far.div_ceil(1000) {
        let key = format!("holds:far{h}");
        let fields: Vec<String> = (0..1000.min(far - h * 1000))
            .map(|i| format!("f{i}"))
            .collect();
        let mut p = redis::pipe();
        p.cmd("HSET").arg(&key);
        for f in &fields {
            p.arg(f).arg(1);
        }
        p.ignore();
        p.cmd("HEXPIRE")
            .arg(&key)
            .arg(3600)
            .arg("FIELDS")
            .arg(fields.len())
            .arg(&fields)
            .ignore();
        let _: () = p.query_async(c).await.unwrap();
    }
}

/// Loads the due fields; returns each one's deadline by (hash, field).
async fn load_due(
    c: &mut redis::aio::MultiplexedConnection,
    due: u64,
    spread_ms: i64,
) -> HashMap<(String, String), i64> {
    let start = now_ms() + 3000;
    let mut deadlines = HashMap::new();
    let mut p = redis::pipe();
    for i in 0..due {
        let key = format!("holds:due{}", i / 100);
        let field = format!("order-{i}");
        let d = start + (i as i64 * spread_ms) / due as i64;
        p.cmd("HSET").arg(&key).arg(&field).arg(1).ignore();
        p.cmd("HPEXPIREAT")
            .arg(&key)
            .arg(d)
            .arg("FIELDS")
            .arg(1)
            .arg(&field)
            .ignore();
        deadlines.insert((key, field), d);
    }
    let _: () = p.query_async(c).await.unwrap();
    deadlines
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let far = arg("--far", 200_000);
    let due = arg("--due", 1000);
    let spread_ms = arg("--spread", 10) as i64 * 1000;
    let bin = fetch::valkey_binary().expect("the pinned valkey-server (hash-field expiry)");
    let server = LocalRedis::start_binary(bin, &["--notify-keyspace-events", "Exgh"]).unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    println!(
        "field lateness: {far} fields with deadlines an hour away, {due} untouched fields due over {} s (valkey-server 9.1.2)",
        spread_ms / 1000
    );
    load_far(&mut c, far).await;

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
    let rules = format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{hook}\"\nrules:\n  - name: hold-due\n    match: \"holds:{{h}}\"\n    field: \"{{item}}\"\n    on: [hexpired]\n    notify: {{ to: [hook] }}\n"
    );
    let loaded = config::load_texts(
        vec!["field_lateness.yaml".into()],
        &[rules],
        Mode::Run,
        &|_| None,
    )
    .unwrap();
    let stop = CancellationToken::new();
    let opts = RunOptions {
        redis: Some(server.url()),
        listen: "127.0.0.1:0".parse().unwrap(),
        stop_after: None,
        rules: Vec::new(),
        shadow: false,
    };
    let run = tokio::spawn(run::run(loaded.config, opts, stop.clone()));
    let learnt = std::time::Instant::now();
    loop {
        // Each far hash's index in the field ledger (field → deadline).
        let mut p = redis::pipe();
        for h in 0..far.div_ceil(1000) {
            p.cmd("HLEN")
                .arg(format!("keywatch:fields:0:h:holds:far{h}"));
        }
        let lens: Vec<u64> = p.query_async(&mut c).await.unwrap();
        let n: u64 = lens.iter().sum();
        if n >= far {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "keywatch learnt the {far} far fields in {:.1} s",
        learnt.elapsed().as_secs_f64()
    );

    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe("__keyevent@0__:hexpired").await.unwrap();
    let deadlines = load_due(&mut c, due, spread_ms).await;
    // By hash, the due fields not yet credited to the plain subscriber, soonest first.
    let mut pending: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for ((k, _), d) in &deadlines {
        pending.entry(k.clone()).or_default().push(*d);
    }
    for v in pending.values_mut() {
        v.sort_unstable();
    }
    let mut plain = Vec::new();
    let mut stream = pubsub.on_message();
    let give_up =
        tokio::time::Instant::now() + Duration::from_millis(spread_ms as u64 + 3000 + 20_000);
    while plain.len() < deadlines.len() {
        tokio::select! {
            m = stream.next() => {
                let Some(m) = m else { break };
                let at = now_ms();
                let key = String::from_utf8_lossy(m.get_payload_bytes()).into_owned();
                if let Some(ds) = pending.get_mut(&key) {
                    let gone = ds.partition_point(|d| *d < at);
                    plain.extend(ds.drain(..gone).map(|d| at - d));
                }
            }
            _ = tokio::time::sleep_until(give_up) => break,
        }
    }
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
        .filter_map(|(at, j)| {
            let k = (
                j["key"].as_str()?.to_string(),
                j["field"].as_str()?.to_string(),
            );
            deadlines.get(&k).map(|d| at - d)
        })
        .collect();
    let (plain, late, receipt) = (stats(plain), stats(late_ms), stats(receipt));
    println!();
    println!(
        "| measured after the field's deadline          | delivered | p50 ms | p99 ms | max ms |"
    );
    println!(
        "|----------------------------------------------|-----------|--------|--------|--------|"
    );
    for (name, s) in [
        ("plain subscriber: `hexpired` of its hash", &plain),
        ("keywatch: `late_ms` (event taken)", &late),
        ("keywatch: webhook received", &receipt),
    ] {
        println!(
            "| {name:<44} | {:>4}/{due:<4} | {:>6} | {:>6} | {:>6} |",
            s.n, s.p50, s.p99, s.max
        );
    }
    println!(
        "\n(undelivered within 20 s after the last deadline count as missing; peak RSS of this process {:.0} MB)",
        keywatch::proc_stats::own_peak_rss_mb()
    );
}
