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
