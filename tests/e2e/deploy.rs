//! What ships beside the binary stays true to it: the Grafana dashboard queries only metrics that
//! keywatch exports (and every metric of docs/operations.md#metrics), the systemd unit and the container file name
//! what exists, and `keywatch completions` prints scripts the shells accept.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::run_keywatch;
use keywatch::metrics::Metrics;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every sample name `/metrics` can show, with labelled families populated once so their
/// samples appear (`_total`, `_bucket`, `_sum`, `_count` included).
fn exported_samples() -> BTreeSet<String> {
    let m = Metrics::new();
    m.event("expired", 0);
    m.matched("r", "expired");
    m.action("r", "notify", "sent", 0.01);
    m.subscriber("127.0.0.1:6379", true);
    m.notify_flags("127.0.0.1:6379", true);
    m.recovery_skipped_for("r");
    m.recovered_for("r");
    m.silenced_for("r");
    m.encode()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

/// `keywatch_…` names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("keywatch_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        out.push(name);
    }
    out
}

fn exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn every_dashboard_query_names_an_exported_metric_and_every_spec_metric_is_shown() {
    let exported = exported_samples();
    let mut dashboards = 0;
    for entry in std::fs::read_dir(repo().join("deploy")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        dashboards += 1;
        let json: serde_json::Value = serde_json::from_str(&read(&path))
            .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
        let mut all = Vec::new();
        exprs(&json, &mut all);
        assert!(!all.is_empty(), "{} has no queries", path.display());
        let mut queried = BTreeSet::new();
        for expr in &all {
            for name in metric_names(expr) {
                assert!(
                    exported.contains(&name),
                    "{} queries `{name}`, which keywatch does not export (in `{expr}`); exported: {exported:?}",
                    path.display()
                );
                queried.insert(name);
            }
        }
        // docs/operations.md#metrics, as sample names.
        for spec in [
            "keywatch_events_total",
            "keywatch_matches_total",
            "keywatch_actions_total",
            "keywatch_action_seconds_bucket",
            "keywatch_expiry_lateness_seconds_bucket",
            "keywatch_queue_pending",
            "keywatch_queue_due",
            "keywatch_dead_letters_total",
            "keywatch_ledger_keys",
            "keywatch_recovered_total",
            "keywatch_subscriber_up",
            "keywatch_reconnects_total",
            "keywatch_rules_loaded",
            "keywatch_reload_failures_total",
            "keywatch_config_last_reload_successful",
            "keywatch_scan_keys_total",
            "keywatch_scan_seconds_bucket",
        ] {
            assert!(
                queried.contains(spec),
                "{} shows no panel for {spec}",
                path.display()
            );
        }
        let mut ids = BTreeSet::new();
        for p in json["panels"].as_array().expect("panels") {
            let id = p["id"].as_u64().expect("panel id");
            assert!(ids.insert(id), "{}: panel id {id} twice", path.display());
        }
    }
    assert!(dashboards > 0, "no dashboard JSON in deploy/");
}

#[test]
fn the_container_file_copies_what_exists_and_checks_health() {
    let file = read(&repo().join("deploy/Containerfile"));
    for line in file
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        for src in &words[1..words.len() - 1] {
            assert!(
                repo().join(src).exists(),
                "Containerfile copies `{src}`, which is not in the repository"
            );
        }
    }
    assert!(file.contains("HEALTHCHECK"), "no HEALTHCHECK");
    assert!(
        file.contains("/healthz"),
        "the HEALTHCHECK does not ask /healthz"
    );
    assert!(file.contains("\nUSER "), "the image runs as root");
}

#[test]
fn the_systemd_unit_is_hardened_and_restarts_on_failure() {
    let unit = read(&repo().join("deploy/keywatch.service"));
    let set: Vec<&str> = unit
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    for needed in [
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "Restart=on-failure",
        "EnvironmentFile=/etc/keywatch/keywatch.env",
        // keywatch reloads its rules on SIGHUP (tests/e2e/reload.rs).
        "ExecReload=/bin/kill -HUP $MAINPID",
    ] {
        assert!(set.contains(&needed), "keywatch.service lacks `{needed}`");
    }
    assert!(repo().join("deploy/keywatch.env.example").exists());
}

