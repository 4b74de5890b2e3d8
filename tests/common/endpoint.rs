//! keywatch's own HTTP endpoint (`--listen`): its address from the start-up log, plain requests,
//! and metric sums.

use super::daemon::KeywatchProcess;
use super::wait::PATIENCE;

/// The HTTP endpoint's address, from its `listening` internal event (text or JSON logs).
pub fn endpoint(kw: &KeywatchProcess) -> String {
    let listening = kw.events("listening");
    let event = listening.first().expect("the endpoint's `listening` event");
    event["addr"]
        .as_str()
        .expect("the `listening` event's addr")
        .to_string()
}

/// The HTTP endpoint's address once `kw` has emitted its `listening` internal event.
pub fn wait_for_endpoint(kw: &mut KeywatchProcess) -> String {
    kw.wait_for_event("listening", "of the HTTP endpoint", |_| true);
    endpoint(kw)
}

/// (status, body) of a plain GET.
pub fn get(addr: &str, path: &str) -> (u16, String) {
    http(addr, "GET", path)
}

/// (status, body) of a POST without a body.
pub fn post(addr: &str, path: &str) -> (u16, String) {
    http(addr, "POST", path)
}

fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect to the HTTP endpoint");
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    // One write: `write!` sends each piece of the format as a segment of its own, and Nagle's
    // algorithm holds the second until the server's (delayed, 40 ms) ACK of the first.
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The sum of the samples of the metric lines starting with `prefix`.
pub fn metric(body: &str, prefix: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
