//! The crash drill (docs/reliability.md#guarantees, "no window loses an event"): an instance is killed (SIGKILL, from
//! inside, at an exact step of an event's path: `KEYWATCH_DRILL_CRASH_AT`, see `src/drill.rs`)
//! while a batch of delayed tasks falls due, and the tasks must all be delivered anyway — by the
//! restarted instance, or by a second instance that kept running — each with its detail, and
//! every detail removed afterwards. A duplicate is allowed only where docs/reliability.md#guarantees allows one: for a task
//! whose request reached the receiver before the kill (sent, not yet recorded as sent).
//!
//! The steps: `taken` (claimed and recorded, no job yet), `stored` (jobs stored, details not yet
//! removed), `removed` (details removed, record not yet cleared), `sent` (an action succeeded,
//! not yet acknowledged), `marked` (jobs of a bundle acknowledged by their completion marks, the
//! rest of the bundle not). The same for the scanner's warnings.
//!
//! What is sent twice is also bounded: at most what the killed instance had in flight (see
//! [`DOUBLED_MAX`]). "Doubled only if sent before the kill" alone cannot catch a take-over that
//! re-sends jobs acknowledged long before it (they were sent before the kill too).

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{HttpReceiver, KeywatchProcess, Logs, RedisServer, Response, wait_until};

/// Tasks per drill: several batches' worth of work in flight at the kill.
const TASKS: usize = 300;
/// Leases (5 s here, see [`spawn_with`]) must end before another instance takes over; then
/// delivery is quick.
const AFTER_CRASH: Duration = Duration::from_secs(120);

fn rules(dir: &Path, receiver: &HttpReceiver) -> PathBuf {
    common::hook_rules(
        dir,
        receiver,
        r#"rules:
  - name: close-unpaid
    match: "delay:task:{id}"
    detail: { hash: "delay:detail", field: "{{ id }}", remove: true }
    notify: { to: [hook] }
"#,
    )
}

fn spawn(redis: &RedisServer, rules: &Path, crash_at: Option<&str>) -> KeywatchProcess {
    spawn_with(redis, rules, crash_at, &[])
}

/// [`spawn`] with more of the environment (`also`).
fn spawn_with(
    redis: &RedisServer,
    rules: &Path,
    crash_at: Option<&str>,
    also: &[(&str, &str)],
) -> KeywatchProcess {
    // A 5 s lease: what a kill leaves is taken over 5 s later, not 15 (the drills wait for it).
    let mut envs: Vec<(&str, &str)> = vec![("KEYWATCH_LEASE", "5s")];
    if let Some(step) = crash_at {
        envs.push(("KEYWATCH_DRILL_CRASH_AT", step));
    }
    envs.extend_from_slice(also);
    common::run_subscribed(&redis.url(), rules, Logs::Text, &envs)
}

