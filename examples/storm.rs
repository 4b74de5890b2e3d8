//! Storm: N keys expiring at one instant on a notify-only rule whose webhook answers in 20 ms,
//! on a throwaway redis-server, against `keywatch run` as a child process (production code path
//! and logging). What docs/reliability.md#guarantees promises under any storm, measured:
//!
//! - the most requests the receiver held at once (must be ≤ the channel's `concurrency`);
//! - keywatch's peak RSS (`VmHWM`) at the end, and its RSS sampled while it drained;
//! - the most jobs waiting in the queue in Redis (where a storm waits);
//! - the time from the due instant until every event was delivered, and whether each was
//!   delivered once.
//!
//! ```text
//! cargo run --release --example storm [-- --events 100000] [--concurrency 16] [--hold-ms 20]
//!                                     [--save FILE]
//! ```
//!
//! Not a test: nothing here asserts a time. It exits 1 when an event was not delivered, was
//! delivered twice, or the receiver held more requests at once than the concurrency.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use keywatch::local_redis::LocalRedis;
use keywatch::proc_stats::peak_rss_mb;
use serde::Serialize;

/// Keys written per pipeline while loading.
const LOAD_CHUNK: usize = 5000;

struct Args {
    events: usize,
    concurrency: usize,
    hold: Duration,
    save: Option<PathBuf>,
}

fn parse_args() -> Args {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    Args {
        events: value("--events")
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000),
        concurrency: value("--concurrency")
            .and_then(|v| v.parse().ok())
            .unwrap_or(16),
        hold: Duration::from_millis(
            value("--hold-ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(20),
        ),
        save: value("--save").map(PathBuf::from),
    }
}

/// The figures of one run, as printed and saved with `--save`.
#[derive(Debug, Serialize)]
struct Figures {
    events: usize,
    concurrency: usize,
    hold_ms: u64,
    /// The most requests the receiver held at once.
    peak_in_flight: usize,
    /// keywatch's peak resident memory (VmHWM) at the end of the run, MiB.
    peak_rss_mib: f64,
    /// keywatch's resident memory sampled every 250 ms while it drained: the largest, MiB.
    largest_sampled_rss_mib: f64,
    /// The most jobs in Redis (the queue and the targets' waiting sets) seen while draining.
    peak_queued: usize,
    /// Seconds from the due instant until every event was delivered.
    drain_s: f64,
    delivered: usize,
    requests: usize,
    /// Requests for an event already delivered.
    duplicates: usize,
}

/// What the receiver has seen.
struct Seen {
    delivered: Vec<AtomicBool>,
    distinct: AtomicUsize,
    requests: AtomicUsize,
    holding: AtomicUsize,
    most: AtomicUsize,
    /// When the last new event arrived, µs since the run's start.
    last_us: AtomicU64,
}

