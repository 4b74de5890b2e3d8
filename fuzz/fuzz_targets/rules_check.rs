//! Arbitrary bytes as a rule file, through the load + validate path of `keywatch check`.
//!
//! The contract (docs/commands.md): a problem is a diagnostic with a location, never a panic; a load
//! that fails holds at least one error (else `check` would print "0 error(s) found" and exit 1),
//! and a load that succeeds holds none.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use keywatch::config::{self, LoadError, Mode, Severity};
use libfuzzer_sys::fuzz_target;

/// One temp dir per fuzzing process: the file is rewritten for every input, so the path read is
/// the one `check` reads (and `url_file: x` resolves beside it, to nothing).
fn rules_path() -> &'static PathBuf {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("rules.yaml");
        (dir, path)
    })
    .1
}

fn env(name: &str) -> Option<String> {
    match name {
        "SET" => Some("https://example.invalid/hook".into()),
        "EMPTY" => Some(String::new()),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let path = rules_path();
    std::fs::write(path, data).expect("write the rule file");
    for mode in [Mode::Check, Mode::Run] {
        match config::load(std::slice::from_ref(path), mode, &env) {
            Ok(loaded) => {
                for w in &loaded.warnings {
                    assert_eq!(w.severity, Severity::Warning, "{w}");
                    assert!(!w.to_string().is_empty());
                }
                // What `check` prints after a successful load.
                let _ = loaded.config.needed_notify_flags();
            }
            Err(LoadError::Invalid(diags)) => {
                assert!(
                    diags.iter().any(|d| d.severity == Severity::Error),
                    "an invalid load without an error: {diags:?}"
                );
                for d in &diags {
                    let line = d.to_string();
                    assert!(!line.is_empty());
                    // One problem, one line: scripts and editors read `FILE:LINE:COLUMN: message`.
                    assert!(!line.contains('\n'), "{line:?}");
                }
            }
            Err(LoadError::Unreadable(msg)) => {
                // Only text that is not UTF-8 is unreadable here: the file itself exists.
                assert!(std::str::from_utf8(data).is_err(), "{msg}");
            }
        }
    }
});
