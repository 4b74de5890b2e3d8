//! `keywatch test` as CI and users run it: every example in `rules/` and `extra-rules/` has a
//! rule test beside it and passes it, and each way a test can fail (a wrong text, a missing
//! action, an unexpected action, an invalid file) is reported at its place with exit 1, or 2
//! for a file that cannot run.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::run_keywatch;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The files of `dir` whose names end with `suffix`, sorted.
fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().unwrap().ends_with(suffix))
        .collect();
    out.sort();
    out
}

#[test]
fn every_example_rule_file_has_a_test_and_passes_it() {
    let mut tests = Vec::new();
    for dir in ["rules", "extra-rules"] {
        let dir = repo().join(dir);
        for rules in files(&dir, ".yaml") {
            let name = rules.file_name().unwrap().to_str().unwrap();
            if name.ends_with(".test.yaml") || name == "channels.yaml" {
                continue;
            }
            let test = rules.with_extension("test.yaml");
            assert!(
                test.exists(),
                "{} has no rule test: add {}",
                rules.display(),
                test.display()
            );
            tests.push(test);
        }
    }
    let mut args = vec!["test".to_string()];
    args.extend(tests.iter().map(|t| t.display().to_string()));
    let out = run_keywatch(&args, &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    let passed = text.lines().filter(|l| l.starts_with("ok ")).count();
    assert!(passed >= 2 * tests.len(), "{text}");
    assert!(
        text.ends_with(&format!("\n{passed} passed, 0 failed\n")),
        "{text}"
    );
}

/// A folder with the shipped order-lock rules and their channels, and test files written into
/// it.
struct Drill {
    dir: tempfile::TempDir,
}

impl Drill {
    fn new() -> Drill {
        let dir = tempfile::tempdir().unwrap();
        for f in ["channels.yaml", "order-locks.yaml"] {
            std::fs::copy(repo().join("rules").join(f), dir.path().join(f)).unwrap();
        }
        Drill { dir }
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }

    fn test(&self, files: &[&str]) -> Output {
        let mut args = vec!["test"];
        args.extend_from_slice(files);
        run_keywatch(args, &[])
    }
}

const HEAD: &str =
    "rules: [channels.yaml, order-locks.yaml]\nnow: \"2026-12-06T10:00:00+08:00\"\ntests:\n";

#[test]
fn a_wrong_text_fails_at_its_expectation_with_a_diff() {
    let d = Drill::new();
    let file = d.write(
        "wrong.test.yaml",
        &format!(
            "{HEAD}  - name: wrong text
    events: [{{ key: \"order_lock:42\" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall, text: \"- Lock of order 42 expired.\" }}
      - {{ rule: order-lock-timeout, notify: team, contains: \"Lock of order 42\" }}
"
        ),
    );
    let out = d.test(&[&file]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!(
            "FAILED  {file}: wrong text\n  {file}:7:9: order-lock-timeout notify oncall: the text differs\n      --- expected\n      +++ rendered\n      -- Lock of order 42 expired.\n      +- Lock of order 42 expired before it was released: check the order worker.\n"
        )),
        "{text}"
    );
    assert!(text.ends_with("\n0 passed, 1 failed\n"), "{text}");
}

#[test]
fn a_missing_action_fails_at_its_expectation() {
    let d = Drill::new();
    let file = d.write(
        "missing.test.yaml",
        &format!(
            "{HEAD}  - name: missing
    events: [{{ key: \"order_lock:42:owner\" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall }}
"
        ),
    );
    let out = d.test(&[&file]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!(
            "  {file}:7:9: order-lock-timeout notify oncall: expected, not rendered: the rule renders nothing for these events (`keywatch explain KEY` shows why)\n"
        )),
        "{text}"
    );
}

#[test]
fn an_unexpected_action_fails_at_expect_and_says_how_to_expect_it() {
    let d = Drill::new();
    let file = d.write(
        "unexpected.test.yaml",
        &format!(
            "{HEAD}  - name: unexpected
    events: [{{ key: \"order_lock:42\" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall }}
"
        ),
    );
    let out = d.test(&[&file, "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["ok"], false, "{verdict:#}");
    let problems = verdict["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 1, "{verdict:#}");
    let p = &problems[0];
    assert_eq!(p["problem"], "unexpected", "{p:#}");
    assert_eq!(p["at"], format!("{file}:6:5"), "{p:#}");
    assert_eq!(p["channel"], "team", "{p:#}");
    assert_eq!(
        p["expectation"],
        "{ rule: order-lock-timeout, notify: team, text: \"- Lock of order 42 expired before it was released: check the order worker.\" }"
    );
    assert_eq!(
        verdict["rendered"].as_array().unwrap().len(),
        2,
        "{verdict:#}"
    );
    // The same in text: the line to add.
    let out = d.test(&[&file]);
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "  {file}:6:5: order-lock-timeout notify team: rendered, not expected\n      to expect it: - {{ rule: order-lock-timeout, notify: team, text: \"- Lock of order 42 expired before it was released: check the order worker.\" }}\n"
        )),
        "{text}"
    );
}

#[test]
fn an_invalid_file_exits_2_with_every_problem_located_and_the_others_still_run() {
    let d = Drill::new();
    let bad = d.write(
        "bad.test.yaml",
        &format!(
            "{HEAD}  - name: bad
    events: [{{ key: \"order_lock:42\", recoverd: true }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncal }}
"
        ),
    );
    let good = d.write(
        "good.test.yaml",
        &format!(
            "{HEAD}  - name: deletes fire nothing
    events: [{{ key: \"order_lock:42\", event: deleted }}]
    expect: []
"
        ),
    );
    let out = d.test(&[&bad, &good]);
    let (text, errors) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{text}{errors}");
    assert_eq!(
        errors,
        format!("{bad}:5:38: unknown field `recoverd` in an event; did you mean `recovered`?\n")
    );
    assert!(
        text.starts_with(&format!("ok      {good}: deletes fire nothing\n")),
        "{text}"
    );
    // Once the file reads, the names it gives are checked against the rules.
    std::fs::write(
        &bad,
        std::fs::read_to_string(&bad)
            .unwrap()
            .replace("recoverd", "recovered"),
    )
    .unwrap();
    let out = d.test(&[&bad]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!("{bad}:7:45: no channel `oncal` in the rules tested; did you mean `oncall`?\n")
    );
    // An unreadable file too.
    let out = d.test(&["/nonexistent/x.test.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("/nonexistent/x.test.yaml: cannot read:"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_and_run_skip_the_tests_beside_the_rules() {
    let d = Drill::new();
    d.write(
        "x.test.yaml",
        &format!("{HEAD}  - name: t\n    events: []\n    expect: []\n"),
    );
    let out = run_keywatch(["check", "-r", d.dir.path().to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("OK: 2 file(s), 1 rule(s)"),
        "{}",
        stdout(&out)
    );
}

/// What `keywatch test` renders is what `run` sends: the same rules, the same key and detail,
/// once through `keywatch test --json` and once through the daemon on a real Redis; the reload's
/// request line and body and the chat message arrive exactly as the test rendered them. Key text
/// that must be escaped (`/`, a space, `&`, `<>`) and a JSON detail make any second rendering
/// path show.
#[test]
fn what_keywatch_test_renders_is_what_run_sends() {
    let receiver = common::HttpReceiver::start();
    let yaml = r#"
channels:
  chat: { type: slack, url: "@RECEIVER@/chat" }
rules:
  - name: warm
    regex: '^cache:(?P<user>[^:]+):(?P<kind>[^:]+)$'
    detail: { key: "cache_meta:{{ user }}" }
    reload:
      url: "@RECEIVER@/reload/{{ kind }}/{{ user }}?event={{ event }}"
      body: '{"user": {{ user | tojson }}, "plan": {{ detail.plan | tojson }}}'
    notify:
      to: [chat]
      title: "Cache {{ kind }} of {{ user }}"
      message: "The {{ kind }} cache of <{{ user }}> ({{ detail.plan }}) expired: warming it again."
"#
    .replace("@RECEIVER@", &receiver.url());
    let (key, detail) = ("cache:a/b c&<x>:profile", r#"{"plan": "gold & <pro>"}"#);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.yaml"), &yaml).unwrap();
    let test = dir.path().join("rules.test.yaml");
    let event = serde_json::json!({ "key": key, "detail": detail });
    std::fs::write(
        &test,
        format!(
            "rules: [rules.yaml]\ntests:\n  - name: one\n    events: [{event}]\n    expect: []\n"
        ),
    )
    .unwrap();
    let out = run_keywatch(["test", test.to_str().unwrap(), "--json"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rendered = verdict["rendered"].as_array().unwrap();
    assert_eq!(rendered.len(), 2, "{verdict:#}");
    let (reload, notify) = (&rendered[0], &rendered[1]);
    assert_eq!(reload["action"], "reload", "{verdict:#}");
    assert_eq!(notify["action"], "notify", "{verdict:#}");

    let daemon = common::Daemon::start_with(common::RedisServer::with_events("Exg"), &yaml, &[]);
    let mut conn = daemon.conn();
    let () = redis::cmd("SET")
        .arg("cache_meta:a/b c&<x>")
        .arg(detail)
        .query(&mut conn)
        .unwrap();
    common::set_and_expire_now(&mut conn, &[key]);
    let got = receiver.wait_for(2, common::PATIENCE);
    let sent_reload = got
        .iter()
        .find(|r| r.target.starts_with("/reload/"))
        .unwrap();
    let sent_chat = got.iter().find(|r| r.target == "/chat").unwrap();

    let url = reload["reload"].as_str().unwrap();
    let (method, url) = url.split_once(' ').unwrap();
    assert_eq!(sent_reload.method, method);
    assert_eq!(
        format!("{}{}", receiver.url(), sent_reload.target),
        url,
        "the reload went elsewhere than the test rendered"
    );
    assert_eq!(
        String::from_utf8_lossy(&sent_reload.body),
        reload["body"].as_str().unwrap()
    );
    let chat: serde_json::Value = serde_json::from_slice(&sent_chat.body).unwrap();
    let chat = chat["text"].as_str().unwrap();
    for part in ["title", "text"] {
        let part = notify[part].as_str().unwrap();
        assert!(chat.contains(part), "sent {chat:?}, rendered {part:?}");
    }
    daemon.stop();
}