/// A webhook that answers 200 after `hold`, counting what it holds at once and which events came.
async fn receiver(events: usize, hold: Duration, start: Instant) -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen {
        delivered: (0..events).map(|_| AtomicBool::new(false)).collect(),
        distinct: AtomicUsize::new(0),
        requests: AtomicUsize::new(0),
        holding: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
        last_us: AtomicU64::new(0),
    });
    let s = seen.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: Bytes| {
            let s = s.clone();
            async move {
                let now = s.holding.fetch_add(1, Ordering::SeqCst) + 1;
                s.most.fetch_max(now, Ordering::SeqCst);
                s.requests.fetch_add(1, Ordering::Relaxed);
                let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let index = event["key"]
                    .as_str()
                    .and_then(|k| k.strip_prefix("storm:"))
                    .and_then(|i| i.parse::<usize>().ok());
                if let Some(i) = index
                    && i < s.delivered.len()
                    && !s.delivered[i].swap(true, Ordering::SeqCst)
                {
                    s.distinct.fetch_add(1, Ordering::SeqCst);
                    s.last_us
                        .fetch_max(start.elapsed().as_micros() as u64, Ordering::SeqCst);
                }
                tokio::time::sleep(hold).await;
                s.holding.fetch_sub(1, Ordering::SeqCst);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the receiver");
    let url = format!(
        "http://{}/hook",
        listener.local_addr().expect("receiver address")
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Writes the keys, due together at an instant far enough ahead for the load to finish; returns
/// that instant (unix ms).
async fn load(c: &mut redis::aio::MultiplexedConnection, events: usize) -> i64 {
    let due = now_ms() + 3000 + (events as i64) / 20;
    let ids: Vec<usize> = (0..events).collect();
    for chunk in ids.chunks(LOAD_CHUNK) {
        let mut p = redis::pipe();
        for &i in chunk {
            p.cmd("SET")
                .arg(format!("storm:{i}"))
                .arg("")
                .arg("PXAT")
                .arg(due)
                .ignore();
        }
        let _: () = p.query_async(c).await.expect("load keys");
    }
    assert!(
        now_ms() < due - 200,
        "loading took too long: the keys were due before it ended"
    );
    due
}

struct Keywatch {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Keywatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_path() -> PathBuf {
    std::env::temp_dir().join("keywatch-storm.log")
}

/// `keywatch run` as a child process: this example started again with `--keywatch`.
fn start_keywatch(redis: &str, receiver: &str, concurrency: usize) -> Keywatch {
    let dir = tempfile::tempdir().expect("temp dir");
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        format!(
            r#"channels:
  hook:
    type: webhook
    url: "{receiver}"
    concurrency: {concurrency}
rules:
  - name: storm
    match: "storm:{{id}}"
    on: [expired]
    notify: {{ to: [hook] }}
"#
        ),
    )
    .expect("write rules");
    let log = std::fs::File::create(log_path()).expect("log file");
    let exe = std::env::current_exe().expect("this example's path");
    let child = Command::new(exe)
        .arg("--keywatch")
        .args(["run", "-r"])
        .arg(&rules)
        .args(["--redis", redis, "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start keywatch");
    Keywatch { child, _dir: dir }
}

/// Waits until keywatch subscribes to the expired channel.
async fn wait_subscribed(c: &mut redis::aio::MultiplexedConnection) {
    let started = Instant::now();
    loop {
        let subs: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg("__keyevent@0__:expired")
            .query_async(c)
            .await
            .expect("PUBSUB NUMSUB");
        if subs.1 > 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "keywatch did not subscribe within 60 s; its log: {}",
            log_path().display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Jobs in Redis: in the queue, and waiting for their target in its own set.
async fn queued(c: &mut redis::aio::MultiplexedConnection) -> usize {
    let targets: Vec<String> = redis::cmd("SMEMBERS")
        .arg("keywatch:queue:waits")
        .query_async(c)
        .await
        .unwrap_or_default();
    let mut pipe = redis::pipe();
    pipe.cmd("ZCARD").arg("keywatch:queue");
    for t in &targets {
        pipe.cmd("ZCARD").arg(format!("keywatch:queue:wait:{t}"));
    }
    let counts: Vec<usize> = pipe.query_async(c).await.unwrap_or_default();
    counts.iter().sum()
}

/// A process's resident memory now (VmRSS), MiB.
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn run(args: &Args) -> Figures {
    let start = Instant::now();
    let server = LocalRedis::start(&["--notify-keyspace-events", "Exg"]).expect("redis-server");
    let client = redis::Client::open(server.url()).expect("redis url");
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the throwaway redis-server");
    let (hook, seen) = receiver(args.events, args.hold, start).await;
    let kw = start_keywatch(&server.url(), &hook, args.concurrency);
    let pid = kw.child.id();
    wait_subscribed(&mut c).await;
    let due = load(&mut c, args.events).await;
    eprintln!(
        "{} keys due in {:.1} s",
        args.events,
        (due - now_ms()) as f64 / 1000.0
    );
    let due_at = start + Duration::from_millis(u64::try_from(due - now_ms()).unwrap_or(0));
    let mut largest_rss: f64 = 0.0;
    let mut peak_queued = 0;
    let mut last_report = Instant::now();
    // Gives up when nothing new arrives for a minute.
    let mut last_progress = (0, Instant::now());
    while seen.distinct.load(Ordering::SeqCst) < args.events {
        tokio::time::sleep(Duration::from_millis(250)).await;
        largest_rss = largest_rss.max(rss_mib(pid));
        let queued = queued(&mut c).await;
        peak_queued = peak_queued.max(queued);
        let distinct = seen.distinct.load(Ordering::SeqCst);
        if distinct > last_progress.0 {
            last_progress = (distinct, Instant::now());
        } else if last_progress.1.elapsed() > Duration::from_secs(60) {
            eprintln!(
                "no progress for a minute: {distinct} of {} delivered; keywatch's log: {}",
                args.events,
                log_path().display()
            );
            break;
        }
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "{distinct} delivered, {queued} in the queue, {} in flight at most, RSS {:.0} MiB",
                seen.most.load(Ordering::SeqCst),
                rss_mib(pid)
            );
        }
    }
    // Requests still on their way would be duplicates: give them a moment to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delivered = seen.distinct.load(Ordering::SeqCst);
    let requests = seen.requests.load(Ordering::SeqCst);
    let last = start + Duration::from_micros(seen.last_us.load(Ordering::SeqCst));
    let figures = Figures {
        events: args.events,
        concurrency: args.concurrency,
        hold_ms: args.hold.as_millis() as u64,
        peak_in_flight: seen.most.load(Ordering::SeqCst),
        peak_rss_mib: peak_rss_mb(pid),
        largest_sampled_rss_mib: largest_rss,
        peak_queued,
        drain_s: last.saturating_duration_since(due_at).as_secs_f64(),
        delivered,
        requests,
        duplicates: requests.saturating_sub(delivered),
    };
    drop(kw);
    figures
}

fn main() -> std::process::ExitCode {
    let mut argv = std::env::args();
    if argv.nth(1).as_deref() == Some("--keywatch") {
        // The child: `keywatch` itself, as the binary runs it.
        let cli = <keywatch::command::Cli as clap::Parser>::parse_from(
            std::iter::once("keywatch".to_string()).chain(argv),
        );
        return keywatch::command::run(cli);
    }
    let args = parse_args();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let f = rt.block_on(run(&args));
    println!(
        "\nstorm: {} notify-only events at one instant, webhook answering in {} ms, concurrency {}\n",
        f.events, f.hold_ms, f.concurrency
    );
    println!("| figure | value |");
    println!("|---|---:|");
    println!("| peak requests in flight | {} |", f.peak_in_flight);
    println!("| keywatch peak RSS (VmHWM) | {:.0} MiB |", f.peak_rss_mib);
    println!(
        "| keywatch largest RSS sampled while draining | {:.0} MiB |",
        f.largest_sampled_rss_mib
    );
    println!("| most jobs in the queue in Redis | {} |", f.peak_queued);
    println!(
        "| time to drain (due instant → last delivery) | {:.1} s |",
        f.drain_s
    );
    println!(
        "| delivered / requests / duplicates | {} / {} / {} |",
        f.delivered, f.requests, f.duplicates
    );
    let ideal = f.events as f64 * f.hold_ms as f64 / 1000.0 / f.concurrency as f64;
    println!(
        "\nthe concurrency allows at best {ideal:.1} s ({:.0} % of that reached)",
        ideal / f.drain_s * 100.0
    );
    if let Some(p) = &args.save {
        let text = serde_json::to_string_pretty(&f).expect("figures as JSON");
        std::fs::write(p, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", p.display()));
        println!("saved to {}", p.display());
    }
    let ok = f.delivered == f.events && f.duplicates == 0 && f.peak_in_flight <= f.concurrency;
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(1)
    }
}
