//! Rule files and configs for tests.

use std::path::{Path, PathBuf};
use std::process::Output;

use super::daemon::run_keywatch;
use super::http_receiver::HttpReceiver;

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

/// A rules folder in a temp dir, with one file `rules.yaml`.
pub struct Rules {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl Rules {
    /// `yaml` as `rules.yaml` in a new temp dir.
    pub fn new(yaml: &str) -> Rules {
        Rules::new_with(|_| yaml.to_owned())
    }

    /// The text `yaml(dir)` returns as `rules.yaml` in a new temp dir `dir` (for rules that name
    /// files beside them).
    pub fn new_with(yaml: impl FnOnce(&Path) -> String) -> Rules {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-rules-")
            .tempdir()
            .expect("create a temp dir for rules");
        let path = write_rules(dir.path(), "rules.yaml", &yaml(dir.path()));
        Rules { dir, path }
    }

    /// The path as a `-r` argument.
    pub fn arg(&self) -> String {
        self.path.display().to_string()
    }

    /// Runs a one-shot command (`explain`, `check`, `send-test`) with `-r RULES` appended.
    pub fn run(&self, args: &[&str], envs: &[(&str, &str)]) -> Output {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.push("-r".into());
        all.push(self.arg());
        run_keywatch(all, envs)
    }
}

/// Rules with a webhook channel `hook` to `receiver` (plus `channel_extra` lines, e.g.
/// `"    rate: 5/s\n"`) and one rule, `lock-expired`, on `lock:{id}`.
pub fn lock_rules(dir: &Path, receiver: &HttpReceiver, channel_extra: &str) -> PathBuf {
    let yaml = format!(
        "channels:\n  hook:\n    type: webhook\n    url: \"{}\"\n{channel_extra}rules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n",
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
}

/// Rules with a webhook channel `hook` to `receiver`, then `sections` (YAML at the top level,
/// e.g. a `scanner:` section, the `rules:` list included).
pub fn hook_rules(dir: &Path, receiver: &HttpReceiver, sections: &str) -> PathBuf {
    let yaml = format!(
        "channels:\n  hook: {{ type: webhook, url: \"{}\" }}\n{sections}",
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
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

/// The `ACL SETUSER keywatch …` lines of the least-privilege section of `docs/redis.md`, in
/// order: the line every deployment needs, then the one that adds cleanup. Tests run keywatch and
/// doctor under exactly these, so the documentation and reality cannot drift apart. The third
/// line, for `hexpired` rules, is left out: the default test server (Redis 7.0) has no hash-field
/// expiry and refuses it (tests/e2e/hash_fields.rs runs those rules on Valkey).
pub fn documented_acl_lines() -> Vec<String> {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"),
    )
    .expect("read docs/redis.md");
    let start = doc
        .find("## Least-privilege ACL")
        .expect("docs/redis.md has a `## Least-privilege ACL` section");
    let section = &doc[start..];
    let end = section[4..].find("\n#").map_or(section.len(), |e| e + 4);
    let lines: Vec<String> = section[..end]
        .lines()
        .filter(|l| l.starts_with("ACL SETUSER keywatch ") && !l.contains("+hpexpiretime"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        lines.len(),
        2,
        "the ACL section of docs/redis.md should have the base line and the cleanup line: {lines:?}"
    );
    lines
}
