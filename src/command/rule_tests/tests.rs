//! `keywatch test` end to end in-process: test files in a temporary folder, their verdicts.

use super::*;

/// Each test's name, problems and rendered actions.
type Verdicts = Vec<(String, Vec<Problem>, Vec<Rendered>)>;

/// A folder with one rule file and one test file.
struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new(rules: &str) -> Dir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rules.yaml"), rules).unwrap();
        Dir { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The test file's problems, or each test's (name, problems) and what it rendered.
    fn run(&self, test: &str) -> Result<Verdicts, Vec<String>> {
        let path = self.path("rules.test.yaml");
        std::fs::write(&path, test).unwrap();
        let opts = Options {
            files: vec![path.clone()],
            rules: Vec::new(),
            json: false,
        };
        let suite = prepare(&path, &opts)?;
        let now = suite.file.now.unwrap();
        Ok(suite
            .file
            .tests
            .iter()
            .map(|t| {
                let rendered = render::render(&suite.config, &suite.actions, now, t);
                let problems = compare::compare(&t.expect, &rendered, &t.expect_loc);
                (t.name.clone(), problems, rendered)
            })
            .collect())
    }

    /// The problems of the file's only test.
    fn problems(&self, test: &str) -> Vec<Problem> {
        let mut tests = self.run(test).unwrap_or_else(|e| panic!("{e:#?}"));
        assert_eq!(tests.len(), 1);
        tests.remove(0).1
    }

    /// The actions the file's only test renders, as the expectations that would list them.
    fn rendered(&self, test: &str) -> Vec<String> {
        let tests = self.run(test).unwrap_or_else(|e| panic!("{e:#?}"));
        tests[0].2.iter().map(compare::expectation).collect()
    }

    /// `FILE:` of the test file, to check locations against.
    fn at(&self, line_col: &str) -> String {
        format!("{}:{line_col}", self.path("rules.test.yaml").display())
    }
}

const RULES: &str = r#"
channels:
  oncall: { type: dingtalk, url: "${DINGTALK_WEBHOOK}", msgtype: text }
  team: { type: slack, url: "https://hooks.slack.com/services/T0/B0/x" }
rules:
  - name: order-lock-timeout
    regex: '^order_lock:(?P<order_id>[^:]+)$'
    notify:
      to: [oncall]
      message: "Lock of order {{ order_id }} expired at {{ now }}."
  - name: cache-prewarm
    match: "cache:{user_id}:{kind}"
    reload:
      url: "http://127.0.0.1:8080/reload/{{ kind }}/{{ user_id }}"
      body: '{"user": {{ user_id | tojson }}}'
  - name: session-cleanup
    regex: '^session:(?P<sid>[^:]+)$'
    cleanup:
      delete: ["session:{{ sid }}:*"]
      hdel: [{ key: online_users, field: "{{ sid }}" }]
    exec: { command: ["/usr/local/bin/logout", "--sid", "{{ sid }}"] }
"#;

const HEAD: &str = r#"rules: [rules.yaml]
now: "2026-12-06T10:00:00+08:00"
env: { DINGTALK_WEBHOOK: "https://oapi.dingtalk.com/robot/send?access_token=test" }
"#;