#[test]
fn completions_are_printed_for_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "_keywatch()"),
        ("zsh", "#compdef keywatch"),
        ("fish", "complete -c keywatch"),
    ] {
        let out = run_keywatch(["completions", shell], &[]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        assert!(
            script.contains(marker),
            "{shell}: no `{marker}` in\n{script}"
        );
        for sub in [
            "run",
            "check",
            "explain",
            "send-test",
            "demo",
            "completions",
        ] {
            assert!(script.contains(sub), "{shell}: `{sub}` is not completed");
        }
        if shell == "bash" {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("keywatch.bash");
            std::fs::write(&file, &script).unwrap();
            let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
            assert!(
                check.status.success(),
                "bash rejects the script: {}",
                String::from_utf8_lossy(&check.stderr)
            );
        }
    }
    let out = run_keywatch(["completions", "tcsh"], &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `promtool` from Debian's `prometheus` package; fails with the fix when it is missing.
fn promtool() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("promtool"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`promtool` was not found on PATH: the alert rules in deploy/prometheus are \
                 checked with it. Install it (`apt-get install prometheus`; `.ci/run` does)."
            )
        })
}

/// The anchors GitHub gives the `##` headings of a Markdown file.
fn anchors(markdown: &str) -> BTreeSet<String> {
    markdown
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| {
            h.to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// The alert rules for keywatch itself (docs/operations.md#alertmanager-and-prometheus): valid
/// for promtool, each alert unit-tested firing and not firing, every metric they read one
/// keywatch exports, every runbook a section of docs/troubleshooting.md.
#[test]
fn the_prometheus_alert_rules_pass_promtool_and_point_at_what_exists() {
    let dir = repo().join("deploy/prometheus");
    for args in [
        vec!["check", "rules", "keywatch.rules.yaml"],
        vec!["test", "rules", "keywatch.rules.test.yaml"],
    ] {
        let out = Command::new(promtool())
            .args(&args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let exported = exported_samples();
    let troubleshooting = anchors(&read(&repo().join("docs/troubleshooting.md")));
    let tests = read(&dir.join("keywatch.rules.test.yaml"));
    let mut alerts = Vec::new();
    for rule in alert_rules(&read(&dir.join("keywatch.rules.yaml"))) {
        let alert = &rule["alert"];
        for name in metric_names(&rule["expr"]) {
            assert!(
                exported.contains(&name),
                "{alert} reads `{name}`, which keywatch does not export"
            );
        }
        for field in ["summary", "description", "runbook_url"] {
            assert!(rule.contains_key(field), "{alert} has no `{field}`");
        }
        let runbook = &rule["runbook_url"];
        let anchor = runbook
            .strip_prefix("docs/troubleshooting.md#")
            .unwrap_or_else(|| panic!("{alert}: runbook {runbook}"));
        assert!(
            troubleshooting.contains(anchor),
            "{alert}: docs/troubleshooting.md has no section `#{anchor}`"
        );
        // Shown not firing (`exp_alerts: []`) and firing (`exp_labels`) in the unit tests.
        assert!(
            tests.matches(&format!("alertname: {alert}\n")).count() >= 2
                && tests.contains(&format!("alertname: {alert}\n    exp_alerts:\n")),
            "{alert} is not tested firing and not firing"
        );
        alerts.push(alert.clone());
    }
    for spec in [
        "KeywatchDown",
        "KeywatchNotReady",
        "KeywatchNotSubscribed",
        "KeywatchNotificationFlagsMissing",
        "KeywatchReloadFailed",
        "KeywatchDeadLetters",
        "KeywatchQueueBacklog",
        "KeywatchLateExpiries",
        "KeywatchRecoverySkipping",
    ] {
        assert!(alerts.iter().any(|a| a == spec), "no alert {spec}");
    }
}

/// Each alerting rule of a rules file written as deploy/prometheus/keywatch.rules.yaml is
/// (one `key: value` per line): its `alert`, `expr` and annotations.
fn alert_rules(yaml: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    let mut out: Vec<std::collections::BTreeMap<String, String>> = Vec::new();
    for line in yaml.lines().map(str::trim) {
        let line = line.strip_prefix("- ").unwrap_or(line);
        let Some((k, v)) = line.split_once(": ") else {
            continue;
        };
        let v = v.trim().trim_matches('"').to_string();
        if k == "alert" {
            out.push(Default::default());
        }
        if let Some(rule) = out.last_mut()
            && ["alert", "expr", "summary", "description", "runbook_url"].contains(&k)
        {
            rule.insert(k.to_string(), v);
        }
    }
    out
}
