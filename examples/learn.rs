//! How fast does keywatch learn the deadlines of a big keyspace, and what does its ledger cost?
//!
//! `cargo run --release --example learn [-- --keys 1000000 --pace 1000000 --over 86400]`
//!
//! On a throwaway redis-server: `--keys` keys `session:NNNNNNNN` (one value byte, deadlines spread
//! over a day from an hour on, or over `--over` seconds, so none expires during the run), one rule `session:{id}` on
//! `expired`. Then one fill of the ledger, as at start-up (SCAN + `PEXPIRETIME` + the ledger's
//! record, paced to `scanner.max_keys_per_second` from `--pace`). Prints the bytes per key of the
//! keys themselves and of the ledger (`used_memory` before and after), the keys learnt per
//! second, the redis-server CPU they took per key (and per command), and this process's peak RSS.
//! See docs/performance.md#learning-a-big-keyspace.

use std::sync::Arc;
use std::time::Instant;

use keywatch::config::{self, Mode};
use keywatch::keyspace::Keyspace;
use keywatch::local_redis::LocalRedis;
use keywatch::metrics::Metrics;
use keywatch::source::ledger::{Ledger, fill_all};

fn arg(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

async fn used_memory(c: &mut redis::aio::MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(c)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// `keys` session keys, deadlines random over `over_s` seconds from an hour on (so SCAN meets
/// them in no order of deadline).
async fn load(c: &mut redis::aio::MultiplexedConnection, keys: u64, over_s: u64) {
    let now: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let day = over_s * 1000;
    let all: Vec<u64> = (0..keys).collect();
    for chunk in all.chunks(10_000) {
        let mut p = redis::pipe();
        for &i in chunk {
            let key = format!("session:{i:08}");
            let at = now + 3_600_000 + fastrand::u64(..day);
            p.cmd("SET").arg(&key).arg("x").arg("PXAT").arg(at).ignore();
        }
        p.exec_async(c).await.unwrap();
    }
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let keys = arg("--keys").unwrap_or(1_000_000);
    let pace = arg("--pace").unwrap_or(1_000_000);
    let over = arg("--over").unwrap_or(86_400);
    let redis = LocalRedis::start(&[]).expect("a throwaway redis-server");
    let url = redis.url();
    // A pipeline of 10,000 `SET`s may take longer than the default half second while the
    // keyspace's table grows on a loaded machine: it ended runs of both builds in `timed out`.
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(60)));
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();

    let empty = used_memory(&mut c).await;
    let t = Instant::now();
    load(&mut c, keys, over).await;
    let loaded = used_memory(&mut c).await;
    println!(
        "loaded {keys} keys in {:.1} s: {:.1} bytes per key",
        t.elapsed().as_secs_f64(),
        (loaded - empty) as f64 / keys as f64
    );

    let dir = std::env::temp_dir().join(format!("keywatch-learn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.yaml");
    std::fs::write(
        &path,
        format!(
            "channels:\n  log: {{ type: log }}\nscanner:\n  schedule: \"@every 1h\"\n  max_keys_per_second: {pace}\nrules:\n  - name: session-ended\n    match: \"session:{{id}}\"\n    on: [expired]\n    notify: {{ to: [log] }}\n"
        ),
    )
    .unwrap();
    let loaded_config = config::load(&[path], Mode::Run, &|_| None).expect("rules load");
    let config = Arc::new(loaded_config.config);
    let keyspace = Keyspace::new(
        keywatch::config::Secret::new(url.clone()),
        config.redis.clone(),
    )
    .unwrap();
    let state = keyspace.conn(0).await.unwrap();
    let ledger = Ledger::new(state, keyspace, "keywatch:", Arc::new(Metrics::new()));

    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut c)
        .await
        .unwrap();
    let cpu_before = keywatch::proc_stats::cpu_secs(redis.pid());
    let t = Instant::now();
    fill_all(&ledger, &config, None).await;
    let took = t.elapsed().as_secs_f64();
    let redis_cpu = keywatch::proc_stats::cpu_secs(redis.pid()) - cpu_before;
    let learnt = ledger.indexed();
    let after = used_memory(&mut c).await;
    println!(
        "learnt {learnt} deadlines in {took:.1} s: {:.0} keys/s (max_keys_per_second {pace}); redis-server CPU {:.2} µs per key",
        learnt as f64 / took,
        redis_cpu * 1e6 / learnt.max(1) as f64
    );
    println!(
        "ledger: {:.1} bytes per key in Redis; peak RSS of this process {:.0} MB",
        (after - loaded) as f64 / keys as f64,
        keywatch::proc_stats::own_peak_rss_mb()
    );
    // Where redis-server's time went, per key learnt (`INFO commandstats`: a script's commands
    // are counted within the script's own time too).
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    for line in stats.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let usec: f64 = rest
            .split(',')
            .find_map(|f| f.strip_prefix("usec="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if usec / (learnt.max(1) as f64) >= 0.05 {
            println!("  {name:<12} {:.2} µs per key", usec / learnt.max(1) as f64);
        }
    }
    assert_eq!(learnt as u64, keys, "every deadline learnt");
    let _ = std::fs::remove_dir_all(&dir);
}
