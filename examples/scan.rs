//! How fast does the scanner walk a keyspace, and what does another client feel meanwhile?
//!
//! `cargo run --release --example scan [-- --keys 1000000 --pace N]`
//!
//! On a throwaway redis-server: `--keys` keys, 10% of them `lock:{i}` (the rule's pattern, TTLs
//! spread over two hours so about half are within its `warn_before: 1h`), the rest `other:{i}`
//! (half with a TTL). Then, in one run, another client PINGs about a thousand times a second on
//! its own connection, first for a few seconds with no scan, then during one scanner run (the
//! SCAN path: no ledger) at the configured pace: `scanner.max_keys_per_second` from `--pace`, or
//! keywatch's default when absent. Prints keys walked per second, warnings sent, and the PING
//! latency percentiles of both phases.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use keywatch::config::{self, Mode};
use keywatch::keyspace::Keyspace;
use keywatch::local_redis::LocalRedis;
use keywatch::metrics::Metrics;
use keywatch::source::Signal;
use keywatch::source::scanner::Scanner;

fn arg(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

async fn load(url: &str, keys: u64) {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let all: Vec<u64> = (0..keys).collect();
    for chunk in all.chunks(10_000) {
        let mut p = redis::pipe();
        for &i in chunk {
            if i % 10 == 0 {
                let ttl = 60 + fastrand::u64(..7200);
                p.cmd("SET")
                    .arg(format!("lock:{i}"))
                    .arg("x")
                    .arg("EX")
                    .arg(ttl)
                    .ignore();
            } else if i % 2 == 0 {
                p.cmd("SET")
                    .arg(format!("other:{i}"))
                    .arg("x")
                    .arg("EX")
                    .arg(86_400)
                    .ignore();
            } else {
                p.cmd("SET").arg(format!("other:{i}")).arg("x").ignore();
            }
        }
        let () = p.query_async(&mut c).await.unwrap();
    }
}

struct Latency {
    n: usize,
    p50_us: u128,
    p99_us: u128,
    p999_us: u128,
    max_us: u128,
}

fn summarize(mut v: Vec<Duration>) -> Latency {
    v.sort_unstable();
    let q = |p: f64| {
        v.get(((v.len() as f64 - 1.0) * p).round() as usize)
            .map_or(0, |d| d.as_micros())
    };
    Latency {
        n: v.len(),
        p50_us: q(0.5),
        p99_us: q(0.99),
        p999_us: q(0.999),
        max_us: v.last().map_or(0, |d| d.as_micros()),
    }
}

/// Another client: PING about every millisecond on its own connection (its own OS thread, so
/// the scanner's tasks cannot delay the measurement) until `stop`.
fn probe(url: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<Duration>> {
    std::thread::spawn(move || {
        let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
        let mut out = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            let _: String = redis::cmd("PING").query(&mut c).unwrap();
            out.push(t.elapsed());
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    })
}

fn print(label: &str, l: &Latency) {
    println!(
        "  PING {label:<12} n={:<6} p50={:>5} µs  p99={:>5} µs  p99.9={:>5} µs  max={:>6} µs",
        l.n, l.p50_us, l.p99_us, l.p999_us, l.max_us
    );
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let keys = arg("--keys").unwrap_or(1_000_000);
    let pace = arg("--pace");
    let redis = LocalRedis::start(&[]).expect("a throwaway redis-server");
    let url = redis.url();
    let t = Instant::now();
    load(&url, keys).await;
    println!(
        "loaded {keys} keys (10% lock:*) in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let dir = tempfile_dir();
    let pace_line = pace.map_or(String::new(), |p| format!("  max_keys_per_second: {p}\n"));
    let yaml = format!(
        "channels:\n  log: {{ type: log }}\nscanner:\n  schedule: \"@every 1h\"\n{pace_line}rules:\n  - name: lock-held-long\n    match: \"lock:{{id}}\"\n    on: [expiring]\n    warn_before: 1h\n    notify: {{ to: [log] }}\n"
    );
    let path = dir.join("rules.yaml");
    std::fs::write(&path, yaml).unwrap();
    let loaded =
        config::load(&[path], Mode::Run, &|_| None).unwrap_or_else(|_| panic!("rules load"));
    let config = Arc::new(loaded.config);
    let pace_used = config.scanner.as_ref().unwrap().max_keys_per_second;

    let keyspace = Keyspace::new(
        keywatch::config::Secret::new(url.clone()),
        config.redis.clone(),
    )
    .unwrap();
    let state = keyspace.conn(0).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(64 * 1024);
    let counter = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(s) = rx.recv().await {
            if let Signal::Warn { rules, .. } = s {
                n += rules.len() as u64;
            }
        }
        n
    });
    let scanner = Scanner::new(
        config.clone(),
        keyspace,
        state,
        None,
        Arc::new(Metrics::new()),
        tx,
    );

    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut c).unwrap();
    let idle_for = Duration::from_secs(5);
    println!("phase 1: no scan, {} s", idle_for.as_secs());
    let stop = Arc::new(AtomicBool::new(false));
    let p = probe(url.clone(), stop.clone());
    tokio::time::sleep(idle_for).await;
    stop.store(true, Ordering::Relaxed);
    let idle = summarize(p.join().unwrap());

    println!(
        "phase 2: one scanner run at max_keys_per_second = {pace_used}{}",
        if pace.is_none() { " (the default)" } else { "" }
    );
    let stop = Arc::new(AtomicBool::new(false));
    let p = probe(url.clone(), stop.clone());
    let t = Instant::now();
    let stats = scanner.run_once().await.expect("the scan");
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let scanning = summarize(p.join().unwrap());
    drop(scanner);
    let warned = counter.await.unwrap();

    println!();
    println!(
        "scan: {keys} keys walked in {:.2} s = {:.0} keys/s; {} keys read (SCAN MATCH lock:*), {} due ({} warnings sent), {} slow-reply pauses",
        took.as_secs_f64(),
        keys as f64 / took.as_secs_f64(),
        stats.keys,
        stats.due,
        warned,
        stats.pauses
    );
    print("no scan", &idle);
    print("during scan", &scanning);
    println!(
        "  p99 rise: {:+.3} ms",
        (scanning.p99_us as f64 - idle.p99_us as f64) / 1000.0
    );
    println!(
        "  peak RSS of this process (scanner and pinger): {:.0} MB",
        keywatch::proc_stats::own_peak_rss_mb()
    );
    // Where Redis's time went (INFO commandstats: calls and µs per call).
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c)
        .unwrap();
    for l in info.lines().filter(|l| {
        ["scan", "pexpiretime", "set", "ping"]
            .iter()
            .any(|c| l.starts_with(&format!("cmdstat_{c}:")))
    }) {
        println!("  redis {l}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("keywatch-scan-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
