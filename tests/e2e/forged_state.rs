//! keywatch's state is not a way in (docs/reliability.md#keywatchs-state-is-not-a-way-in): the
//! real binary on a real `redis-server`, and entries written into keywatch's state by hand, as
//! an application whose Redis user can write `keywatch:*` could ([`common::forge_job`]). A job
//! runs only as what the rules in force say for its key; anything else is refused, for good.

use crate::common;

use std::path::Path;

use common::daemon::Logs;
use common::{Daemon, PATIENCE, RedisServer, Rules};
use serde_json::Value;

/// A rule whose `regex` admits only dates, and whose `exec` gets the capture in `X`: the lines
/// it ran with go to `ran` beside the rules.
fn report_rules(dir: &Path) -> String {
    format!(
        r#"
rules:
  - name: report
    regex: '^report:(?P<day>\d{{4}}-\d{{2}}-\d{{2}})$'
    exec:
      command: ["/bin/sh", "-c", 'printf "%s\n" "$$X" >> "$$0"', "{}/ran"]
      env: {{ X: "{{{{ day }}}}" }}
"#,
        dir.display()
    )
}

/// `keywatch dead list --json`: one letter per line.
fn dead_letters(daemon: &Daemon) -> Vec<Value> {
    let out = daemon.rules.run(
        &["dead", "list", "--json", "--redis", &daemon.redis.url()],
        &[],
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The dead letter of the event `event_id`, once there is one (other than `not`).
fn dead_letter_of(daemon: &Daemon, event_id: &str, not: Option<&str>) -> Value {
    common::poll(
        &format!("a dead letter of the forged job {event_id}"),
        PATIENCE,
        || {
            dead_letters(daemon)
                .into_iter()
                .find(|d| d["firings"][0]["id"] == event_id && not.is_none_or(|n| d["id"] != n))
        },
        || format!("{:#?}\n{}", dead_letters(daemon), daemon.stderr()),
    )
}

/// Issue 43: a hand-written queue entry with made-up captures ran an `exec` job with
/// `X=FORGED-not-from-key`, and one whose key the rule's `regex` refuses ran too: captures were
/// not taken from the key again, so the `regex` protected nothing. Both are refused now, dead-
/// lettered with the reason, and `dead retry` puts them through the same check.
#[test]
fn a_forged_queue_entry_is_refused_and_so_is_its_retry() {
    let rules = Rules::new_with(report_rules);
    let ran = rules.dir.path().join("ran");
    let daemon = Daemon::launch(RedisServer::with_events("Exg"), rules, Logs::Json, &[]);

    // A real event runs, with the capture the regex took from its key.
    daemon.expire("report:2026-12-05");
    common::wait_until("the real event's exec ran", PATIENCE, || {
        std::fs::read_to_string(&ran).is_ok_and(|t| t == "2026-12-05\n")
    });

    let mut conn = daemon.conn();
    let made_up = common::forge_job(
        &mut conn,
        "keywatch:",
        "report",
        b"report:2026-12-06",
        &[("day", b"FORGED-not-from-key")],
        "exec",
    );
    let not_a_date = common::forge_job(
        &mut conn,
        "keywatch:",
        "report",
        b"report:$(touch /tmp/x)",
        &[("day", b"$(touch /tmp/x)")],
        "exec",
    );
    let event = |job: &str| job.split(':').next().unwrap().to_string();
    let letter = dead_letter_of(&daemon, &event(&made_up), None);
    let reason = letter["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("refused: its captures (day=FORGED-not-from-key)")
            && reason.contains("(day=2026-12-06)"),
        "{letter}"
    );
    let other = dead_letter_of(&daemon, &event(&not_a_date), None);
    let reason = other["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("refused: the key report:$(touch /tmp/x) does not match"),
        "{other}"
    );

    // Re-driven, it meets the same check.
    let id = letter["id"].as_str().unwrap().to_string();
    let out = daemon
        .rules
        .run(&["dead", "retry", &id, "--redis", &daemon.redis.url()], &[]);
    assert!(out.status.success(), "{out:?}");
    let again = dead_letter_of(&daemon, &event(&made_up), Some(&id));
    assert!(
        again["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("refused: its captures")),
        "{again}"
    );

    // Only the real event ran.
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "2026-12-05\n");
    daemon.stop();
}