/// `TASKS` delayed tasks of wave `wave` (`delay:task:W-I`), each with its detail in
/// `delay:detail`, all due in `ms`.
fn schedule_tasks(redis: &RedisServer, wave: usize, ms: u64) {
    let mut c = redis.conn();
    let mut pipe = redis::pipe();
    for i in 0..TASKS {
        pipe.cmd("HSET")
            .arg("delay:detail")
            .arg(format!("{wave}-{i}"))
            .arg(format!(r#"{{"order": {i}, "wave": {wave}}}"#))
            .ignore();
    }
    for i in 0..TASKS {
        pipe.cmd("SET")
            .arg(format!("delay:task:{wave}-{i}"))
            .arg("1")
            .arg("PX")
            .arg(ms)
            .ignore();
    }
    let () = pipe.query(&mut c).expect("schedule tasks");
}

/// The hook channel's `concurrency` (its default): the killed instance's requests at once.
const CONCURRENCY: usize = 16;

/// The most tasks a kill may have sent twice: the channel's `concurrency`. A request holds its
/// permit until its acknowledgement is in Redis, so those sent and not yet acknowledged are
/// never more than that, however far acknowledgements lag behind the requests
/// (docs/reliability.md#guarantees). A take-over that ignored acknowledgements — a bundle's
/// completion marks, say — re-sends whole bundles of acknowledged jobs (up to 64 each), far past
/// this.
const DOUBLED_MAX: usize = CONCURRENCY;

/// Waves of tasks tried before a drill gives up on its instance reaching the step: beside a
/// second instance on a loaded machine, the doomed one may lose every claim of a wave (a wave's
/// events arrive together, and one take script wins a batch of them whole: 1 run in 5 lost three
/// waves in a row on a loaded machine).
const WAVES: usize = 6;

/// Waits until every request the killed instance wrote has been recorded by `receiver`: its
/// sockets' buffered bytes may arrive after the process is gone, and each of its connections is
/// read to its end (the kernel closed them at its death) before it leaves the receiver's open
/// connections. Connections still open then are `survivor`'s. Nothing of the killed instance's
/// work is done again before its leases end (15 s after their last renewal, at most 5 s before
/// the kill), so this comes first.
fn wait_dead_instance_drained(receiver: &HttpReceiver, survivor: Option<&KeywatchProcess>) {
    receiver.accept_pending(AFTER_CRASH);
    wait_until(
        "the killed instance's connections are read to their end",
        AFTER_CRASH,
        || {
            let theirs = survivor.map(KeywatchProcess::tcp_ports).unwrap_or_default();
            receiver
                .open_peers()
                .iter()
                .all(|peer| theirs.contains(&peer.port()))
        },
    );
}

fn count(redis: &RedisServer, cmd: &str, key: &str) -> i64 {
    redis::cmd(cmd)
        .arg(key)
        .query(&mut redis.conn())
        .unwrap_or_else(|e| panic!("{cmd} {key}: {e}"))
}

/// Waits until `tasks` keys were delivered and nothing is left behind: no job in the queue, no
/// taken event in the intake, no detail in its hash.
fn wait_drained(redis: &RedisServer, receiver: &HttpReceiver, tasks: usize) {
    wait_until(
        &format!("all {tasks} tasks are delivered"),
        AFTER_CRASH,
        || by_key(receiver).0.len() >= tasks,
    );
    wait_until(
        "the queue, the intake and the details are empty",
        AFTER_CRASH,
        || {
            count(redis, "ZCARD", "keywatch:queue") == 0
                && count(redis, "ZCARD", "keywatch:intake") == 0
                && count(redis, "HLEN", "delay:detail") == 0
        },
    );
}

/// Requests received per key, and which carried a null detail.
fn by_key(receiver: &HttpReceiver) -> (BTreeMap<String, usize>, Vec<String>) {
    let mut n = BTreeMap::new();
    let mut null = Vec::new();
    for r in receiver.requests() {
        let j = r.json();
        let key = j["key"].as_str().expect("event JSON has a key").to_string();
        if j["detail"].is_null() {
            null.push(key.clone());
        }
        *n.entry(key).or_insert(0) += 1;
    }
    (n, null)
}

/// Runs one drill: `crash_at` on an instance (alone, or beside a second one that keeps running
/// when `two`), then checks that every task was delivered, with its detail, at most once except
/// those sent before the kill, and that nothing is left behind.
fn drill(crash_at: &str, two: bool) {
    drill_against(crash_at, two, HttpReceiver::start(), &[]);
}

/// The internal event of each scanner run.
const SCAN_DONE: &str = "scan_done";

/// [`drill`] against `receiver`, the doomed instance run with `envs` beside its step.
fn drill_against(crash_at: &str, two: bool, receiver: HttpReceiver, envs: &[(&str, &str)]) {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let dir = tempfile::tempdir().unwrap();
    let rules = rules(dir.path(), &receiver);
    let mut doomed = spawn_with(&redis, &rules, Some(crash_at), envs);
    let survivor = two.then(|| spawn(&redis, &rules, None));
    // Learnt from `expire` events: due in 1.5 s, fired on time by the poker.
    let mut waves = 0;
    loop {
        schedule_tasks(&redis, waves, 1500);
        waves += 1;
        if doomed.wait_timeout(Duration::from_secs(20)).is_some() {
            break;
        }
        assert!(
            waves < WAVES,
            "the instance never reached `{crash_at}` in {WAVES} waves:\n{}",
            doomed.describe_output()
        );
    }
    let tasks = waves * TASKS;
    // The drill kills its instance with SIGKILL at the step (src/drill.rs); a panic, an abort
    // or an exit is something else.
    let status = doomed.try_status().expect("exited");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "the instance died of something else ({status}):\n{}",
        doomed.describe_output()
    );
    // Every request that reaches the receiver by now was sent before the kill (or by the
    // survivor, which makes the check looser, never wrong).
    wait_dead_instance_drained(&receiver, survivor.as_ref());
    let (before, _) = by_key(&receiver);
    let sent_before: BTreeSet<String> = before.keys().cloned().collect();
    let _restarted = (!two).then(|| spawn(&redis, &rules, None));

    wait_drained(&redis, &receiver, tasks);
    let (delivered, null) = by_key(&receiver);
    assert_eq!(delivered.len(), tasks, "{:?}", delivered.keys());
    assert!(null.is_empty(), "delivered with `detail: null`: {null:?}");
    let doubled: Vec<(&String, &usize)> = delivered.iter().filter(|(_, n)| **n > 1).collect();
    let unexplained: Vec<_> = doubled
        .iter()
        .filter(|(k, _)| !sent_before.contains(*k))
        .collect();
    assert!(
        unexplained.is_empty(),
        "delivered twice though not sent before the kill at `{crash_at}`: {unexplained:?}"
    );
    assert!(
        doubled.len() <= DOUBLED_MAX,
        "{} tasks delivered twice after the kill at `{crash_at}`, more than the killed instance can have had in flight ({DOUBLED_MAX}): {doubled:?}",
        doubled.len()
    );
    eprintln!(
        "crash at `{crash_at}` ({}): {tasks} tasks, 0 lost, {} duplicates (all sent before the kill), {} sent before the kill",
        if two {
            "two instances"
        } else {
            "one instance, restarted"
        },
        doubled.len(),
        sent_before.len()
    );
}

#[test]
fn a_kill_after_taking_loses_nothing_alone() {
    drill("taken", false);
}

#[test]
fn a_kill_after_taking_loses_nothing_beside_another_instance() {
    drill("taken", true);
}

#[test]
fn a_kill_after_storing_jobs_loses_nothing_and_leaves_no_detail() {
    drill("stored", false);
}

#[test]
fn a_kill_after_storing_jobs_loses_nothing_beside_another_instance() {
    drill("stored", true);
}

#[test]
fn a_kill_after_removing_details_loses_nothing() {
    drill("removed", false);
}

#[test]
fn a_kill_after_removing_details_loses_nothing_beside_another_instance() {
    drill("removed", true);
}

#[test]
fn a_kill_after_sending_loses_nothing_and_doubles_only_what_was_sent() {
    drill("sent", false);
}

#[test]
fn a_kill_after_sending_beside_another_instance_doubles_only_what_was_sent() {
    drill("sent", true);
}

/// The kill falls after the 100th completion mark: by then the instance holds bundles (64 jobs
/// each: the hook is far narrower than a wave) with many jobs acknowledged by their marks and
/// the rest not. Whoever takes those bundles over attempts only the unmarked jobs.
#[test]
fn a_kill_amid_a_bundle_doubles_only_what_was_in_flight() {
    drill("marked:100", false);
}

#[test]
fn a_kill_amid_a_bundle_beside_another_instance_doubles_only_what_was_in_flight() {
    drill("marked:100", true);
}

/// How long the doomed instance's acknowledgements are held on their way to Redis in
/// [`a_kill_while_acknowledgements_lag_doubles_at_most_the_concurrency`]: far longer than a
/// request to the receiver takes, however loaded the machine.
const ACK_DELAY: &str = "1s";

/// A state Redis too slow to take acknowledgements (each batch of them held [`ACK_DELAY`],
/// `KEYWATCH_DRILL_ACK_DELAY`) beside a receiver that answers at once: the worst case for what
/// a kill sends twice, made certain rather than left to a loaded machine. Killed at the 48th
/// request sent, three times the channel's width: what it doubles must still be at most what it
/// can have held sent and not yet acknowledged.
#[test]
fn a_kill_while_acknowledgements_lag_doubles_at_most_the_concurrency() {
    let at = format!("sent:{}", 3 * CONCURRENCY);
    drill_against(
        &at,
        false,
        HttpReceiver::start(),
        &[("KEYWATCH_DRILL_ACK_DELAY", ACK_DELAY)],
    );
}

/// Warnings have the same path: a warning claimed and recorded by an instance killed before
/// storing it is sent by the restarted instance, once per key.
#[test]
fn a_kill_after_taking_warnings_loses_none() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = common::hook_rules(
        dir.path(),
        &receiver,
        r#"scanner:
  schedule: "@every 1s"
rules:
  - name: licence-expiring
    match: "licence:{customer}"
    on: [expiring]
    warn_before: 1h
    notify: { to: [hook] }
"#,
    );
    let mut c = redis.conn();
    for i in 0..50 {
        common::set_px(&mut c, format!("licence:{i}"), 600_000);
    }
    let mut doomed = spawn(&redis, &rules, Some("taken"));
    assert!(
        doomed.wait_timeout(Duration::from_secs(30)).is_some(),
        "the instance never took a warning:\n{}",
        doomed.describe_output()
    );
    assert!(receiver.requests().is_empty(), "sent before the kill");
    let restarted = spawn(&redis, &rules, None);
    wait_until("50 warnings are delivered", AFTER_CRASH, || {
        by_key(&receiver).0.len() >= 50
    });
    wait_until("the intake is empty", AFTER_CRASH, || {
        count(&redis, "ZCARD", "keywatch:intake") == 0
            && count(&redis, "ZCARD", "keywatch:queue") == 0
    });
    // A scan or two later: still once each.
    let runs = || restarted.events(SCAN_DONE).len();
    let drained_at = runs();
    wait_until("two more scans ran", AFTER_CRASH, || {
        runs() >= drained_at + 2
    });
    let (delivered, _) = by_key(&receiver);
    assert_eq!(delivered.len(), 50);
    assert!(delivered.values().all(|n| *n == 1), "{delivered:?}");
}

