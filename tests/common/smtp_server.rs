//! A real SMTP server for the email tests: Python's aiosmtpd (`smtp_server.py` beside this file)
//! as a child on a loopback port, with STARTTLS or implicit TLS, AUTH, and scripted answers to
//! DATA ([`SmtpServerBuilder`]).
//!
//! Every mail it accepts is read back as a [`Mail`]: the exact bytes received, the envelope, the
//! login, whether TLS was on, and the headers and parts as Python's own mail parser decodes them
//! (independently of lettre). Every DATA and AUTH is an [`SmtpServer::events`] line.
//!
//! Tests never skip when aiosmtpd is missing: they fail saying how to install it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::wait::PATIENCE;

/// The Python that runs the server: `KEYWATCH_PYTHON`, else `python3`. Panics saying how to
/// install aiosmtpd when it cannot import it.
pub fn python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let python = std::env::var("KEYWATCH_PYTHON")
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "python3".into());
        let out = Command::new(&python)
            .args(["-c", "import aiosmtpd"])
            .output();
        match out {
            Ok(o) if o.status.success() => python,
            Ok(o) => panic!(
                "the email tests need Python's aiosmtpd (a real SMTP server), which `{python}` cannot import: \
                 install it with `{python} -m pip install aiosmtpd==1.4.6` (./.ci/run does), or set \
                 KEYWATCH_PYTHON to a Python that has it.\n{}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => panic!(
                "the email tests need python3 with aiosmtpd and cannot run `{python}` ({e}): install \
                 python3 and `python3 -m pip install aiosmtpd==1.4.6`, or set KEYWATCH_PYTHON"
            ),
        }
    })
}

/// How to start an [`SmtpServer`].
#[derive(Default)]
pub struct SmtpServerBuilder {
    port: u16,
    replies: Vec<String>,
    tls: Option<(PathBuf, PathBuf, bool)>,
    login: Option<(String, String)>,
}

impl SmtpServerBuilder {
    /// Listen on `port` (a port a test kept free), instead of one the server picks.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Answer the next DATA with `line` (e.g. `451 4.3.0 Try again later`) instead of accepting
    /// the mail; replies are used in the order given, then mails are accepted.
    pub fn reply(mut self, line: &str) -> Self {
        self.replies.push(line.to_string());
        self
    }

    /// Offer STARTTLS with this certificate and key, and require it before anything else.
    pub fn starttls(mut self, cert: &Path, key: &Path) -> Self {
        self.tls = Some((cert.to_path_buf(), key.to_path_buf(), false));
        self
    }

    /// TLS from the first byte (`smtps://`).
    pub fn implicit_tls(mut self, cert: &Path, key: &Path) -> Self {
        self.tls = Some((cert.to_path_buf(), key.to_path_buf(), true));
        self
    }

    /// Require AUTH with these credentials; a wrong password gets a 535 that echoes it.
    pub fn login(mut self, user: &str, password: &str) -> Self {
        self.login = Some((user.to_string(), password.to_string()));
        self
    }

    pub fn start(self) -> SmtpServer {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-smtp-")
            .tempdir()
            .expect("create a temp dir for received mail");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/smtp_server.py");
        let mut cmd = Command::new(python());
        cmd.arg(&script)
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--dir")
            .arg(dir.path());
        for r in &self.replies {
            cmd.arg("--reply").arg(r);
        }
        if let Some((cert, key, implicit)) = &self.tls {
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
            if *implicit {
                cmd.arg("--implicit-tls");
            }
        }
        if let Some((user, password)) = &self.login {
            cmd.args(["--user", user, "--password", password]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", script.display()));
        let events: Events = Arc::default();
        let stdout = child.stdout.take().expect("piped stdout");
        let recorded = Arc::clone(&events);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let value = serde_json::from_str(&line).unwrap_or(Value::String(line));
                let (lock, changed) = &*recorded;
                lock.lock().unwrap_or_else(|e| e.into_inner()).push(value);
                changed.notify_all();
            }
            let (lock, changed) = &*recorded;
            lock.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Value::String("<exited>".into()));
            changed.notify_all();
        });
        let mut server = SmtpServer {
            child,
            port: 0,
            dir,
            events,
            reader: Some(reader),
        };
        let ready = server.wait_for_event("the SMTP server to listen", PATIENCE, |e| {
            e.get("ready").is_some() || e == "<exited>"
        });
        match ready["ready"].as_u64() {
            Some(port) => server.port = port as u16,
            None => {
                let mut stderr = String::new();
                if let Some(mut e) = server.child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut stderr);
                }
                panic!("the SMTP server did not start:\n{stderr}");
            }
        }
        server
    }
}

