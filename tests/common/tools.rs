//! Where `redis-server` is.
//!
//! Tests never skip themselves when `redis-server` is missing: a skipped test looks like a passing
//! one in CI. They fail and say how to fix it.

use std::path::{Path, PathBuf};

/// The `redis-server` (or `valkey-server`) binary: `KEYWATCH_REDIS_SERVER`, else `redis-server`
/// on `PATH`. Panics with installation advice when neither exists.
pub fn redis_server_bin() -> PathBuf {
    find_tool(
        "KEYWATCH_REDIS_SERVER",
        "redis-server",
        "a redis-server or valkey-server binary",
    )
}

/// The pinned valkey-server 9.1.2 (hash-field expiry), whatever `redis-server` is:
/// `KEYWATCH_VALKEY_SERVER`, else fetched once into the cache (`.ci/valkey-server` fetches the
/// same pin). Panics saying how to fix it when it cannot be had.
pub fn valkey_server_bin() -> PathBuf {
    keywatch::local_redis::fetch::valkey_binary().unwrap_or_else(|e| {
        panic!(
            "these tests need valkey-server 9.1.2 (hash-field expiry), and it could not be fetched: \
             {e}. Fetch it with `bash .ci/valkey-server` (needs the network once) and set \
             KEYWATCH_VALKEY_SERVER to the path it prints, or point KEYWATCH_VALKEY_SERVER at a \
             valkey-server 9.x you have."
        )
    })
}

fn find_tool(variable: &str, name: &str, what: &str) -> PathBuf {
    if let Some(value) = std::env::var_os(variable).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        if let Some(found) = resolve(&path) {
            return found;
        }
        panic!(
            "{variable}={} does not name an executable file; set it to {what}, or unset it to use \
             `{name}` from PATH",
            path.display()
        );
    }
    if let Some(found) = resolve(Path::new(name)) {
        return found;
    }
    panic!(
        "`{name}` was not found on PATH. These tests need a real server: install it \
         (`apt-get install redis-server`) or set {variable} to {what}."
    );
}

/// `path` itself if it contains a slash, else the first executable of that name on `PATH`.
fn resolve(path: &Path) -> Option<PathBuf> {
    if path.components().count() > 1 {
        return is_executable(path).then(|| path.to_path_buf());
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(path))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// libfaketime, which the clock drill runs keywatch under and the quiet-hours drills run Redis
/// under (.ci/run installs it): `KEYWATCH_LIBFAKETIME`, else Debian's path. Panics saying how to
/// install it when it is missing.
pub fn libfaketime() -> String {
    let path = std::env::var("KEYWATCH_LIBFAKETIME")
        .unwrap_or_else(|_| "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1".into());
    assert!(
        Path::new(&path).exists(),
        "this drill needs libfaketime at {path}: `apt-get install libfaketime` (or set KEYWATCH_LIBFAKETIME)"
    );
    path
}