/// A clean stop (SIGTERM) in the middle of the storm: what was taken is finished or handed back,
/// and the restarted instance delivers the rest. Nothing lost, and — unlike a kill — nothing
/// doubled: every request that reached the receiver was recorded as sent before the exit.
#[test]
fn a_clean_stop_in_a_storm_loses_and_doubles_nothing() {
    let redis = RedisServer::builder().notify_keyspace_events("Exg").start();
    let receiver =
        HttpReceiver::with_default(Response::status(200).delay(Duration::from_millis(300)));
    let dir = tempfile::tempdir().unwrap();
    let rules = rules(dir.path(), &receiver);
    let mut first = spawn(&redis, &rules, None);
    schedule_tasks(&redis, 0, 1500);
    wait_until("the storm has begun", AFTER_CRASH, || {
        !receiver.requests().is_empty()
    });
    first.sigterm();
    let status = first.wait_timeout(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "did not exit 0 within the grace: {status:?}\n{}",
        first.describe_output()
    );
    let _second = spawn(&redis, &rules, None);
    wait_drained(&redis, &receiver, TASKS);
    let (delivered, null) = by_key(&receiver);
    assert!(null.is_empty(), "delivered with `detail: null`: {null:?}");
    let doubled: Vec<_> = delivered.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "a clean stop doubled: {doubled:?}");
}