type Events = Arc<(Mutex<Vec<Value>>, Condvar)>;

/// A running aiosmtpd; killed when dropped.
pub struct SmtpServer {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    events: Events,
    reader: Option<JoinHandle<()>>,
}

/// One mail the server accepted.
#[derive(Clone, Debug)]
pub struct Mail {
    /// The bytes after DATA, as received.
    pub raw: Vec<u8>,
    pub mail_from: String,
    pub rcpt_tos: Vec<String>,
    /// Who logged in with AUTH, if anyone.
    pub login: Option<String>,
    pub tls: bool,
    /// Every header as Python's mail parser decodes it (RFC 2047 words decoded), in order.
    pub headers: Vec<(String, String)>,
    /// The leaf parts: content type and decoded text.
    pub parts: Vec<(String, String)>,
    /// What Python's parser found wrong with the mail.
    pub defects: Vec<String>,
}

impl Mail {
    /// The decoded value of the one header `name` (case-insensitive); panics if it appears more
    /// than once.
    pub fn header(&self, name: &str) -> Option<&str> {
        let found: Vec<&str> = self
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect();
        assert!(
            found.len() <= 1,
            "header {name} appears {} times",
            found.len()
        );
        found.first().copied()
    }

    /// The decoded text of the part of content type `ty` (`text/plain`, `text/html`).
    pub fn part(&self, ty: &str) -> &str {
        self.parts
            .iter()
            .find(|(t, _)| t == ty)
            .map(|(_, text)| text.as_str())
            .unwrap_or_else(|| panic!("no {ty} part in {:?}", self.parts))
    }

    pub fn raw_text(&self) -> String {
        String::from_utf8_lossy(&self.raw).into_owned()
    }
}

impl SmtpServer {
    pub fn builder() -> SmtpServerBuilder {
        SmtpServerBuilder::default()
    }

    /// A plain server (no TLS, no AUTH) accepting every mail.
    pub fn start() -> SmtpServer {
        SmtpServer::builder().start()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every line the server reported so far: `{"ready"}`, `{"data", "reply"[, "accepted"]}`,
    /// `{"auth", "login", "ok"}`.
    pub fn events(&self) -> Vec<Value> {
        self.events
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The DATA commands answered so far (accepted or not).
    pub fn datas(&self) -> usize {
        self.events()
            .iter()
            .filter(|e| e.get("data").is_some())
            .count()
    }

    /// Waits for a reported line matching `pred`; panics after `timeout` saying `what`.
    pub fn wait_for_event(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        let (lock, changed) = &*self.events;
        let mut events = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = events.iter().find(|e| pred(e)) {
                return e.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                panic!("no {what} within {timeout:?}; the SMTP server reported {events:?}");
            }
            events = changed
                .wait_timeout(events, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The mails accepted so far, in order.
    pub fn mails(&self) -> Vec<Mail> {
        let mut out = Vec::new();
        for n in 1.. {
            let stem = self.dir.path().join(format!("{n:04}"));
            let Ok(meta) = std::fs::read(stem.with_extension("json")) else {
                break;
            };
            let meta: Value = serde_json::from_slice(&meta).expect("the server's JSON");
            let raw = std::fs::read(stem.with_extension("eml")).expect("the mail's bytes");
            let strings = |v: &Value| -> Vec<String> {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            };
            let pairs = |v: &Value, a: &str, b: &str| -> Vec<(String, String)> {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        let get = |k: &str| match &p[k] {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        match p {
                            Value::Array(kv) => (
                                kv[0].as_str().unwrap_or_default().to_string(),
                                kv[1].as_str().unwrap_or_default().to_string(),
                            ),
                            _ => (get(a), get(b)),
                        }
                    })
                    .collect()
            };
            out.push(Mail {
                raw,
                mail_from: meta["mail_from"].as_str().unwrap_or_default().to_string(),
                rcpt_tos: strings(&meta["rcpt_tos"]),
                login: meta["login"].as_str().map(String::from),
                tls: meta["tls"] == true,
                headers: pairs(&meta["headers"], "", ""),
                parts: pairs(&meta["parts"], "type", "text"),
                defects: strings(&meta["defects"]),
            });
        }
        out
    }

    /// Waits until `n` mails were accepted, and returns them.
    pub fn wait_for_mails(&self, n: usize, timeout: Duration) -> Vec<Mail> {
        self.wait_for_event(&format!("{n} accepted mail(s)"), timeout, |e| {
            e["accepted"].as_u64().is_some_and(|a| a >= n as u64)
        });
        self.mails()
    }
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}