#[test]
fn every_kind_of_action_is_rendered_as_run_would_and_passes() {
    let d = Dir::new(RULES);
    let tests = d
        .run(&format!(
            r#"{HEAD}tests:
  - name: all of it
    events: [{{ key: "order_lock:42" }}, {{ key: "cache:42:profile" }}, {{ key: "session:s1" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall, text: "Lock of order 42 expired at 2026-12-06T02:00:00.000Z." }}
      - {{ rule: cache-prewarm, reload: "POST http://127.0.0.1:8080/reload/profile/42", body: '{{"user": "42"}}' }}
      - {{ rule: session-cleanup, exec: ["/usr/local/bin/logout", "--sid", "s1"] }}
      - {{ rule: session-cleanup, cleanup: {{ delete: ["session:s1:*"], hdel: [[online_users, s1]] }} }}
  - name: look-alike keys fire nothing
    events: [{{ key: "order_lock:42:owner" }}, {{ key: "session:s1:csrf" }}]
    expect: []
"#
        ))
        .unwrap_or_else(|e| panic!("{e:#?}"));
    assert_eq!(tests.len(), 2);
    for (name, problems, _) in tests {
        assert_eq!(problems, [], "{name}");
    }
}

#[test]
fn a_wrong_text_is_located_with_what_was_rendered() {
    let d = Dir::new(RULES);
    let problems = d.problems(&format!(
        r#"{HEAD}tests:
  - name: wrong text
    events: [{{ key: "order_lock:42" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall, text: "Lock of order 42 expired." }}
"#
    ));
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let p = &problems[0];
    assert_eq!(p.loc.to_string(), d.at("8:9"));
    assert_eq!(
        p.kind,
        ProblemKind::Differs {
            part: "text",
            expected: "Lock of order 42 expired.".into(),
            rendered: "Lock of order 42 expired at 2026-12-06T02:00:00.000Z.".into(),
            contains: false,
        }
    );
    assert_eq!(
        text(&d.path("t"), "wrong text", &problems)
            .lines()
            .skip(1)
            .collect::<Vec<_>>(),
        [
            format!(
                "  {}: order-lock-timeout notify oncall: the text differs",
                d.at("8:9")
            )
            .as_str(),
            "      --- expected",
            "      +++ rendered",
            "      -Lock of order 42 expired.",
            "      +Lock of order 42 expired at 2026-12-06T02:00:00.000Z.",
        ]
    );
}

#[test]
fn missing_unexpected_and_misplaced_actions_are_named() {
    let d = Dir::new(RULES);
    let problems = d.problems(&format!(
        r#"{HEAD}tests:
  - name: several
    events: [{{ key: "session:s1" }}, {{ key: "order_lock:7" }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall, contains: "order 7" }}
      - {{ rule: session-cleanup, exec: ["/usr/local/bin/logout", "--sid", "s1"] }}
      - {{ rule: cache-prewarm, reload: "POST http://127.0.0.1:8080/reload/a/b" }}
"#
    ));
    let kinds: Vec<(String, &ProblemKind)> = problems
        .iter()
        .map(|p| (p.loc.to_string(), &p.kind))
        .collect();
    // Rendered: the session's exec and cleanup, then the lock's notification. The notification
    // lines up with the first expectation; the exec is expected, but after it.
    assert_eq!(
        kinds,
        [
            (
                d.at("7:5"),
                &ProblemKind::Unexpected {
                    expectation: r#"{ rule: session-cleanup, cleanup: { delete: ["session:s1:*"], hdel: [["online_users", "s1"]] } }"#.into()
                }
            ),
            (d.at("9:9"), &ProblemKind::Elsewhere),
            (d.at("10:9"), &ProblemKind::Missing { fired: false }),
        ],
        "{problems:#?}"
    );
}

#[test]
fn a_digest_window_takes_the_events_until_it_ends_and_escalations_come_after() {
    let d = Dir::new(
        r#"
channels:
  team: { type: slack, url: "https://hooks.slack.com/services/T0/B0/x" }
  lead: { type: slack, url: "https://hooks.slack.com/services/T0/B0/y" }
rules:
  - name: locks
    match: "lock:{id}"
    notify: { to: [team], message: "{{ id }}", group: { window: 30s, max_items: 5 } }
    escalate: { after: 15m, to: [lead], message: "{{ id }} still gone after {{ gap }} ({{ now }})" }
    resolved: { within: 1h, to: [team] }
"#,
    );
    let rendered = d.rendered(&format!(
        r#"{HEAD}tests:
  - name: a burst
    events:
      - {{ key: "lock:1", at: "2026-12-06T09:59:50+08:00" }}
      - {{ key: "lock:2", at: "2026-12-06T10:00:10+08:00" }}
      - {{ key: "lock:3", at: "2026-12-06T10:00:30+08:00" }}
      - {{ key: "lock:4", event: expiring }}
    expect: []
"#
    ));
    assert_eq!(
        rendered,
        [
            r#"{ rule: locks, notify: team, text: "2 expired events:\n- 1\n- 2" }"#,
            r#"{ rule: locks, notify: team, text: "- 3" }"#,
            r#"{ rule: locks, escalate: lead, text: "1 still gone after 15m (2026-12-06T02:14:50.000Z)" }"#,
            r#"{ rule: locks, escalate: lead, text: "2 still gone after 15m (2026-12-06T02:15:10.000Z)" }"#,
            r#"{ rule: locks, escalate: lead, text: "3 still gone after 15m (2026-12-06T02:15:30.000Z)" }"#,
        ]
    );
}

#[test]
fn recovered_silenced_and_detail_events_follow_the_rules_recover() {
    let d = Dir::new(
        r#"
channels:
  team: { type: slack, url: "https://hooks.slack.com/services/T0/B0/x" }
rules:
  - name: close
    match: "delay:task:{id}"
    detail: { hash: "delay:detail", field: "{{ id }}" }
    recover: { when: if_detail, max_late: 6h }
    notify: { to: [team], message: "close {{ detail.order }}{% if recovered %} (late){% endif %}" }
  - name: any
    match: "delay:task:{id}"
    notify: { to: [team] }
"#,
    );
    let rendered = d.rendered(&format!(
        r#"{HEAD}tests:
  - name: recover
    events:
      - {{ key: "delay:task:1", detail: {{ order: 1001 }} }}
      - {{ key: "delay:task:2", recovered: true, at: "2026-12-06T09:00:00+08:00" }}
      - {{ key: "delay:task:3", recovered: true, at: "2026-12-06T09:00:00+08:00", detail: '{{"order": 1003}}' }}
      - {{ key: "delay:task:4", recovered: true, at: "2026-12-06T01:00:00+08:00", detail: {{ order: 1004 }} }}
      - {{ key: "delay:task:5", silenced: true, detail: {{ order: 1005 }} }}
    expect: []
"#
    ));
    assert_eq!(
        rendered,
        [
            r#"{ rule: close, notify: team, text: "close 1001" }"#,
            r#"{ rule: any, notify: team, text: "any: delay:task:1 expired" }"#,
            r#"{ rule: any, notify: team, text: "any: delay:task:2 found gone after keywatch was down: expired, or deleted while nobody listened" }"#,
            r#"{ rule: close, notify: team, text: "close 1003 (late)" }"#,
            r#"{ rule: any, notify: team, text: "any: delay:task:3 found gone after keywatch was down: expired, or deleted while nobody listened" }"#,
            r#"{ rule: any, notify: team, text: "any: delay:task:4 found gone after keywatch was down: expired, or deleted while nobody listened" }"#,
        ]
    );
}

#[test]
fn an_invalid_file_says_every_problem_at_its_place() {
    let d = Dir::new(RULES);
    let problems = d
        .run(&format!(
            r#"{HEAD}tests:
  - name: bad
    events: [{{ key: "order_lock:1", evnt: expired }}, {{ event: gone, at: yesterday }}]
    expect:
      - {{ rule: order-lock-timeout, notify: oncall, held_until: "tomorrow morning" }}
      - {{ rule: order-lock-timeout, notify: oncall, reload: "POST http://x/" }}
      - {{ rule: order-lock-timeout, reload: "http://x/" }}
      - {{ rule: order-lock-timeout, notify: oncall, body: "{{}}" }}
  - name: bad
    events: []
"#
        ))
        .unwrap_err();
    assert_eq!(
        problems,
        [
            format!(
                "{}: unknown field `evnt` in an event; did you mean `event`?",
                d.at("6:37")
            ),
            format!("{}: an event is missing the field `key`", d.at("6:54")),
            format!(
                "{}: `gone` is not an event; expected one of expired, evicted, deleted, expiring, hexpired",
                d.at("6:63")
            ),
            format!(
                "{}: an event's `at`: `yesterday` is not a time (premature end of input); write e.g. \"2026-12-06T10:00:00+08:00\"",
                d.at("6:73")
            ),
            format!(
                "{}: `held_until`: `tomorrow morning` is not a time (premature end of input); write e.g. \"2026-12-06T10:00:00+08:00\"",
                d.at("8:65")
            ),
            format!(
                "{}: an expected action is one action: `notify` or `reload`, not both (list each on its own)",
                d.at("9:53")
            ),
            format!(
                "{}: `reload` is the method and the URL, e.g. \"POST http://127.0.0.1:8080/reload/42\"; found \"http://x/\"",
                d.at("10:45")
            ),
            format!(
                "{}: unknown field `body` in an expected action: it goes with `reload`",
                d.at("11:53")
            ),
            format!(
                "{}: a test says what it expects: `expect:` is missing or empty (write `expect: []` when nothing should fire)",
                d.at("12:5")
            ),
            format!(
                "{}: the test `bad` is named twice: first at {}",
                d.at("12:5"),
                d.at("5:5")
            ),
        ]
    );
}

#[test]
fn an_unknown_rule_or_channel_and_rules_that_do_not_load_are_invalid() {
    let d = Dir::new(RULES);
    let problems = d
        .run(&format!(
            r#"{HEAD}tests:
  - name: names
    events: [{{ key: "order_lock:1" }}]
    expect:
      - {{ rule: order-lock-timeuot, notify: on-call }}
"#
        ))
        .unwrap_err();
    assert_eq!(
        problems,
        [
            format!(
                "{}: no rule `order-lock-timeuot` in the rules tested; did you mean `order-lock-timeout`?",
                d.at("8:17")
            ),
            format!(
                "{}: no channel `on-call` in the rules tested; did you mean `oncall`?",
                d.at("8:45")
            ),
        ]
    );
    // Without the file's `env`, the rules do not load as `run` would need them.
    let problems = d
        .run("rules: [rules.yaml]\nnow: \"2026-12-06T10:00:00+08:00\"\ntests: []\n")
        .unwrap_err();
    assert!(problems[0].contains("DINGTALK_WEBHOOK"), "{problems:#?}");
    assert_eq!(
        problems.last().unwrap(),
        &format!(
            "{}: the rules do not load with this file's `env` (as `keywatch run` would refuse them): their problems are above",
            d.at("1:8")
        )
    );
}

/// Quiet hours as delivery applies them (`Config::hold`): a message to a quiet channel is held
/// until its window ends, and a test says so with `held_until`; held when the test expects it
/// at once, or at once when it expects it held, or held until another time, fails.
#[test]
fn held_until_checks_the_quiet_hours_of_the_channel() {
    let d = Dir::new(
        r#"
timezone: Asia/Shanghai
quiet_hours:
  night: [{ days: [mon, tue, wed, thu, fri], from: "22:00", to: "08:00" }]
channels:
  team: { type: slack, url: "https://hooks.slack.com/services/T0/B0/x", quiet: { during: night } }
rules:
  - name: caches
    match: "cache:{id}"
    notify: { to: [team], message: "Cache {{ id }} expired." }
"#,
    );
    let head = "rules: [rules.yaml]\nnow: \"2026-12-08T23:30:00+08:00\"\ntests:\n  - name: t\n    events: [{ key: \"cache:1\" }]\n    expect:\n";
    let held = |expect: &str| d.problems(&format!("{head}      - {expect}\n"));
    assert_eq!(
        held(
            r#"{ rule: caches, notify: team, text: "Cache 1 expired.", held_until: "2026-12-09T08:00:00+08:00" }"#
        ),
        []
    );
    let kinds: Vec<ProblemKind> = [
        r#"{ rule: caches, notify: team, text: "Cache 1 expired." }"#,
        r#"{ rule: caches, notify: team, held_until: "2026-12-09T09:00:00+08:00" }"#,
    ]
    .iter()
    .map(|e| held(e).remove(0).kind)
    .collect();
    assert_eq!(
        kinds,
        [
            ProblemKind::Differs {
                part: "held_until",
                expected: "sent at once (not held)".into(),
                rendered: "held until 2026-12-09T00:00:00.000Z".into(),
                contains: false,
            },
            ProblemKind::Differs {
                part: "held_until",
                expected: "held until 2026-12-09T01:00:00.000Z".into(),
                rendered: "held until 2026-12-09T00:00:00.000Z".into(),
                contains: false,
            },
        ]
    );
    assert_eq!(
        d.rendered(&format!("{head}      - {{ rule: caches, notify: team }}\n")),
        [
            r#"{ rule: caches, notify: team, text: "Cache 1 expired.", held_until: "2026-12-09T00:00:00.000Z" }"#
        ]
    );
}
