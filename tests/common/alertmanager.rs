//! A real Prometheus Alertmanager per test: Debian's `prometheus-alertmanager` (or upstream's
//! `alertmanager`), on a free loopback port, clustering off, its own storage folder, routing
//! every alert to a local [`HttpReceiver`] with short group timers so tests are quick.
//!
//! A missing binary fails the test with the fix (`apt-get install prometheus-alertmanager`,
//! which `.ci/run` does), never skips it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http_receiver::HttpReceiver;
use super::ports::free_port;
use super::wait::{PATIENCE, poll};

/// The Alertmanager binary: `KEYWATCH_ALERTMANAGER`, else `prometheus-alertmanager` (Debian)
/// or `alertmanager` (upstream) on `PATH`. Panics saying how to install it.
pub fn alertmanager_bin() -> PathBuf {
    if let Some(v) = std::env::var_os("KEYWATCH_ALERTMANAGER").filter(|v| !v.is_empty()) {
        return PathBuf::from(v);
    }
    for name in ["prometheus-alertmanager", "alertmanager"] {
        if let Some(found) = on_path(name) {
            return found;
        }
    }
    panic!(
        "no Alertmanager binary: these tests run a real Prometheus Alertmanager. Install it \
         (`apt-get install prometheus-alertmanager`; `.ci/run` does) or set KEYWATCH_ALERTMANAGER \
         to an `alertmanager` binary."
    )
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// One Alertmanager child, killed when dropped.
pub struct Alertmanager {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    config: PathBuf,
    /// Storage folders used so far: a fresh start gets a new one.
    starts: usize,
}

/// The route of every test Alertmanager: one group per rule (`alertname`), notifications a
/// second after the first alert of a group and a second after each change, resolved ones too.
fn config_yaml(hook: &str) -> String {
    format!(
        "route:\n  receiver: hook\n  group_by: [alertname]\n  group_wait: 2s\n  group_interval: 1s\n  repeat_interval: 1h\n\
         receivers:\n  - name: hook\n    webhook_configs:\n      - url: \"{hook}\"\n        send_resolved: true\n"
    )
}

impl Alertmanager {
    /// Starts one that sends its notifications to `receiver` at `/hook`.
    pub fn start(receiver: &HttpReceiver) -> Alertmanager {
        let dir = tempfile::tempdir().expect("a temp dir for Alertmanager");
        let config = dir.path().join("alertmanager.yml");
        std::fs::write(&config, config_yaml(&receiver.url_for("/hook"))).unwrap();
        let mut am = Alertmanager {
            child: None,
            port: 0,
            dir,
            config,
            starts: 0,
        };
        for _ in 0..5 {
            am.port = free_port();
            if am.spawn() {
                return am;
            }
        }
        panic!("Alertmanager did not start on any of 5 free ports");
    }

    /// `http://127.0.0.1:PORT`, for a channel's `urls`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts the child on `self.port` with a storage folder of its own; false when it exited
    /// (the port was taken meanwhile).
    fn spawn(&mut self) -> bool {
        self.starts += 1;
        let storage = self.dir.path().join(format!("data-{}", self.starts));
        std::fs::create_dir_all(&storage).unwrap();
        let log =
            std::fs::File::create(self.dir.path().join(format!("am-{}.log", self.starts))).unwrap();
        let child = Command::new(alertmanager_bin())
            .arg(format!("--config.file={}", self.config.display()))
            .arg(format!("--storage.path={}", storage.display()))
            .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
            .arg("--cluster.listen-address=")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", alertmanager_bin().display()));
        self.child = Some(child);
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                self.child = None;
                return false;
            }
            if matches!(self.request("GET", "/-/ready", None), Some((200, _))) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "Alertmanager was not ready within {PATIENCE:?}:\n{}",
            self.log()
        );
    }

    /// Its log so far (the current start's).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("am-{}.log", self.starts)))
            .unwrap_or_default()
    }

    /// Kills it (SIGKILL: it keeps alerts in memory only, so they are gone).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it and starts a new one on the same port with an empty storage folder: no alert,
    /// no silence, no notification log.
    pub fn restart_afresh(&mut self) {
        self.kill();
        let deadline = Instant::now() + PATIENCE;
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "Alertmanager could not start again on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The alerts it holds (`GET /api/v2/alerts`: active, silenced and inhibited, not resolved).
    pub fn alerts(&self) -> Vec<Value> {
        match self.request("GET", "/api/v2/alerts", None) {
            Some((200, body)) => serde_json::from_str::<Vec<Value>>(&body).unwrap_or_default(),
            other => panic!("GET /api/v2/alerts: {other:?}"),
        }
    }

    /// Waits until it holds an alert with label `key` = `key`; returns it.
    pub fn wait_for_alert(&self, key: &str) -> Value {
        self.wait_for_alert_within(key, PATIENCE)
    }

    /// [`Alertmanager::wait_for_alert`], panicking after `timeout`: for a bound that is part of
    /// what a test shows (an alert back within a few `resend`s).
    pub fn wait_for_alert_within(&self, key: &str, timeout: Duration) -> Value {
        poll(
            &format!("Alertmanager holds an alert of {key} (within {timeout:?})"),
            timeout,
            || {
                self.alerts()
                    .into_iter()
                    .find(|a| a["labels"]["key"] == key)
            },
            || self.log(),
        )
    }

    /// A silence (API v2) matching `label` = `value` exactly, for an hour; its id.
    pub fn silence(&self, label: &str, value: &str) -> String {
        let now = chrono::Utc::now();
        let body = json!({
            "matchers": [{"name": label, "value": value, "isRegex": false, "isEqual": true}],
            "startsAt": now.to_rfc3339(),
            "endsAt": (now + chrono::Duration::hours(1)).to_rfc3339(),
            "createdBy": "keywatch tests",
            "comment": "muted by a test",
        });
        match self.request("POST", "/api/v2/silences", Some(body)) {
            Some((200, answer)) => serde_json::from_str::<Value>(&answer).unwrap()["silenceID"]
                .as_str()
                .unwrap()
                .to_string(),
            other => panic!("POST /api/v2/silences: {other:?}"),
        }
    }

    /// (status, body) of one request to its API; `None` when it cannot be reached.
    pub fn request(&self, method: &str, path: &str, body: Option<Value>) -> Option<(u16, String)> {
        let url = format!("{}{path}", self.url());
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let client = reqwest::Client::new();
            let mut req = client.request(method, &url).timeout(Duration::from_secs(5));
            if let Some(b) = body {
                req = req.json(&b);
            }
            let resp = req.send().await.ok()?;
            let status = resp.status().as_u16();
            Some((status, resp.text().await.unwrap_or_default()))
        })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The notifications Alertmanager sent to `receiver` (its webhook JSON, version 4), in order.
pub fn notifications(receiver: &HttpReceiver) -> Vec<Value> {
    receiver
        .requests()
        .iter()
        .filter(|r| r.path() == "/hook")
        .map(|r| r.json())
        .collect()
}

/// The `key` labels of a notification's alerts, sorted.
pub fn keys_of(notification: &Value) -> Vec<String> {
    let mut keys: Vec<String> = notification["alerts"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x["labels"]["key"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    keys.sort();
    keys
}

/// Waits until Alertmanager has sent `receiver` a notification that `pred` accepts; returns it.
pub fn wait_for_notification(
    receiver: &HttpReceiver,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    poll(
        &format!("Alertmanager notifies {what}"),
        PATIENCE,
        || notifications(receiver).into_iter().find(|n| pred(n)),
        || format!("notifications so far: {:#?}", notifications(receiver)),
    )
}
