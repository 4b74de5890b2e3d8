//! The allocator keywatch ships with, and how soon it gives freed memory back.

/// A storm of expiries allocates and frees small buffers on every worker thread (firings,
/// rendered templates, HTTP requests); glibc's allocator spent about a third of a mass expiry's
/// CPU in malloc and free. Declared in the library, not in `main.rs`, so the examples that run
/// `keywatch run` in-process measure the allocator the binary ships with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long mimalloc keeps freed memory before it gives it back to the system, unless
/// `MIMALLOC_PURGE_DELAY` says otherwise. mimalloc 3's default, a second, kept what one step of a
/// long key's handling freed (a 16 MiB read buffer, the key's last copy) resident while the next
/// allocated: 14–17 MiB of a 16 MiB key's peak (docs/reliability.md#bounded-whatever-the-key).
pub const PURGE_DELAY_MS: std::ffi::c_long = 50;

/// mimalloc 3's `mi_option_purge_delay` (its place in `mi_option_t`, `mimalloc.h`), which
/// libmimalloc-sys does not name.
const MI_OPTION_PURGE_DELAY: i32 = 15;

unsafe extern "C" {
    fn mi_option_set(option: i32, value: std::ffi::c_long);
}

/// Sets [`PURGE_DELAY_MS`], unless the environment set a purge delay of its own.
pub fn tune() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: mimalloc's options are atomics, set and read from any thread.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" {
        fn mi_option_get(option: i32) -> std::ffi::c_long;
    }

    /// The purge delay in force, in milliseconds.
    fn purge_delay_ms() -> std::ffi::c_long {
        // SAFETY: as in `tune`.
        unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) }
    }

    /// The option's place is mimalloc 3's purge delay: before it is set it holds mimalloc 3's
    /// default (1000 ms), or what the environment says; after, what keywatch sets.
    #[test]
    fn the_purge_delay_is_set_where_mimalloc_reads_it() {
        let from_env = std::env::var("MIMALLOC_PURGE_DELAY").ok();
        let before = purge_delay_ms();
        match from_env.and_then(|v| v.parse::<std::ffi::c_long>().ok()) {
            Some(v) => assert_eq!(before, v),
            None => {
                assert!(before == 1000 || before == PURGE_DELAY_MS, "{before}");
                tune();
                assert_eq!(purge_delay_ms(), PURGE_DELAY_MS);
            }
        }
    }
}
