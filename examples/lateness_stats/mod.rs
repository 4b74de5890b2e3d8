//! What the two lateness examples (`lateness`, `field_lateness`) share: their arguments, the
//! clock they stamp with, and the percentiles they report.

use std::time::{SystemTime, UNIX_EPOCH};

/// Unix ms on this host's clock (the examples' server runs on the same host).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The sample count, median, 99th percentile and largest of a set of latenesses (ms).
pub struct Stats {
    pub n: usize,
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
}

pub fn stats(mut v: Vec<i64>) -> Stats {
    v.sort_unstable();
    let q = |p: f64| {
        v.get(((v.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(-1)
    };
    Stats {
        n: v.len(),
        p50: q(0.5),
        p99: q(0.99),
        max: v.last().copied().unwrap_or(-1),
    }
}