/// A job during which keywatch dies three times (SIGKILL while its request is under way, as an
/// OOM kill would) is dead-lettered with that reason at the fourth start instead of taken again:
/// a job that kills every instance that takes it must not keep alerting down
/// (docs/reliability.md#bounded-whatever-the-key). Before, every restart took it again.
#[test]
fn a_job_during_which_keywatch_dies_three_times_is_dead_lettered() {
    let redis = RedisServer::with_events("Exg");
    // The request never gets its answer while keywatch lives.
    let hook = HttpReceiver::with_default(Response::status(200).delay(Duration::from_secs(120)));
    let dir = tempfile::tempdir().unwrap();
    let rules = common::write_rules(
        dir.path(),
        "rules.yaml",
        &format!(
            "channels:\n  hook: {{ type: webhook, url: \"{}\", timeout: 10m }}\nrules:\n  - name: heavy\n    match: \"heavy:{{id}}\"\n    notify: {{ to: [hook] }}\n",
            hook.url()
        ),
    );
    let envs = [("KEYWATCH_LEASE", "2s")];
    let mut kw = common::run_subscribed(&redis.url(), &rules, Logs::Json, &envs);
    common::set_and_expire_now(&mut redis.conn(), &["heavy:1"]);
    for death in 1..=3 {
        hook.wait_for(death, common::PATIENCE);
        kw.sigkill();
        kw = common::run_subscribed(&redis.url(), &rules, Logs::Json, &envs);
    }
    let letter = kw.wait_for_event("dead_lettered", "of the job keywatch died with", |e| {
        e["reason"]
            .as_str()
            .is_some_and(|r| r.contains("died 3 times"))
    });
    assert_eq!(letter["rule"], "heavy", "{letter}");
    let out = common::run_keywatch(
        [
            "dead",
            "list",
            "--json",
            "--redis",
            &redis.url(),
            "-r",
            &rules.to_string_lossy(),
        ],
        &[],
    );
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(list.contains("died 3 times"), "{list}");
    // Not taken a fourth time: its job left the queue with its dead letter.
    common::wait_no_work_left(&mut redis.conn());
    assert_eq!(hook.requests().len(), 3, "taken again after three deaths");
}
