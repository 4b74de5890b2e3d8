//! Peak memory and CPU time of a process, read from `/proc`: what the load tools in `examples/`
//! report beside their timings, so a regression in memory or CPU shows even when the machine's
//! load blurs the wall-clock figures. Linux only; elsewhere the figures are NaN.

/// Peak resident set of process `pid` (`VmHWM`), MB.
pub fn peak_rss_mb(pid: u32) -> f64 {
    status_field(&format!("/proc/{pid}/status"), "VmHWM:").map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Peak resident set of this process, MB.
pub fn own_peak_rss_mb() -> f64 {
    status_field("/proc/self/status", "VmHWM:").map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Makes this process's peak resident set (`VmHWM`) start again from what it holds now, so a
/// tool measures the peak of one phase (Linux's `/proc/self/clear_refs`); where that cannot be
/// done the peak stays the process's.
pub fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// CPU seconds process `pid` has used so far (user + system).
pub fn cpu_secs(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The fields after the command name, which is in parentheses and may hold spaces.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        })
        // Clock ticks; USER_HZ is 100 on every Linux this runs on.
        .map_or(f64::NAN, |ticks| ticks / 100.0)
}

fn status_field(path: &str, name: &str) -> Option<f64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find(|l| l.starts_with(name))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_cpu_time() {
        let rss = own_peak_rss_mb();
        assert!(rss > 0.1 && rss < 100_000.0, "{rss}");
        // The same figure by pid (other test threads may have raised the peak since).
        assert!(peak_rss_mb(std::process::id()) >= rss);
        // Burn a little CPU so the counter cannot be zero by rounding alone.
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        assert!(cpu_secs(std::process::id()) > 0.0);
    }
}
