//! The status page at `/`, loaded in a real headless chromium against a running daemon: an event
//! whose notification was sent and one whose notification was dead-lettered (a webhook that
//! answers 404) both show, key text is escaped, and a phone-sized screenshot is saved.
//!
//! Needs Debian's `chromium` (`.ci/run` installs it) or `KEYWATCH_CHROMIUM` naming a
//! Chromium/Chrome binary. Without one the test fails and says so; it never skips.

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, HttpReceiver, RedisServer, Response, endpoint, get};

/// Chromium's start-up is slow on a loaded CI machine; a page load never takes this long.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(90);

fn chromium() -> PathBuf {
    if let Some(v) = std::env::var_os("KEYWATCH_CHROMIUM").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        assert!(
            p.is_file(),
            "KEYWATCH_CHROMIUM={} is not a file; set it to a chromium binary or unset it",
            p.display()
        );
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Some(p) = std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
        {
            return p;
        }
    }
    panic!(
        "chromium was not found on PATH. The status page test needs a real headless browser: \
         install it (`apt-get install chromium`, as .ci/run does) or set KEYWATCH_CHROMIUM to a \
         chromium or chrome binary."
    );
}

/// Runs headless chromium with `extra` arguments on `url`; returns its stdout.
fn run_chromium(extra: &[String], url: &str) -> String {
    let profile = tempfile::Builder::new()
        .prefix("keywatch-chromium-")
        .tempdir()
        .expect("temp dir for the chromium profile");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=412,915",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + BROWSER_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for chromium") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within {BROWSER_TIMEOUT:?}\n{}",
                err.join().unwrap()
            );
        }
        // Polls chromium's exit (bounded by BROWSER_TIMEOUT above); not a fixed wait.
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "chromium failed ({status}):\n{err}");
    out
}

/// Waits until the status page (a plain GET of `/`, without a browser) shows `needle`.
fn wait_for_page(addr: &str, needle: &str) {
    common::poll(
        &format!("the status page shows {needle:?}"),
        common::PATIENCE,
        || get(addr, "/").1.contains(needle).then_some(()),
        || get(addr, "/").1,
    );
}

/// The text of `<section id="ID">` in `dom`.
fn section<'a>(dom: &'a str, id: &str) -> &'a str {
    let open = format!("<section id=\"{id}\">");
    let start = dom
        .find(&open)
        .unwrap_or_else(|| panic!("no {open} in the page:\n{dom}"));
    let rest = &dom[start..];
    &rest[..rest.find("</section>").expect("section end")]
}

#[test]
fn status_page_in_headless_chromium_shows_events_and_dead_letters() {
    // Fail at once, before starting anything, when there is no browser.
    chromium();
    let good = HttpReceiver::start();
    let gone = HttpReceiver::with_default(Response::status(404).body("no such hook"));
    let yaml = format!(
        r#"
channels:
  audit:
    type: webhook
    url: "{good}"
  retired:
    type: webhook
    url: "{gone}"
rules:
  - name: order-lock-timeout
    match: "order_lock:{{order_id}}"
    notify: {{ to: [audit, retired] }}
  - name: session-cleanup
    match: "session:{{sid}}"
    notify: {{ to: [audit] }}
"#,
        good = good.url_for("/hook"),
        gone = gone.url_for("/old-hook"),
    );
    let daemon = Daemon::start_with(RedisServer::with_events("Exg"), &yaml, &[]);
    let addr = endpoint(&daemon.process);

    // Markup in a key must be shown as text.
    let key = "order_lock:<b>42</b>";
    daemon.expire(key);
    daemon.dead_letter_on("retired");
    daemon.attempt_on("audit", "sent");

    // A key that expires later: the ledger learns its deadline and the page lists it.
    common::set_with_ttl(
        &mut daemon.conn(),
        "order_lock:7",
        "v",
        Duration::from_secs(3600),
    );
    wait_for_page(&addr, "order_lock:7");

    let url = format!("http://{addr}/");
    let dom = run_chromium(&["--dump-dom".to_string()], &url);
    let shown = "order_lock:&lt;b&gt;42&lt;/b&gt;";

    assert!(!dom.contains("<b>42</b>"), "key text became markup:\n{dom}");
    assert!(dom.contains("<title>keywatch status</title>"), "{dom}");
    assert!(
        dom.contains("id=\"ready\">ready<"),
        "the page does not say ready:\n{dom}"
    );
    let recent = section(&dom, "recent");
    assert!(
        recent.contains(shown),
        "recent events lack the key:\n{recent}"
    );
    assert!(recent.contains("order-lock-timeout"), "{recent}");
    assert!(recent.contains("notify:audit: sent"), "{recent}");
    assert!(recent.contains("notify:retired: dead"), "{recent}");
    let dead = section(&dom, "dead");
    assert!(dead.contains(shown), "dead letters lack the key:\n{dead}");
    assert!(dead.contains("notify:retired"), "{dead}");
    assert!(dead.contains("404"), "the reason names the answer:\n{dead}");
    let rules = section(&dom, "rules");
    assert!(rules.contains("order-lock-timeout"), "{rules}");
    assert!(rules.contains("1 matched"), "{rules}");
    assert!(rules.contains("1 dead"), "{rules}");
    assert!(rules.contains("session-cleanup"), "{rules}");
    let subscribers = section(&dom, "subscribers");
    assert!(subscribers.contains("subscribed"), "{subscribers}");
    assert!(subscribers.contains(&daemon.redis.addr()), "{subscribers}");
    assert!(section(&dom, "silences").contains("none"));
    let upcoming = section(&dom, "upcoming");
    assert!(upcoming.contains("order_lock:7"), "{upcoming}");
    assert!(upcoming.contains("in 59m"), "{upcoming}");

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    run_chromium(&[format!("--screenshot={}", shot.display())], &url);
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG: {}", shot.display());
    // The whole page, for a person to look at the sections below the fold.
    let full = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page-full.png");
    run_chromium(
        &[
            format!("--screenshot={}", full.display()),
            "--window-size=412,1800".to_string(),
        ],
        &url,
    );
    eprintln!(
        "status page screenshots: {} (phone screen), {} (whole page)",
        shot.display(),
        full.display()
    );

    daemon.stop();
}
