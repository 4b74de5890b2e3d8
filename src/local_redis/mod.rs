//! A throwaway `redis-server` child on a free loopback port, for `keywatch demo` and the
//! benchmark tools: it never touches a Redis the user already runs, and it is killed (and its
//! folder removed) when dropped. Where no server is installed, [`fetch`] fetches
//! a pinned valkey-server, so a machine with only Rust can run the tour.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

pub mod fetch;

use fetch::FetchError;

#[derive(Debug, thiserror::Error)]
pub enum LocalRedisError {
    #[error(
        "redis-server was not found ({0}). Install it (Debian/Ubuntu: `apt-get install redis-server`, macOS: `brew install redis`) or point KEYWATCH_REDIS_SERVER at a redis-server or valkey-server binary."
    )]
    NoServer(String),
    #[error(
        "no redis-server or valkey-server is on the PATH, and fetching valkey-server failed: {0}. Install one (Debian/Ubuntu: `apt-get install redis-server`, macOS: `brew install redis`) or point KEYWATCH_REDIS_SERVER at a redis-server or valkey-server binary."
    )]
    Fetch(#[from] FetchError),
    #[error("cannot start redis-server: {0}")]
    Start(String),
}

pub struct LocalRedis {
    child: std::process::Child,
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

impl Drop for LocalRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl LocalRedis {
    /// Starts a server with `--save "" --appendonly no` plus `extra` arguments, and waits until
    /// it answers PING.
    pub fn start(extra: &[&str]) -> Result<LocalRedis, LocalRedisError> {
        Self::start_binary(fetch::server_binary()?, extra)
    }

    /// [`LocalRedis::start`] with the server binary `bin` (say, [`fetch::valkey_binary`]
    /// where hash-field expiry is needed).
    pub fn start_binary(
        bin: std::path::PathBuf,
        extra: &[&str],
    ) -> Result<LocalRedis, LocalRedisError> {
        let shown = bin.display();
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| LocalRedisError::Start(e.to_string()))?
                .port();
            let dir =
                std::env::temp_dir().join(format!("keywatch-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| LocalRedisError::Start(e.to_string()))?;
            let child = std::process::Command::new(&bin)
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .arg("--dir")
                .arg(&dir)
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        LocalRedisError::NoServer(format!("`{shown}`: {e}"))
                    }
                    _ => LocalRedisError::Start(e.to_string()),
                })?;
            let mut server = LocalRedis {
                child,
                port,
                dir,
                bin: bin.clone(),
            };
            for _ in 0..100 {
                if let Ok(Some(_)) = server.child.try_wait() {
                    break; // the port was taken between our probe and its bind: try another
                }
                if let Ok(c) = redis::Client::open(server.url())
                    && let Ok(mut conn) = c.get_connection_with_timeout(Duration::from_millis(200))
                    && redis::cmd("PING").query::<String>(&mut conn).is_ok()
                {
                    return Ok(server);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Err(LocalRedisError::Start(format!(
            "`{shown}` did not come up on a free port"
        )))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server binary this child runs, for telling the user which one that was.
    pub fn binary(&self) -> &std::path::Path {
        &self.bin
    }
}

/// A throwaway redis-server and a connection to it, for tests of the modules that keep state
/// (the server lives as long as the returned value).
#[cfg(test)]
pub async fn throwaway() -> (LocalRedis, crate::keyspace::Conn) {
    let server = tokio::task::spawn_blocking(|| LocalRedis::start(&[]))
        .await
        .unwrap()
        .expect("a throwaway redis-server");
    let client = redis::Client::open(server.url()).unwrap();
    let conn = crate::keyspace::Conn::Node(
        redis::aio::ConnectionManager::new(client.clone())
            .await
            .unwrap(),
        Some(std::sync::Arc::new(client)),
    );
    (server, conn)
}
