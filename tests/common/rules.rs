//! Rule files for tests.

use std::path::{Path, PathBuf};

/// Writes `yaml` to `dir/name` (creating parent folders, so `name` may be `team/a.yaml`) and
/// returns the file's path.
pub fn write_rules(dir: impl AsRef<Path>, name: &str, yaml: &str) -> PathBuf {
    let path = dir.as_ref().join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .unwrap_or_else(|e| panic!("create {}: {e}", parent.display()));
    }
    std::fs::write(&path, yaml).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// The config of one rule on `k:*` that logs, loaded as `keywatch check` would: for tests that
/// drive a part (ledger, claims) through the library with a real config.
pub fn log_rule_config() -> keywatch::config::Config {
    let env = |_: &str| None;
    let rules = "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'k:*'\n    notify: { to: [log] }\n";
    keywatch::config::load_texts(
        vec!["r.yaml".into()],
        &[rules.to_string()],
        keywatch::config::Mode::Check,
        &env,
    )
    .unwrap()
    .config
}
