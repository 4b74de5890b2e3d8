//! What an idle keywatch costs the Redis it watches: commands per second and Redis CPU while
//! nothing is due (docs/performance.md#an-idle-instance).
//!
//! ```text
//! cargo build --release
//! cargo run --release --example idle [-- --keywatch target/release/keywatch]
//!                                    [--baseline PATH] [--keys 50000] [--secs 30]
//! ```
//!
//! On a throwaway redis-server (`notify-keyspace-events Exg`): `--keys` keys `session:NNNNNNNN`
//! in each of databases 0 and 1, deadlines spread over a day from an hour on (none falls due
//! during the run), one rule per database. Measured over `--secs` seconds each, from
//! `INFO commandstats` and `INFO cpu` (`used_cpu_sys` + `used_cpu_user`) deltas: Redis alone,
//! then with one `keywatch run`, then with three, each started instance first having learnt
//! every deadline (its log says so for both databases) and a few seconds more to settle. The
//! subscriber's pushes are messages, not commands, and are not counted; the example's own
//! `INFO` is taken out. Also the instances' own CPU (`/proc/PID/stat`), per instance.
//!
//! `--baseline PATH` runs the same on a fresh server with another build of the binary (say,
//! `target/release/keywatch` of an older commit, copied aside), and prints both in one table.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keywatch::local_redis::LocalRedis;
use keywatch::proc_stats::cpu_secs;

/// Settling time after every instance has learnt its deadlines: start-up's one-off work (the
/// reconcile walk, a first marker) is not what an idle instance costs.
const SETTLE: Duration = Duration::from_secs(5);
const DATABASES: [u32; 2] = [0, 1];

struct Args {
    keywatch: PathBuf,
    baseline: Option<PathBuf>,
    keys: u64,
    secs: u64,
}

fn parse_args() -> Args {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    Args {
        keywatch: value("--keywatch").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/release/keywatch"),
            PathBuf::from,
        ),
        baseline: value("--baseline").map(PathBuf::from),
        keys: value("--keys")
            .and_then(|v| v.parse().ok())
            .unwrap_or(50_000),
        secs: value("--secs").and_then(|v| v.parse().ok()).unwrap_or(30),
    }
}

/// `keys` session keys in each database, deadlines random over a day from an hour on.
async fn load(c: &mut redis::aio::MultiplexedConnection, keys: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for db in DATABASES {
        let all: Vec<u64> = (0..keys).collect();
        for chunk in all.chunks(10_000) {
            let mut p = redis::pipe();
            p.cmd("SELECT").arg(db).ignore();
            for &i in chunk {
                let at = now + 3_600_000 + fastrand::u64(..86_400_000);
                p.cmd("SET")
                    .arg(format!("session:{i:08}"))
                    .arg("x")
                    .arg("PXAT")
                    .arg(at)
                    .ignore();
            }
            p.exec_async(c).await.unwrap();
        }
    }
    let () = redis::cmd("SELECT").arg(0).query_async(c).await.unwrap();
}

/// One `keywatch run`, killed when dropped; its log in a file of its own.
struct Instance {
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(exe: &Path, url: &str, n: usize) -> Instance {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    let mut text =
        String::from("redis: { databases: [0, 1] }\nchannels:\n  console: { type: log }\nrules:\n");
    for db in DATABASES {
        text.push_str(&format!(
            "  - name: sessions-{db}\n    match: \"session:{{id}}\"\n    db: {db}\n    notify: {{ to: [console] }}\n"
        ));
    }
    std::fs::write(&rules, text).unwrap();
    let log = std::env::temp_dir().join(format!("keywatch-idle-{}-{n}.log", std::process::id()));
    let child = Command::new(exe)
        .args(["run", "-r"])
        .arg(&rules)
        .args(["--redis", url, "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
    Instance {
        child,
        log,
        _dir: dir,
    }
}

/// Waits until the instance's log says it learnt the deadlines of both databases.
async fn learnt(i: &Instance) {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&i.log).unwrap_or_default();
        if text
            .matches("Ledger: learnt the deadlines of existing keys.")
            .count()
            >= DATABASES.len()
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "keywatch did not learn its deadlines within 5 minutes; its log: {}",
            i.log.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `INFO commandstats` and `INFO cpu` at once: calls per command, and CPU seconds.
async fn snapshot(c: &mut redis::aio::MultiplexedConnection) -> (Vec<(String, u64)>, f64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query_async(c)
        .await
        .unwrap();
    let mut cpu = 0.0;
    let mut calls = Vec::new();
    for l in info.lines() {
        if let Some(v) = l
            .strip_prefix("used_cpu_sys:")
            .or_else(|| l.strip_prefix("used_cpu_user:"))
        {
            cpu += v.trim().parse::<f64>().unwrap_or(0.0);
        }
        if let Some((name, rest)) = l.strip_prefix("cmdstat_").and_then(|l| l.split_once(':')) {
            let n = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            calls.push((name.to_string(), n));
        }
    }
    (calls, cpu)
}

/// What Redis did over `secs`: commands per second by command (most first), and the CPU share of
/// a core.
struct Span {
    per_command: Vec<(String, f64)>,
    cpu_percent: f64,
    /// The keywatch instances' own CPU over the span, per instance, in % of a core.
    keywatch_percent: f64,
}

impl Span {
    fn total(&self) -> f64 {
        self.per_command.iter().fold(0.0, |sum, (_, r)| sum + r)
    }
}

async fn measure(c: &mut redis::aio::MultiplexedConnection, secs: u64, pids: &[u32]) -> Span {
    let own = |pids: &[u32]| pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
    let (before, cpu0) = snapshot(c).await;
    let kw0 = own(pids);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (after, cpu1) = snapshot(c).await;
    let kw1 = own(pids);
    let elapsed = t0.elapsed().as_secs_f64();
    let mut per_command: Vec<(String, f64)> = after
        .into_iter()
        .map(|(name, n)| {
            let was = before.iter().find(|b| b.0 == name).map_or(0, |b| b.1);
            // The first snapshot's own INFO is counted in the second.
            let own = u64::from(name == "info");
            (name, n.saturating_sub(was + own) as f64 / elapsed)
        })
        .filter(|(_, r)| *r > 0.0)
        .collect();
    per_command.sort_by(|a, b| b.1.total_cmp(&a.1));
    Span {
        per_command,
        cpu_percent: (cpu1 - cpu0) / elapsed * 100.0,
        keywatch_percent: (kw1 - kw0) / elapsed * 100.0 / pids.len().max(1) as f64,
    }
}

/// Redis alone, one instance, three instances of `exe`.
async fn series(exe: &Path, keys: u64, secs: u64) -> Vec<(usize, Span)> {
    let server = LocalRedis::start(&["--notify-keyspace-events", "Exg"]).expect("redis-server");
    let client = redis::Client::open(server.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    load(&mut c, keys).await;
    let mut out = Vec::new();
    eprintln!("{}: Redis alone, {secs} s", exe.display());
    out.push((0, measure(&mut c, secs, &[]).await));
    let mut instances = Vec::new();
    for want in [1, 3] {
        while instances.len() < want {
            let i = start(exe, &server.url(), instances.len());
            learnt(&i).await;
            instances.push(i);
        }
        tokio::time::sleep(SETTLE).await;
        eprintln!("{}: {want} instance(s), {secs} s", exe.display());
        let pids: Vec<u32> = instances.iter().map(|i| i.child.id()).collect();
        out.push((want, measure(&mut c, secs, &pids).await));
    }
    out
}

fn print(name: &str, rows: &[(usize, Span)]) {
    let alone = rows.first().map_or(0.0, |(_, s)| s.cpu_percent);
    for (n, s) in rows {
        let who = match n {
            0 => "Redis alone".to_string(),
            1 => "+ 1 instance".to_string(),
            n => format!("+ {n} instances"),
        };
        let per = if *n == 0 {
            String::new()
        } else {
            format!("{:.1}", s.total() / *n as f64)
        };
        let (added, own) = if *n == 0 {
            (String::new(), String::new())
        } else {
            (
                format!("{:+.2} %", (s.cpu_percent - alone) / *n as f64),
                format!("{:.2} %", s.keywatch_percent),
            )
        };
        let top: Vec<String> = s
            .per_command
            .iter()
            .take(8)
            .map(|(c, r)| format!("{} {r:.1}", c.to_uppercase()))
            .collect();
        println!(
            "| {name} | {who} | {:.1} | {per} | {:.2} % | {added} | {own} | {} |",
            s.total(),
            s.cpu_percent,
            top.join(", ")
        );
    }
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let mut results = Vec::new();
    if let Some(b) = &args.baseline {
        results.push(("baseline", series(b, args.keys, args.secs).await));
    }
    results.push((
        "this build",
        series(&args.keywatch, args.keys, args.secs).await,
    ));
    println!(
        "\n{} keys in each of databases 0 and 1, deadlines over a day from an hour on; {} s each\n",
        args.keys, args.secs
    );
    println!(
        "| build | | commands/s | per instance | Redis CPU (of a core) | added per instance | keywatch CPU per instance | commands/s by command |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---|");
    for (name, rows) in &results {
        print(name, rows);
    }
}
